"""The split prefill's second call's inputs (kernels/prefill_attention.SplitPattern) in one pass:
the image queries' rows of q and the image keys' rows of k and v, in reversed order, copied into
contiguous [B, heads, R, D] buffers for the causal kernel.

Compiled, the same gathers took two inductor kernels a layer on the H200 at DROID (6.7 us for q,
3.5 for k and v; the twelfth session's profile) for ~19 MB moved (~4.5 us at bandwidth), each kernel
with its launch gap. Behind `split_gather_kernel` (off) until timed on the GPU. Runs on the CPU under
TRITON_INTERPRET=1 (the CI tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_heads(X, Out, b, row, r, n_rows, sxb, sxh, sxt, n_heads, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Token `row`'s heads of X (entry b) into row r of Out [B, heads, n_rows, D] (contiguous)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < n_heads)[:, None] & (d < D)[None, :]
    x = tl.load(X + b * sxb + h[:, None] * sxh + row * sxt + d[None, :], mask=ok, other=0.0)
    tl.store(Out + ((b * n_heads + h[:, None]) * n_rows + r) * D + d[None, :], x, mask=ok)


@triton.jit
def _split_gather(Q, K, V, Rows, Keys, QO, KO, VO, n_rows, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                  H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)                   # (entry, gathered row)
    b = (pid // n_rows).to(tl.int64)
    r = pid % n_rows
    row = tl.load(Rows + r)
    key = tl.load(Keys + r)
    _gather_heads(Q, QO, b, row, r, n_rows, sqb, sqh, sqt, H, D, BLOCK_H, BLOCK_D)
    _gather_heads(K, KO, b, key, r, n_rows, skb, skh, skt, KV, D, BLOCK_KV, BLOCK_D)
    _gather_heads(V, VO, b, key, r, n_rows, svb, svh, svt, KV, D, BLOCK_KV, BLOCK_D)


def split_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q[:, :, rows], k[:, :, keys], v[:, :, keys] for q [B, H, T, D] and k/v [B, KV, T, D] (any
    strides, the head dim contiguous), rows/keys [R] (long): contiguous [B, H|KV, R, D]."""
    b, heads, _, d = q.shape
    kv_heads, n = k.shape[1], rows.numel()
    if any(x.stride(-1) != 1 for x in (q, k, v)) or k.shape != v.shape or keys.numel() != n:
        raise ValueError("split_gather needs the head dim contiguous, k and v alike and as many keys as rows")
    qo = q.new_empty((b, heads, n, d))
    ko, vo = k.new_empty((b, kv_heads, n, d)), v.new_empty((b, kv_heads, n, d))
    _split_gather[(b * n,)](q, k, v, rows, keys, qo, ko, vo, n, q.stride(0), q.stride(1), q.stride(2),
                            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                            H=heads, KV=kv_heads, D=d, BLOCK_H=triton.next_power_of_2(heads),
                            BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(d))
    return qo, ko, vo


@torch.library.custom_op("vla::split_gather", mutates_args=())
def split_gather_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                    keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_gather as one op a compiled region keeps whole (on the CPU torch's indexing: the
    engine's CPU runs never split; a traced CPU call stays exact)."""
    if q.is_cuda:
        return split_gather(q, k, v, rows, keys)
    return q[:, :, rows].contiguous(), k[:, :, keys].contiguous(), v[:, :, keys].contiguous()


@split_gather_op.register_fake
def _(q, k, v, rows, keys):
    n = rows.numel()
    return q.new_empty((*q.shape[:2], n, q.shape[3])), k.new_empty((*k.shape[:2], n, k.shape[3])), \
        v.new_empty((*v.shape[:2], n, v.shape[3]))

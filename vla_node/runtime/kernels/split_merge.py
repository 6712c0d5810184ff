"""The split prefill's merge (kernels/prefill_attention.SplitPattern) in one pass: each token's
causal result, merged for image tokens with its second part by their log-sum-exps, written in the
[B, T, H, D] layout the output projection reads (so its transpose + reshape is a view).

Compiled, the same merge took three inductor kernels a layer on the H200 (5.3 + 5.9 + 6.1 us at
DROID: the merged rows, the index copy, the transpose; BENCHMARKS.md, twelfth session's profile)
for ~20 MB moved (~5 us at bandwidth); this pass took the DROID LLM stage from 14.69 to 14.36 ms
(`split_merge_kernel`, the `triton` rung).
Runs on the CPU under TRITON_INTERPRET=1 (the CI tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_token(Out, Lse, Extra, LseExtra, ExtraRow, Unused, Y, tokens,
                 sob, soh, sot, slb, slh, slt, seb, seh, set_, sxb, sxh, sxt,
                 H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)                   # (entry, token)
    b = pid // tokens
    t = pid % tokens
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < H)[:, None] & (d < D)[None, :]
    base = tl.load(Out + b * sob + h[:, None] * soh + t * sot + d[None, :], mask=ok, other=0.0)
    r = tl.load(ExtraRow + t)                # this token's row of the second part, -1: none
    if r >= 0:
        lse_base = tl.load(Lse + b * slb + h * slh + t * slt, mask=h < H, other=0.0)
        lse_extra = tl.load(LseExtra + b * sxb + h * sxh + r * sxt, mask=h < H, other=0.0) + tl.load(Unused + r)
        extra = tl.load(Extra + b * seb + h[:, None] * seh + r * set_ + d[None, :], mask=ok, other=0.0)
        top = tl.maximum(lse_base, lse_extra)
        w_base = tl.exp(lse_base - top)
        w_extra = tl.exp(lse_extra - top)
        merged = (base.to(tl.float32) * w_base[:, None] + extra.to(tl.float32) * w_extra[:, None]) \
            / (w_base + w_extra)[:, None]
        base = merged.to(Y.dtype.element_ty)
    tl.store(Y + ((b * tokens + t) * H + h[:, None]) * D + d[None, :], base, mask=ok)


def merge_split(out: torch.Tensor, lse: torch.Tensor, extra: torch.Tensor, lse_extra: torch.Tensor,
                extra_row: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    """out [B, H, T, D] and lse [B, H, T] of the causal call; extra [B, H, R, D] and lse_extra
    [B, H, R] of the second, `unused` [R] added to its lse (-inf: no second part); extra_row [T]
    (long) the second part's row of each token, -1 for none. Returns y [B, T, H, D] contiguous."""
    b, h, t, d = out.shape
    if out.stride(-1) != 1 or extra.stride(-1) != 1:
        raise ValueError("merge_split needs the head dim contiguous")
    y = torch.empty((b, t, h, d), dtype=out.dtype, device=out.device)
    _merge_token[(b * t,)](out, lse, extra, lse_extra, extra_row, unused, y, t,
                           out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
                           extra.stride(0), extra.stride(1), extra.stride(2),
                           lse_extra.stride(0), lse_extra.stride(1), lse_extra.stride(2),
                           H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))
    return y


def merge_by_lse(base: torch.Tensor, lse_base: torch.Tensor, extra: torch.Tensor,
                 lse_extra: torch.Tensor) -> torch.Tensor:
    """Two attention results [..., D] over disjoint key sets, with their log-sum-exps [...], as the
    result over both (fp32): each weighted by its share of the softmax's total."""
    top = torch.maximum(lse_base, lse_extra)
    w_base, w_extra = torch.exp(lse_base - top), torch.exp(lse_extra - top)
    return (base.float() * w_base[..., None] + extra.float() * w_extra[..., None]) / (w_base + w_extra)[..., None]


@torch.library.custom_op("vla::merge_split", mutates_args=())
def _merge_split_op(out: torch.Tensor, lse: torch.Tensor, extra: torch.Tensor, lse_extra: torch.Tensor,
                    extra_row: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    if out.is_cuda:
        return merge_split(out, lse, extra, lse_extra, extra_row, unused)
    # the same merge in torch (a traced CPU call; the engine's CPU runs never split)
    rows = extra_row.clamp_min(0)
    has = (extra_row >= 0)[None, None, :]
    lse_rows = torch.where(has, (lse_extra + unused)[:, :, rows], float("-inf"))
    merged = merge_by_lse(out, lse, extra[:, :, rows], lse_rows)
    return torch.where(has[..., None], merged.to(out.dtype), out).transpose(1, 2).contiguous()


@_merge_split_op.register_fake
def _(out, lse, extra, lse_extra, extra_row, unused):
    b, h, t, d = out.shape
    return out.new_empty((b, t, h, d))


def merge_split_op(out, lse, extra, lse_extra, extra_row, unused) -> torch.Tensor:
    """merge_split as one op a compiled region keeps whole; returns [B, H, T, D] (a view)."""
    return _merge_split_op(out, lse, extra, lse_extra, extra_row, unused).transpose(1, 2)

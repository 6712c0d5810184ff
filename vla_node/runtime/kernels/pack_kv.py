"""The context K/V of each expert block in the fragment orders the CUDA flow kernel loads
(kernels/expert_flow.cu): one Triton program a (block, entry, head, 16-key tile) reads the tile's
keys from the block's K and V views (any strides, the head dim contiguous) and writes its 32 lanes'
fragments in one contiguous run, padding keys as zeros. One pass over the context, where stacking,
padding and permuting with torch took five (0.7 ms of a DROID query on the H200). Blocks whose
views lie one stride apart in one buffer (runtime/fusion.BatchedContextKV's) take one launch for
all of them: a launch a block was 36 x 3.9 us at DROID on the H200 (the twelfth session's
profile), each moving 5.4 MB, ~1.3 us of bandwidth.
Runs on the CPU under TRITON_INTERPRET=1 (the CI tests), like the other kernels here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_tiles(K, V, Out, n_keys, heads, tiles, skj, skb, skh, skt, svj, svb, svh, svt,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                  # (entry, head, tile), in out's order
    j = tl.program_id(1).to(tl.int64)       # the block
    tile = pid % tiles
    h = (pid // tiles) % heads
    b = pid // (tiles * heads)
    r = tl.arange(0, BLOCK)                 # (lane, element) of the tile's K part, then of its V part
    inside = r < 32 * HALF
    lane = r // HALF
    idx = r % HALF
    g = lane // 4
    q = lane % 4
    e = idx % 2
    half = (idx // 2) % 2
    # K in Q K^T's B-fragment order: element ((ks * 2 + nt) * 2 + half) * 2 + e is key 8 nt + g,
    # dim 16 ks + 8 half + 2 q + e
    key = tile * 16 + 8 * ((idx // 4) % 2) + g
    d = 16 * (idx // 8) + 8 * half + 2 * q + e
    k = tl.load(K + j * skj + b * skb + h * skh + key * skt + d, mask=inside & (key < n_keys), other=0.0)
    out = Out + (j * tl.num_programs(0) + pid) * (64 * HALF)
    tl.store(out + r, k, mask=inside)
    # V in P V's: element (dn * 2 + half) * 2 + e is key 8 half + 2 q + e, dim 8 dn + g
    key = tile * 16 + 8 * half + 2 * q + e
    d = 8 * (idx // 4) + g
    v = tl.load(V + j * svj + b * svb + h * svh + key * svt + d, mask=inside & (key < n_keys), other=0.0)
    tl.store(out + 32 * HALF + r, v, mask=inside)


def block_stride(views: Sequence[torch.Tensor]) -> Optional[int]:
    """Elements from each view to the next when they are alike views of one buffer one stride
    apart (so one launch reads them all), else None."""
    first = views[0]
    offsets = [t.storage_offset() for t in views]
    stride = offsets[1] - offsets[0] if len(views) > 1 else 0
    alike = all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.shape == first.shape
                and t.stride() == first.stride() and t.dtype == first.dtype for t in views)
    steady = all(b - a == stride for a, b in zip(offsets, offsets[1:]))
    return stride if alike and steady else None


def pack_kv(kv: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """Per-block context K, V [B, heads, keys, hd] into out [depth, B, heads, tiles, 2, 32, hd/2]
    (contiguous): per 16-key tile and lane, K in the B-fragment order of Q K^T ([k-step][key half
    nt][d half][e]: key = 8 nt + g, d = 16 ks + 8 half + 2 q + e) and V in that of P V ([d tile
    dn][key half][e]: key = 8 half + 2 q + e, d = 8 dn + g), lane = 4 g + q. Padding keys are zeros
    (the kernel masks them)."""
    depth, b, heads, tiles, _, _, half = out.shape
    if len(kv) != depth or not out.is_contiguous():
        raise ValueError(f"pack_kv: {len(kv)} blocks into a contiguous out of {depth}")
    ks, vs = ([t if t.stride(-1) == 1 else t.contiguous() for t in part] for part in zip(*kv))
    sk, sv = block_stride(ks), block_stride(vs)
    launches = [(ks[0], vs[0], out, sk, sv, depth)] if sk is not None and sv is not None else \
        [(k, v, out[j], 0, 0, 1) for j, (k, v) in enumerate(zip(ks, vs))]
    for k, v, dst, skj, svj, blocks in launches:
        _pack_tiles[(b * heads * tiles, blocks)](k, v, dst, k.shape[2], heads, tiles, skj, k.stride(0), k.stride(1),
                                                 k.stride(2), svj, v.stride(0), v.stride(1), v.stride(2), HALF=half,
                                                 BLOCK=triton.next_power_of_2(32 * half))

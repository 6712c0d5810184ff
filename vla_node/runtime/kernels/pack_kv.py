"""The context K/V of each expert block in the fragment orders the CUDA flow kernel loads
(kernels/expert_flow.cu): one Triton program a (entry, head, 16-key tile) reads the tile's keys
from the block's K and V views (any strides, the head dim contiguous) and writes its 32 lanes'
fragments in one contiguous run, padding keys as zeros. One pass over the context per block,
where stacking, padding and permuting with torch took five (0.7 ms of a DROID query on the H200).
Runs on the CPU under TRITON_INTERPRET=1 (the CI tests), like the other kernels here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_tiles(K, V, Out, n_keys, heads, tiles, skb, skh, skt, svb, svh, svt,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                  # (entry, head, tile), in out's order
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
    k = tl.load(K + b * skb + h * skh + key * skt + d, mask=inside & (key < n_keys), other=0.0)
    out = Out + pid.to(tl.int64) * (64 * HALF)
    tl.store(out + r, k, mask=inside)
    # V in P V's: element (dn * 2 + half) * 2 + e is key 8 half + 2 q + e, dim 8 dn + g
    key = tile * 16 + 8 * half + 2 * q + e
    d = 8 * (idx // 4) + g
    v = tl.load(V + b * svb + h * svh + key * svt + d, mask=inside & (key < n_keys), other=0.0)
    tl.store(out + 32 * HALF + r, v, mask=inside)


def pack_kv(kv: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """Per-block context K, V [B, heads, keys, hd] into out [depth, B, heads, tiles, 2, 32, hd/2]
    (contiguous): per 16-key tile and lane, K in the B-fragment order of Q K^T ([k-step][key half
    nt][d half][e]: key = 8 nt + g, d = 16 ks + 8 half + 2 q + e) and V in that of P V ([d tile
    dn][key half][e]: key = 8 half + 2 q + e, d = 8 dn + g), lane = 4 g + q. Padding keys are zeros
    (the kernel masks them)."""
    depth, b, heads, tiles, _, _, half = out.shape
    if len(kv) != depth or not out.is_contiguous():
        raise ValueError(f"pack_kv: {len(kv)} blocks into a contiguous out of {depth}")
    for j, (k, v) in enumerate(kv):
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        _pack_tiles[(b * heads * tiles,)](k, v, out[j], k.shape[2], heads, tiles, k.stride(0), k.stride(1),
                                          k.stride(2), v.stride(0), v.stride(1), v.stride(2), HALF=half,
                                          BLOCK=triton.next_power_of_2(32 * half))

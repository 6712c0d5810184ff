"""The hardware floor of each stage of a query: the larger of its arithmetic over peak throughput
and the bytes it must move over memory bandwidth (each weight and each cached K/V read once).
Measured ceilings of one H200 (BENCHMARKS.md / DESIGN.md): 788 TFLOP/s bf16 matrix products,
4.3 TB/s device-to-device copy (bytes read + written)."""
from __future__ import annotations

from ..model.config import ModelConfig

H200_BF16_FLOPS = 790e12
H200_FP8_FLOPS = 2 * H200_BF16_FLOPS
H200_BYTES_PER_S = 4.3e12


def _ms(flops: float, nbytes: float, fp8: bool = False) -> float:
    peak = H200_FP8_FLOPS if fp8 else H200_BF16_FLOPS
    return 1e3 * max(flops / peak, nbytes / H200_BYTES_PER_S)


def stage_floors(cfg: ModelConfig, images: int, tokens: int, expert_calls: float, new_tokens: int | None = None,
                 llm_fp8: bool = False, dtype_bytes: int = 2) -> dict[str, float]:
    """ms floors of vision (`images` encoded), llm (prefill of `new_tokens` of a `tokens`-long
    prompt; all of them by default) and action (`expert_calls` velocity evaluations)."""
    v, l, a = cfg.vision, cfg.llm, cfg.action
    n = v.grid ** 2
    vit_params = v.layers_run * (4 * v.width ** 2 + 2 * v.width * v.mlp) + 3 * v.patch_size ** 2 * v.width
    pool_params = v.feature_dim * 3 * v.width + v.width ** 2
    proj_params = v.width * cfg.projector_hidden * 2 + cfg.projector_hidden * l.dim
    vision_flops = images * (2 * n * vit_params + 4 * v.layers_run * n * n * v.width
                             + 2 * v.tokens_per_image * (pool_params + proj_params))
    vision_bytes = dtype_bytes * (vit_params + pool_params + proj_params)

    new = tokens if new_tokens is None else new_tokens
    layer_params = l.dim * (l.heads + 2 * l.kv_heads) * l.head_dim + l.heads * l.head_dim * l.dim + 3 * l.dim * l.mlp
    attn_flops = 4 * l.layers * l.heads * l.head_dim * new * tokens  # scores + weighted sum (no causal saving counted)
    llm_flops = 2 * new * l.layers * layer_params + attn_flops
    llm_bytes = (l.layers * layer_params * (1 if llm_fp8 else dtype_bytes)
                 + 2 * l.layers * tokens * l.kv_heads * l.head_dim * dtype_bytes)

    w = a.width
    block_params = w * 3 * w + 3 * w * w + 2 * w * a.mlp + 9 * w * w  # self qkv/out, cross q/out, mlp, adaLN (hoisted)
    per_call = cfg.expert_depth * ((block_params - 9 * w * w) * dtype_bytes + 2 * (tokens + 1) * w * dtype_bytes)
    action_flops = expert_calls * 2 * a.horizon * cfg.expert_depth * block_params
    return {"vision": _ms(vision_flops, vision_bytes), "llm": _ms(llm_flops, llm_bytes, llm_fp8),
            "action": _ms(action_flops, expert_calls * per_call)}

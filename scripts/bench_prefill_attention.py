"""The LLM prefill's attention under the official pattern (causal, plus image tokens seeing each
other both ways), one layer's call side by side in every way we can run it (issue 22, item 4):
the DROID and 8-image prompts of molmobot-4b (32 query heads, 8 key/value heads, head_dim 128),
random bf16 q/k/v, each way captured 10 calls to a CUDA graph and timed per call (median of
replays), its error against the fp32 dense-mask reference beside it, and the FLOP floor of the
pairs the pattern makes visible (790 TFLOP/s).

    PYTHONPATH=$PWD python3 scripts/bench_prefill_attention.py [--layouts droid,8img] [--json F]

Ways: causal flash SDPA (the wrong pattern: the speed of the plain causal kernel), SDPA with the
dense boolean mask (default backend; cuDNN forced), flex attention compiled with the runtime's
block mask (default kernel options and a few tile choices), two causal SDPA calls merged by their
log-sum-exps (two_causal_calls, eager and compiled; the runtime's prefill before the pattern kernel),
with bounds beside it (cuDNN's causal kernel alone, the two calls alone, the two as one call of
batch 2), and `pattern kernel`: the pattern in one Triton kernel (runtime/kernels/pattern_attention.py,
`pattern_kernel`) at PATTERN_TILES. The layer part times a whole decoder layer (compiled) with some
of the ways and with none, and its four linears alone. Without CUDA it is a dry run on the CPU at a
small size (the Triton kernels interpreted).
"""
import argparse
import dataclasses
import json
import os
import traceback

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # before any kernel's import
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from vla_node.model import get_preset
from vla_node.model.layers import rope_tables
from vla_node.model.llm import DecoderLayer
from vla_node.model.sequence import PromptBuilder
from vla_node.model.tokenizer import load_tokenizer
from vla_node.model.weights import TINY_TOKENIZER
from vla_node.runtime import LAYOUTS, EngineConfig
from vla_node.runtime.fusion import fuse_projections
from vla_node.runtime.graphs import graph_us
from vla_node.runtime.kernels.pattern_attention import PatternAttention, pattern_mask
from vla_node.runtime.kernels.prefill_attention import block_mask, flex_attend

dynamo_config.cache_size_limit = dynamo_config.recompile_limit = 256  # every way recompiles flex
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PEAK = 790e12  # bf16 FLOP/s, the H200's measured matmul rate
# The pattern kernel's tilings: (BLOCK_M, BLOCK_N, num_warps, num_stages, tma), its default first. Compiled
# for sm_90 by Triton 3.9 at head_dim 128 in bf16 (no GPU, scripts/compile_pattern_kernel.py --ptxas): 64x64
# w4 s3 112 KB of shared memory and 190 registers a thread (two programs a SM), s2 80 KB; 128x64 w8 s2 96 KB
# and 191 registers (one program a SM: the registers); 128x128 w8 s2 spills. With tma (q, K and V through
# tensor descriptors, the default) 64x64 w4 s3 113 KB and 176 registers, s2 81 KB; tilings that spilled by
# pointer fit: 64x128 w4 s2 145 KB and 217 registers, 128x128 w8 s2 161 KB and 230 (one program a SM),
# 128x64 w8 s3 129 KB and 166. Key tiles of 32 (Triton 3.9, thirty-second session), for more programs a SM: Nsight
# Compute put 64x64 w4 s3 at 2 warps a scheduler, each issuing every 4.8 cycles (fixed-latency dependencies,
# long scoreboard), L2 at 45 %: 64x32 w4 s3 67 KB and 128 registers (three programs a SM), s2 49 KB and 128
# (four), 128x32 w8 s3 82 KB and 122 (two).
PATTERN_TILES = {"64x64 w4 s3 tma": (64, 64, 4, 3, True), "64x64 w4 s3": (64, 64, 4, 3, False),
                 "64x64 w4 s2 tma": (64, 64, 4, 2, True), "128x64 w8 s2 tma": (128, 64, 8, 2, True),
                 "128x64 w8 s3 tma": (128, 64, 8, 3, True), "64x128 w4 s2 tma": (64, 128, 4, 2, True),
                 "128x128 w8 s2 tma": (128, 128, 8, 2, True), "64x32 w4 s3 tma": (64, 32, 4, 3, True),
                 "64x32 w4 s2 tma": (64, 32, 4, 2, True), "128x32 w8 s3 tma": (128, 32, 8, 3, True)}


def image_tokens(layout_name: str) -> torch.Tensor:
    """The bucket's image-token flags (prompt + instruction budget) of molmobot-4b at the layout."""
    layout = LAYOUTS[layout_name]
    cfg = get_preset("molmobot-4b")
    cfg = dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, max_images=max(cfg.prompt.max_images,
                                                                                          layout.images)))
    prompt = PromptBuilder(load_tokenizer(TINY_TOKENIZER), cfg).build(len(layout.cameras), layout.frames, "x")
    length = prompt.instruction_start + EngineConfig().max_instruction_tokens
    img = torch.zeros(length, dtype=torch.bool)
    img[:prompt.instruction_start] = torch.tensor(prompt.image_token[:prompt.instruction_start])
    return img


def timed(fn, calls: int = 10, replays: int = 20) -> float:
    """us per call: `calls` calls captured in one CUDA graph, median of `replays` replays."""
    if not CUDA:
        fn()
        return float("nan")
    return graph_us(fn, calls, replays)


def causal_attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal maskless attention (top-left aligned, equal lengths; k/v with fewer heads are read as
    grouped heads) and its log-sum-exp [B, H, T] fp32: cuDNN's kernel on CUDA in half precision
    (on the H200 31 us against the flash kernel's 54 at the DROID prompt, BENCHMARKS.md), the
    memory-efficient kernel on CUDA in fp32 (cuDNN's takes half precision only: given fp32 it
    returned NaN without an error), the flash kernel on the CPU."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
    else:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[:2]
    # cuDNN's is [B, H, T, 1], the memory-efficient kernel's [B, H, T rounded up to 32]
    return out, lse.reshape(*out.shape[:2], -1)[..., :out.shape[2]]


def two_causal_calls(img: torch.Tensor):
    """attend(q, k, v) for the pattern of `img` as two maskless causal calls merged by their
    log-sum-exps: every query over the keys at or before it, and every image query over the image
    keys after it, gathered in reverse order (where "after" is "before": a causal call of one
    token's offset). The two key sets are disjoint and together are what the pattern shows."""
    reversed_images = torch.nonzero(img).flatten().flip(0)
    rows, keys = reversed_images[1:], reversed_images[:-1]   # query rows[r] sees keys[0 .. r]

    def attend(q, k, v):
        out, lse = causal_attend_lse(q, k, v)
        extra, lse_extra = causal_attend_lse(q[:, :, rows], k[:, :, keys], v[:, :, keys])
        lse_rows = lse[:, :, rows]
        top = torch.maximum(lse_rows, lse_extra)
        w_causal, w_extra = torch.exp(lse_rows - top), torch.exp(lse_extra - top)
        merged = (out[:, :, rows].float() * w_causal[..., None] + extra.float() * w_extra[..., None]) \
            / (w_causal + w_extra)[..., None]
        return out.index_copy(2, rows, merged.to(out.dtype))
    return attend


def ways(img: torch.Tensor, mask: torch.Tensor):
    """name -> attend(q, k, v) for the pattern of `img`."""
    bm = block_mask(img, 0, img.numel(), img.numel())
    two_calls = two_causal_calls(img)
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    out = {
        "sdpa causal (not the pattern)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                        enable_gqa=True),
        "sdpa dense mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "flex (runtime)": lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True),
        "two causal calls + merge": two_calls,
        **{f"pattern kernel {name}": pattern(img, tiles).attend for name, tiles in PATTERN_TILES.items()},
    }
    if CUDA:
        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out["sdpa dense mask, cuDNN"] = cudnn
        out["two causal calls + merge, compiled"] = torch.compile(two_calls, fullgraph=True, dynamic=False)
        out["cuDNN causal + lse (not the pattern)"] = lambda q, k, v: causal_attend_lse(q, k, v)[0]
        # The two causal calls alone (the image rows' call as long as two_causal_calls' gathers),
        # then as one call of batch 2, the second sequence padded at its end to the first's length
        # (a causal row never sees the padding after it): whether one launch fills the SMs better.
        rows = int(img.sum()) - 1
        inputs: dict[str, list[torch.Tensor]] = {}

        def two_calls_inputs(q, k, v) -> dict[str, list[torch.Tensor]]:
            if not inputs:   # made once, outside the timed calls
                inputs["rows"] = [x[:, :, :rows].contiguous() for x in (q, k, v)]
                inputs["batch2"] = [torch.cat([x, F.pad(r, (0, 0, 0, x.shape[2] - r.shape[2]))])
                                    for x, r in zip((q, k, v), inputs["rows"])]
            return inputs

        def two_calls_alone(q, k, v):   # returns the first call's [B, H, T, D] (the error column compares T rows)
            out = causal_attend_lse(q, k, v)[0]
            causal_attend_lse(*two_calls_inputs(q, k, v)["rows"])
            return out

        out["cuDNN causal, the two calls alone (not the pattern)"] = two_calls_alone
        out["cuDNN causal, the two as one call of batch 2 (not the pattern)"] = \
            lambda q, k, v: causal_attend_lse(*two_calls_inputs(q, k, v)["batch2"])[0][:1]
        for name, opts in {"flex 128x64 w8 s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                           "flex 128x128 w8 s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                           "flex 64x64 w4 s3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                           "flex 128x64 w8 s3 tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3,
                                                         USE_TMA=True)}.items():
            out[name] = (lambda o: lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True,
                                                        kernel_options=o))(opts)
    return out


def pattern(img: torch.Tensor, tiles: tuple[int, int, int, int, bool]) -> PatternAttention:
    block_m, block_n, num_warps, num_stages, tma = tiles
    return PatternAttention(img, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                            tma=tma)


def gemms(t: int) -> dict:
    """us per call of the layer's four linears at M = t and at M rounded up to 128 rows."""
    cfg = get_preset("molmobot-4b").llm
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, cfg.dim), "o": (cfg.dim, cfg.heads * cfg.head_dim), "gate_up": (2 * cfg.mlp, cfg.dim),
              "down": (cfg.dim, cfg.mlp)}
    out = {}
    for m in sorted({t, -(-t // 128) * 128}):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            us = timed(lambda: F.linear(x, w))
            out[f"{name} M={m}"] = {"us": us, "tflops": 2 * m * n * k / us / 1e6}
    return out


def chosen(name: str, only: list[str]) -> bool:
    """Whether a way is asked for (--ways: any of its comma-separated strings in the name; none: all)."""
    return not only or any(part in name for part in only)


def decoder_layer(t: int) -> tuple[DecoderLayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One molmobot-4b decoder layer in bf16 with its projections fused, as the runtime builds it, and
    inputs for t tokens: (layer, x, cos, sin). Called as a middle layer, layer(x, cos, sin, mask,
    mlp_out=x): the MLP output of the layer before added in."""
    cfg = get_preset("molmobot-4b").llm
    layer = DecoderLayer(cfg).to(DEVICE, torch.bfloat16)
    fuse_projections(layer)
    x = torch.randn(1, t, cfg.dim, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = rope_tables(cfg.head_dim, torch.arange(t, device=DEVICE), cfg.rope_theta)
    return layer, x, cos, sin


def layer_times(img: torch.Tensor, only: list[str]) -> dict:
    """us per call of one molmobot-4b decoder layer (fused projections, compiled as the runtime
    compiles it) with each attention way, and with none (attention's output = q: the rest)."""
    t = img.numel()
    layer, x, cos, sin = decoder_layer(t)
    bm = block_mask(img, 0, t, t)
    tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    ways = {"flex (runtime)": (flex_attend, bm),
            "flex 64x64 w4 s3": (lambda q, k, v, m: flex_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                                   block_mask=m, enable_gqa=True,
                                                                   kernel_options=tiles), bm),
            **{f"pattern {name}": (flex_attend, pattern(img, tiles)) for name, tiles in PATTERN_TILES.items()},
            "no attention (the rest)": (lambda q, k, v, m: q, None)}
    out = {}
    with torch.inference_mode():
        for name, (attend, mask) in ways.items():
            if not chosen(name, only):
                continue
            try:
                layer.attn.attend = attend
                layer._compiled_call_impl = None
                layer.compile(fullgraph=True, dynamic=False)
                out[name] = {"us": timed(lambda: layer(x, cos, sin, mask, mlp_out=x))}
            except Exception as exc:
                traceback.print_exc()
                out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            print("layer", t, name, out[name], flush=True)
        if CUDA:  # the flex layer's kernels, one call under the profiler
            layer.attn.attend = flex_attend
            layer._compiled_call_impl = None
            layer.compile(fullgraph=True, dynamic=False)
            layer(x, cos, sin, bm, mlp_out=x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    layer(x, cos, sin, bm, mlp_out=x)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="droid,8img")
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="attention,layer", help="attention (the ways alone), layer (a whole "
                    "decoder layer with some ways, and its linears alone)")
    ap.add_argument("--ways", default="", help="only the ways whose names hold one of these comma-separated "
                    "strings (default: every way), e.g. 'lse,two causal,pattern kernel' (a comma always separates)")
    args = ap.parse_args()
    only = [w for w in args.ways.split(",") if w]
    parts = args.parts.split(",")
    cfg = get_preset("molmobot-4b").llm
    heads, kv_heads, hd = (cfg.heads, cfg.kv_heads, cfg.head_dim) if CUDA else (4, 2, 16)
    dtype = torch.bfloat16 if CUDA else torch.float32
    results, rows = {}, []
    for name in args.layouts.split(","):
        img = image_tokens(name)
        if not CUDA:
            img = img[:96] | (torch.arange(96) % 40 > 30)  # a small pattern of the same kind
        t = img.numel()
        img = img.to(DEVICE)
        mask = pattern_mask(img, 0, img.numel())
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q = torch.randn(1, heads, t, hd, device=DEVICE, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, t, hd, device=DEVICE, generator=g).to(dtype)
        v = torch.randn(1, kv_heads, t, hd, device=DEVICE, generator=g).to(dtype)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        pairs = int(mask.sum())
        floor_us = 4 * pairs * hd * heads / PEAK * 1e6
        results[name] = {"tokens": t, "image_tokens": int(img.sum()), "visible_pairs": pairs, "floor_us": floor_us,
                         "ways": {}}
        for way, fn in (ways(img, mask).items() if "attention" in parts else ()):
            if not chosen(way, only):
                continue
            try:
                out = fn(q, k, v)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = timed(lambda: fn(q, k, v))
                entry = {"us": us, "rel_err": err, "x_floor": us / floor_us}
            except Exception as exc:  # a way this torch cannot run: say why, go on
                traceback.print_exc()
                entry = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            results[name]["ways"][way] = entry
            rows.append((name, t, way, entry))
            print(name, way, entry, flush=True)
        if "layer" in parts and CUDA:
            results[name]["layer"] = layer_times(img, only)
            results[name]["gemms"] = gemms(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'layout':7} {'tokens':>6} {'way':34} {'us/call':>9} {'x floor':>8} {'rel err':>9}")
    for name, t, way, e in rows:
        if "error" in e:
            print(f"{name:7} {t:6d} {way:34} {e['error']}")
        else:
            print(f"{name:7} {t:6d} {way:34} {e['us']:9.1f} {e['x_floor']:8.2f} {e['rel_err']:9.2e}")
    for name, r in results.items():
        for key in ("layer", "gemms"):
            for what, e in r.get(key, {}).items():
                print(f"{name:7} {key:6} {what:32} " + (e["error"] if "error" in e else
                      f"{e['us']:9.1f} us" + (f"  {e['tflops']:5.0f} TFLOP/s" if "tflops" in e else "")))
        print(f"{name}: floor {r['floor_us']:.1f} us/layer ({r['visible_pairs']} visible pairs, "
              f"{r['image_tokens']} image tokens of {r['tokens']}); x36 layers = floor "
              f"{36 * r['floor_us'] / 1000:.2f} ms")


if __name__ == "__main__":
    main()

"""vla-bench: latency per stage of each engine mode, its deviation from the eager reference on
the same inputs and noise, memory, ready time, and a transformers ViT+LLM baseline.

    vla-bench --preset tiny --device cpu --modes eager --json out/bench.json
    vla-bench --preset molmobot-4b --device cuda --modes eager,compile,graphs,fast --layout 8img
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..runtime import LAYOUTS, MODES, EngineConfig, PolicyEngine
from ..runtime.graphs import NO_GEMM_WORKSPACE, use_gemms_without_workspace
from ..runtime.types import BATCH_SIZES
from .floors import stage_floors
from .stats import summary

STAGES = ("preprocess", "vision", "llm", "action")
INSTRUCTION = "put the red cup in the bowl"   # a stream's (synthetic_stream)


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def summarize(samples: list[float]) -> dict:
    return summary(samples, "median", "min", "p90")


def deviation(out: np.ndarray, ref: np.ndarray) -> dict:
    diff = out - ref
    return {"max_abs_dev": float(np.abs(diff).max()), "mean_abs_dev": float(np.abs(diff).mean()),
            "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref))}


# Opt-in options a mode name can stack: "fast+stream+fp8t+cache".
OPTIONS = {
    "stream": {"streaming_kv": True, "vision_cache": True},
    "fp8": {"fp8": "rowwise"},
    "fp8t": {"fp8": "tensorwise"},
    "cache": {"flow_steps": 8, "action_cache": "flashdrive"},
    "adaptive": {"action_cache": "adaptive:0.05"},
    "steps8": {"flow_steps": 8},
    "steps5": {"flow_steps": 5},
    "expert": {"fused_expert": True},
    "expertfp8": {"fused_expert": True, "expert_fp8": True},
    "cudaexpert": {"fused_expert": True, "expert_kernel": "cuda"},  # the loop on kernels/expert_flow.cu
    "tritonexpert": {"fused_expert": True, "expert_kernel": "triton"},  # the loop on kernels/expert_flow.py
    # the prefill through flex attention only
    "flexonly": {"pattern_kernel": False},
    "poolsdpa": {"window_attention_ops": False},  # the vision pool's window attention through SDPA
    "addpass": {"add_norm_kernel": False},  # the ViT blocks' residual adds as passes of their own
    "torchrotary": {"rotary_kernel": False},  # the LLM's q/k norms, RoPE and head layout compiled from torch ops
    "torchnorms": {"triton_layer_norm": False},  # the ViT's and the context's LayerNorms as torch's / inductor's
    "gelupass": {"gelu_epilogue": False},  # the ViT's GELU as its own pass after fc1, as before the epilogue
    "padded": {"unpadded_gemms": False},  # inductor's pad_mm pass on, its default: padding copies before GEMMs
    "torchgemms": {"tuned_gemms": False},  # the ViT's and LLM's GEMMs at torch's choice, not timed at warm-up
    "memsetnodes": {"memset_kernels": False},  # the captured graphs' memset nodes left as they are
    "patch588": {"aligned_patch_embedding": False},  # the patch embedding's GEMM at K = 588, unaligned
    "embedpass": {"one_pass_embedding": True},  # the prefill's embeddings in one pass over the frame store
    "inputstream": {"input_stream": True},  # a query's small input copies beside the vision stage
    "qrope": {"q_rope_in_attention": True},  # q's norm and RoPE in the pattern kernel, k's alone in the rotary pass
    "fulltiers": {"tile_tiers": False},  # every instruction tier at its own length, none trimmed to a GEMM tile
    # one instruction budget (96 tokens), as before instruction_tiers: what the tiers' shorter padding saves
    "onebudget": {"instruction_tiers": ()},
}
BASE_FIELDS = ("preset", "checkpoint", "seed", "device", "dtype", "layout", "camera_height", "camera_width",
               "flow_steps", "max_instruction_tokens")


def option_overrides(option: str) -> dict | None:
    """The config fields an option sets (None: no such option): OPTIONS' entry, or for tierN one
    instruction tier of N tokens below max_instruction_tokens (to time the bucket lengths it makes:
    a whole number of GEMM tiles, say)."""
    tier = re.fullmatch(r"tier([1-9][0-9]*)", option)
    return {"instruction_tiers": (int(tier[1]),)} if tier else OPTIONS.get(option)


def mode_config(spec: str, base: EngineConfig) -> EngineConfig:
    """'fast+stream+fp8' -> the fast mode's features plus those options."""
    name, *options = spec.split("+")
    unknown = [o for o in options if option_overrides(o) is None]
    if name not in MODES or unknown:
        raise ValueError(f"unknown mode {spec!r}: modes {list(MODES)}, options {list(OPTIONS)} or tierN")
    overrides = {k: getattr(base, k) for k in BASE_FIELDS}
    for option in options:
        overrides.update(option_overrides(option))
    return EngineConfig.for_mode(name, **overrides)


def gemms_without_workspace_if_any(configs: list[EngineConfig]) -> None:
    """Before the process's first GEMM: torch may size cuBLAS's workspaces once a process, so if any
    mode runs without one, every mode does, eager too (its DROID row took 2.3x as long on the H100,
    most likely its small GEMMs losing cuBLAS's split-K: BENCHMARKS.md, thirty-fourth session)."""
    if any(c.workspace_free_gemms for c in configs):
        use_gemms_without_workspace()


def synthetic_stream(layout, windows: int) -> list:
    """A stream of sliding windows over the rendered DROID-like scene of the sample bag (camera
    frames at 15 Hz, windows every `stride` frames, so each shares frames with the last)."""
    from ..runtime import Observation
    from .sample_scene import CAMERA_HZ, joint_positions, render_exo, render_wrist

    render = {"exo": render_exo, "wrist": render_wrist}
    frames: dict = {}
    out = []
    for w in range(windows):
        times = [(w + k) * layout.stride for k in range(layout.frames)]
        ids = [(cam, f) for f in times for cam in layout.cameras]
        for cam, f in ids:
            if (cam, f) not in frames:
                frames[cam, f] = render[cam if cam in render else "exo"](f / CAMERA_HZ)
        state = joint_positions(times[-1] / CAMERA_HZ).astype(np.float32)
        noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(w))
        out.append((Observation(images=[frames[i] for i in ids], state=state, instruction=INSTRUCTION,
                                stamp=times[-1] / CAMERA_HZ, frame_ids=ids), noise))
    return out


def page_locked(inputs: list) -> list:
    """The observations with their frames in page-locked host memory (each distinct frame once), as
    the engine process of a node has them: the node's shared frame buffer, registered."""
    pinned: dict = {}

    def lock(image: np.ndarray) -> np.ndarray:
        if id(image) not in pinned:
            pinned[id(image)] = torch.from_numpy(image).pin_memory().numpy()
        return pinned[id(image)]
    return [(dataclasses.replace(obs, images=[lock(i) for i in obs.images]), noise) for obs, noise in inputs]


def run_mode(spec: str, base: EngineConfig, iters: int, inputs, stream: bool,
             progress, batches: tuple[int, ...] = (1,)) -> tuple[dict, list[np.ndarray]]:
    """Full queries: outputs on `inputs`, then `iters` timed repeats of the first. Stream: every
    window of `inputs` in order (each sharing frames with the last), timed as it goes. Then each
    batch size of `batches` above 1 (full queries only): one query of that many of `inputs`
    against their outputs alone, then `iters` timed queries."""
    cuda = base.device.startswith("cuda")
    torch._dynamo.reset()  # each mode compiles for itself, so its ready time is its own
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = mode_config(spec, base).replace(max_batch=max(batches))
    if cuda and cfg.tuned_gemms:
        from ..runtime.lt_gemm import TUNED
        TUNED.seen.clear()   # this mode's shapes only in its report (earlier modes' choices are reused)
    engine = PolicyEngine(cfg, progress=lambda m: progress(f"[{spec}] {m}"))
    stats = engine.warmup()
    dev = engine.device
    if stream:
        chunks = [engine.predict(obs, noise=noise.to(dev)) for obs, noise in inputs]
        outs = [c.normalized for c in chunks]
        timings = [c.timings for c in chunks[1:]]  # the first window is a cold full query
    else:
        outs = [engine.predict(obs, noise=noise.to(dev)).normalized for obs, noise in inputs]
        timings = [engine.predict(inputs[0][0]).timings for _ in range(iters)]
    result = {
        "total_ms": statistics.median(t["total"] for t in timings),
        "total_min_ms": min(t["total"] for t in timings),
        "stages": {s: summarize([t.get(s, 0.0) for t in timings]) for s in STAGES},
        "ready_s": stats.ready_s,
        "compiled_graphs": stats.compiled_graphs,
        "graph_captures": stats.graph_captures,
        "weight_gb": engine.weight_bytes() / 1e9,
        "features": list(MODES[spec.split("+")[0]]) + spec.split("+")[1:],
        "flow_steps": engine.flow_steps,
        "action_cache": cfg.action_cache,
    }
    calls = engine.flow_steps
    if engine.static is not None:
        result["stream_steps"] = engine.static.stream_steps
        calls = result["expert_calls_per_query"] = engine.static.expert_calls / max(1, engine.stats.queries)
        if cfg.compile:
            result["recompiles_after_ready"] = engine.static.recompiles()
    if cuda:  # the floors are the H200's
        result["floors_ms"] = floors(engine, calls, stream)
    if not stream and len(batches) > 1:
        result["batches"] = {n: batch_timings(engine, inputs, outs, n, iters) for n in batches
                             if n <= engine.max_batch}   # 1 under streaming_kv, the adaptive cache
    if cuda and cfg.tuned_gemms:
        result["tuned_gemms"] = TUNED.report(TUNED.seen)
        result["tuned_gemms_source"] = {"file": str(TUNED.file), "cublaslt": TUNED.libraries,
                                        "file_error": TUNED.file_error}
        for row in result["tuned_gemms"]:
            progress(f"[{spec}] GEMM {row['m_k_n']}: torch {row['torch_us']:.1f} us, chosen {row['chosen_us']:.1f} "
                     f"({row['algorithm']}{', from the file' if row['from_file'] else ''})")
        progress(f"[{spec}] tuned_gemms: {sum(r['from_file'] for r in result['tuned_gemms'])} of "
                 f"{len(result['tuned_gemms'])} choices read from {TUNED.file}"
                 f"{f' (file {TUNED.file_error})' if TUNED.file_error else ''}; cuBLASLt {TUNED.libraries}")
    if cuda:
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        result["reserved_mem_gb"] = torch.cuda.memory_reserved() / 1e9
    engine.close()
    del engine
    gc.collect()
    return result, outs


def batch_timings(engine: PolicyEngine, inputs, alone: list[np.ndarray], n: int, iters: int) -> dict:
    """Queries of n observations (inputs taken in turn): each entry's output against its output
    alone on the same noise, and the query's stage times (every entry's, they ran together)."""
    picks = [i % len(inputs) for i in range(n)]
    noise = torch.cat([inputs[i][1] for i in picks]).to(engine.device)
    chunks = engine.predict_batch([inputs[i][0] for i in picks], noise=noise)
    dev = max(float(np.abs(c.normalized - alone[i]).max()) for c, i in zip(chunks, picks))
    timings = [engine.predict_batch([inputs[i][0] for i in picks])[0].timings for _ in range(iters)]
    total = statistics.median(t["total"] for t in timings)
    return {"total_ms": total, "per_observation_ms": total / n, "max_abs_dev_vs_alone": dev,
            "stages": {s: summarize([t.get(s, 0.0) for t in timings]) for s in STAGES}}


def floors(engine: PolicyEngine, expert_calls: float, stream: bool) -> dict:
    """Each stage's hardware floor for the query this mode ran. A stream of sliding windows
    encodes one new frame time per window with the vision cache, and prefills only its tokens
    with streaming_kv; full queries (cold frames) encode and prefill everything."""
    layout = engine.layout
    prompt = engine.prompts.build(len(layout.cameras), layout.frames, INSTRUCTION)
    images, new_tokens = layout.images, None
    if stream and engine.config.vision_cache:
        images = len(layout.cameras)
        bucket = engine.static.bucket(layout, 1, engine.static.budget_for(layout, [INSTRUCTION]))
        if bucket.stream is not None:
            new_tokens = bucket.length - bucket.stream.new_start
    return stage_floors(engine.model_cfg, images, len(prompt), expert_calls, new_tokens,
                        llm_fp8=engine.config.fp8 != "off")


def hf_baseline(preset: str, device: str, dtype: torch.dtype, images: int, tokens: int, iters: int) -> dict:
    """transformers' SiglipVisionModel + Qwen3Model at the preset's dimensions (random weights):
    the ViT over the window's images and one prefill of the same token count."""
    import transformers

    from ..model import get_preset

    cfg = get_preset(preset)
    v, l = cfg.vision, cfg.llm
    with torch.device(device):
        vit = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
            hidden_size=v.width, intermediate_size=v.mlp, num_hidden_layers=v.layers_run, num_attention_heads=v.heads,
            image_size=v.image_size, patch_size=v.patch_size, hidden_act="gelu_pytorch_tanh", vision_use_head=False,
            attn_implementation="sdpa")).to(dtype).eval()
        llm = transformers.Qwen3Model(transformers.Qwen3Config(
            vocab_size=l.vocab_size, hidden_size=l.dim, intermediate_size=l.mlp, num_hidden_layers=l.layers,
            num_attention_heads=l.heads, num_key_value_heads=l.kv_heads, head_dim=l.head_dim, rope_theta=l.rope_theta,
            attn_implementation="sdpa")).to(dtype).eval()
    pixels = torch.randn(images, 3, v.image_size, v.image_size, device=device, dtype=dtype)
    ids = torch.randint(0, l.vocab_size, (1, tokens), device=device)

    def timed(fn) -> list[float]:
        out = []
        for i in range(iters + 2):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1e3)
        return out

    with torch.inference_mode():
        vit_ms = timed(lambda: vit(pixel_values=pixels, output_hidden_states=True))
        llm_ms = timed(lambda: llm(input_ids=ids, output_hidden_states=True, use_cache=False))
    return {"vision": summarize(vit_ms), "llm": summarize(llm_ms),
            "total_ms": statistics.median(vit_ms) + statistics.median(llm_ms),
            "transformers": transformers.__version__}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["modes"])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    bottom = np.zeros(len(names))
    for stage in STAGES:
        vals = np.array([results["modes"][n]["stages"][stage]["median"] for n in names])
        ax.bar(names, vals, bottom=bottom, label=stage)
        bottom += vals
    if "baseline" in results:
        b = results["baseline"]
        ax.bar(["hf ViT+LLM"], [b["vision"]["median"]], color="gray", label="transformers vision")
        ax.bar(["hf ViT+LLM"], [b["llm"]["median"]], bottom=[b["vision"]["median"]], color="silver",
               label="transformers LLM")
    ax.set_ylabel("median ms per query")
    ax.set_title(f"{results['preset']} {results['layout']} ({results['tokens']} tokens) on {results['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--modes", default="eager",
                    help=f"comma-separated, from {list(MODES)}, each optionally +{'+'.join(OPTIONS)} or +tierN "
                    "(one instruction tier of N tokens)")
    ap.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    ap.add_argument("--iters", type=int, default=20, help="warm queries timed per mode")
    ap.add_argument("--dev-windows", type=int, default=5, help="full-query inputs compared against eager per mode")
    ap.add_argument("--stream", type=int, default=0, metavar="N",
                    help="instead of repeated full queries, run N sliding windows of a rendered scene")
    ap.add_argument("--batches", default="1", help="batch sizes timed after the single queries, e.g. 1,2,4,8 "
                    "(queries of that many observations, as an engine server batches robots)")
    ap.add_argument("--baseline", action="store_true", help="also time transformers' ViT + LLM of the same size")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG stage breakdown (default: next to --json)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--frames", default="page-locked", choices=("page-locked", "pageable"),
                    help="on CUDA, where the camera frames lie: page-locked memory, as in a node's engine "
                    "process (the node's shared frame buffer, registered), or pageable (a program calling the "
                    "engine itself with numpy frames: each frame copied into a pinned buffer first)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    batches = tuple(sorted({1, *(int(n) for n in args.batches.split(","))}))
    if not set(batches) <= set(BATCH_SIZES) or (args.stream and len(batches) > 1):
        ap.error(f"--batches: sizes from {BATCH_SIZES}, full queries only (not with --stream)")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    for spec in modes:
        try:
            mode_config(spec, EngineConfig(device=args.device))
        except ValueError as err:
            ap.error(str(err))
    base = EngineConfig(preset=args.preset, checkpoint=args.checkpoint, device=args.device, dtype=dtype,
                        layout=LAYOUTS[args.layout])
    progress = lambda m: print(m, flush=True)  # noqa: E731

    gemms_without_workspace_if_any([mode_config(spec, base) for spec in modes])
    probe = PolicyEngine(base)
    if args.stream:
        inputs = synthetic_stream(base.layout, args.stream)
    else:
        inputs = [(probe.dummy_observation(seed=i), torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(i)))
                  for i in range(args.dev_windows)]
    frames = args.frames if args.device.startswith("cuda") else "pageable"
    if frames == "page-locked":
        inputs = page_locked(inputs)
    prompt = probe.prompts.build(len(base.layout.cameras), base.layout.frames, inputs[0][0].instruction)
    results = {"machine": machine(), "preset": args.preset, "device": args.device, "dtype": dtype,
               "layout": args.layout, "images": base.layout.images, "tokens": len(prompt), "frames": frames,
               "flow_steps": probe.flow_steps, "iters": args.iters,
               "scenario": f"stream of {args.stream} sliding windows" if args.stream else "full queries",
               "gemm_workspace": " ".join(f"{k}={os.environ[k]}" for k in NO_GEMM_WORKSPACE if k in os.environ)
               or "torch's default", "modes": {}}
    probe.close()
    del probe
    reference = None
    for name in modes:
        try:
            res, outs = run_mode(name, base, args.iters, inputs, bool(args.stream), progress, batches)
        except Exception as err:   # a kernel that fails to build or run costs its own row, not the others'
            traceback.print_exc()
            results.setdefault("failed", {})[name] = f"{type(err).__name__}: {err}"
            progress(f"[{name}] failed: {results['failed'][name]}")
        if name in results.get("failed", {}):
            gc.collect()   # here, not in the except block: its traceback held the failed engine (device memory)
            save(results, args)
            continue
        if reference is None and name == "eager":
            reference = outs
        if reference is not None:
            devs = [deviation(o, r) for o, r in zip(outs, reference)]
            res["max_abs_dev"] = max(d["max_abs_dev"] for d in devs)
            res["mean_abs_dev"] = statistics.mean(d["mean_abs_dev"] for d in devs)
            res["rel_l2"] = max(d["rel_l2"] for d in devs)
            res["max_dev_pct_of_range"] = 100 * res["max_abs_dev"] / 2  # normalised actions span [-1, 1]
        results["modes"][name] = res
        progress(f"[{name}] total {res['total_ms']:.2f} ms median")
        save(results, args)  # after every mode, so a run cut short keeps what it measured
    if args.baseline:
        results["baseline"] = hf_baseline(args.preset, args.device, getattr(torch, dtype), base.layout.images,
                                          results["tokens"], args.iters)
        save(results, args)
    print_table(results)
    return 1 if results.get("failed") else 0


def save(results: dict, args) -> None:
    if not args.json:
        return
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(args.plot) if args.plot else path.with_suffix(".png"))


def print_table(results: dict) -> None:
    print(f"\n{results['preset']} {results['layout']} ({results['images']} images, {results['tokens']} tokens, "
          f"{results['flow_steps']} flow steps) on {results['device']} {results['dtype']}")
    w = max(9, max(len(n) for n in [*results["modes"], *results.get("failed", {})]) + 1)
    print(f"scenario: {results.get('scenario', 'full queries')}, frames {results.get('frames', 'pageable')}, "
          f"cuBLAS workspace: {results.get('gemm_workspace', 'unknown')} (every mode)")
    head = (f"{'mode':<{w}}{'total':>9}{'min':>9}" + "".join(f"{s:>11}" for s in STAGES)
            + f"{'ready s':>9}{'max|dev|':>10}{'relL2':>9}{'wt GB':>8}")
    print(head)
    eager = results["modes"].get("eager", {}).get("total_ms")
    for name, r in results["modes"].items():
        row = f"{name:<{w}}{r['total_ms']:>9.2f}{r['total_min_ms']:>9.2f}"
        row += "".join(f"{r['stages'][s]['median']:>11.2f}" for s in STAGES)
        row += f"{r['ready_s']:>9.1f}{r.get('max_abs_dev', float('nan')):>10.2e}{r.get('rel_l2', float('nan')):>9.1e}"
        row += f"{r['weight_gb']:>8.2f}"
        if eager:
            row += f"  x{eager / r['total_ms']:.1f}"
        print(row)
    if any("floors_ms" in r for r in results["modes"].values()):
        print("hardware floor per stage (H200: 790 TFLOP/s bf16, 4.3 TB/s), ms:")
        for name, r in results["modes"].items():
            f = r["floors_ms"]
            print(f"{name:<{w}}{'':>18}{'':>11}" + "".join(f"{f[s]:>11.2f}" for s in STAGES[1:])
                  + "   stage/floor " + " ".join(f"{s} {r['stages'][s]['median'] / f[s]:.1f}x" for s in STAGES[1:]))
    for name, r in results["modes"].items():
        if "batches" in r:
            print(f"{name}: batches of observations (one query each; max|dev| of an entry against it alone)")
            print(f"{'batch':>7}{'total':>9}{'per obs':>9}" + "".join(f"{s:>11}" for s in STAGES[1:])
                  + f"{'x batch 1':>11}{'max|dev|':>10}")
            one = r["batches"][1]["total_ms"]
            for n, b in r["batches"].items():
                print(f"{n:>7}{b['total_ms']:>9.2f}{b['per_observation_ms']:>9.2f}"
                      + "".join(f"{b['stages'][s]['median']:>11.2f}" for s in STAGES[1:])
                      + f"{b['total_ms'] / one:>11.2f}{b['max_abs_dev_vs_alone']:>10.2e}")
    for name, error in results.get("failed", {}).items():
        print(f"{name:<{w}} failed: {error}")
    if "baseline" in results:
        b = results["baseline"]
        print(f"{'hf-base':<{w}}{b['total_ms']:>9.2f}   (transformers {b['transformers']}: vision "
              f"{b['vision']['median']:.2f} + llm {b['llm']['median']:.2f})")


if __name__ == "__main__":
    raise SystemExit(main())

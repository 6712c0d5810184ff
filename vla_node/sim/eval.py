"""`vla-sim eval`: closed-loop success of engine configurations on the same seeds, without DDS.

Every configuration (and hand-over mode and latency) runs the same seeds. Each engine is loaded
and warmed up once; its stream state is reset at every episode. The report's
`configs.<name>.success_rate` comes with its 95 % Wilson interval, the engine's predict time,
and the command's step per tick at chunk boundaries against inside chunks.

`--latency-ms alone` is the latency a user of one robot sees, on a machine shared like a robot's
is not: before a configuration's workers start, one process (nothing else on the device) runs the
first seed with each query's own predict time, and the workers then run every seed with that
episode's median fixed in sim time, so sharing the device for the physics cannot change it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..model.config import get_preset
from ..model.convert import resolve_checkpoint
from ..model.weights import read_config
from ..runtime import EngineConfig, PolicyEngine
from ..runtime.action_cache import FlowSchedule
from ..tools.offline import file_label, parse_configs, parse_overrides
from .aloha import CONTROL_PERIOD_NS, RenderConfig, TransferCube
from .closed_loop import ClosedLoop, ControlSettings, summarize
from .video import write_video


def variants(args, settings: ControlSettings) -> list[tuple[str, str, float | None]]:
    """(suffix, handover, latency_s) for every hand-over mode x latency asked for; a suffix only
    where more than one was asked for."""
    handovers = args.handover or [settings.handover]
    latencies = []
    for text in args.latency_ms:
        if text == "measured":
            latencies.append(("measured", None))
        elif text == "alone":   # evaluate() measured it (alone_ms) before the workers started
            latencies.append(("alone", getattr(args, "alone_ms", None) and args.alone_ms / 1e3))
        else:
            try:
                latencies.append((f"{float(text):g}ms", float(text) / 1e3))
            except ValueError:
                raise ValueError(f"--latency-ms takes 'measured', 'alone' or milliseconds, got {text!r}") from None
    out = []
    for handover in handovers:
        for label, latency_s in latencies:
            suffix = (f"|{handover}" if len(handovers) > 1 else "") + (f"|{label}" if len(latencies) > 1 else "")
            out.append((suffix, handover, latency_s))
    return out


def _render_and_settings(args) -> tuple[RenderConfig, ControlSettings]:
    settings = ControlSettings.from_params_file(args.params)
    render = RenderConfig(cameras=tuple(args.cameras or settings.camera_names),
                          height=args.height or settings.camera_height, width=args.width or settings.camera_width,
                          shadows=args.shadows)
    settings = dataclasses.replace(settings, camera_names=render.cameras, camera_height=render.height,
                                   camera_width=render.width)
    return render, settings


def _engine_config(args, spec, settings: ControlSettings, render: RenderConfig) -> EngineConfig:
    common = dict(preset=args.preset, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                  seed=args.seed, layout=settings.layout, camera_height=render.height, camera_width=render.width)
    common.update(parse_overrides(args.overrides))
    return EngineConfig.for_mode(spec.mode, **{**common, **spec.overrides})


def check_configs(args, specs, settings: ControlSettings, render: RenderConfig) -> None:
    """Every configuration checked before the first one runs (EngineConfig's rules, the action cache
    against its flow steps): one refused late in the list would otherwise end the evaluation after
    the ones before it had spent their time, and before the speedups are computed."""
    policy = read_config(resolve_checkpoint(args.checkpoint)) if args.checkpoint else get_preset(args.preset)
    for spec in specs:
        config = _engine_config(args, spec, settings, render)
        FlowSchedule.parse(config.action_cache, config.flow_steps or policy.action.flow_steps)


def run_seeds(args, spec, seeds: list[int], progress=print) -> tuple[float, dict[str, list]]:
    """One engine for `spec`, every variant (hand-over x latency) on `seeds`: (ready_s, results by
    variant suffix). A process of its own per worker: its own simulator and engine."""
    render, settings = _render_and_settings(args)
    config = _engine_config(args, spec, settings, render)
    progress(f"[{spec.label}] loading {config.checkpoint or config.preset} ({spec.mode}) on {config.device}")
    engine = PolicyEngine(config, progress=lambda m: progress(f"[{spec.label}] {m}"))
    out: dict[str, list] = {}
    try:
        action = engine.model_cfg.action
        if (action.state_dim, action.action_dim) != (14, 14):
            raise ValueError(f"the policy has state_dim {action.state_dim} and action_dim "
                             f"{action.action_dim}; the simulator has 14 joints")
        ready_s = engine.warmup().ready_s
        with TransferCube(render) as env:
            for suffix, handover, latency_s in variants(args, settings):
                name = spec.label + suffix
                loop = ClosedLoop(env, engine, dataclasses.replace(settings, handover=handover),
                                  latency_s=latency_s, ticks=args.ticks, camera_every=args.camera_every)
                results = out[suffix] = []
                for seed in seeds:
                    frames = [] if args.video_dir and seed - args.first_seed < args.videos else None
                    result = loop.run(seed, frames)
                    if frames:
                        path = write_video(Path(args.video_dir) / f"{file_label(name)}_seed{seed}",
                                           frames, 1e9 / CONTROL_PERIOD_NS / args.camera_every)
                        result.video = str(path)
                    results.append(result)
                    median_ms = np.median(result.predict_ms) if result.predict_ms else float("nan")
                    progress(f"[{name}] seed {seed}: {'success' if result.success else 'fail'} "
                             f"(reward {result.max_reward}, {result.ticks} ticks, {result.queries} queries, "
                             f"median {median_ms:.0f} ms)")
    finally:
        engine.close()
        del engine
        gc.collect()
    return ready_s, out


def _worker(job) -> tuple[float, dict[str, list], int]:
    """run_seeds in a pool process with `threads` intra-op threads (None: torch's default, every
    core): (ready_s, results, the threads it ran with)."""
    args, spec, seeds, threads = job
    if threads:
        torch.set_num_threads(threads)
    return (*run_seeds(args, spec, seeds, progress=lambda m: print(m, flush=True)), torch.get_num_threads())


def latency_alone(args, spec) -> dict:
    """Predict times (ms percentiles) of `spec` over the first seed with the measured latency, in a
    process of its own while nothing else runs (its engine's device context goes with it)."""
    import multiprocessing

    alone = argparse.Namespace(**{**vars(args), "latency_ms": ["measured"], "handover": None, "video_dir": None})
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        _, results, _ = pool.apply(_worker, ((alone, spec, [args.first_seed], None),))
    return summarize(results[""])["predict_ms"]


def evaluate(args, progress=print, save=lambda report: None) -> dict:
    """Every configuration on the same seeds. With `args.workers` > 1 the seeds of a configuration
    are spread over that many processes (each its own simulator and engine; on one GPU they share
    it, which slows each query: compare predict times from one worker, or from vla-bench)."""
    render, settings = _render_and_settings(args)
    specs = parse_configs(args.configs)
    check_configs(args, specs, settings, render)
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    workers = max(1, min(getattr(args, "workers", 1) or 1, len(seeds)))
    report = {"task": "gym-aloha AlohaTransferCube-v0 (vla_node.sim)", "seeds": seeds, "ticks": args.ticks,
              "params": str(args.params), "checkpoint": args.checkpoint, "preset": args.preset,
              "device": args.device, "cameras": list(render.cameras), "image_size": [render.height, render.width],
              "control_period_ms": CONTROL_PERIOD_NS / 1e6, "workers": workers, "configs": {}}
    for spec in specs:
        t0 = time.perf_counter()
        alone = latency_alone(args, spec) if "alone" in args.latency_ms else None
        if alone:
            args = argparse.Namespace(**{**vars(args), "alone_ms": alone["p50"]})
            progress(f"[{spec.label}] latency alone: median {alone['p50']:.1f} ms over {alone['n']} queries")
        if workers == 1:
            parts = [(*run_seeds(args, spec, seeds, progress), torch.get_num_threads())]
        else:
            import multiprocessing

            # Each worker its share of the cores: sixteen workers of torch's default (every core each)
            # contend for them on the CPU side of every tick.
            threads = max(1, (os.cpu_count() or 1) // workers)
            shares = [seeds[i::workers] for i in range(workers)]
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                parts = pool.map(_worker, [(args, spec, share, threads) for share in shares])
        for suffix, handover, latency_s in variants(args, settings):
            results = sorted((r for _, part, _ in parts for r in part[suffix]), key=lambda r: r.seed)
            name = spec.label + suffix
            entry = {"mode": spec.mode, "overrides": {k: str(v) for k, v in spec.overrides.items()},
                     "handover_mode": handover, "latency": "measured" if latency_s is None else latency_s * 1e3,
                     "ready_s": max(ready for ready, _, _ in parts), "wall_s": time.perf_counter() - t0,
                     "threads_per_worker": sorted({threads for _, _, threads in parts}),
                     **summarize(results)}
            if alone:
                entry["latency_alone_ms"] = alone
            report["configs"][name] = entry
            low, high = entry["success_ci95"]
            progress(f"[{name}] success {entry['successes']}/{entry['episodes']} "
                     f"({100 * entry['success_rate']:.0f} %, 95 % interval {100 * low:.0f}-{100 * high:.0f} %)")
        # Each configuration's results, speedups included, as soon as it has them: a later one may
        # not finish (a device call's time limit).
        add_speedups(report)
        save(report)
    return report


def add_speedups(report: dict) -> None:
    """Each configuration's speedup over the first, from the latencies measured alone where there
    are any (shared ones time each other)."""
    median = lambda entry: entry.get("latency_alone_ms", entry["predict_ms"]).get("p50")  # noqa: E731
    base = next(iter(report["configs"].values()), None)
    for entry in report["configs"].values():
        if base and median(base) and median(entry):
            entry["speedup_vs_first"] = median(base) / median(entry)


def table(report: dict) -> str:
    """One row a configuration (and hand-over x latency variant): its latency in sim time, success
    with the 95 % interval, speedup over the first configuration, chunks dropped late and the
    command's step at chunk boundaries against inside them (p99, rad); with streaming_kv in any
    configuration, the queries that streamed (a row where none did measured nothing of it)."""
    streaming = any("streaming_kv" in name or e.get("streamed") for name, e in report["configs"].items())
    rows = [("configuration", "latency", "success", "95 %", "speedup", "late", "step p99 boundary / inside")
            + (("streamed",) if streaming else ())]
    for name, e in report["configs"].items():
        alone = e.get("latency_alone_ms", {}).get("p50")
        latency = "measured" if e["latency"] == "measured" else \
            f"{'alone ' if e['latency'] == alone else ''}{e['latency']:.1f} ms"
        ticks = e["latency_ticks"].get("p50")   # none without an answered query
        low, high = e["success_ci95"]
        steps = e["handover"]
        inside, boundary = steps["command_step_rad_inside_chunks"], steps["command_step_rad_at_boundaries"]
        speedup = e.get("speedup_vs_first")
        rows.append((name, latency + (f" ({ticks:g} tick{'s' * (ticks != 1)})" if ticks is not None else ""),
                     f"{e['successes']}/{e['episodes']} ({100 * e['success_rate']:.0f} %)",
                     f"{100 * low:.0f}-{100 * high:.0f} %", f"{speedup:.2f}x" if speedup else "",
                     str(e["late_chunks"]), f"{boundary.get('p99', float('nan')):.3f} / "
                                            f"{inside.get('p99', float('nan')):.3f}")
                    + ((f"{e.get('streamed', 0)}/{e.get('queries', 0)}",) if streaming else ()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


"""Offline replay: a bag's observations straight through the engine (no DDS), frame for frame.

Every configuration sees the same queries (the bag is read the same way each time) and the same
noise (drawn by the first configuration's engine, the baseline, and handed to the others), so
any difference between their actions is the configuration's doing. Reference actions in the bag
are compared too. Writes a JSON report and PNG plots.
"""
from __future__ import annotations

import ast
import dataclasses
import gc
import json
import re
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..runtime import LAYOUTS, MODES, EngineConfig, PolicyEngine, WindowLayout
from ..runtime.types import history_offset
from ..runtime.windows import MAX_CAMERA_RATE_HZ, STATE_SLOP_S, SYNC_SLOP_S
from .bag_io import (
    JOINT_NAMES,
    Bag,
    BagError,
    BagInputs,
    ObservationStream,
    StreamStats,
    image_shape,
    read_references,
    resolve_inputs,
)
from .bench import STAGES, deviation
from .stats import summary

Progress = Callable[[str], None]


# -- naming configurations on the command line --------------------------------------------------
@dataclass(frozen=True)
class ConfigSpec:
    """`MODE[:KEY=VALUE...]`, e.g. `fast`, `fast:flow_steps=5:dtype=bfloat16`: a mode of
    EngineConfig.for_mode plus overrides of any EngineConfig field."""
    label: str
    mode: str
    overrides: dict = field(default_factory=dict)


def parse_value(key: str, text: str):
    """An EngineConfig field's value from text, by the field's annotated type."""
    hints = typing.get_type_hints(EngineConfig)
    if key not in hints:
        raise ValueError(f"unknown engine option {key!r}; known: {', '.join(sorted(hints))}")
    return _convert(key, hints[key], text.strip())


def _convert(key: str, annotation, text: str):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if text.lower() == "none" and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _convert(key, annotation, text)
    if origin is typing.Literal:
        matches = [a for a in args if str(a) == text]
        if not matches:
            raise ValueError(f"{key} must be one of {list(args)}, got {text!r}")
        return matches[0]
    if annotation is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key} is a bool (true/false), got {text!r}")
    if annotation is WindowLayout:
        if text not in LAYOUTS:
            raise ValueError(f"{key}: unknown layout {text!r}; known: {sorted(LAYOUTS)}")
        return LAYOUTS[text]
    if annotation in (int, float, str):
        try:
            return annotation(text)
        except ValueError:
            raise ValueError(f"{key} is {annotation.__name__}, got {text!r}") from None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"{key}: cannot read {text!r} as {annotation}") from None


def parse_overrides(items: Sequence[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        overrides[key.strip()] = parse_value(key.strip(), value)
    return overrides


def parse_configs(text: str) -> list[ConfigSpec]:
    """Comma-separated `MODE[:KEY=VALUE...]`. Values may hold commas and colons (action-cache
    schedules such as `4:3,5:3` do): a comma starts a configuration only before a name followed by
    `:`, `,` or the end, a colon starts an override only before `NAME=`."""
    specs, seen = [], {}
    for item in re.split(r",(?=\s*[A-Za-z_]\w*\s*(?::|,|$))", text):
        item = item.strip()
        if not item:
            continue
        mode, _, rest = item.partition(":")
        if mode.strip() not in MODES:
            raise ValueError(f"unknown mode {mode.strip()!r} in {item!r}; known: {list(MODES)}")
        overrides = re.split(r":(?=\s*[A-Za-z_]\w*\s*=)", rest) if rest else []
        seen[item] = seen.get(item, 0) + 1
        label = item if seen[item] == 1 else f"{item}#{seen[item]}"
        specs.append(ConfigSpec(label, mode.strip(), parse_overrides(overrides)))
    if not specs:
        raise ValueError("no configurations given")
    return specs


# -- what is compared ---------------------------------------------------------------------------
@dataclass
class BagQuery:
    """Which bag, which topics, which queries."""
    bag: Path
    camera_topics: Sequence[str]
    joint_states: str
    instruction_topic: Optional[str]        # None: `instruction` is used
    instruction: Optional[str]
    reference_topic: Optional[str]
    joint_names: Sequence[str] = JOINT_NAMES     # the model's state, in order; reordered by name from the bag
    every: int = 1
    max_frames: Optional[int] = None
    # The node's parameters of the same names.
    sync_slop_s: float = SYNC_SLOP_S
    state_slop_s: float = STATE_SLOP_S
    history_offset_s: float = 0.0               # 0: the engine's checkpoint's
    wait_for_history: bool = False
    max_camera_rate_hz: float = MAX_CAMERA_RATE_HZ
    state_sync: str = "frame"                   # frame | newest

    def inputs(self, bag: Bag, layout: WindowLayout) -> BagInputs:
        return resolve_inputs(bag, layout.cameras, self.camera_topics, self.joint_states, self.instruction_topic,
                              self.reference_topic)

    def stream(self, bag: Bag, layout: WindowLayout, state_dim: int, checkpoint_offset_s: float) -> ObservationStream:
        """The bag's queries for a model with this state size and history offset (unless
        history_offset_s overrides it)."""
        if len(self.joint_names) != state_dim:
            raise BagError(f"{len(self.joint_names)} joints {list(self.joint_names)}, the model's state has "
                           f"{state_dim} (choose joints with --joint-names)")
        offset_s = history_offset(self.history_offset_s, checkpoint_offset_s)
        return ObservationStream(bag, self.inputs(bag, layout), layout, offset_s, self.joint_names, self.instruction,
                                 self.every, self.max_frames, self.sync_slop_s, self.state_slop_s,
                                 self.wait_for_history, self.max_camera_rate_hz, self.state_sync)


@dataclass
class ConfigRun:
    spec: ConfigSpec
    config: EngineConfig
    ready_s: float
    actions: np.ndarray          # [frames, horizon, action_dim]
    normalized: np.ndarray
    timings: list[dict]
    compiled_graphs: int


@dataclass
class FrameLog:
    """What the baseline pass learnt about each query (shared by every configuration)."""
    stamps_ns: list[int] = field(default_factory=list)
    states: list[np.ndarray] = field(default_factory=list)
    noises: list[torch.Tensor] = field(default_factory=list)


def skipped_text(stats: StreamStats) -> str:
    skipped = {"without history": stats.frames_without_history, "out of sync": stats.frames_without_sync,
               "without joint state": stats.frames_without_state,
               "without instruction": stats.frames_without_instruction,
               "superseded by a newer frame": stats.frames_superseded}
    more = {"queries with partial history": stats.partial_history,
            "timeline restarts (stamps stepped back)": stats.timeline_restarts,
            "malformed joint states skipped": stats.joint_states_refused,
            "camera frames dropped (unstamped or a repeated stamp)": stats.frames_refused}
    return f"{stats.first_camera_frames} frames of the first camera" + "".join(
        f", {n} {why} skipped" for why, n in skipped.items() if n) + "".join(
        f"; {n} {what}" for what, n in more.items() if n)


def distribution(samples: Sequence[float]) -> dict:
    return summary(samples)


def run_config(spec: ConfigSpec, config: EngineConfig, query: BagQuery, log: FrameLog, baseline: bool,
               progress: Progress) -> tuple[ConfigRun, Bag, ObservationStream]:
    engine = PolicyEngine(config, progress=lambda m: progress(f"[{spec.label}] {m}"))
    try:
        stats = engine.warmup()
        engine.reset_stream()
        actions, normalized, timings = [], [], []
        bag = Bag(query.bag)
        with bag:
            stream = query.stream(bag, engine.layout, engine.model_cfg.action.state_dim, engine.history_offset_s)
            for frame in stream:
                if frame.new_timeline:   # as the node: a frame id of the new timeline may name an older picture
                    engine.reset_stream()
                if baseline:
                    log.noises.append(engine.draw_noise().cpu())
                    log.stamps_ns.append(frame.stamp_ns)
                    log.states.append(np.asarray(frame.observation.state))
                elif frame.index >= len(log.noises) or log.stamps_ns[frame.index] != frame.stamp_ns:
                    raise RuntimeError(f"[{spec.label}] query {frame.index} differs from the baseline's: "
                                       f"the bag did not read the same way twice")
                chunk = engine.predict(frame.observation, noise=log.noises[frame.index].to(engine.device))
                actions.append(chunk.actions)
                normalized.append(chunk.normalized)
                timings.append(chunk.timings)
                if frame.index % 20 == 0:
                    progress(f"[{spec.label}] query {frame.index}: {chunk.timings['total']:.1f} ms")
        if baseline and not timings:
            damage = f"; {bag.damage.describe(bag.start_ns)}" if bag.damage else ""
            last = f"; the last window lacked: {stream.last_wait.reason}" if stream.last_wait else ""
            last += f"; the last message dropped: {stream.last_refusal}" if stream.last_refusal else ""
            raise BagError(f"no query could be formed from {bag.path}: {skipped_text(stream.stats)}{last}{damage}")
        if len(timings) != len(log.noises):
            raise RuntimeError(f"[{spec.label}] {len(timings)} queries, the baseline had {len(log.noises)}: "
                               f"the bag did not read the same way twice")
        run = ConfigRun(spec, config, stats.ready_s, np.stack(actions), np.stack(normalized), timings,
                        stats.compiled_graphs)
        return run, bag, stream
    finally:
        engine.close()
        del engine
        gc.collect()


# -- the report ---------------------------------------------------------------------------------
def compare(run: ConfigRun, base: ConfigRun) -> tuple[dict, list[dict]]:
    frames = [dict(deviation(n, b), identical=bool(np.array_equal(a, ba)))
              for n, b, a, ba in zip(run.normalized, base.normalized, run.actions, base.actions)]
    summary = {
        "bit_identical": all(f["identical"] for f in frames),
        "identical_frames": sum(f["identical"] for f in frames),
        "max_abs_dev": max(f["max_abs_dev"] for f in frames),
        "mean_abs_dev": float(np.mean([f["mean_abs_dev"] for f in frames])),
        "max_rel_l2": max(f["rel_l2"] for f in frames),
        "max_abs_dev_raw": float(np.abs(run.actions - base.actions).max()),
    }
    return summary, frames


def compare_reference(run: ConfigRun, log: FrameLog, references: dict[int, np.ndarray]) -> tuple[Optional[dict], list]:
    per_frame = []
    for actions, stamp in zip(run.actions, log.stamps_ns):
        ref = references.get(stamp)
        if ref is None:
            per_frame.append(None)
            continue
        if ref.shape[1] != actions.shape[1]:
            raise BagError(f"reference actions have {ref.shape[1]} joints, the model's actions {actions.shape[1]}")
        steps = min(len(ref), len(actions))
        err = np.abs(actions[:steps] - ref[:steps])
        per_frame.append({"mae": float(err.mean()), "max_abs": float(err.max()),
                          "first_step_mae": float(err[0].mean())})
    matched = [f for f in per_frame if f is not None]
    if not matched:
        return None, per_frame
    return {"frames": len(matched), "mae": float(np.mean([f["mae"] for f in matched])),
            "max_abs": max(f["max_abs"] for f in matched),
            "first_step_mae": float(np.mean([f["first_step_mae"] for f in matched]))}, per_frame


def build_report(runs: list[ConfigRun], log: FrameLog, bag: Bag, stream: ObservationStream, inputs: BagInputs,
                 references: dict[int, np.ndarray]) -> dict:
    base = runs[0]
    start = bag.start_ns
    report = {
        "bag": {"path": str(bag.path), "storage": bag.storage, "duration_s": bag.duration_s, "topics": bag.topics,
                "notes": bag.notes, "damage": bag.damage.to_dict(start) if bag.damage else None},
        "inputs": {"cameras": {c.name: c.topic for c in inputs.cameras}, "joint_states": inputs.joint_states,
                   "instruction": inputs.instruction, "reference": inputs.reference},
        "queries": {"evaluated": len(log.stamps_ns), **dataclasses.asdict(stream.stats)},
        "baseline": base.spec.label,
        "configs": [],
        "per_frame": [{"index": i, "time_s": (s - start) / 1e9 if start is not None else None, "stamp_ns": s,
                       "configs": {}} for i, s in enumerate(log.stamps_ns)],
    }
    for run in runs:
        vs_base, frames = compare(run, base)
        vs_ref, ref_frames = compare_reference(run, log, references)
        stages = [s for s in (*STAGES, "total") if any(s in t for t in run.timings)]
        engine_config = dataclasses.asdict(run.config)
        report["configs"].append({
            "label": run.spec.label, "mode": run.spec.mode,
            "overrides": {k: engine_config[k] for k in run.spec.overrides},
            "engine_config": engine_config, "ready_s": run.ready_s,
            "compiled_graphs": run.compiled_graphs,
            "latency_ms": {s: distribution([t.get(s, 0.0) for t in run.timings]) for s in stages},
            "vs_baseline": vs_base, "vs_reference": vs_ref,
        })
        for entry, dev, ref, timing in zip(report["per_frame"], frames, ref_frames, run.timings):
            entry["configs"][run.spec.label] = {"total_ms": timing["total"], **dev,
                                                **({"reference": ref} if ref else {})}
    return report


def file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def write_plots(report: dict, runs: list[ConfigRun], log: FrameLog, references: dict[int, np.ndarray],
                out_dir: Path, joint_names: Sequence[str]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = np.array([f["time_s"] for f in report["per_frame"]], np.float64)
    states = np.stack(log.states)
    ref_first = np.array([references[s][0] if s in references else np.full(runs[0].actions.shape[2], np.nan)
                          for s in log.stamps_ns]) if references else None
    paths = []
    for run in runs:
        dims = run.actions.shape[2]
        fig, axes = plt.subplots((dims + 1) // 2, 2, figsize=(11, 1.9 * ((dims + 1) // 2) + 0.6), sharex=True)
        for d, ax in enumerate(axes.flat[:dims]):
            ax.plot(times, states[:, d], color="0.6", lw=1, label="joint state")
            if ref_first is not None:
                ax.plot(times, ref_first[:, d], "k--", lw=1, label="reference (step 0)")
            if run is not runs[0]:
                ax.plot(times, runs[0].actions[:, 0, d], color="tab:orange", lw=1, ls=":",
                        label=f"{runs[0].spec.label} (step 0)")
            ax.plot(times, run.actions[:, 0, d], color="tab:blue", lw=1.3, label=f"{run.spec.label} (step 0)")
            ax.set_ylabel(joint_names[d] if d < len(joint_names) else f"action {d}", fontsize=8)
        for ax in axes.flat[dims:]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("bag time (s)")
        axes.flat[0].legend(fontsize=7, loc="best")
        fig.suptitle(f"actions over time: {run.spec.label} (first action of each chunk)")
        fig.tight_layout()
        path = out_dir / f"actions_{file_label(run.spec.label)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, (hist, bars) = plt.subplots(1, 2, figsize=(12, 4))
    for run in runs:
        hist.hist([t["total"] for t in run.timings], bins=30, histtype="step", lw=1.5, label=run.spec.label)
    hist.set_xlabel("latency per query (ms)")
    hist.set_ylabel("queries")
    hist.legend(fontsize=8)
    labels = [r.spec.label for r in runs]
    bottom = np.zeros(len(runs))
    for stage in STAGES:
        means = np.array([np.mean([t.get(stage, 0.0) for t in r.timings]) for r in runs])
        bars.bar(labels, means, bottom=bottom, label=stage)
        bottom += means
    bars.set_ylabel("mean ms per stage")
    bars.legend(fontsize=8)
    fig.suptitle("latency")
    fig.tight_layout()
    path = out_dir / "latency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
    return paths


def evaluate(query: BagQuery, specs: Sequence[ConfigSpec], common: dict, out_dir: Path,
             progress: Progress = print) -> dict:
    """Run every configuration over the bag; write report.json and the plots into out_dir."""
    layout = common.get("layout", EngineConfig().layout)
    with Bag(query.bag) as probe:
        inputs = query.inputs(probe, layout)
        height, width = image_shape(probe, inputs)
        references = read_references(probe, inputs.reference) if inputs.reference else {}
        joint_labels = list(query.joint_names)
    configs = [EngineConfig.for_mode(s.mode, **{**common, "camera_height": height, "camera_width": width,
                                                 **s.overrides}) for s in specs]
    log, runs = FrameLog(), []
    t0 = time.perf_counter()
    for i, (spec, config) in enumerate(zip(specs, configs)):
        progress(f"[{spec.label}] {spec.mode} {spec.overrides or ''}".rstrip())
        run, bag, stream = run_config(spec, config, query, log, baseline=(i == 0), progress=progress)
        runs.append(run)
        progress(f"[{spec.label}] {len(run.timings)} queries, median "
                 f"{np.median([t['total'] for t in run.timings]):.1f} ms")
    report = build_report(runs, log, bag, stream, inputs, references)
    report["wall_s"] = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = [str(p) for p in write_plots(report, runs, log, references, out_dir, joint_labels)]
    report["report"] = str(out_dir / "report.json")
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_summary(report: dict, print_fn: Progress = print) -> None:
    bag = report["bag"]
    q = report["queries"]
    print_fn(f"bag {bag['path']} ({bag['storage']}, {bag['duration_s']:.1f} s): {q['evaluated']} queries; "
             f"{skipped_text(StreamStats(**{k: v for k, v in q.items() if k != 'evaluated'}))}")
    for note in bag["notes"]:
        print_fn(f"  note: {note}")
    if bag["damage"]:
        print_fn(f"  PARTIAL BAG: {bag['damage']['summary']}")
    width = max(len("config"), *(len(c["label"]) for c in report["configs"])) + 2
    deviation_head = f"max|dev| vs {report['baseline']}"
    dev_width = max(len(deviation_head), 10) + 2
    head = (f"  {'config':<{width}}{'median ms':>10}{'p99 ms':>9}{'ready s':>9}{deviation_head:>{dev_width}}"
            f"{'identical':>11}")
    has_ref = any(c["vs_reference"] for c in report["configs"])
    print_fn(head + (f"{'ref MAE':>10}" if has_ref else ""))
    for c in report["configs"]:
        lat, dev = c["latency_ms"].get("total", {}), c["vs_baseline"]
        row = (f"  {c['label']:<{width}}{lat.get('p50', float('nan')):>10.1f}{lat.get('p99', float('nan')):>9.1f}"
               f"{c['ready_s']:>9.1f}{dev['max_abs_dev']:>{dev_width}.2e}{'yes' if dev['bit_identical'] else 'no':>11}")
        if has_ref:
            row += f"{c['vs_reference']['mae']:>10.3f}" if c["vs_reference"] else f"{'-':>10}"
        print_fn(row)
    if has_ref:
        untrained = report["configs"][0]["engine_config"]["checkpoint"] is None
        print_fn("  ref MAE: mean |action - the bag's reference action| over each chunk, in joint units"
                 + ("; random weights are not expected to follow it" if untrained else ""))
    stages = [s for s in STAGES if s in report["configs"][0]["latency_ms"]]
    print_fn("  per-stage median ms: " + "; ".join(
        f"{c['label']}: " + ", ".join(f"{s} {c['latency_ms'][s]['p50']:.1f}" for s in stages
                                      if "p50" in c["latency_ms"][s])
        for c in report["configs"]))
    print_fn(f"  report: {report['report']}")
    print_fn("  plots:  " + ", ".join(report["plots"]))

"""The action stage on the GPU: the full-size expert's 10-step flow loop, each variant captured
as one CUDA graph and timed against its bandwidth floor (weights + context K/V read once per
step at 4.3 TB/s), then every kernel of the per-phase loop alone against its own floor, and the
persistent loop at batch 1, 2, 4 and 8. Random weights (init_random_); contexts of 891 and 1738
tokens (the DROID and 8-image prompts) with 10 % padding masked.

    PYTHONPATH=$PWD python3 scripts/bench_expert_gpu.py [--contexts 891,1738] [--out $OUT] [--budget-s 300]

Variants: eager (ActionExpert.velocity in the runner's loop), compiled (the engine's `fast`
action stage: compiled blocks + few_query_attention; --no-compile skips it), fused per-phase
(one launch per phase), fused persistent (one launch per loop; also with each phase's weights
loaded after its barrier wait instead of before, with fewer cross-attention key splits, and
with e4m3 weights). The anatomy part reads the persistent kernel's own timestamps: per phase, the
barrier's release and the slowest program's work. Needs no ROS. Prints a table last and
writes bench_expert_gpu.json under --out after every measurement; what the time budget leaves
is listed as skipped. Without CUDA it is a dry run of the script (TRITON_INTERPRET=1 ...
--preset tiny --contexts 30 --no-compile).
"""
import argparse
import copy
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from vla_node.model import get_preset, init_random_
from vla_node.model.action_expert import ActionExpert, euler, flow_times
from vla_node.runtime.compile import uncompile
from vla_node.runtime.fused_expert import SPIN_LIMIT, FusedExpert, Tiling
from vla_node.runtime.fusion import fuse_projections
from vla_node.runtime.graphs import capture
from vla_node.runtime.kernels.expert_flow import _grid_arrive, _grid_wait
from vla_node.runtime.kernels.few_query_attention import few_query_attention

BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy bandwidth
STEPS = 10
BF16 = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPLAYS = 50 if DEVICE == "cuda" else 1  # compared bit for bit with the first


@triton.jit
def barriers_kernel(Bar, Err, n, SPIN_LIMIT: tl.constexpr):
    """n grid barriers of the persistent kernel and nothing else: what a barrier costs."""
    for k in range(1, n + 1):
        _grid_arrive(Bar)
        _grid_wait(Bar, Err, k * tl.num_programs(0), SPIN_LIMIT)


class _Call:
    """Stands in for a graph on the CPU dry run."""
    def __init__(self, fn):
        self.replay = fn


def graph_of(fn):
    """fn captured as a CUDA graph (runtime/graphs.capture); returns (graph, output)."""
    if DEVICE == "cpu":
        return _Call(fn), fn()
    return capture(fn)


def replay_ms(graph) -> float:
    """Median ms of one replay."""
    if DEVICE == "cpu":
        t = time.perf_counter()
        graph.replay()
        return 1e3 * (time.perf_counter() - t)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def phase_table(t, names: list[str]) -> tuple[dict, float]:
    """Per phase, from timestamps t [programs, segments, (start, end[, mark 2, mark 3])] (us) of
    segments `names`: the span from the last arrival before it to the last arrival after it, split
    into the barrier's release (last arrival -> a program starts, median over programs) and the
    slowest program's work (start -> arrival), and where the CUDA kernel marks its phases inside
    (the slowest marked program's start -> mark 2 -> mark 3 -> arrival: `parts`); medians over the
    phase's occurrences, and its share."""
    import numpy as np
    last_end = t[:, :, 1].max(0)
    rows = {}
    for s in range(1, len(names)):
        r = rows.setdefault(names[s], {"span": [], "release": [], "work": [], "parts": []})
        r["span"].append(last_end[s] - last_end[s - 1])
        r["release"].append(float(np.median(t[:, s, 0])) - last_end[s - 1])
        work = t[:, s, 1] - t[:, s, 0]
        r["work"].append(float(work.max()))
        marked = (t[:, s, 2:] > 0).all(1) if t.shape[2] == 4 else np.zeros(len(t), bool)
        if marked.any():
            p = int(np.flatnonzero(marked)[work[marked].argmax()])
            r["parts"].append([t[p, s, 2] - t[p, s, 0], t[p, s, 3] - t[p, s, 2], t[p, s, 1] - t[p, s, 3]])
    for r in rows.values():
        r["parts"] = list(np.median(np.array(r["parts"]), 0)) if r["parts"] else []
    total = float(last_end[-1] - t[:, 0, 0].min())
    return {k: dict(count=len(v["span"]), share=float(np.sum(v["span"]) / total), parts=[float(x) for x in v["parts"]],
                    **{m: float(np.median(x)) for m, x in v.items() if m != "parts"}) for k, v in rows.items()}, total


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_expert(cfg, device: str = DEVICE) -> tuple[ActionExpert, ActionExpert]:
    """A random bf16 expert of config cfg (projections fused) and its fp32 twin, the same weights."""
    with torch.device(device):
        expert = ActionExpert(cfg).eval().requires_grad_(False)
    init_random_(expert, seed=0)
    expert = expert.to(BF16)
    truth = copy.deepcopy(expert).float()
    fuse_projections(expert)
    fuse_projections(truth)
    return expert, truth


class Bench:
    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.out_path = os.path.join(args.out, "bench_expert_gpu.json")
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
        self.results = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                        "loops": [], "phases": [], "skipped": [], "errors": {}}
        cfg = get_preset(args.preset)
        self.expert, self.truth = random_expert(cfg)  # the truth: the same (bf16-valued) weights in fp32
        self.cfg, a = cfg, cfg.action
        self.kv_bytes_per_key = 2 * a.width * 2 * cfg.expert_depth  # K and V, bf16, all blocks
        self.fused = FusedExpert(self.expert)
        self.bf16_weight_bytes = self.fused.weight_bytes()

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self):
        with open(self.out_path, "w") as f:
            json.dump(self.results, f, indent=1)

    def context(self, tokens: int, entries: int = 1) -> dict:
        e, cfg = self.expert, self.cfg
        g = torch.Generator(device=DEVICE).manual_seed(tokens)
        hidden = [torch.randn(entries, tokens, cfg.llm.dim, device=DEVICE, generator=g) for _ in e.blocks]
        state = torch.rand(entries, cfg.action.state_dim, device=DEVICE, generator=g) * 2 - 1
        mask = torch.ones(entries, 1, 1, tokens + 1, dtype=torch.bool, device=DEVICE)
        mask[..., tokens - tokens // 10:tokens] = False  # instruction padding; the state token stays
        times = [torch.full((1,), t, device=DEVICE) for t in flow_times(STEPS)]
        ctx = dict(tokens=tokens, entries=entries, mask=mask,
                   noise=torch.randn(entries, cfg.action.horizon, cfg.action.action_dim, device=DEVICE, generator=g))
        ctx["kv"] = e.context_kv([h.to(BF16) for h in hidden], state.to(BF16))
        ctx["mods"] = [e.modulations(t) for t in times]
        truth_kv, truth_mods = self.truth.context_kv(hidden, state), [self.truth.modulations(t) for t in times]
        ctx["truth"] = euler(lambda x, i: self.truth.velocity(x, truth_mods[i], truth_kv, mask), ctx["noise"], STEPS)
        ctx["eager"] = self.reference_loop(e.velocity, ctx)()
        return ctx

    @staticmethod
    def reference_loop(velocity_of, ctx):
        """The runner's Euler loop (runtime/static.py) over velocity_of(x_bf16, mods, kv, mask)."""
        return lambda: euler(lambda x, i: velocity_of(x.to(BF16), ctx["mods"][i], ctx["kv"], ctx["mask"]).float(),
                             ctx["noise"], STEPS)

    def loop(self, name: str, run, ctx: dict, weight_bytes: int, launches: int = 0, needs_s: float = 0,
             fused: FusedExpert | None = None):
        """Time one variant's flow loop run() -> actions as a CUDA graph; skipped when less than
        needs_s is left of the budget."""
        label = f"{name} @ {ctx['tokens']} x{ctx['entries']}"
        if self.left_s() < needs_s:
            self.results["skipped"].append(label)
            return
        try:
            t = time.perf_counter()
            graph, actions = graph_of(run)
            ready_s = time.perf_counter() - t
            ms = replay_ms(graph)
            first = actions.clone()
            identical = True
            for _ in range(REPLAYS):
                graph.replay()
                identical &= bool(torch.equal(actions, first))
            nbytes = STEPS * (weight_bytes + self.kv_bytes_per_key * ctx["entries"] * (ctx["tokens"] + 1))
            row = dict(variant=name, context=ctx["tokens"], entries=ctx["entries"], loop_ms=ms,
                       us_per_block=1e3 * ms / (STEPS * len(self.expert.blocks)), gb_s=nbytes / ms / 1e6,
                       floor_ms=1e3 * nbytes / BANDWIDTH, launches_per_loop=launches,
                       rel_err_actions=rel(first, ctx["truth"]), rel_err_vs_eager_bf16=rel(first, ctx["eager"]),
                       replays_identical=identical, ready_s=ready_s,
                       barrier_timed_out=fused.barrier_timed_out() if fused is not None else None)
            self.results["loops"].append(row)
            print(f"{label:44s}: {ms:7.3f} ms/loop, err {row['rel_err_actions']:.2e} (ready {ready_s:.1f}s, "
                  f"{self.left_s():.0f}s left)", flush=True)
        except Exception:
            self.results["errors"][label] = traceback.format_exc()
            print(f"{label} failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def fused_loop(self, name: str, fused: FusedExpert, ctx: dict, **kw):
        inputs = fused.schedule(ctx["mods"])
        noise = ctx["noise"]
        buf = fused.buffers(ctx["entries"], noise.shape[1], ctx["kv"][0][0].shape[2], STEPS, noise.device)
        launches = 1 if fused.runs_persistent(buf) else STEPS * (7 * len(self.expert.blocks) + 2)
        self.loop(name, lambda: fused.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"]), ctx,
                  fused.weight_bytes(), launches, fused=fused, **kw)

    def phases(self, ctx: dict):
        """Each kernel of the per-phase loop alone: one graph of its launches in one flow step
        (36 for a block phase), against its bytes at the bandwidth."""
        if self.left_s() < 20:
            self.results["skipped"].append(f"phases @ {ctx['tokens']}")
            return
        try:
            fused = FusedExpert(self.expert, tiling=Tiling(persistent=False))
            inputs = fused.schedule(ctx["mods"][:1])
            buf = fused.prepare(ctx["noise"], 1, ctx["kv"])
            launches: dict[str, list] = {}
            for phase, _, launch in fused.phase_launches(buf, inputs, ctx["mask"]):
                launches.setdefault(phase, []).append(launch)
            s, keys = fused, ctx["entries"] * (ctx["tokens"] + 1)
            weights = {"qkv": s.qkv, "self": s.self_out, "cross_q": s.cross_q, "cross_out": s.cross_out,
                       "fc1": s.fc1, "fc2": s.fc2}
            for phase, fns in launches.items():
                graph, _ = graph_of(lambda: [f() for f in fns])
                us = 1e3 * replay_ms(graph) / len(fns)
                nbytes = self.kv_bytes_per_key // len(self.expert.blocks) * keys if phase == "cross" else 0
                if phase in weights:
                    w = weights[phase]
                    nbytes += w.weight[0].numel() * w.weight.element_size()
                row = dict(context=ctx["tokens"], phase=phase, launches=len(fns), us=us, bytes=nbytes,
                           gb_s=nbytes / us / 1e3, floor_us=1e6 * nbytes / BANDWIDTH)
                self.results["phases"].append(row)
                print(f"  {phase:10s} {us:6.2f} us  {row['gb_s']:7.0f} GB/s  (floor {row['floor_us']:5.2f} us)",
                      flush=True)
        except Exception:
            self.results["errors"][f"phases @ {ctx['tokens']}"] = traceback.format_exc()
            print(f"phases failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def tilings(self, ctx: dict):
        """The persistent loop under each Tiling of --tilings at each batch of --tiling-entries
        (with --warm-jobs, every tiling is first compiled in processes of its own, in parallel:
        a configuration of the persistent kernel takes ~15 s to compile)."""
        specs = [tiling_spec(s) for s in self.args.tilings.split(",") if s]
        if self.args.warm_jobs and not self.args.warm_only:
            self.warm_tilings()
        for entries in (int(b) for b in self.args.tiling_entries.split(",")):
            batch = self.context(ctx["tokens"], entries)
            for name, fields in specs:
                fused = FusedExpert(self.expert, tiling=Tiling(**fields))
                if self.args.warm_only:
                    fused.flow(batch["noise"], fused.schedule(batch["mods"]), batch["kv"], batch["mask"])
                else:
                    self.fused_loop(f"tiling {name}", fused, batch, needs_s=20)

    def warm_tilings(self):
        """Compile each tiling of --tilings in a process of its own, --warm-jobs at a time (the
        kernels land in Triton's on-disk cache, where this process finds them)."""
        import subprocess
        import sys
        specs = [s for s in self.args.tilings.split(",") if s]
        common = [sys.executable, __file__, "--parts", "tilings", "--warm-only", "--out", self.args.out,
                  "--contexts", self.args.contexts.split(",")[0], "--tiling-entries", self.args.tiling_entries]
        running = []
        for spec in specs:
            running.append(subprocess.Popen(common + ["--tilings", spec]))
            while len(running) >= self.args.warm_jobs:
                running.pop(0).wait()
        for p in running:
            p.wait()
        print(f"  tilings compiled ({time.perf_counter() - self.t0:.0f} s)", flush=True)

    def anatomy(self, ctx: dict, variants: tuple[str, ...] = ("hoisted", "after the wait")):
        """Where the persistent loop's time goes, from its own timestamps (Tiling(trace=True)):
        per phase, the span from the last arrival at the barrier before it to the last arrival
        at the barrier after it, split into the barrier's release (last arrival -> a program
        sees it, median over programs) and the slowest program's work (its wait's end -> its
        arrival)."""
        if DEVICE == "cpu" or self.left_s() < 20:
            self.results["skipped"].append(f"anatomy @ {ctx['tokens']} x{ctx['entries']}")
            return
        try:
            import numpy as np
            tilings = {"hoisted": Tiling(trace=True), "after the wait": Tiling(trace=True, hoist=False)}
            for name in variants:
                fused = FusedExpert(self.expert, tiling=tilings[name])
                inputs = fused.schedule(ctx["mods"])
                for _ in range(3):  # the last of three
                    fused.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"])
                torch.cuda.synchronize()
                buf = next(iter(fused._buffers.values()))
                t = buf.trace.cpu().numpy().astype(np.float64) / 1e3  # us; [programs, segments, (start, end)]
                names = ["in"] + [n for _ in range(len(self.expert.blocks))
                                  for n in ("qkv", "self", "cross_q", "cross", "cross_out", "fc1", "fc2")] + ["out"]
                table, total = phase_table(t, names * STEPS)
                name = f"{name}, B={ctx['entries']}"
                print(f"  anatomy ({name}): loop {total / 1e3:.2f} ms from the kernel's own clock", flush=True)
                for phase, r in table.items():
                    row = dict(variant=name, phase=phase, **r)
                    self.results.setdefault("anatomy", []).append(row)
                    print(f"    {phase:10s} span {row['span']:6.2f} us = release {row['release']:5.2f} + slowest work "
                          f"{row['work']:5.2f} (median of {row['count']}; {100 * row['share']:4.1f} % of the loop)",
                          flush=True)
        except Exception:
            self.results["errors"][f"anatomy @ {ctx['tokens']} x{ctx['entries']}"] = traceback.format_exc()
            print(f"anatomy failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def barriers(self):
        """The grid barrier alone, as many as a 10-step loop has (36 x 7 + 2 per step)."""
        if DEVICE == "cpu":
            self.results["skipped"].append("barriers (spins: GPU only)")
            return
        try:
            n = STEPS * (7 * len(self.expert.blocks) + 2)
            bar, err = (torch.zeros(1, dtype=torch.int32, device=DEVICE) for _ in range(2))
            programs = torch.cuda.get_device_properties(DEVICE).multi_processor_count

            def run():
                bar.zero_()
                barriers_kernel[(programs,)](bar, err, n, SPIN_LIMIT=SPIN_LIMIT, num_warps=8)
            graph, _ = graph_of(run)
            us = 1e3 * replay_ms(graph) / n
            self.results["phases"].append(dict(context=0, phase="grid barrier", launches=n, us=us, bytes=0, gb_s=0,
                                               floor_us=0, timed_out=bool(err.item())))
            print(f"  grid barrier {us:6.2f} us ({programs} programs)", flush=True)
        except Exception:
            self.results["errors"]["barriers"] = traceback.format_exc()
            print(f"barriers failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def run(self):
        e = self.expert
        contexts = [self.context(int(t)) for t in self.args.contexts.split(",")]
        variants = {"fused persistent": self.fused,
                    "fused persistent, weights after the wait": FusedExpert(e, tiling=Tiling(hoist=False)),
                    "fused persistent, 8 key splits": FusedExpert(e, tiling=Tiling(key_splits=8)),
                    "fused persistent, 4 key splits": FusedExpert(e, tiling=Tiling(key_splits=4)),
                    "fused persistent fp8": FusedExpert(e, fp8=True),
                    "fused per-phase": FusedExpert(e, tiling=Tiling(persistent=False))}
        parts = self.args.parts.split(",")
        if "tilings" in parts:
            self.tilings(contexts[0])
            if self.args.warm_only:
                return
        # Most telling first; the budget cuts from the end.
        for k, ctx in enumerate(contexts):
            if "loops" in parts:
                self.loop("eager", self.reference_loop(e.velocity, ctx), ctx, self.bf16_weight_bytes)
                for name, fused in variants.items():
                    if k == 0 or fused is self.fused:
                        self.fused_loop(name, fused, ctx, needs_s=20)
            if k == 0 and "anatomy" in parts:
                self.anatomy(ctx)
            for entries in (1, 4, 2, 8) if k == 0 and "batch" in parts else ():
                batch = self.context(ctx["tokens"], entries)
                self.fused_loop("fused persistent", self.fused, batch, needs_s=30)
                if entries in (4, 8) and "anatomy" in parts:
                    self.anatomy(batch, ("hoisted",))
        if "phases" in parts:
            self.barriers()
            self.phases(contexts[0])
        if "compiled" not in parts:
            pass
        elif self.args.no_compile:
            self.results["skipped"].append("compiled blocks (--no-compile)")
        elif self.left_s() < 90:  # inductor needs about a minute for the block
            self.results["skipped"].append("compiled blocks + fqa (time budget)")
        else:
            for blk in e.blocks:  # the engine's `fast` action stage
                blk.attend = few_query_attention
                blk.compile(fullgraph=True, dynamic=False)
            for ctx in contexts:
                self.loop("compiled blocks + fqa (fast)", self.reference_loop(e.velocity, ctx), ctx,
                          self.bf16_weight_bytes)
            uncompile(list(e.blocks))
            for blk in e.blocks:
                blk.attend = F.scaled_dot_product_attention
        self.report()

    def report(self):
        r = self.results
        print(f"\n{r['device']}, torch {r['torch']}, triton {r['triton']}; floor = bytes / {BANDWIDTH / 1e12} TB/s")
        print(f"{'variant':32s} {'ctx':>5s} {'B':>2s} {'ms/loop':>8s} {'us/blk':>7s} {'GB/s':>6s} {'%BW':>5s} "
              f"{'floor ms':>8s} {'err':>8s} {'vs bf16':>8s} {'replay=':>7s} {'launch':>6s}")
        for x in r["loops"]:
            print(f"{x['variant'][:32]:32s} {x['context']:5d} {x['entries']:2d} {x['loop_ms']:8.3f} "
                  f"{x['us_per_block']:7.2f} {x['gb_s']:6.0f} {100 * x['gb_s'] * 1e9 / BANDWIDTH:5.1f} "
                  f"{x['floor_ms']:8.3f} {x['rel_err_actions']:8.1e} {x['rel_err_vs_eager_bf16']:8.1e} "
                  f"{str(x['replays_identical']):>7s} {x['launches_per_loop']:6d}")
        if r["phases"]:
            print(f"\n{'per-phase kernel (1 graph of a step)':36s} {'ctx':>5s} {'us':>7s} {'GB/s':>6s} "
                  f"{'floor us':>8s} {'x floor':>7s}")
            for x in r["phases"]:
                ratio = x["us"] / x["floor_us"] if x["floor_us"] else float("nan")
                print(f"{x['phase']:36s} {x['context']:5d} {x['us']:7.2f} {x['gb_s']:6.0f} {x['floor_us']:8.2f} "
                      f"{ratio:7.1f}")
        if r.get("anatomy"):
            print(f"\n{'persistent loop, own clock (median us)':40s} {'span':>6s} {'release':>7s} {'work':>6s} "
                  f"{'share':>6s}")
            for x in r["anatomy"]:
                print(f"{x['variant'][:26]:26s} {x['phase']:13s} {x['span']:6.2f} {x['release']:7.2f} {x['work']:6.2f} "
                      f"{100 * x['share']:5.1f}%")
        for what in r["skipped"]:
            print(f"skipped: {what}")
        for what, trace in r["errors"].items():
            print(f"error: {what}: {trace.strip().splitlines()[-1]}")
        print(f"err = relative L2 error of the actions after {STEPS} steps against the fp32 expert with the same "
              f"weights; vs bf16: against the eager bf16 loop; full results: {self.out_path}")


def tiling_spec(spec: str) -> tuple[str, dict]:
    """'name:field=value+field=value' (Tiling's fields) -> (name, {field: value})."""
    name, _, fields = spec.partition(":")
    parsed = {}
    for item in filter(None, fields.split("+")):
        key, _, value = item.partition("=")
        parsed[key] = value == "True" if value in ("True", "False") else int(value)
    return name, parsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="891,1738", help="context tokens (LLM sequence) per query")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip what is left after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant (the slowest to build)")
    ap.add_argument("--parts", default="loops,anatomy,phases,batch,compiled",
                    help="what to measure: loops (every variant), anatomy (the persistent loop's own timestamps per "
                         "phase), phases (each kernel alone, the barrier), batch (B = 1-8), compiled (the engine's "
                         "compiled blocks), tilings (the persistent loop under each of --tilings)")
    ap.add_argument("--preset", default="molmobot-4b", help="model preset (tiny: a CPU dry run of the script)")
    ap.add_argument("--tilings", default="default:,warps4:num_warps=4,ks8:key_splits=8",
                    help="the tilings part: name:field=value+field=value (Tiling's fields), comma-separated")
    ap.add_argument("--tiling-entries", default="1,4", help="the tilings part: batch sizes")
    ap.add_argument("--warm-jobs", type=int, default=0, help="the tilings part: compile first in this many processes")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # a warm_tilings process
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with torch.inference_mode():
        Bench(args).run()


if __name__ == "__main__":
    main()

"""The action stage on the GPU: the full-size expert's 10-step flow loop, eager, compiled (the
engine's fast path: compiled blocks + few_query_attention) and on the fused Triton kernels
(runtime/fused_expert.py: bf16, fp8, with programmatic dependent launch, q projection fused or
not), each captured as one CUDA graph per loop; then each fused kernel alone against its
bandwidth floor, and a few tilings. Random weights (init_random_), contexts of ~830 and ~1650
tokens (2 cameras x 2 frames / 8 images) with 10% padding masked.

    PYTHONPATH=$PWD python3 scripts/bench_expert_gpu.py [--contexts 830,1650] [--out $OUT] [--budget-s 200]

Needs no ROS. Prints a table last and writes bench_expert_gpu.json under --out (after every
measurement, so a cut-off run keeps what it measured); variants still pending when the time
budget is spent are skipped and listed. Without CUDA it is a dry run of the script itself
(TRITON_INTERPRET=1 ... --preset tiny --contexts 30 --no-compile): graphs become plain calls
and the times mean nothing.
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
from triton.testing import do_bench

from vla_node.model import get_preset, init_random_
from vla_node.model.action_expert import ActionExpert, flow_times
from vla_node.runtime.compile import uncompile
from vla_node.runtime.fused_expert import FusedExpert
from vla_node.runtime.fusion import fuse_projections
from vla_node.runtime.kernels.expert_block import Tiling
from vla_node.runtime.kernels.few_query_attention import few_query_attention

BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy bandwidth
STEPS, HORIZON = 10, 16
BF16 = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Call:
    """Stands in for a graph on the CPU dry run."""
    def __init__(self, fn):
        self.replay = fn


def graph_of(fn):
    """fn captured as a CUDA graph after two warm runs on a side stream; returns (graph, output)."""
    if DEVICE == "cpu":
        return _Call(fn), fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph) -> float:
    """Median ms of one replay (L2 flushed before each, as after the LLM's prefill)."""
    if DEVICE == "cpu":
        times = []
        for _ in range(2):
            t = time.perf_counter()
            graph.replay()
            times.append(1e3 * (time.perf_counter() - t))
        return min(times)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class Bench:
    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.out_path = os.path.join(args.out, "bench_expert_gpu.json")
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
        self.results = {"device": device, "torch": torch.__version__,
                        "triton": triton.__version__, "loops": [], "stages": [], "skipped": [], "errors": {}}
        cfg = get_preset(args.preset)
        with torch.device(DEVICE):
            expert = ActionExpert(cfg).eval().requires_grad_(False)
        init_random_(expert, seed=0)
        self.expert = expert.to(BF16)
        self.truth = copy.deepcopy(self.expert).float()  # the same (bf16-valued) weights in fp32
        fuse_projections(self.expert)
        fuse_projections(self.truth)
        self.cfg = cfg
        a = cfg.action
        self.kv_bytes_per_key = 2 * a.width * 2 * cfg.expert_depth  # K and V, bf16, all blocks
        self.bf16_weight_bytes = FusedExpert(self.expert).weight_bytes()

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self):
        with open(self.out_path, "w") as f:
            json.dump(self.results, f, indent=1)

    def context(self, tokens: int) -> dict:
        e, cfg = self.expert, self.cfg
        g = torch.Generator(device=DEVICE).manual_seed(tokens)
        hidden = [torch.randn(1, tokens, cfg.llm.dim, device=DEVICE, generator=g) for _ in e.blocks]
        state = torch.rand(1, cfg.action.state_dim, device=DEVICE, generator=g) * 2 - 1
        mask = torch.ones(1, 1, 1, tokens + 1, dtype=torch.bool, device=DEVICE)
        mask[..., tokens - tokens // 10:tokens] = False  # instruction padding; the state token stays
        times = [torch.full((1,), t, device=DEVICE) for t in flow_times(STEPS)]
        ctx = dict(tokens=tokens, mask=mask, noise=torch.randn(1, HORIZON, cfg.action.action_dim, device=DEVICE,
                                                              generator=g))
        ctx["kv"] = e.context_kv([h.to(BF16) for h in hidden], state.to(BF16))
        ctx["mods"] = [e.modulations(t) for t in times]
        truth_kv = self.truth.context_kv(hidden, state)
        truth_mods = [self.truth.modulations(t) for t in times]
        truth_v = lambda x, i: self.truth.velocity(x, truth_mods[i], truth_kv, mask)  # noqa: E731
        ctx["truth_v0"] = truth_v(ctx["noise"], 0)
        ctx["eager_v0"] = e.velocity(ctx["noise"].to(BF16), ctx["mods"][0], ctx["kv"], mask).float()
        ctx["truth_actions"] = self.flow(truth_v, ctx["noise"])()
        return ctx

    @staticmethod
    def flow(velocity, noise):
        """The runner's Euler loop (runtime/static.py) over velocity(x, step) -> fp32."""
        def run():
            x = noise
            for i in range(STEPS):
                x = x + (1.0 / STEPS) * velocity(x, i)
            return x
        return run

    def loop(self, name: str, velocity_of, ctx: dict, weight_bytes: int, launches: int = 0, needs_s: float = 0):
        """Time one variant's flow loop as a CUDA graph; velocity_of(x_model_dtype, mods, kv, mask).
        launches: kernels per loop (0: not counted); skipped when less than needs_s is left."""
        if self.left_s() < needs_s:
            self.results["skipped"].append(f"{name} @ {ctx['tokens']}")
            return
        try:
            v = lambda x, i: velocity_of(x.to(BF16), ctx["mods"][i], ctx["kv"], ctx["mask"]).float()  # noqa: E731
            t = time.perf_counter()
            v0 = v(ctx["noise"], 0)
            graph, actions = graph_of(self.flow(v, ctx["noise"]))
            ready_s = time.perf_counter() - t
            ms = replay_ms(graph)
            replays = [actions.clone()]
            for _ in range(3):
                graph.replay()
                replays.append(actions.clone())
            nbytes = STEPS * (weight_bytes + self.kv_bytes_per_key * (ctx["tokens"] + 1))
            row = dict(variant=name, context=ctx["tokens"], loop_ms=ms,
                       us_per_block=1e3 * ms / (STEPS * len(self.expert.blocks)),
                       gb_s=nbytes / ms / 1e6, floor_ms=1e3 * nbytes / BANDWIDTH, launches_per_loop=launches,
                       rel_err_velocity=rel(v0, ctx["truth_v0"]), rel_err_actions=rel(actions, ctx["truth_actions"]),
                       rel_err_velocity_vs_eager_bf16=rel(v0, ctx["eager_v0"]),
                       replays_identical=all(torch.equal(r, replays[0]) for r in replays), ready_s=ready_s)
            self.results["loops"].append(row)
            print(f"{name:28s} ctx {ctx['tokens']:5d}: {ms:7.3f} ms/loop, err {row['rel_err_actions']:.2e} "
                  f"(ready {ready_s:.1f}s, {self.left_s():.0f}s left)", flush=True)
        except Exception:
            self.results["errors"][f"{name} @ {ctx['tokens']}"] = traceback.format_exc()
            print(f"{name} @ {ctx['tokens']} failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def stages(self, name: str, fused: FusedExpert, ctx: dict):
        """Each fused kernel alone: a graph of its 360 launches (10 steps x 36 blocks)."""
        if self.left_s() < 0:
            self.results["skipped"].append(f"stages {name} @ {ctx['tokens']}")
            return
        try:
            fused.velocity(ctx["noise"], ctx["mods"][0], ctx["kv"], ctx["mask"])  # buffers hold real values
            buf = fused.buffers(1, HORIZON, ctx["tokens"] + 1, DEVICE)
            mask_rows = ctx["mask"].reshape(1, -1)
            launches: dict[str, list] = {}
            for i in range(STEPS):
                for j, (k, v) in enumerate(ctx["kv"]):
                    for stage, launch in fused.block_stages(buf, j, ctx["mods"][i][0][j], k, v, mask_rows, HORIZON):
                        launches.setdefault(stage, []).append(launch)
            blk = fused.blocks[0]
            kv_bytes = self.kv_bytes_per_key // len(fused.blocks) * (ctx["tokens"] + 1)
            nbytes = {"qkv": blk.qkv, "self_out": blk.self_out, "cross_q": blk.cross_q, "cross_out": blk.cross_out,
                      "fc1": blk.fc1, "fc2": blk.fc2}
            for stage, fns in launches.items():
                graph, _ = graph_of(lambda: [f() for f in fns])
                us = 1e3 * replay_ms(graph) / len(fns)
                b = kv_bytes if stage == "cross" else 0
                if stage != "cross" or fused.project_in_attention:
                    lin = nbytes["cross_q" if stage == "cross" else stage]
                    b += lin.weight.numel() * lin.weight.element_size()
                self.results["stages"].append(dict(variant=name, context=ctx["tokens"], stage=stage, us=us,
                                                   bytes=b, gb_s=b / us / 1e3, floor_us=1e6 * b / BANDWIDTH))
                print(f"  {name} {stage:10s} {us:6.2f} us  {b / us / 1e3:7.0f} GB/s  "
                      f"(floor {1e6 * b / BANDWIDTH:5.2f} us)", flush=True)
        except Exception:
            self.results["errors"][f"stages {name} @ {ctx['tokens']}"] = traceback.format_exc()
            print(f"stages {name} failed:\n{traceback.format_exc()}", flush=True)
        self.save()

    def run(self):
        e, blocks = self.expert, len(self.expert.blocks)
        contexts = [self.context(int(t)) for t in self.args.contexts.split(",")]
        fused = {"fused bf16": FusedExpert(e), "fused fp8": FusedExpert(e, fp8=True)}
        fp8_bytes = fused["fused fp8"].weight_bytes()
        if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
            fused["fused bf16 pdl"] = FusedExpert(e, pdl=True)
            fused["fused fp8 pdl"] = FusedExpert(e, fp8=True, pdl=True)
        else:
            self.results["skipped"].append("pdl: needs a GPU of compute capability >= 9.0")
        launches = lambda f: STEPS * (blocks * (6 if f.project_in_attention else 7) + 2)  # noqa: E731
        # Most telling first; the budget cuts from the end.
        for ctx in contexts:
            self.loop("eager", e.velocity, ctx, self.bf16_weight_bytes)
            for name, f in fused.items():
                self.loop(name, f.velocity, ctx, fp8_bytes if f.fp8 else self.bf16_weight_bytes, launches(f))
        self.stages("fused bf16", fused["fused bf16"], contexts[-1])
        q_linear = FusedExpert(e, project_in_attention=False)
        for ctx in contexts:
            self.loop("fused bf16 q-linear", q_linear.velocity, ctx, self.bf16_weight_bytes, launches(q_linear))
        self.stages("fused fp8", fused["fused fp8"], contexts[-1])
        if self.args.no_compile:
            self.results["skipped"].append("compiled blocks (--no-compile)")
        elif self.left_s() < 90:  # inductor needs about a minute for the block
            self.results["skipped"].append("compiled blocks + fqa (time budget)")
        else:
            for blk in e.blocks:  # the engine's fast path today
                blk.attend = few_query_attention
                blk.compile(fullgraph=True, dynamic=False)
            for ctx in contexts:
                self.loop("compiled blocks + fqa", e.velocity, ctx, self.bf16_weight_bytes)
            uncompile(list(e.blocks))
            for blk in e.blocks:
                blk.attend = F.scaled_dot_product_attention
        for tiling in (Tiling(prefetch_l2=False), Tiling(keys_per_split=128), Tiling(keys_per_split=512),
                       Tiling(block_n=32), Tiling(head_block_n=64), Tiling(num_warps=8)):
            changed = ",".join(f"{k}={v}" for k, v in vars(tiling).items() if v != getattr(Tiling(), k))
            f = FusedExpert(e, tiling=tiling)
            self.loop(f"fused bf16 {changed}", f.velocity, contexts[-1], self.bf16_weight_bytes, launches(f),
                      needs_s=15)
        self.report()

    def report(self):
        r = self.results
        print(f"\n{r['device']}, torch {r['torch']}, triton {r['triton']}; floor = bytes / {BANDWIDTH / 1e12} TB/s")
        print(f"{'variant':44s} {'ctx':>5s} {'ms/loop':>8s} {'us/blk':>7s} {'GB/s':>6s} {'%BW':>5s} "
              f"{'floor ms':>8s} {'err(v)':>8s} {'err(act)':>8s} {'vs bf16':>8s} {'replay=':>7s}")
        for x in r["loops"]:
            print(f"{x['variant'][:44]:44s} {x['context']:5d} {x['loop_ms']:8.3f} {x['us_per_block']:7.2f} "
                  f"{x['gb_s']:6.0f} {100 * x['gb_s'] * 1e9 / BANDWIDTH:5.1f} {x['floor_ms']:8.3f} "
                  f"{x['rel_err_velocity']:8.1e} {x['rel_err_actions']:8.1e} "
                  f"{x['rel_err_velocity_vs_eager_bf16']:8.1e} {str(x['replays_identical']):>7s}")
        if r["stages"]:
            print(f"\n{'per kernel (its launches of a loop, 1 graph)':44s} {'ctx':>5s} {'us':>7s} {'GB/s':>6s} "
                  f"{'floor us':>8s}")
            for x in r["stages"]:
                print(f"{(x['variant'] + ' ' + x['stage'])[:44]:44s} {x['context']:5d} {x['us']:7.2f} "
                      f"{x['gb_s']:6.0f} {x['floor_us']:8.2f}")
        for what in r["skipped"]:
            print(f"skipped: {what}")
        for what, trace in r["errors"].items():
            print(f"error: {what}: {trace.strip().splitlines()[-1]}")
        print(f"err = relative L2 error against the fp32 expert with the same weights (velocity of step 0; "
              f"actions after {STEPS} steps); vs bf16: the step-0 velocity against the eager bf16 expert's; "
              f"full results: {self.out_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="830,1650", help="context tokens (LLM sequence) per query")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip what is left after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant (the slowest to build)")
    ap.add_argument("--preset", default="molmobot-4b", help="model preset (tiny: a CPU dry run of the script)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with torch.inference_mode():
        Bench(args).run()


if __name__ == "__main__":
    main()

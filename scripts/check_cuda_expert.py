"""The fused expert's CUDA backend (kernels/expert_flow.cu) at full size against the fp32 expert
and the Triton kernel: error, loop time in a CUDA graph, bit-identical replays, for batches of
observations; action caching, per-entry masks and known actions (inpainting) on the way.

    PYTHONPATH=$PWD python3 scripts/check_cuda_expert.py --entries 1,2,4,8 [--backends cuda,triton,cuda-fp8]
        [--out DIR]   # JSON of every row

Prints one table last. Random bf16 weights (molmobot-4b), 10 flow steps, horizon 16; a backend or a
variant with fp8 (`cuda-fp8`, `name:fp8=1+...`) takes them in e4m3 (expert_fp8), its error against
the unquantised fp32 expert.
"""
import argparse
import dataclasses
import json
import os
import time

import torch
from bench_expert_gpu import BANDWIDTH, phase_table, random_expert, rel  # scripts/: shared with the Triton bench
from triton.testing import do_bench

from vla_node.model import get_preset
from vla_node.model.action_expert import KnownActions, euler, flow_times
from vla_node.runtime.fused_expert import FusedExpert
from vla_node.runtime.fused_expert_cuda import CudaTiling
from vla_node.runtime.graphs import capture


def context(cfg, expert, entries: int, tokens: int, times, padded: bool = False) -> dict:
    """One query's inputs for `entries` observations: LLM hidden states and state (fp32), noise, the
    bf16 expert's context K/V and modulations, and the key mask (padded: a different number of
    padding keys per entry, else none)."""
    g = torch.Generator(device="cuda").manual_seed(entries)
    hidden = [torch.randn(entries, tokens, cfg.llm.dim, device="cuda", generator=g) for _ in expert.blocks]
    state = torch.rand(entries, cfg.action.state_dim, device="cuda", generator=g) * 2 - 1
    mask = torch.ones(entries, 1, 1, tokens + 1, dtype=torch.bool, device="cuda")
    for b in range(entries if padded else 0):
        mask[b, ..., tokens - tokens // (10 + b):tokens] = False
    with torch.inference_mode():
        return dict(hidden=hidden, state=state, mask=mask,
                    noise=torch.randn(entries, cfg.action.horizon, cfg.action.action_dim, device="cuda", generator=g),
                    kv=expert.context_kv([h.bfloat16() for h in hidden], state.bfloat16()),
                    mods=[expert.modulations(t) for t in times])


def truth_velocity(truth, ctx: dict, times):
    """The fp32 expert's velocity (x, step) -> v on a context's inputs (for euler)."""
    kv = truth.context_kv(ctx["hidden"], ctx["state"])
    mods = [truth.modulations(t) for t in times]
    return lambda x, i: truth.velocity(x, mods[i], kv, ctx["mask"])


def phase_floor_us(cfg, phase: str, entries: int, keys: int, folded: bool) -> float:
    """The bytes a phase must read once (its weights; the cross-attention its entries' context K/V),
    over the H200's measured 4.3 TB/s, in us."""
    a = cfg.action
    w, mlp = a.width, a.mlp
    n = dict(qkv=(3 + folded) * w * w, self_out=(1 + folded) * w * w, cross_q=w * w, cross=2 * entries * keys * w,
             cross_out=w * w, fc1=mlp * w, fc2=w * mlp).get(phase, 0)
    return 2 * n / BANDWIDTH * 1e6


def tilings(spec: str) -> list[tuple[str, CudaTiling, bool]]:
    """'name:field=v+field=v,name2:...' -> named CudaTilings (fields as integers) and whether the
    weights are e4m3 (the field fp8=1)."""
    out = []
    for item in spec.split(","):
        name, _, fields = item.partition(":")
        knobs = {k: int(v) for k, v in (f.split("=") for f in fields.split("+") if f)}
        fp8 = bool(knobs.pop("fp8", 0))
        out.append((name, CudaTiling(**knobs), fp8))
    return out


def time_variants(args, cfg, expert, truth, times, report: dict) -> None:
    """--variants at --variant-entries: each one's loop in a CUDA graph (median ms), its distance from
    the fp32 expert and from the variant named default (or, with none so named, the first), and whether
    50 replays are bit-identical."""
    variants = tilings(args.variants) if args.variants else []
    names = [name for name, _, _ in variants]
    ref = "default" if "default" in names or not names else names[0]
    for entries in (int(e) for e in args.variant_entries.split(",") if variants):
        ctx = context(cfg, expert, entries, args.tokens, times)
        with torch.inference_mode():
            want = euler(truth_velocity(truth, ctx, times), ctx["noise"], args.steps)
        reference = None
        for name, tiling, fp8 in variants:
            f = FusedExpert(expert, fp8=fp8, backend="cuda", cuda_tiling=tiling)
            inputs = f.schedule(ctx["mods"])
            try:   # a plan or launch the GPU refuses (before anything ran): report, go on
                f.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"])
                torch.cuda.synchronize()
            except (RuntimeError, ValueError) as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                print(f"variant {name:10s} B={entries}: failed: {why}", flush=True)
                report["variants"].append(dict(variant=name, entries=entries, failed=why))
                continue
            graph, out = capture(lambda: f.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"]))
            ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
            first, identical = out.clone(), True
            for _ in range(50):
                graph.replay()
                identical &= bool(torch.equal(out, first))
            reference = out.clone() if name == ref and reference is None else reference
            diff = rel(out, reference) if reference is not None else float("nan")   # before the reference ran
            err = rel(out, want)
            report["variants"].append(dict(variant=name, entries=entries, loop_ms=ms, diff_vs_default=diff, err=err,
                                           replays_identical=identical, barrier_timed_out=f.barrier_timed_out()))
            print(f"variant {name:10s} B={entries}: loop {ms:.3f} ms, rel err {err:.1e}, rel diff to {ref} "
                  f"{diff:.1e}, 50 replays bit-identical {identical}, barrier timed out {f.barrier_timed_out()}",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="1,2,4,8")
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--tokens", type=int, default=891)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--preset", default="molmobot-4b")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--variants", default="", help="CUDA knob variants timed at --variant-entries, e.g. "
                    "'poll1:poll=1,sync:work=0' (CudaTiling fields)")
    ap.add_argument("--variant-entries", default="1")
    ap.add_argument("--anatomy", default="", help="batch sizes whose per-phase anatomy the CUDA kernel's own "
                    "timestamps give, e.g. 1,4")
    ap.add_argument("--aba", default="", help="a second context length: the loops of --tokens (A) and of this (B) "
                    "captured, replayed A, B, A: A's output bit for bit the same both times")
    ap.add_argument("--anatomy-tilings", default="default:", help="the tilings the anatomy is taken of, as "
                    "--variants names them")
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    expert, truth = random_expert(cfg, "cuda")
    t0 = time.perf_counter()
    fused = {b: FusedExpert(expert, backend=b.removesuffix("-fp8"), fp8=b.endswith("-fp8"))
             for b in args.backends.split(",")}
    print(f"built {list(fused)} in {time.perf_counter() - t0:.1f} s", flush=True)
    times = [torch.full((1,), t, device="cuda") for t in flow_times(args.steps)]
    rows = []
    for entries in (int(e) for e in args.entries.split(",")):
        ctx = context(cfg, expert, entries, args.tokens, times, padded=True)
        noise, kv, mods, mask = ctx["noise"], ctx["kv"], ctx["mods"], ctx["mask"]
        reuse = {3: 2, 5: 4, 7: 6}
        with torch.inference_mode():
            vel = truth_velocity(truth, ctx, times)
            want = euler(vel, noise, args.steps)
            want_reuse = euler(vel, noise, args.steps, reuse=reuse)
            first4 = (torch.arange(noise.shape[1], device="cuda") < 4)[None, :, None].expand(entries, -1, 1)
            known = KnownActions(torch.randn_like(noise) * 0.5, first4)
            want_known = euler(vel, noise, args.steps, known=known)
            for name, f in fused.items():
                row = dict(backend=name, entries=entries)
                try:
                    inputs = f.schedule(mods)
                    got = f.flow(noise, inputs, kv, mask).clone()
                    torch.cuda.synchronize()
                    row["err"] = rel(got, want)
                    row["err_reuse"] = rel(f.flow(noise, f.schedule(mods, reuse), kv, mask), want_reuse)
                    got_known = f.flow(noise, inputs, kv, mask, known=known).clone()
                    row["err_known"] = rel(got_known, want_known)
                    row["known_exact"] = bool(torch.equal(got_known[:, :4], known.values[:, :4].float()))
                    graph, out = capture(lambda: f.flow(noise, inputs, kv, mask))
                    first = out.clone()
                    same = True
                    for _ in range(50):
                        graph.replay()
                        same &= bool(torch.equal(out, first))
                    row["replays_identical"] = same
                    row["loop_ms"] = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
                    row["barrier_timed_out"] = f.barrier_timed_out()
                except Exception as e:   # an illegal access poisons the context: report and stop
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    print(row, flush=True)
                    rows.append(row)
                    break
                print(row, flush=True)
                rows.append(row)
            else:
                continue
            break
    report = dict(rows=rows, variants=[], anatomy=[])
    if args.aba:
        f = FusedExpert(expert, backend="cuda")
        graphs, held = [], []   # held: what the graphs read (inputs, schedules) lives as long as they do
        for tokens in (args.tokens, int(args.aba)):
            ctx = context(cfg, expert, 1, tokens, times, padded=True)
            inputs = f.schedule(ctx["mods"])
            held.append((ctx, inputs))
            graphs.append(capture(lambda ctx=ctx, inputs=inputs: f.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"])))
        (graph_a, out_a), (graph_b, out_b) = graphs
        graph_a.replay()
        first = out_a.clone()
        graph_b.replay()
        graph_a.replay()
        report["aba_identical"] = bool(torch.equal(out_a, first)) and bool(out_b.isfinite().all())
        print(f"A-B-A ({args.tokens}, {args.aba}, {args.tokens} context tokens): A bit-identical "
              f"{report['aba_identical']}", flush=True)
    time_variants(args, cfg, expert, truth, times, report)
    for entries in (int(e) for e in args.anatomy.split(",") if e):
        ctx = context(cfg, expert, entries, args.tokens, times)
        for name, tiling, fp8 in tilings(args.anatomy_tilings):
            f = FusedExpert(expert, fp8=fp8, backend="cuda", cuda_tiling=dataclasses.replace(tiling, trace=True))
            inputs = f.schedule(ctx["mods"])
            for _ in range(3):   # the last of three
                f.flow(ctx["noise"], inputs, ctx["kv"], ctx["mask"])
            torch.cuda.synchronize()
            buf = next(iter(f.cuda._scratch.values()))
            names = f.cuda.segment_names(inputs.reuse_host)
            table, total = phase_table(buf.trace.cpu().double().numpy() / 1e3, names)
            print(f"anatomy {name} B={entries}: loop {total / 1e3:.2f} ms on the kernel's own clock", flush=True)
            for phase, r in table.items():
                floor = phase_floor_us(cfg, phase, entries, args.tokens + 1, tiling.fold_cross_q)
                report["anatomy"].append(dict(tiling=name, entries=entries, phase=phase, floor_us=floor, **r))
                parts = " (inside: {:.2f} + {:.2f} + {:.2f})".format(*r["parts"]) if r["parts"] else ""
                print(f"  {phase:10s} span {r['span']:6.2f} us = release {r['release']:5.2f} + slowest work "
                      f"{r['work']:5.2f} (median of {r['count']}; {100 * r['share']:4.1f} % of the loop); floor "
                      f"{floor:4.2f} us{parts}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_cuda_expert.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"\n{'backend':8} {'B':>2} {'loop ms':>8} {'err':>8} {'reuse':>8} {'known':>8} exact replays timeout")
    for r in rows:
        if "failed" in r:
            print(f"{r['backend']:8} {r['entries']:>2} FAILED {r['failed']}")
            continue
        print(f"{r['backend']:8} {r['entries']:>2} {r['loop_ms']:8.3f} {r['err']:8.1e} {r['err_reuse']:8.1e} "
              f"{r['err_known']:8.1e} {r['known_exact']!s:5} {r['replays_identical']!s:7} {r['barrier_timed_out']}")


if __name__ == "__main__":
    main()

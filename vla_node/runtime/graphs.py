"""One CUDA-graph capture: a warm run on a side stream (capture needs the kernels loaded and the
allocator's pools settled, and must not run on the default stream), then the capture itself.
Used by runtime/static.py, the GPU benchmarks and the fused expert's GPU test. And cuBLAS's
GEMMs without a workspace, whose memsets leave captured graphs idle."""
from __future__ import annotations

import os
import statistics
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], memset_kernels: bool = False) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` captured in a CUDA graph after one warm run, and what the captured call returned:
    replay() runs it again on the same tensors, so that result holds each replay's output.
    memset_kernels: the graph's memset nodes made kernel nodes (runtime/graph_memsets; the graph's
    memsets_replaced says how many) before it is instantiated."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=memset_kernels)
    with torch.cuda.graph(graph):
        out = fn()
    graph.memsets_replaced = 0
    if memset_kernels:
        from .graph_memsets import memsets_as_kernels  # cuda-python: imported where it is used
        graph.memsets_replaced = memsets_as_kernels(graph, torch.cuda.current_device())
        graph.instantiate()
    return graph, out


def graph_us(fn: Callable[[], object], calls: int = 10, replays: int = 7) -> float:
    """us a call of `fn` as a captured graph runs it: `calls` calls in one CUDA graph, the median of
    `replays` replays (runtime/lt_gemm's choices at warm-up, the GPU benchmarks)."""
    graph, _ = capture(lambda: [fn() for _ in range(calls)])
    return statistics.median(ms * 1e3 / calls for ms in replay_ms(graph, replays))


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """ms each of `replays` replays of a captured graph, one after another."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def interleaved_ms(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int = 3,
                   replays: int = 20) -> dict[str, list[float]]:
    """Each graph's median replay ms in each of `rounds` rounds, the graphs in turn within a round
    (A-B-A-B...: drift falls on all of them alike), after 3 warm replays each (the GPU benchmarks' A/B)."""
    for graph in graphs.values():
        replay_ms(graph, 3)
    ms: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            ms[name].append(statistics.median(replay_ms(graph, replays)))
    return ms


# cuBLAS's split-K / stream-K GEMMs reset a semaphore in their workspace before each call: in a
# captured graph a memset node, after which the GEMM starts ~6 us late (62 such GEMMs a DROID query:
# 0.28 ms of idle device on an H100). Without a workspace cuBLAS picks kernels of the same speed that
# need none: the DROID `fast` query 27.90 -> 27.65 ms (BENCHMARKS.md, thirty-third session).
NO_GEMM_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def use_gemms_without_workspace(environ=os.environ) -> bool:
    """Ask torch's cuBLAS handles for no workspace. Depending on its version torch reads the sizes
    when it allocates a stream's workspace or once, at the process's first GEMM on a GPU: set them
    before any (the node's engine process, vla-bench, vla-soak do). Left alone where the user set
    either size, or prefers cuBLASLt (torch's plain cuBLASLt GEMMs refuse a zero workspace). True
    where set."""
    if environ.get("TORCH_BLAS_PREFER_CUBLASLT") or any(name in environ for name in NO_GEMM_WORKSPACE):
        return False
    environ.update(NO_GEMM_WORKSPACE)
    if environ is os.environ and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()   # workspaces already allocated at the old size
    return True

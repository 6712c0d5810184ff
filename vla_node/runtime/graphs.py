"""One CUDA-graph capture: a warm run on a side stream (capture needs the kernels loaded and the
allocator's pools settled, and must not run on the default stream), then the capture itself.
Used by runtime/static.py, the GPU benchmarks and the fused expert's GPU test."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` captured in a CUDA graph after one warm run, and what the captured call returned:
    replay() runs it again on the same tensors, so that result holds each replay's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out

"""One CUDA-graph capture: a warm run on a side stream (capture needs the kernels loaded and the
allocator's pools settled, and must not run on the default stream), then the capture itself.
Used by runtime/static.py and scripts/profile_gpu.py (the copies in the fused-expert benchmark
and its test, edited elsewhere this session, are left to follow)."""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (replay() runs it on the tensors it used), after one warm run."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph

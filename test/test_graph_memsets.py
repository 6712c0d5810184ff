"""runtime/graph_memsets: a captured graph's memset nodes made kernel nodes writing the same bytes.

On the CPU: the switch's place in the engine's ladder and its checks. The `cuda` tests capture
memsets of every element size (1-D and pitched 2-D) between kernels that read and write the same
memory, and ask the edited graph for the plain graph's results bit for bit; and a graphed engine
with the switch for the same actions as one without (run them on the H200).
"""
import numpy as np
import pytest
import torch

from test_fast_path import outputs, same_inputs
from vla_node.runtime import EngineConfig, PolicyEngine
from vla_node.runtime.graphs import capture
from vla_node.runtime.kernels.expert_flow_cuda import _ok


def test_memset_kernels_is_a_graphs_rung_of_the_gpu_ladder():
    assert EngineConfig.for_mode("graphs", device="cuda").memset_kernels
    assert EngineConfig.for_mode("fast", device="cuda").memset_kernels
    assert not EngineConfig.for_mode("graphs").memset_kernels   # a CPU engine's ladder skips it
    with pytest.raises(ValueError, match="memset_kernels needs cuda_graphs"):
        EngineConfig.for_mode("compile", device="cuda", memset_kernels=True)


def _memsets_between_kernels(buf: torch.Tensor, stream_of) -> torch.Tensor:
    """Kernels and driver memsets on `buf` (int32, 4096) in an order whose result shows any reordering
    or a wrong byte: each memset overwrites what the kernel before it wrote and the kernel after
    reads it."""
    from cuda.bindings import driver
    ptr, stream = buf.data_ptr(), driver.CUstream(stream_of())
    buf.add_(7)
    _ok(driver.cuMemsetD32Async(ptr, 0x01020304, 1024, stream), "memset")  # elements 0..1023
    buf.mul_(3)
    _ok(driver.cuMemsetD16Async(ptr + 4096, 0xBEEF, 1000, stream), "memset")  # bytes 4096..6095
    buf.add_(buf.roll(1))
    _ok(driver.cuMemsetD8Async(ptr + 8192, 0x5A, 777, stream), "memset")  # bytes 8192..8968
    buf.mul_(5)
    # 16 rows of 8 words, 64 bytes apart
    _ok(driver.cuMemsetD2D32Async(ptr + 12288, 64, 0x7FFFFFFF, 8, 16, stream), "memset")
    return buf * 2 + buf.roll(3)


@pytest.mark.cuda
def test_memset_nodes_as_kernels_write_the_same_bytes():
    stream_of = lambda: torch.cuda.current_stream().cuda_stream   # noqa: E731 (the stream in capture)
    start = torch.arange(4096, dtype=torch.int32, device="cuda")
    results = {}
    for memset_kernels in (False, True):
        buf = start.clone()
        graph, out = capture(lambda: _memsets_between_kernels(buf, stream_of), memset_kernels=memset_kernels)
        assert graph.memsets_replaced == (4 if memset_kernels else 0)
        runs = []
        for _ in range(3):
            buf.copy_(start)
            graph.replay()
            runs.append(out.clone())
        assert all(torch.equal(r, runs[0]) for r in runs)
        results[memset_kernels] = runs[0]
    buf = start.clone()
    eager = _memsets_between_kernels(buf, stream_of)
    torch.cuda.synchronize()
    assert torch.equal(results[False], eager) and torch.equal(results[True], eager)


@pytest.mark.cuda
def test_graphed_engine_with_memset_kernels_gives_the_same_actions():
    inputs = None
    runs = {}
    for memset_kernels in (False, True):
        engine = PolicyEngine(EngineConfig.for_mode("graphs", device="cuda", dtype="bfloat16",
                                                    memset_kernels=memset_kernels))
        inputs = inputs or same_inputs(engine, 3)
        runs[memset_kernels] = outputs(engine, inputs)
    for a, b in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(a, b)

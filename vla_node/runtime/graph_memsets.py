"""A captured CUDA graph's memset nodes made kernel nodes that write the same bytes.

Libraries reset small scratch buffers with cudaMemsetAsync (cuDNN's ViT attention: one 4-byte
reset of its workspace before each call); captured, each is a memset node, and under the profiler
the kernel after a memset node started ~6 us after the kernel before it (25 such calls a DROID
query: 151 us of idle device on an H100, the thirty-eighth session's trace; 11 us with kernel nodes).
Timed without the profiler: the ViT attention's 25 layers at DROID 2.524 -> 2.490 ms, 1.4 us a layer
(scripts/bench_graph_memsets.py, BENCHMARKS.md, forty-sixth session). The same bytes are written in
the same order of the graph's dependencies: the graph's results are bit for bit the same
(test/test_graph_memsets.py). Needs cuda-python (the CUDA expert kernel's dependency,
kernels/expert_flow_cuda.py).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .kernels.expert_flow_cuda import _bindings, _ok, nvrtc_compile

# One thread an element of a [height][width] array of 1-, 2- or 4-byte elements, rows `pitch` bytes
# apart: a memset node's parameters (CUDA_MEMSET_NODE_PARAMS).
_SOURCE = rb"""
extern "C" __global__ void graph_memset(unsigned char* dst, unsigned long long pitch, unsigned int value,
                                        unsigned int element_size, unsigned long long width) {
    unsigned char* row = dst + blockIdx.y * pitch;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < width;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        if (element_size == 4) ((unsigned int*)row)[i] = value;
        else if (element_size == 2) ((unsigned short*)row)[i] = (unsigned short)value;
        else row[i] = (unsigned char)value;
    }
}
"""
THREADS = 256
# Larger memsets stay memset nodes: a one-element-a-thread kernel is no faster than the copy engine
# for them, and no library of the engine's issues one inside a captured stage.
MAX_BYTES = 1 << 20


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int):
    """The fill kernel loaded on this device: (module, function); the module stays loaded."""
    driver, _ = _bindings()
    major, minor = torch.cuda.get_device_capability(device_index)
    with torch.cuda.device(device_index):
        torch.zeros(1, device=f"cuda:{device_index}")   # the device's primary context, current here
        cubin, _ = nvrtc_compile({}, f"sm_{major}{minor}", source=_SOURCE, name="graph_memset.cu")
        module = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        return module, _ok(driver.cuModuleGetFunction(module, b"graph_memset"), "cuModuleGetFunction")


def _nodes(driver, graph) -> list:
    count = _ok(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    return _ok(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0] if count else []


def _edges(driver, node, query, what: str) -> list:
    """A node's dependencies (cuGraphNodeGetDependencies) or dependents (cuGraphNodeGetDependentNodes)."""
    count = _ok(query(node, 0), what)[-1]
    return list(_ok(query(node, count), what)[0]) if count else []


def memsets_as_kernels(graph: torch.cuda.CUDAGraph, device_index: int) -> int:
    """Every memset node of `graph` (captured with keep_graph=True, not yet instantiated) of at
    most MAX_BYTES replaced by a kernel node with its dependencies and dependents. Returns how many."""
    driver, _ = _bindings()
    raw = driver.CUgraph(graph.raw_cuda_graph())
    function = _kernel(device_index)[1]
    memset = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET
    replaced = 0
    for node in _nodes(driver, raw):
        if _ok(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType") != memset:
            continue
        m = _ok(driver.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
        if m.elementSize not in (1, 2, 4) or m.width * m.elementSize * m.height > MAX_BYTES or m.height > 65535:
            continue
        args = (ctypes.c_void_p(int(m.dst)), ctypes.c_ulonglong(m.pitch), ctypes.c_uint(m.value),
                ctypes.c_uint(m.elementSize), ctypes.c_ulonglong(m.width))
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = function
        params.gridDimX, params.gridDimY, params.gridDimZ = min(-(-m.width // THREADS), 1024), m.height, 1
        params.blockDimX, params.blockDimY, params.blockDimZ = THREADS, 1, 1
        params.sharedMemBytes = 0
        params.kernelParams = ctypes.addressof(pointers)   # copied by the driver when the node is added
        before = _edges(driver, node, driver.cuGraphNodeGetDependencies, "cuGraphNodeGetDependencies")
        after = _edges(driver, node, driver.cuGraphNodeGetDependentNodes, "cuGraphNodeGetDependentNodes")
        fill = _ok(driver.cuGraphAddKernelNode(raw, before, len(before), params), "cuGraphAddKernelNode")
        if after:
            _ok(driver.cuGraphAddDependencies(raw, [fill] * len(after), after, None, len(after)),
                "cuGraphAddDependencies")
        _ok(driver.cuGraphDestroyNode(node), "cuGraphDestroyNode")   # and its edges
        replaced += 1
    return replaced

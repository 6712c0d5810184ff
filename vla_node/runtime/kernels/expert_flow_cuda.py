"""Build and launch expert_flow.cu (the flow loop as one persistent CUDA kernel) at run time:
NVRTC compiles it for the GPU in hand (no nvcc, no build step), the CUDA driver loads and
launches it (cuda-python: `cuda.bindings`). runtime/fused_expert.py (backend "cuda") packs the
weights and the context K/V in the layouts the kernel reads and calls `launch`.

    kernel = FlowKernel.get(constants, device, smem)   # compiled once per shape and GPU, cached
    kernel.launch(params, programs, smem, stream)      # params: a Params (the .cu's struct)

Where no GPU is, `HostKernel` runs the same source on the CPU: a host C++ compiler builds it
with kernels/cuda_on_cpu.h (CUDA's built-ins and the kernel's primitives for the host, every
thread a fiber). Slow; it is the suite's check of the kernel's arithmetic and synchronisation.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("expert_flow.cu")
HOST_HEADER = Path(__file__).with_name("cuda_on_cpu.h")
THREADS = 256
# Options that change the machine code the kernel compiles to (and so the cache key).
NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization")
HOST_OPTIONS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-DVLA_CPU")


class Params(ctypes.Structure):
    """expert_flow.cu's `struct Params`, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "xa", "vel", "reuse", "wqkv", "bqkv", "wso", "bso", "wq", "bq", "wco", "bco", "w1", "b1", "w2", "b2",
        "win", "bin", "pos", "wout", "bout", "mods", "fmods", "kv", "mask", "fold_m", "fold_c", "fold_ln",
        "wsc_qkv", "wsc_so", "wsc_q", "wsc_co", "wsc_1", "wsc_2", "wsc_fold",
        "x", "xf", "stats", "qkv", "q", "y", "hid", "f0", "sq", "opart", "mlpart", "counter", "bar", "err",
        "trace")] + [
        (name, ctypes.c_int) for name in (
            "n_keys", "key_tiles", "cpp", "tiles_per_cta", "mask_stride", "has_mask", "step_lo", "step_hi", "euler",
            "segments")] + [
        (name, ctypes.c_float) for name in ("dt", "eps", "scale")]


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:   # the CUDA backend's one dependency beyond torch
        raise RuntimeError("the CUDA expert kernel needs cuda-python (pip install cuda-bindings "
                           "nvidia-cuda-nvrtc)") from e
    return driver, nvrtc


def _ok(result, what: str):
    """The values of a cuda.bindings call, or its error as a RuntimeError."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


def nvrtc_compile(constants: dict, arch: str, verbose: bool = False, source: Optional[bytes] = None,
                  name: str = SOURCE.name) -> tuple[bytes, str]:
    """expert_flow.cu (or `source`) compiled for `arch` ("sm_90") with -D constants: (cubin,
    NVRTC's log; with verbose, ptxas's register and spill report in it). Needs no GPU."""
    _, nvrtc = _bindings()
    source = SOURCE.read_bytes() if source is None else source
    prog = _ok(nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], []), "nvrtcCreateProgram")
    options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS),
               *(f"-D{k}={v}".encode() for k, v in sorted(constants.items()))]
    if verbose:
        options.append(b"--ptxas-options=-v")
    try:
        result = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        # NVRTC writes into the buffers it is given, so each is a bytearray of its own: `b" " * size` at an
        # empty log (size 1) is the interpreter's shared b" ", which then held a NUL for the rest of the process
        # (print's separators NULs; on Python 3.12 modules imported after it lost spaces from their strings).
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if int(result[0]) != 0:
            raise RuntimeError(f"{name} did not compile ({result[0]!r}):\n{log}")
        size = _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cache_dir() -> Path:
    """Where run-time builds and choices are kept ($VLA_NODE_KERNEL_CACHE, default ~/.cache/vla_node/kernels)."""
    return Path(os.environ.get("VLA_NODE_KERNEL_CACHE", Path.home() / ".cache" / "vla_node" / "kernels"))


def _cache_path(what: bytes, suffix: str) -> Path:
    """Where the build of `what` (the sources, options and constants) is cached."""
    return cache_dir() / f"expert_flow_{hashlib.sha256(what).hexdigest()[:24]}{suffix}"


def store(path: Path, data: bytes) -> Optional[OSError]:
    """Write `data` to the cache atomically; the error where it could not (None: stored)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return None
    except OSError as e:
        return e


def cubin_for(constants: dict, arch: str) -> bytes:
    """The compiled kernel, from the on-disk cache when the same source, options and constants
    were compiled before (a start of the engine then costs no compile)."""
    _, nvrtc = _bindings()
    version = ".".join(str(v) for v in _ok(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    path = _cache_path(SOURCE.read_bytes() + repr((sorted(constants.items()), arch, NVRTC_OPTIONS, version))
                       .encode(), ".cubin")
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin, _ = nvrtc_compile(constants, arch)
    store(path, cubin)   # a read-only home: compile again next time
    return cubin


def host_compiler() -> Optional[str]:
    """The host C++ compiler (CXX, else g++ or c++ on PATH), or None."""
    return next((path for name in (os.environ.get("CXX"), "g++", "c++") if name and (path := shutil.which(name))),
                None)


def host_library(constants: dict) -> Path:
    """expert_flow.cu built for the CPU (a shared library with `expert_flow_host`), cached as the
    cubins are."""
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("the CUDA expert kernel's CPU build needs a C++ compiler (g++; or set CXX)")
    defines = [f"-D{k}={v}" for k, v in sorted(constants.items())]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    path = _cache_path(SOURCE.read_bytes() + HOST_HEADER.read_bytes()
                       + repr((defines, HOST_OPTIONS, version)).encode(), ".so")
    if path.exists():
        return path
    out = path.with_suffix(f".{os.getpid()}.build.so")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([cxx, *HOST_OPTIONS, *defines, "-include", str(HOST_HEADER), "-x", "c++", str(SOURCE),
                           "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"expert_flow.cu did not build for the CPU:\n{done.stderr[-4000:]}")
    out.replace(path)
    return path


class FlowKernel:
    """The loaded kernel of one shape on one GPU."""

    def __init__(self, cubin: bytes, smem_limit: int):
        driver, _ = _bindings()
        self.driver = driver
        _ok(driver.cuInit(0), "cuInit")
        self.module = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.function = _ok(driver.cuModuleGetFunction(self.module, b"expert_flow"), "cuModuleGetFunction")
        _ok(driver.cuFuncSetAttribute(
            self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_limit),
            "cuFuncSetAttribute")
        self.smem_limit = smem_limit

    @classmethod
    @functools.lru_cache(maxsize=None)
    def get(cls, constants: tuple, device_index: int, smem_limit: int) -> "FlowKernel":
        import torch
        major, minor = torch.cuda.get_device_capability(device_index)
        with torch.cuda.device(device_index):
            torch.zeros(1, device=f"cuda:{device_index}")   # the device's primary context, current here
            return cls(cubin_for(dict(constants), f"sm_{major}{minor}"), smem_limit)

    def launch(self, params: Params, programs: int, smem: int, stream: int, cooperative: bool = True,
               cluster: int = 1) -> None:
        """One launch of `programs` programs on `stream` (a CUstream handle), in clusters of
        `cluster` consecutive programs. Cooperative: CUDA guarantees every program resident (the
        grid barriers need it) or refuses the launch."""
        if smem > self.smem_limit:
            raise ValueError(f"the kernel needs {smem} bytes of shared memory, configured for {self.smem_limit}")
        d = self.driver
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = programs, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
        config.sharedMemBytes = smem
        config.hStream = d.CUstream(stream)
        attrs = []
        if cooperative:
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            attrs.append(attr)
        if cluster > 1:
            attrs.append(_cluster_dimension(cluster))
        config.attrs, config.numAttrs = attrs, len(attrs)
        _ok(d.cuLaunchKernelEx(config, self.function, ctypes.addressof(args), 0), "cuLaunchKernelEx")


def _cluster_dimension(cluster: int):
    """The launch attribute of clusters of `cluster` consecutive programs."""
    driver, _ = _bindings()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    return attr


def clusters_held(function, smem: int, cluster: int) -> int:
    """How many clusters of `cluster` programs of `function` (a CUfunction, `smem` bytes of
    dynamic shared memory a program) the current GPU holds at once (0: none, or it cannot)."""
    driver, _ = _bindings()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
    config.sharedMemBytes = smem
    config.attrs, config.numAttrs = [_cluster_dimension(cluster)], 1
    err, clusters = driver.cuOccupancyMaxActiveClusters(function, config)
    return clusters if int(err) == 0 else 0


# A stand-in for the kernel in the occupancy query: it takes an SM a program as the kernel does
# (the kernel by its registers, this by asking for most of the SM's shared memory).
_STAND_IN = b'extern "C" __global__ void __launch_bounds__(256, 1) stand_in() {}'


@functools.lru_cache(maxsize=None)
def programs_held(device_index: int, cluster: int) -> int:
    """How many programs of one an SM the GPU holds at once in clusters of `cluster` (the kernel's
    grid barriers need all of them resident): how its SMs are grouped decides it (the H200: 132
    in clusters of 2, 120 in clusters of 4 or 8). 0 where the GPU launches no clusters."""
    import torch
    driver, _ = _bindings()
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        return 0
    with torch.cuda.device(device_index):
        torch.zeros(1, device=f"cuda:{device_index}")   # the device's primary context, current here
        cubin, _ = nvrtc_compile({}, f"sm_{major}{minor}", source=_STAND_IN, name="stand_in.cu")
        module = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        try:
            function = _ok(driver.cuModuleGetFunction(module, b"stand_in"), "cuModuleGetFunction")
            smem = torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin * 3 // 4
            _ok(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                "cuFuncSetAttribute")
            return clusters_held(function, smem, cluster) * cluster
        finally:
            driver.cuModuleUnload(module)


# programs_held's answers on an H100 SXM or an H200 (132 SMs; scripts/probe_clusters.py): plans made
# without the GPU (the tests, scripts/cuda_expert_spills.py) as it makes them.
HOPPER_HELD = {1: 132, 2: 132, 4: 120, 8: 120}


class HostKernel:
    """The kernel of one shape built for the CPU: FlowKernel's launch, on host memory."""

    def __init__(self, library: Path):
        self.library = ctypes.CDLL(str(library))
        self.function = self.library.expert_flow_host
        self.function.argtypes = (ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int)
        self.function.restype = ctypes.c_int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def get(cls, constants: tuple) -> "HostKernel":
        return cls(host_library(dict(constants)))

    def launch(self, params: Params, programs: int, smem: int) -> None:
        status = self.function(ctypes.byref(params), programs, smem)
        if status == -1:
            raise RuntimeError("the CUDA expert kernel's CPU build could not allocate its threads' stacks")
        if status == -2:   # a barrier that some thread never reaches: a bug of the kernel
            raise RuntimeError("the CUDA expert kernel's CPU build deadlocked: every thread waited at a barrier")
        if status == -3:   # likewise: an mbarrier waited for a copy that no thread issued
            raise RuntimeError("the CUDA expert kernel's CPU build gave up an mbarrier wait: its copy was never issued")


def available(device_type: str = "cuda") -> Optional[str]:
    """None when the CUDA backend can run on this device type here, else why not (one line)."""
    if device_type == "cpu":
        return None if host_compiler() else "the CUDA expert kernel's CPU build needs a C++ compiler (g++; or set CXX)"
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device"
        _bindings()
    except RuntimeError as e:
        return str(e)
    return None

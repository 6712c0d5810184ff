"""The ViT's and the LLM's GEMMs at the cuBLASLt algorithm each shape runs fastest, chosen at warm-up.

torch's GEMMs run the one kernel cuBLAS's heuristic picks for a shape. The H100 profile of a DROID
query ran the ViT's GEMMs at 546-644 TFLOP/s (qkv: 384x104 tiles, three waves for 2.06 waves of work)
and the LLM's qkv and out at ~690, against 790 for its gate/up (BENCHMARKS.md, thirty-fifth session).
`tuned_linear` times, the first time a shape runs outside a CUDA-graph capture, each algorithm the
heuristic offers without a workspace (as the engine's GEMMs run, workspace_free_gemms) against torch's
own GEMM, each one in a CUDA graph as the engine replays them, and keeps the fastest whose output
matches torch's; torch's stays where none is faster. Another algorithm sums in another order: equal to
torch's GEMM up to rounding (split-K ones included), and the same algorithm every call of the process.
The choices are kept on disk per GPU model and cuBLASLt build ($VLA_NODE_KERNEL_CACHE, as the expert
kernel's builds): a restart on the same machine runs the same algorithms (the same bits) without timing
them again; a cached algorithm is checked against torch's output before it is used.
The CPU, fp32 and a shape first met inside a capture run torch's GEMM.
"""
from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layers import FusableProjection
from ..model.vision import ViTBlock
from .fusion import addmm_gelu, linear_gelu_epilogue
from .graphs import graph_us
from .kernels.expert_flow_cuda import cache_dir, store

# cublasLt.h (CUDA 12 and 13)
COMPUTE_32F, SCALE_32F = 68, 0
DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
OP_N, OP_T = 0, 1
EPILOGUES = {"none": 1, "bias": 4, "gelu_bias": 36}
PREF_MAX_WORKSPACE_BYTES, PREF_MIN_ALIGNMENT = 1, (5, 6, 7, 8)   # alignment of A, B, C, D
ALGO_CONFIG = (("id", 0), ("tile", 1), ("splitk", 2), ("reduction", 3), ("swizzle", 4), ("stages", 6),
               ("cluster", 8))
# The heuristic's algorithms asked for, and how much faster than torch's one must be to replace it
# (a margin above the timings' noise: a choice made on noise would change numbers for nothing).
CANDIDATES, MARGIN = 16, 0.97
# An algorithm's output against torch's (fp32 sums of bf16 products in another order: ~1e-3).
AGREEMENT = 1e-2


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what}: status {status}")


def cublaslt_paths(maps: Iterable[str], cuda: Optional[str]) -> list[str]:
    """The libcublasLt files of /proc/self/maps' lines, those of CUDA `cuda`'s major version (torch's) first:
    a library loaded later with a CUDA of its own must not be taken for torch's."""
    paths = sorted({line.split()[-1] for line in maps if "libcublasLt" in line})
    torchs = f"libcublasLt.so.{(cuda or '').split('.')[0]}"
    return sorted(paths, key=lambda path: not Path(path).name.startswith(torchs))


def load_cublaslt() -> tuple[ctypes.CDLL, list[str]]:
    """The libcublasLt torch itself loaded (the build its own GEMMs run), its calls typed, and every
    libcublasLt the process has mapped (that one first)."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = cublaslt_paths(maps, torch.version.cuda)
    if not paths:
        raise RuntimeError("no libcublasLt in this process")
    lib = ctypes.CDLL(paths[0])
    p, vp, sz = ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [p(vp)]
    lib.cublasLtMatrixLayoutCreate.argtypes = [p(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescCreate.argtypes = [p(vp), ctypes.c_int, ctypes.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [p(vp)]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, p(Heuristic),
                                                   p(ctypes.c_int)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [p(Algo), ctypes.c_int, vp, sz, p(sz)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(Algo), vp, sz, vp]
    lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, p(Algo), p(Heuristic)]
    lib.cublasLtGetVersion.restype = sz
    return lib, paths


def alignment(*tensors: Optional[torch.Tensor]) -> int:
    """The largest power of two up to 256 dividing every tensor's address (what an algorithm may assume)."""
    align = 256
    for t in tensors:
        if t is not None:
            while t.data_ptr() % align:
                align //= 2
    return align


class LtGemm:
    """One GEMM shape through cublasLtMatmul: out[M, N] = epilogue(x[M, K] @ w[N, K]^T + bias), row-major
    tensors. cuBLASLt is column-major: out^T = w^T (w read transposed) times x^T, as torch's linear runs it."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, m: int, k: int, n: int, dtype: torch.dtype,
                 epilogue: str):
        self.lib, self.handle = lib, handle
        self.desc = ctypes.c_void_p()
        ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, SCALE_32F), "matmul description")
        for attr, value in ((DESC_TRANSA, ctypes.c_int32(OP_T)), (DESC_TRANSB, ctypes.c_int32(OP_N)),
                            (DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))):
            ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "matmul attribute")
        self.layouts = []
        for rows, cols in ((k, n), (k, m), (n, m)):   # w, x, out (out is both C and D)
            layout = ctypes.c_void_p()
            ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), DATA_TYPES[dtype], rows, cols, rows), "layout")
            self.layouts.append(layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _bias(self, bias: Optional[torch.Tensor]) -> None:
        if bias is not None:   # the description is the shape's: each layer's bias is set before its call
            ptr = ctypes.c_void_p(bias.data_ptr())
            ok(self.lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_BIAS_POINTER, ctypes.byref(ptr), 8), "bias")

    def algos(self, count: int, align: int, bias: Optional[torch.Tensor], workspace: int = 0) -> list[Heuristic]:
        """Up to `count` of the heuristic's algorithms for buffers `align`-aligned, needing at most
        `workspace` bytes of workspace."""
        pref = ctypes.c_void_p()
        ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        settings = [(PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(workspace))]
        settings += [(attr, ctypes.c_uint32(align)) for attr in PREF_MIN_ALIGNMENT]
        for attr, value in settings:
            ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "preference attribute")
        self._bias(bias)
        results, got = (Heuristic * count)(), ctypes.c_int()
        a, b, c = self.layouts
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, pref, count, results,
                                                         ctypes.byref(got))
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        ok(status, "heuristic")
        return [r for r in results[:got.value] if r.state == 0]

    def accepts(self, algo: Heuristic, bias: Optional[torch.Tensor]) -> bool:
        """Whether cuBLASLt runs `algo` for this shape (one read back from the cache file: not the heuristic's)."""
        self._bias(bias)
        a, b, c = self.layouts
        return self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, c, c, ctypes.byref(algo.algo),
                                                ctypes.byref(Heuristic())) == 0

    def __call__(self, algo: Heuristic, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                 out: torch.Tensor, workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._bias(bias)
        a, b, c = self.layouts
        space = None if workspace is None else workspace.data_ptr()
        ok(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), w.data_ptr(), a, x.data_ptr(),
                                   b, ctypes.byref(self.beta), out.data_ptr(), c, out.data_ptr(), c,
                                   ctypes.byref(algo.algo), space, algo.workspace if space else 0,
                                   torch.cuda.current_stream().cuda_stream), "matmul")
        return out

    def describe(self, algo: Heuristic) -> str:
        """The algorithm's configuration: its id, tile, split-K, ... as cuBLASLt numbers them."""
        parts = []
        for name, attr in ALGO_CONFIG:
            size = ctypes.c_size_t()
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo.algo), attr, None, 0,
                                                             ctypes.byref(size)) or not 0 < size.value <= 8:
                continue
            buf = (ctypes.c_uint8 * size.value)()
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo.algo), attr, buf, size.value,
                                                          ctypes.byref(size))
            parts.append(f"{name}={int.from_bytes(bytes(buf), 'little')}")
        return " ".join(parts) + f" waves={algo.waves:.2f}"


def torch_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool) -> torch.Tensor:
    """What the engine runs without a choice: linear, or with its GELU in cuBLASLt's epilogue."""
    return addmm_gelu(x, w, bias) if gelu else F.linear(x, w, bias)


@dataclass
class Choice:
    """A shape's algorithm (None: torch's) and what the warm-up measured."""
    gemm: Optional[LtGemm]
    algo: Optional[Heuristic]
    torch_us: float
    best_us: float
    config: str
    from_file: bool = False   # read from the cache file, not timed in this process

    def stored(self) -> dict:
        """The choice as the cache file keeps it (the algorithm as cuBLASLt's opaque bytes)."""
        return {"algo": None if self.algo is None else bytes(self.algo).hex(), "torch_us": self.torch_us,
                "chosen_us": self.best_us, "algorithm": self.config}

    @staticmethod
    def restored(kept: dict) -> "Choice":
        """`stored`'s inverse, without its LtGemm (the caller's, for an algorithm); ValueError where the entry
        is not one."""
        try:
            algo = None if kept["algo"] is None else Heuristic.from_buffer_copy(bytes.fromhex(kept["algo"]))
            return Choice(None, algo, float(kept["torch_us"]), float(kept["chosen_us"]), str(kept["algorithm"]),
                          from_file=True)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a stored choice: {kept!r}") from e


def key_name(key: tuple) -> str:
    """A shape's key as the cache file names it."""
    m, k, n, dtype, gelu, bias, align = key
    return f"{m}x{k}x{n} {str(dtype).removeprefix('torch.')} gelu={int(gelu)} bias={int(bias)} align={align}"


def cache_file(lib: ctypes.CDLL) -> Path:
    """Where this GPU model's choices under this cuBLASLt build are kept."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = f"{props.name} sm{props.major}{props.minor} x{props.multi_processor_count}".replace(" ", "_")
    return cache_dir() / f"gemms_{gpu}_cublaslt{lib.cublasLtGetVersion()}.json"


def read_choices(path: Path) -> dict:
    """The choices kept in `path`, {} where there is none; OSError or ValueError where it cannot be read."""
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(stored, dict):
        raise ValueError("not a JSON object")
    return stored


class TunedGemms:
    """The process's choices, one per (M, K, N, dtype, epilogue, alignment), made at a shape's first call;
    `seen` holds the shapes called since it was last cleared (one engine's, where several share the process)."""

    def __init__(self):
        self.lib: Optional[ctypes.CDLL] = None
        self.handle = ctypes.c_void_p()
        self.choices: dict[tuple, Choice] = {}
        self.seen: set[tuple] = set()
        self.file: Optional[Path] = None
        self.stored: dict[str, dict] = {}
        self.file_error: Optional[str] = None   # the first reason the file was not read or written
        self.libraries: list[str] = []

    def _read(self) -> dict:
        """The file's choices; {} where it cannot be read (its shapes are timed again), said in file_error."""
        try:
            return read_choices(self.file)
        except (OSError, ValueError) as e:
            self.file_error = self.file_error or f"not read: {e!r}"
            return {}

    def _choose(self, key: tuple, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                gelu: bool) -> Choice:
        if self.lib is None:
            self.lib, self.libraries = load_cublaslt()
            ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
            self.file = cache_file(self.lib)
            self.stored = self._read()
        try:   # a choice made before on this GPU model and cuBLASLt build
            kept: Optional[Choice] = Choice.restored(self.stored[key_name(key)])
        except (KeyError, ValueError):
            kept = None
        if kept is not None and kept.algo is None:
            return kept   # torch's: nothing of cuBLASLt's to build or check
        (m, k), n = x.shape, w.shape[0]
        want = torch_linear(x, w, bias, gelu)
        epilogue = "gelu_bias" if gelu else "bias" if bias is not None else "none"
        gemm = LtGemm(self.lib, self.handle, m, k, n, x.dtype, epilogue)
        out = torch.empty_like(want)

        def agrees(algo: Heuristic) -> bool:
            gemm(algo, x, w, bias, out)
            return bool(((out.float() - want.float()).norm() <= AGREEMENT * want.float().norm()).item())

        if kept is not None and gemm.accepts(kept.algo, bias) and agrees(kept.algo):   # it still runs and agrees
            return replace(kept, gemm=gemm)
        torch_us = graph_us(lambda: torch_linear(x, w, bias, gelu))
        best = Choice(None, None, torch_us, torch_us, "torch's")
        for algo in gemm.algos(CANDIDATES, key[-1], bias):
            if not agrees(algo):
                continue
            us = graph_us(lambda algo=algo: gemm(algo, x, w, bias, out))
            if us < min(best.best_us, MARGIN * torch_us):
                best = Choice(gemm, algo, torch_us, us, gemm.describe(algo))
        # another process may have stored choices since this one read the file: keep theirs too
        self.stored = {**self._read(), **self.stored, key_name(key): best.stored()}
        error = store(self.file, json.dumps(self.stored, indent=1).encode())   # chosen again next start
        if error is not None:
            self.file_error = self.file_error or f"not written: {error!r}"
        return best

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool) -> torch.Tensor:
        key = (*x.shape, w.shape[0], x.dtype, gelu, bias is not None, alignment(x, w, bias))
        self.seen.add(key)
        choice = self.choices.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                return torch_linear(x, w, bias, gelu)   # no timing inside a capture: the next eager call chooses
            choice = self.choices[key] = self._choose(key, x, w, bias, gelu)
        if choice.algo is None:
            return torch_linear(x, w, bias, gelu)
        return choice.gemm(choice.algo, x, w, bias, x.new_empty(x.shape[0], w.shape[0]))

    def report(self, keys: Optional[set[tuple]] = None) -> list[dict]:
        """The choice of each shape in `keys` (all: None) and its warm-up timings (vla-bench's JSON)."""
        rows = []
        for key, c in self.choices.items():
            if keys is None or key in keys:
                m, k, n, _, gelu, bias, align = key
                rows.append({"m_k_n": [m, k, n], "gelu": gelu, "bias": bias, "align": align, "torch_us": c.torch_us,
                             "chosen_us": c.best_us, "algorithm": c.config, "from_file": c.from_file})
        return rows


TUNED = TunedGemms()


@torch.library.custom_op("vla::tuned_linear", mutates_args=())
def tuned_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if x.is_cuda and x.dtype in DATA_TYPES and weight.is_contiguous():
        out = TUNED(rows, weight, bias, gelu)
    else:
        out = torch_linear(rows, weight, bias, gelu)
    return out.view(*x.shape[:-1], weight.shape[0])


@tuned_linear.register_fake
def _(x, weight, bias, gelu):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class TunedLinear(nn.Linear):
    """nn.Linear through tuned_linear (its parameters and state_dict keys unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuned_linear(x, self.weight, self.bias, False)


def tuned_linear_gelu(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """model.layers.linear_gelu as one tuned GEMM with cuBLASLt's GELU epilogue."""
    return tuned_linear(x, linear.weight, linear.bias, True)


def tuned_fused(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """FusableProjection's fused GEMM (q/k/v, gate/up) through tuned_linear."""
    return tuned_linear(x, weight, bias, False)


def use_tuned_gemms(model: nn.Module) -> int:
    """The ViT blocks' and the LLM layers' GEMMs through tuned_linear: their linears (e4m3 ones left
    alone), fused projections and, where runtime.fusion put it in the epilogue, the ViT's fc1 + GELU
    (this takes the epilogue over). Returns how many modules changed."""
    count = 0
    for module in (*model.vision.encoder.blocks.modules(), *model.llm.layers.modules()):
        if type(module) is nn.Linear:
            module.__class__ = TunedLinear
        elif isinstance(module, FusableProjection):
            module.fused_linear = tuned_fused
        elif isinstance(module, ViTBlock) and module.fc1_gelu is linear_gelu_epilogue:
            module.fc1_gelu = tuned_linear_gelu   # without the epilogue fc1 is a TunedLinear, its GELU a pass
        else:
            continue
        count += 1
    return count

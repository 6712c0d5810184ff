"""runtime/lt_gemm: the ViT's and the LLM's GEMMs at cuBLASLt's fastest algorithm per shape.

On the CPU the tuned GEMMs are torch's own: an engine with them gives the same numbers bit for bit,
compiled or not. The `cuda` tests check the chosen algorithms against torch's GEMMs at the query's
shapes and a tuned engine against the plain one (run them on the H200).
"""
import ctypes
import json

import numpy as np
import pytest
import torch
from torch import nn

from test_fast_path import outputs, same_inputs
from vla_node.model import get_preset
from vla_node.model.layers import linear_gelu
from vla_node.runtime import EngineConfig, PolicyEngine, lt_gemm
from vla_node.runtime.kernels.expert_flow_cuda import store
from vla_node.runtime.lt_gemm import (
    Choice,
    Heuristic,
    TunedGemms,
    TunedLinear,
    cublaslt_paths,
    key_name,
    read_choices,
    torch_linear,
    tuned_linear,
    tuned_linear_gelu,
)


def test_tuned_gemms_take_every_vit_and_llm_gemm_and_keep_the_checkpoint_keys():
    plain = PolicyEngine(EngineConfig.for_mode("fused"))
    tuned = PolicyEngine(EngineConfig.for_mode("fused", tuned_gemms=True))
    assert plain.model.state_dict().keys() == tuned.model.state_dict().keys()
    for block in tuned.model.vision.encoder.blocks:
        assert isinstance(block.attn.out, TunedLinear) and isinstance(block.fc2, TunedLinear)
        assert block.fc1_gelu is tuned_linear_gelu
    for layer in tuned.model.llm.layers:
        assert not [m for m in layer.modules() if type(m) is nn.Linear], "a plain linear left in an LLM layer"
    assert not any(isinstance(m, TunedLinear) for m in tuned.model.expert.modules()), "the expert has its own kernels"


def test_without_the_gelu_epilogue_fc1_is_tuned_and_its_gelu_stays_a_pass():
    tuned = PolicyEngine(EngineConfig.for_mode("fused", gelu_epilogue=False, tuned_gemms=True))
    for block in tuned.model.vision.encoder.blocks:
        assert isinstance(block.fc1, TunedLinear) and block.fc1_gelu is linear_gelu


@pytest.mark.parametrize("mode", ["fused", "compile"])
def test_tuned_gemms_change_no_number_off_the_gpu(mode):
    plain = PolicyEngine(EngineConfig.for_mode(mode))
    tuned = PolicyEngine(EngineConfig.for_mode(mode, tuned_gemms=True))
    inputs = same_inputs(plain, 2)
    for a, b in zip(outputs(plain, inputs), outputs(tuned, inputs)):
        assert np.array_equal(a, b)


def test_an_unaligned_or_strided_input_runs_as_torchs_linear():
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    x = torch.randn(3, 7, 25)[..., 1:]   # not contiguous, offset by one element
    with torch.no_grad():
        assert torch.equal(tuned_linear(x, lin.weight, lin.bias, False), lin(x))
        assert torch.equal(tuned_linear(x, lin.weight, lin.bias, True), linear_gelu(x, lin))


def test_a_choice_survives_the_cache_file_and_a_bad_file_is_timed_again_and_said(tmp_path):
    algo = Heuristic()
    algo.algo.data[0], algo.algo.data[7], algo.waves = 0x1234_5678_9ABC, 42, 2.5
    chosen, kept_torch = Choice(None, algo, 10.0, 8.0, "id=5 tile=20"), Choice(None, None, 5.0, 5.0, "torch's")
    keys = [(2916, 1152, 3456, torch.bfloat16, False, True, 256), (896, 2560, 19456, torch.bfloat16, False, False, 16)]
    assert key_name(keys[0]) == "2916x1152x3456 bfloat16 gelu=0 bias=1 align=256"
    path = tmp_path / "gemms.json"
    entries = {key_name(keys[0]): chosen.stored(), key_name(keys[1]): kept_torch.stored()}
    assert store(path, json.dumps(entries).encode()) is None
    stored = read_choices(path)
    back = Choice.restored(stored[key_name(keys[0])])
    assert bytes(back.algo) == bytes(algo) and back.gemm is None and back.from_file
    assert (back.torch_us, back.best_us, back.config) == (10.0, 8.0, "id=5 tile=20")
    back = Choice.restored(stored[key_name(keys[1])])
    assert back.algo is None and back.gemm is None and back.best_us == 5.0
    for bad in ({"algo": "zz"}, {"algo": "00", "torch_us": 1, "chosen_us": 1, "algorithm": "short"}, "text"):
        with pytest.raises(ValueError):
            Choice.restored(bad)
    assert read_choices(tmp_path / "absent.json") == {}
    tuned = TunedGemms()
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        with pytest.raises(ValueError):
            read_choices(path)
        tuned.file, tuned.file_error = path, None
        assert tuned._read() == {} and tuned.file_error.startswith("not read: ")   # timed again, and said so
    assert isinstance(store(path / "under_a_file.json", b"{}"), OSError)


def test_torchs_cublaslt_is_taken_before_one_of_another_cuda():
    maps = ["7f00-7f10 r-xp 0 08:01 5 /opt/cuda12/lib/libcublasLt.so.12.9.1",
            "7f10-7f20 r-xp 0 08:01 6 /venv/nvidia/cu13/lib/libcublasLt.so.13",
            "7f20-7f30 r--p 0 08:01 6 /venv/nvidia/cu13/lib/libcublasLt.so.13",
            "7f30-7f40 r-xp 0 08:01 7 /venv/torch/lib/libtorch_cuda.so"]
    assert cublaslt_paths(maps, "13.0") == ["/venv/nvidia/cu13/lib/libcublasLt.so.13",
                                            "/opt/cuda12/lib/libcublasLt.so.12.9.1"]
    assert cublaslt_paths(maps, "12.8")[0] == "/opt/cuda12/lib/libcublasLt.so.12.9.1"
    assert cublaslt_paths(maps[3:], "13.0") == []


@pytest.fixture
def own_choices(tmp_path, monkeypatch) -> TunedGemms:
    """The process's TunedGemms, new and keeping its choices under tmp_path: a test times its shapes
    itself and leaves the user's choices alone (the expert kernel's builds stay cached where they are)."""
    monkeypatch.setattr(lt_gemm, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(lt_gemm, "TUNED", TunedGemms())
    return lt_gemm.TUNED


def gpu_rows(m: int, k: int, offset: int = 0) -> torch.Tensor:
    """[m, k] bf16 rows on the GPU, `offset` elements into their buffer (offset 8: 16-byte aligned only)."""
    return torch.randn(m * k + offset, device="cuda", dtype=torch.bfloat16)[offset:].view(m, k)


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 8])
def test_the_chosen_algorithms_agree_with_torchs_gemms_at_the_query_shapes(offset, own_choices):
    """molmobot-4b's ViT and LLM shapes at DROID (2916 patches, 896 tokens): every epilogue, and an
    input only 16-byte aligned (its own choice: an algorithm chosen for 256-byte buffers may not run)."""
    cfg = get_preset("molmobot-4b")
    vit, llm = cfg.vision, cfg.llm
    torch.manual_seed(0)
    shapes = [(2916, vit.width, 3 * vit.width, "bias"), (2916, vit.width, vit.mlp, "gelu"),
              (2916, vit.mlp, vit.width, "bias"), (896, llm.dim, 2 * llm.mlp, "none"),
              (896, llm.heads * llm.head_dim, llm.dim, "none")]
    for m, k, n, epilogue in shapes:
        x = gpu_rows(m, k, offset)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if epilogue != "none" else None
        gelu = epilogue == "gelu"
        ref = (torch.nn.functional.gelu(x.float() @ w.float().t() + bias.float(), approximate="tanh") if gelu
               else torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()))
        got = tuned_linear(x, w, bias, gelu).float()
        again = tuned_linear(x, w, bias, gelu)   # the choice made, then run
        plain = torch_linear(x, w, bias, gelu).float()   # what the engine runs without a choice
        err, err_torch = ((got - ref).norm() / ref.norm()).item(), ((plain - ref).norm() / ref.norm()).item()
        assert err < 1.5 * err_torch + 1e-4, (m, k, n, epilogue, err, err_torch)
        assert torch.equal(again.float(), got), "one algorithm a shape: the same bits every call"
    for row in own_choices.report():   # what each shape chose (pytest -s; scripts/gpu_cuda_expert.sh PARTS=tuned)
        print(row)


@pytest.mark.cuda
def test_a_tuned_engine_matches_the_plain_one_and_chooses_only_at_warm_up(own_choices):
    base = dict(device="cuda", dtype="bfloat16", preset="tiny")
    plain = PolicyEngine(EngineConfig.for_mode("fast", tuned_gemms=False, **base))
    tuned = PolicyEngine(EngineConfig.for_mode("fast", **base))
    plain.warmup()
    own_choices.seen.clear()
    tuned.warmup()
    chosen = dict(own_choices.choices)
    seen = own_choices.seen
    assert len(own_choices.report(seen)) == len(seen) > 0, "every shape the engine ran has its choice"
    inputs = same_inputs(plain, 4)
    a, b = outputs(plain, inputs), outputs(tuned, inputs)
    for x, y in zip(a, b):
        assert np.abs(x - y).max() < 2e-2, np.abs(x - y).max()
    assert all(np.array_equal(x, y) for x, y in zip(b, outputs(tuned, inputs))), "replays bit-identical"
    assert own_choices.choices == chosen, "a shape first met after warm-up"
    assert tuned.static.recompiles() == 0


@pytest.mark.cuda
def test_a_restart_runs_the_stored_choice_untimed_and_a_bad_one_is_chosen_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VLA_NODE_KERNEL_CACHE", str(tmp_path))
    torch.manual_seed(0)
    x, w = gpu_rows(2916, 1152), torch.randn(3456, 1152, device="cuda", dtype=torch.bfloat16) / 34
    bias = torch.randn(3456, device="cuda", dtype=torch.bfloat16)
    first = TunedGemms()
    want = first(x, w, bias, False)
    (key, choice), = first.choices.items()
    assert first.file.parent == tmp_path and key_name(key) in read_choices(first.file)
    timed = []
    monkeypatch.setattr(lt_gemm, "graph_us", lambda fn, **kw: timed.append(fn) or 1.0)
    restarted = TunedGemms()
    assert torch.equal(restarted(x, w, bias, False), want), "the same algorithm: the same bits"
    assert not timed and restarted.choices[key].from_file and restarted.choices[key].config == choice.config
    stored = read_choices(first.file)
    stored[key_name(key)]["algo"] = "ff" * ctypes.sizeof(Heuristic)   # an algorithm cuBLASLt does not know
    store(first.file, json.dumps(stored).encode())
    TunedGemms()(x, w, bias, False)
    assert timed, "a stored algorithm that does not run is chosen again"
    stored[key_name(key)] = Choice(None, None, 5.0, 5.0, "torch's").stored()
    store(first.file, json.dumps(stored).encode())
    monkeypatch.setattr(lt_gemm, "LtGemm", None)   # a stored torch's choice builds no cuBLASLt GEMM
    again = TunedGemms()
    assert torch.equal(again(x, w, bias, False), lt_gemm.torch_linear(x, w, bias, False))
    assert again.choices[key].from_file and again.choices[key].algo is None

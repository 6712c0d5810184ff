"""Checkpoints: round trip, strict key/shape checks, no pickle, random checkpoints in bf16."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_node.model import (
    CheckpointError,
    build_model,
    create_random_checkpoint,
    get_preset,
    init_random_,
    load_checkpoint,
    save_checkpoint,
)
from vla_node.model.weights import WEIGHTS_FILE
from vla_node.runtime import EngineConfig, PolicyEngine


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model = init_random_(build_model(get_preset("tiny")), seed=7)
    save_checkpoint(model, folder)
    return folder, model


def test_round_trip_is_exact(tiny_ckpt):
    folder, model = tiny_ckpt
    loaded = load_checkpoint(folder)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((folder / "config.json").read_text())["name"] == "tiny"
    assert (folder / "tokenizer.json").is_file()


def test_engine_from_checkpoint_equals_engine_from_same_weights(tiny_ckpt):
    folder, _ = tiny_ckpt
    from_disk = PolicyEngine(EngineConfig(checkpoint=str(folder), seed=7))
    in_memory = PolicyEngine(EngineConfig(seed=7))
    obs = from_disk.dummy_observation()
    assert (from_disk.predict(obs).actions == in_memory.predict(obs).actions).all()


def _rewrite(folder, tmp_path, edit):
    tensors = load_file(str(folder / WEIGHTS_FILE))
    edit(tensors)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text((folder / "config.json").read_text())
    return out


def test_missing_key_is_named(tiny_ckpt, tmp_path):
    folder, _ = tiny_ckpt
    bad = _rewrite(folder, tmp_path, lambda t: t.pop("llm.layers.1.attn.o.weight"))
    with pytest.raises(CheckpointError, match=r"missing key 'llm\.layers\.1\.attn\.o\.weight'"):
        load_checkpoint(bad)


def test_unexpected_key_is_named(tiny_ckpt, tmp_path):
    folder, _ = tiny_ckpt
    bad = _rewrite(folder, tmp_path, lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected key 'extra\.weight'"):
        load_checkpoint(bad)


def test_wrong_shape_is_named(tiny_ckpt, tmp_path):
    folder, _ = tiny_ckpt
    bad = _rewrite(folder, tmp_path, lambda t: t.__setitem__("expert.action_pos", torch.zeros(3, 64)))
    with pytest.raises(CheckpointError, match=r"'expert\.action_pos' has shape \(3, 64\).*expects \(32, 64\)"):
        load_checkpoint(bad)


def test_pickle_checkpoints_are_refused(tiny_ckpt, tmp_path):
    folder, model = tiny_ckpt
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(tmp_path)  # a folder with only a pickle
    disguised = tmp_path / "disguised"
    disguised.mkdir()
    torch.save(model.state_dict(), disguised / WEIGHTS_FILE)  # a pickle under the safetensors name
    (disguised / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(disguised)


def test_missing_checkpoint_and_bad_stats(tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    folder, _ = tiny_ckpt
    bad = _rewrite(folder, tmp_path, lambda t: t.__setitem__("action_stats", t["action_stats"][[0, 0]].clone()))
    with pytest.raises(CheckpointError, match="action statistics .* positive, finite spread"):
        load_checkpoint(bad)


def test_random_checkpoint_in_bf16(tmp_path):
    create_random_checkpoint("tiny", tmp_path, seed=1, dtype=torch.bfloat16)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    assert tensors["llm.embed.weight"].dtype == torch.bfloat16
    assert tensors["action_stats"].dtype == torch.float32  # statistics stay fp32
    model = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert model.llm.embed.weight.dtype == torch.bfloat16


def test_4b_preset_builds_without_host_fp32():
    """The 4B preset is sized on the meta device; a random checkpoint of it is generated in its
    target dtype tensor by tensor (what `create_random_checkpoint` does on a GPU host)."""
    model = build_model(get_preset("molmobot-4b"), device="meta", dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert 4.0e9 < params < 5.5e9
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    expert = sum(p.numel() for p in model.expert.parameters())
    assert 0.45e9 < expert < 0.7e9

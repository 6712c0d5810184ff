"""The official MolmoBot implementation's outputs on a tiny random checkpoint (test/data/
molmobot-official-tiny, produced by running the official code unmodified; see its README):
vla-convert of the official folder, then every stage and the actions of this project's eager
engine in fp32 against the official ones."""
import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vla_node.model import load_checkpoint, load_tokenizer
from vla_node.model.action_expert import ExpertBlock, timestep_features
from vla_node.model.convert import (
    CheckpointError,
    convert,
    load_official_weights,
    model_config_from_official,
    read_official_config,
    resolve_checkpoint,
)
from vla_node.model.convert import main as convert_main
from vla_node.model.layers import rope_tables
from vla_node.model.sequence import PromptBuilder
from vla_node.model.tokenizer import IMAGE_SPECIAL_TOKENS
from vla_node.runtime import MODES, EngineConfig, Observation, PolicyEngine, WindowLayout
from vla_node.runtime.preprocess import preprocess_reference

GOLDEN = Path(__file__).parent / "data" / "molmobot-official-tiny"
REF = json.loads((GOLDEN / "reference.json").read_text())
LAYOUT = WindowLayout(("exo", "wrist"), frames=2, stride=8)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "converted"
    assert convert_main([str(GOLDEN / "official_ckpt"), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def golden():
    inputs, outputs = load_file(str(GOLDEN / "inputs.safetensors")), load_file(str(GOLDEN / "outputs.safetensors"))
    order = [REF["images_order"].index(name) for name in ("exo@t-8", "wrist@t-8", "exo@t", "wrist@t")]
    images = [inputs["images"][i].numpy() for i in order]  # this project's slot order: time-major
    obs = Observation(images=images, state=inputs["state_raw"].numpy(), instruction=REF["instruction"])
    return obs, inputs, outputs


def engine_for(converted: Path, mode: str = "eager", **overrides) -> PolicyEngine:
    h, w = REF["camera_hw"]
    return PolicyEngine(EngineConfig.for_mode(mode, checkpoint=str(converted), layout=LAYOUT, camera_height=h,
                                              camera_width=w, **overrides))


def test_eager_engine_reproduces_the_official_actions(converted, golden):
    obs, inputs, outputs = golden
    chunk = engine_for(converted).predict(obs, noise=inputs["noise"])
    err = np.abs(chunk.normalized - outputs["actions_normalized"].numpy()).max()
    assert err <= 1e-5, f"normalised actions differ by {err}"
    scale = np.abs(outputs["actions"].numpy()).max()  # the gripper channel is on a 0-255 scale
    assert np.abs(chunk.actions - outputs["actions"].numpy()).max() <= 1e-5 * scale


def test_every_stage_matches_the_official_one(converted, golden):
    obs, inputs, outputs = golden
    m = load_checkpoint(converted)
    prompt = PromptBuilder(load_tokenizer(converted), m.cfg).build(2, 2, REF["instruction"])
    assert list(prompt.ids) == REF["prompt"]["input_ids"]
    pixels = preprocess_reference(obs.images, m.cfg.vision.image_size)
    official_pixels = outputs["batch.images"][0].float().view(4, 7, 7, 14, 14, 3).permute(0, 5, 1, 3, 2, 4)
    assert torch.equal(pixels, official_pixels.reshape(4, 3, 98, 98) / 255 * 2 - 1)
    with torch.no_grad():
        layers = m.vision.encoder.layer_outputs(pixels)
        for i in range(m.cfg.vision.layers_run):
            assert rel(layers[i], outputs[f"vit.layer{i}"]) <= 1e-5, f"ViT layer {i}"
        tokens = m.vision(pixels).reshape(1, -1, m.cfg.llm.dim)
        assert rel(tokens[0], outputs["vision.image_features"]) <= 1e-5
        embeds = m.embed(torch.tensor([prompt.ids]), tokens, torch.tensor(prompt.patch_positions))
        assert rel(embeds, outputs["llm.input_embeddings"]) <= 1e-5
        cos, sin = rope_tables(m.cfg.llm.head_dim, torch.arange(len(prompt)), m.cfg.llm.rope_theta)
        hidden = m.llm(embeds, cos, sin, m.attention_mask(prompt, "cpu"))
        for i, h in enumerate(hidden):
            assert rel(h, outputs[f"llm.layer{i}"]) <= 1e-5, f"LLM layer {i}"
        state = m.normalize_state(inputs["state_raw"][None])
        assert torch.allclose(state, outputs["batch.states"][0], atol=1e-7)
        kv = m.expert.context_kv(hidden, state)
        for i in range(REF["flow"]["steps"]):
            x, t = outputs[f"flow.step{i}.x_t"], outputs[f"flow.step{i}.t"]
            v = m.expert.velocity(x, m.expert.modulations(t), kv)
            assert rel(v, outputs[f"flow.step{i}.velocity"]) <= 1e-5, f"flow step {i}"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
def test_lossless_modes_stay_at_the_official_actions(converted, golden, mode):
    obs, inputs, outputs = golden
    chunk = engine_for(converted, mode).predict(obs, noise=inputs["noise"])
    assert np.abs(chunk.normalized - outputs["actions_normalized"].numpy()).max() <= 1e-4


def test_converted_config_comes_from_config_yaml(converted):
    cfg = json.loads((converted / "config.json").read_text())
    dims = REF["toy_dims"]
    assert cfg["llm"]["rope_theta"] == dims["llm_rope_theta"] and cfg["llm"]["extra_vocab"] == 128
    assert cfg["vision"]["feature_layers"] == [2, 1]  # vit_layers [-2, -3] of 4
    assert cfg["prompt"]["bidirectional_images"] is True and cfg["prompt"]["max_images"] == 4
    assert cfg["robot"]["frames"] == 2 and cfg["robot"]["obs_step_delta"] == 8
    assert cfg["robot"]["action_norm"] == "quantiles" and cfg["robot"]["state_norm"] == "min_max"
    stats = load_file(str(converted / "model.safetensors"))
    q = REF["norm"]["stats"]["synthmanip"]["action"]
    assert torch.equal(stats["action_stats"], torch.tensor([q["q01"], q["q99"]]))
    assert cfg["action"]["flow_steps"] == 10 and cfg["action"]["horizon"] == 16 and cfg["action"]["max_horizon"] == 32


# -- one test per difference found between the official model and the earlier look-alike ----------
def test_state_token_is_one_linear_on_the_zero_padded_state_then_layernorm(converted):
    m = load_checkpoint(converted)
    state = torch.rand(1, 8) * 2 - 1
    w = m.cfg.action.width
    expected = F.layer_norm(F.linear(F.pad(state, (0, w - 8)), m.expert.state_enc.weight, m.expert.state_enc.bias),
                            (w,), eps=1e-6)
    assert torch.allclose(m.expert.state_token(state)[:, 0], expected, atol=1e-6)


def test_time_features_are_unscaled_sines_first_with_half_minus_one_spacing():
    t = torch.tensor([0.3])
    half = 16
    freqs = torch.exp(-math.log(1e4) * torch.arange(half) / (half - 1))
    expected = torch.cat([torch.sin(0.3 * freqs), torch.cos(0.3 * freqs)])
    assert torch.allclose(timestep_features(t, 2 * half)[0], expected, atol=1e-6)


def test_expert_mlp_uses_exact_gelu():
    cfg = dataclasses.replace(read_cfg().action)
    blk = ExpertBlock(cfg)
    x = torch.randn(1, 16, cfg.width) * 3
    mod = torch.zeros(1, 9 * cfg.width)
    mod[:, 8 * cfg.width:] = 1  # MLP gate open, attention gates closed
    kv_shape = (1, cfg.heads, 1, cfg.width // cfg.heads)
    out = blk(x, mod, torch.zeros(kv_shape), torch.zeros(kv_shape))
    h = F.layer_norm(x, (cfg.width,), eps=1e-6)
    assert torch.allclose(out, x + blk.fc2(F.gelu(blk.fc1(h))), atol=1e-5)
    assert not torch.allclose(out, x + blk.fc2(F.gelu(blk.fc1(h), approximate="tanh")), atol=1e-5)


def test_context_projection_is_shared_without_bias_and_normalised_without_affine(converted):
    m = load_checkpoint(converted)
    assert m.expert.ctx_proj.bias is None
    assert not any("ctx" in n for n, _ in m.expert.blocks.named_parameters())
    ln = m.expert.ctx_norm
    assert ln.elementwise_affine is False and ln.eps == 1e-5


def test_vocabulary_holds_the_added_rows_with_the_image_tokens(converted):
    m, tok = load_checkpoint(converted), load_tokenizer(converted)
    official = load_official_weights(GOLDEN / "official_ckpt")
    assert m.llm.embed.weight.shape[0] == 320 + 128
    assert torch.equal(m.llm.embed.weight[320:], official["transformer.wte.new_embedding"])
    for i, token in enumerate(IMAGE_SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(token) == 320 + i == REF["prompt"]["special_token_ids"][token]


def test_image_tokens_attend_both_ways_and_labels_follow_the_window(converted):
    m = load_checkpoint(converted)
    builder = PromptBuilder(load_tokenizer(converted), m.cfg)
    prompt = builder.build(2, 2, "x")
    mask = m.attention_mask(prompt, "cpu")
    first_patch, last_patch = prompt.patch_positions[0], prompt.patch_positions[-1]
    assert mask[first_patch, last_patch]  # an early image token sees a later image's token
    assert not mask[0, first_patch] and not mask[prompt.instruction_start, len(prompt) - 1]  # text stays causal
    assert builder.labels(2, 2) == ["Image 0 View 1", "Image 0 View 2", "Image 1 View 1", "Image 1 View 2"]
    # An episode's start: the current frames keep their labels.
    assert builder.labels(2, 1) == ["Image 1 View 1", "Image 1 View 2"]
    assert builder.labels(1, 1) == [""]


def test_preprocessing_stretches_bilinear_without_antialias_and_rounds(golden):
    obs, _, outputs = golden
    pixels = preprocess_reference(obs.images, 98)
    u8 = ((pixels + 1) / 2 * 255).round()
    official = (outputs["batch.images"][0].float().view(4, 7, 7, 14, 14, 3).permute(0, 5, 1, 3, 2, 4)
                .reshape(4, 3, 98, 98))
    assert torch.equal(u8, official)


def test_episode_start_drops_missing_history(converted, golden):
    """Only the current frames (as the official wrapper sends at an episode's start): the prompt
    labels them 'Image 1 View 1/2' and the query runs in every lossless mode alike."""
    obs, inputs, _ = golden
    start = Observation(images=obs.images[2:], state=obs.state, instruction=obs.instruction)
    eager = engine_for(converted).predict(start, noise=inputs["noise"]).normalized
    fast = engine_for(converted, "fused").predict(start, noise=inputs["noise"]).normalized
    assert np.abs(eager - fast).max() <= 1e-4
    full = engine_for(converted).predict(obs, noise=inputs["noise"]).normalized
    assert np.abs(eager - full).max() > 1e-3  # the history frames matter


def test_gripper_channel_is_denormalised_to_the_checkpoints_0_255_scale(converted):
    m = load_checkpoint(converted)
    out = m.denormalize_actions(torch.tensor([[-1.0] * 8, [1.0] * 8]))
    assert out[0, 7] == 0 and out[1, 7] == 255
    robot = m.cfg.robot
    assert robot.gripper_dims == (7,) and robot.gripper_threshold == 128 and robot.max_joint_delta == (0.2,) * 7


# -- conversion: formats, refusals, the cache ---------------------------------------------------
def read_cfg():
    cfg, _ = model_config_from_official(read_official_config(GOLDEN / "official_ckpt"), "t")
    return cfg


def copy_official(tmp_path: Path) -> Path:
    folder = tmp_path / "official"
    shutil.copytree(GOLDEN / "official_ckpt", folder)
    (folder.parent / "tokenizer").exists() or shutil.copytree(GOLDEN / "tokenizer", folder.parent / "tokenizer")
    return folder


@pytest.mark.parametrize("key, value, message", [
    ("states_mode", "self_attn", "states_mode='self_attn'"),
    ("action_expert_layer_mode", "even", "action_expert_layer_mode='even'"),
    ("bi_directional_attn", "within_image", "bi_directional_attn='within_image'"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, key, value, message):
    import yaml

    folder = copy_official(tmp_path)
    data = yaml.safe_load((folder / "config.yaml").read_text())
    data["model"][key] = value
    (folder / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CheckpointError, match=message):
        convert(folder, tmp_path / "out")


def test_non_weights_pickle_is_refused(tmp_path):
    folder = copy_official(tmp_path)
    weights = {k: v.clone() for k, v in load_official_weights(folder).items()}  # off the memory map of model.pt
    torch.save({"weights": weights, "module": torch.nn.Linear(2, 2)}, folder / "model.pt")  # a pickled class
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        convert(folder, tmp_path / "out")


def test_sharded_model_and_optim_form_converts_to_the_same_weights(tmp_path, converted):
    import torch.distributed.checkpoint as dcp

    folder = copy_official(tmp_path)
    state = {k: v.clone() for k, v in load_official_weights(folder).items()}
    (folder / "model.pt").unlink()
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"model": state, "optim": {"step": torch.tensor(3)}}, checkpoint_id=str(folder / "model_and_optim"))
    out = convert(folder, tmp_path / "from_sharded")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tokenizer_says_how_to_provide_one(tmp_path):
    folder = tmp_path / "official"
    shutil.copytree(GOLDEN / "official_ckpt", folder)  # no tokenizer folder beside it
    with pytest.raises(CheckpointError, match="--tokenizer"):
        convert(folder, tmp_path / "out")
    out = convert(folder, tmp_path / "out", tokenizer=GOLDEN / "tokenizer")
    assert (out / "tokenizer.json").is_file()


def test_engine_pointed_at_an_official_folder_converts_once(tmp_path, monkeypatch, golden):
    monkeypatch.setenv("VLA_NODE_CACHE", str(tmp_path / "cache"))
    folder = copy_official(tmp_path)
    messages = []
    first = resolve_checkpoint(folder, messages.append)
    second = resolve_checkpoint(folder, messages.append)
    assert first == second and first.parent == tmp_path / "cache" / "converted"
    assert messages[0].startswith("converting official MolmoBot checkpoint")
    assert messages[-1].startswith("using the conversion")
    obs, inputs, outputs = golden
    engine = PolicyEngine(EngineConfig(checkpoint=str(folder), layout=LAYOUT, camera_height=360))
    normalized = engine.predict(obs, noise=inputs["noise"]).normalized
    assert np.abs(normalized - outputs["actions_normalized"].numpy()).max() <= 1e-5

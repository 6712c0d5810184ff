"""The network against implementations no one here wrote (transformers' Qwen3 and SigLIP), and
unit tests of its parts."""
import dataclasses

import pytest
import torch

from vla_node.model import build_model, get_preset, init_random_
from vla_node.model.action_expert import KnownActions, euler, flow_times
from vla_node.model.layers import rope_tables
from vla_node.model.vision import AttentionPool, VisionEncoder, pooling_windows

transformers = pytest.importorskip("transformers")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"))
    # Every parameter random, norms included, so a wrongly mapped weight cannot hide.
    for p in model.parameters():
        p.data.normal_(0, 0.3 if p.dim() == 1 else 0.05)
    return model


def test_llm_matches_transformers_qwen3(tiny):
    cfg = tiny.cfg.llm
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.embedding_rows, hidden_size=cfg.dim, intermediate_size=cfg.mlp, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=False,
        max_position_embeddings=cfg.max_seq_len)
    hf = transformers.Qwen3Model(hf_cfg).eval()
    ours = tiny.llm
    state = {"embed_tokens.weight": ours.embed.weight, "norm.weight": torch.rand(cfg.dim) + 0.5}
    for i, layer in enumerate(ours.layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": layer.attn.qkv.q.weight,
            p + "self_attn.k_proj.weight": layer.attn.qkv.k.weight,
            p + "self_attn.v_proj.weight": layer.attn.qkv.v.weight, p + "self_attn.o_proj.weight": layer.attn.o.weight,
            p + "self_attn.q_norm.weight": layer.attn.q_norm.weight,
            p + "self_attn.k_norm.weight": layer.attn.k_norm.weight,
            p + "mlp.gate_proj.weight": layer.mlp.gate_up.gate.weight,
            p + "mlp.up_proj.weight": layer.mlp.gate_up.up.weight,
            p + "mlp.down_proj.weight": layer.mlp.down.weight,
            p + "input_layernorm.weight": layer.attn_norm.weight,
            p + "post_attention_layernorm.weight": layer.mlp_norm.weight,
        })
    hf.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.embedding_rows, (2, 37))
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        cos, sin = rope_tables(cfg.head_dim, torch.arange(ids.shape[1]), cfg.rope_theta)
        hidden = ours(ours.embed(ids), cos, sin)
    assert len(hidden) == cfg.layers
    # transformers returns the embeddings, then every layer's output; its last entry (and
    # last_hidden_state) has the final norm applied, which the policy does not use.
    for i in range(cfg.layers - 1):
        assert rel_err(hidden[i], out.hidden_states[i + 1]) < 1e-5, f"layer {i}"
    assert rel_err(hf.norm(hidden[-1]), out.last_hidden_state) < 1e-5


def test_vit_matches_transformers_siglip(tiny):
    cfg = tiny.cfg.vision
    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=cfg.width, intermediate_size=cfg.mlp, num_hidden_layers=cfg.layers_run,
        num_attention_heads=cfg.heads, image_size=cfg.image_size, patch_size=cfg.patch_size,
        layer_norm_eps=cfg.norm_eps, hidden_act="gelu_pytorch_tanh", vision_use_head=False)
    hf = transformers.SiglipVisionModel(hf_cfg).eval()
    enc = tiny.vision.encoder
    # Our patch embedding is a Linear over (row, column, channel)-flattened patches; SigLIP's a conv.
    p = cfg.patch_size
    state = {"embeddings.patch_embedding.weight": enc.patch_embed.weight.view(cfg.width, p, p, 3).permute(0, 3, 1, 2),
             "embeddings.patch_embedding.bias": enc.patch_embed.bias,
             "embeddings.position_embedding.weight": enc.pos_embed,
             "post_layernorm.weight": torch.ones(cfg.width),
             "post_layernorm.bias": torch.zeros(cfg.width)}
    for i, blk in enumerate(enc.blocks):
        p = f"encoder.layers.{i}."
        for hf_name, ours in (("layer_norm1", blk.norm1), ("layer_norm2", blk.norm2), ("mlp.fc1", blk.fc1),
                              ("mlp.fc2", blk.fc2), ("self_attn.q_proj", blk.attn.qkv.q),
                              ("self_attn.k_proj", blk.attn.qkv.k), ("self_attn.v_proj", blk.attn.qkv.v),
                              ("self_attn.out_proj", blk.attn.out)):
            state[p + hf_name + ".weight"] = ours.weight
            state[p + hf_name + ".bias"] = ours.bias
    # transformers versions differ in whether the weights sit under a `vision_model` prefix.
    getattr(hf, "vision_model", hf).load_state_dict(state, strict=True)
    pixels = torch.rand(3, 3, cfg.image_size, cfg.image_size) * 2 - 1
    with torch.no_grad():
        ref = hf(pixel_values=pixels, output_hidden_states=True).hidden_states
        outs = enc.layer_outputs(pixels)
        feats = enc(pixels)
    for i in range(cfg.layers_run):
        assert rel_err(outs[i], ref[i + 1]) < 1e-5, f"layer {i}"
    expected = torch.cat([ref[i + 1] for i in cfg.feature_layers], dim=-1)
    assert feats.shape == (3, cfg.grid ** 2, cfg.feature_dim)
    assert rel_err(feats, expected) < 1e-5


def test_vit_runs_only_the_layers_it_needs():
    cfg = get_preset("molmobot-4b").vision
    assert cfg.layers_run == 25 and cfg.feature_dim == 2304 and cfg.tokens_per_image == 196
    with torch.device("meta"):
        assert len(VisionEncoder(cfg).blocks) == 25


def test_pooling_windows_pad_27_to_28():
    idx, valid = pooling_windows(27, 2)
    assert idx.shape == (196, 4)
    assert int(valid.sum()) == 27 * 27
    real = idx[valid]
    assert sorted(real.tolist()) == list(range(27 * 27))  # every patch in exactly one window
    assert valid[-1].tolist() == [True, False, False, False]  # bottom-right corner: 1 real patch


def test_attention_pool_masks_padding_and_uses_window_mean(tiny):
    cfg = tiny.cfg.vision
    pool: AttentionPool = tiny.vision.pool
    feats = torch.randn(2, cfg.grid ** 2, cfg.feature_dim)
    with torch.no_grad():
        out = pool(feats)
        # A window with one real patch attends to that patch alone: out(v(x)).
        corner = feats[:, cfg.grid ** 2 - 1]
        assert torch.allclose(out[:, -1], pool.out(pool.kv.v(corner)), atol=1e-5)
        # A full window: softmax attention with the mean of its 4 patches as the query.
        idx = pool.window_idx[0]
        win = feats[:, idx]
        h = pool.heads
        q = pool.q(win.mean(1)).view(2, h, 1, -1)
        k = pool.kv.k(win).view(2, 4, h, -1).transpose(1, 2)
        v = pool.kv.v(win).view(2, 4, h, -1).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5, dim=-1) @ v
        assert torch.allclose(out[:, 0], pool.out(att.reshape(2, -1)), atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "molmobot-4b"])
def test_projector_and_tower_shapes(preset):
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = build_model(cfg, device="meta")
        tokens = model.vision(torch.empty(2, 3, cfg.vision.image_size, cfg.vision.image_size))
    assert tokens.shape == (2, cfg.vision.tokens_per_image, cfg.llm.dim)
    assert model.vision.projector.gate_up.gate.weight.shape == (cfg.projector_hidden, cfg.vision.width)
    assert model.vision.projector.down.weight.shape == (cfg.llm.dim, cfg.projector_hidden)
    assert len(model.expert.blocks) == cfg.llm.layers


def test_vision_rejects_wrong_image_size(tiny):
    with pytest.raises(ValueError, match=r"expects images \[B, 3, 98, 98\]"):
        tiny.vision(torch.zeros(1, 3, 64, 64))


def test_euler_integrates_constant_velocity_exactly():
    noise = torch.randn(1, 16, 8)
    velocity = torch.randn(1, 16, 8)
    calls = []

    def field(x, i):
        calls.append(i)
        return velocity

    # dt = 1/8 is exact in binary, so the sum of 8 steps equals the velocity to rounding of x.
    out = euler(field, noise, 8)
    assert calls == list(range(8))
    assert torch.allclose(out, noise + velocity, atol=1e-6)
    assert flow_times(4) == [0.0, 0.25, 0.5, 0.75]
    with pytest.raises(ValueError, match="flow steps"):
        euler(field, noise, 0)


def test_inpainting_puts_known_rows_on_the_training_path_at_every_step_and_on_the_values_at_the_end():
    """Real-time chunking by inpainting: before step i (t = i / steps) the known rows of the sample
    are (1 - t) * noise + t * known, as x_t in training; after the last step they are the known
    values exactly, and the free rows integrate as without them."""
    g = torch.Generator().manual_seed(0)
    noise, values, velocity = (torch.randn(1, 16, 8, generator=g) for _ in range(3))
    mask = (torch.arange(16) < 5)[None, :, None]
    seen = []

    def field(x, i):
        seen.append(x.clone())
        return velocity

    out = euler(field, noise, 4, reuse={3: 2}, known=KnownActions(values, mask))
    assert len(seen) == 3        # step 3 reuses step 2's velocity
    for x, t in zip(seen, flow_times(4)):
        assert torch.equal(x[:, :5], (1 - t) * noise[:, :5] + t * values[:, :5])
    assert torch.equal(out[:, :5], values[:, :5])
    free = euler(lambda x, i: velocity, noise, 4, reuse={3: 2})
    assert torch.equal(out[:, 5:], free[:, 5:])


@pytest.mark.parametrize("mode", ["min_max", "quantiles", "quantile10", "mean_std"])
def test_normalisation_round_trip(mode):
    from vla_node.model.policy import denormalize, normalize

    stats = torch.tensor([[-2.0, 0.0, 10.0], [3.0, 0.5, 20.0]])
    x = torch.randn(100, 3) * 4
    assert torch.allclose(denormalize(normalize(x, stats, mode), stats, mode), x, atol=1e-4)
    if mode == "mean_std":
        assert torch.allclose(normalize(stats[0], stats, mode), torch.zeros(3))
    else:  # the two statistics map to -1 and 1
        assert torch.allclose(normalize(stats, stats, mode), torch.tensor([[-1.0] * 3, [1.0] * 3]))


def test_expert_context_split_matches_single_pass(tiny):
    """context_kv + velocity is one forward of the expert: K/V computed once equal K/V computed
    inside the step (the runtime hoists one out of the flow loop)."""
    cfg = tiny.cfg
    hidden = [torch.randn(1, 20, cfg.llm.dim) for _ in range(cfg.llm.layers)]
    state = torch.rand(1, cfg.action.state_dim) * 2 - 1
    x = torch.randn(1, cfg.action.horizon, cfg.action.action_dim)
    with torch.no_grad():
        mods = tiny.expert.modulations(torch.tensor([0.3]))
        v1 = tiny.expert.velocity(x, mods, tiny.expert.context_kv(hidden, state))
        v2 = tiny.expert.velocity(x, mods, tiny.expert.context_kv(hidden, state))
    assert v1.shape == x.shape and torch.equal(v1, v2)


def test_model_config_json_round_trip():
    from vla_node.model import ModelConfig

    for name in ("tiny", "molmobot-4b"):
        cfg = get_preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="feature layer"):
        dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, feature_layers=(30,)))


def test_random_init_is_deterministic_and_nontrivial():
    a = init_random_(build_model(get_preset("tiny")), seed=3)
    b = init_random_(build_model(get_preset("tiny")), seed=3)
    c = init_random_(build_model(get_preset("tiny")), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["llm.embed.weight"], sc["llm.embed.weight"])

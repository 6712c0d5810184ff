"""The ViT's attention kernel (runtime/kernels/vit_attention) against SDPA: on the CPU through
TRITON_INTERPRET=1 (set by conftest.py when there is no GPU; fp32, which the interpreter runs), on
the GPU natively in bf16 and fp32."""
import pytest
import torch

from vla_node.model.config import VisionConfig
from vla_node.model.vision import VisionEncoder, vit_sdpa
from vla_node.runtime.kernels.vit_attention import head_parts, use_vit_attention_kernel, vit_attention, vit_attention_op

DEVICES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CI's run")),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.float32, marks=pytest.mark.cuda)]


def _tolerance(device, dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-6 if device == "cpu" else 1e-5   # fp32 on the GPU: other sums


def _qkv(device, dtype, images: int, tokens: int, heads: int, head_dim: int, seed: int):
    """q, k, v [images, tokens, heads, head_dim] as the ViT makes them: strided views of one fused
    projection's output."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(images, tokens, 3 * heads * head_dim, generator=g).to(device, dtype)
    return tuple(x.view(images, tokens, heads, head_dim) for x in fused.split(heads * head_dim, -1))


def test_a_head_splits_into_a_power_of_two_and_a_padded_rest():
    assert head_parts(72) == (64, 16)    # SigLIP2-so400m: 80 lanes of dots for 72
    assert head_parts(64) == (64, 16)    # a power of two: no rest (the second part unused)
    assert head_parts(96) == (64, 32)
    assert head_parts(24) == (16, 16)


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("images, tokens, heads, head_dim, tiles", [
    (2, 49, 2, 72, dict(block_m=16, block_n=16)),   # a split head, a partial last key tile
    (1, 64, 2, 32, dict(block_m=32, block_n=16)),   # a power-of-two head, tokens a multiple of the tiles
    (3, 20, 1, 24, {}),                              # the default tiles, fewer tokens than a tile
])
def test_vit_attention_matches_sdpa(device, dtype, images, tokens, heads, head_dim, tiles):
    """Every token of an image attends to all of its image's tokens, none of another's; the output
    is [images, tokens, heads * head_dim], the out projection's layout."""
    q, k, v = _qkv(device, dtype, images, tokens, heads, head_dim, seed=tokens + head_dim)
    out = vit_attention(q, k, v, **tiles)
    ref = vit_sdpa(q.float(), k.float(), v.float())
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == dtype
    assert float((out.float() - ref).norm() / ref.norm()) < _tolerance(device, dtype)


def test_vit_attention_refuses_what_it_cannot_run():
    q, k, v = _qkv("cpu", torch.float32, 1, 8, 1, 16, seed=0)
    with pytest.raises(ValueError, match="one shape"):
        vit_attention(q, k[:, :4], v)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        vit_attention(*(x[..., :8] for x in (q, k, v)))


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_a_vision_encoder_with_the_kernel_matches_sdpa_compiled(device, dtype):
    """The kernel as the blocks' attention (a custom op a compiled region keeps whole) gives the
    encoder's SDPA outputs, at SigLIP2-so400m's head width of 72."""
    cfg = VisionConfig(image_size=56, patch_size=14, width=144, heads=2, mlp=64, layers=2, feature_layers=(1, 0))
    torch.manual_seed(0)
    encoder = VisionEncoder(cfg).to(device, dtype).eval()
    pixels = torch.rand(2, 3, 56, 56, device=device, dtype=dtype) * 2 - 1
    with torch.no_grad():
        ref = encoder(pixels).float()
        assert use_vit_attention_kernel(encoder) == cfg.layers_run
        assert encoder.blocks[0].attn.attend is vit_attention_op
        out = torch.compile(encoder, fullgraph=True)(pixels).float()
    assert float((out - ref).norm() / ref.norm()) < _tolerance(device, dtype)


def test_an_engine_with_the_kernel_gives_the_same_actions():
    """`vit_attention_kernel` on a compiled engine (its vision graphs, the vision cache) gives the
    actions of the engine without it, at an episode's start and on a sliding window."""
    import numpy as np

    from vla_node.runtime import EngineConfig, Observation, PolicyEngine

    opts = dict(vision_cache=True)
    plain = PolicyEngine(EngineConfig.for_mode("compile", **opts))
    kernel = PolicyEngine(EngineConfig.for_mode("compile", vit_attention_kernel=True, **opts))
    assert all(block.attn.attend is vit_attention_op for block in kernel.model.vision.encoder.blocks)
    layout = plain.layout
    rng = np.random.default_rng(0)
    frames = {(c, t): rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for c in layout.cameras for t in range(3)}
    for ids in ([(c, 0) for c in layout.cameras], [(c, t) for t in (0, 1) for c in layout.cameras],
                [(c, t) for t in (1, 2) for c in layout.cameras]):
        obs = Observation(images=[frames[i] for i in ids], state=np.zeros(8, np.float32), instruction="pick it up",
                          frame_ids=ids)
        noise = torch.randn(1, 16, 8)
        a, b = plain.predict(obs, noise=noise).normalized, kernel.predict(obs, noise=noise).normalized
        assert np.abs(a - b).max() < 1e-5, ids

"""The lossless fast path against the eager reference.

CPU tests run in CI. Tests marked `cuda` need a GPU (run them on the H200:
`python3 -m pytest -q test/test_fast_path.py`) and skip elsewhere with the reason.
"""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch._dynamo.config as dynamo_config

from vla_node.model import load_checkpoint, save_checkpoint
from vla_node.model.layers import linear_gelu, rope_tables
from vla_node.runtime import LAYOUTS, EngineConfig, Observation, PolicyEngine
from vla_node.runtime.compile import RECOMPILE_LIMIT, uncompile
from vla_node.runtime.fusion import BatchedContextKV, linear_gelu_epilogue
from vla_node.runtime.graphs import NO_GEMM_WORKSPACE, use_gemms_without_workspace
from vla_node.runtime.preprocess import preprocess_reference, resize_normalize

INSTRUCTIONS = ["pick up the red cup", "open the drawer", "put the marker in the bowl and close the lid",
                "wipe the table", "stack the blue block on the yellow cube next to the plate", "push the box",
                "grasp the spoon", "pour the bottle into the mug slowly and carefully", "turn", "fold the towel"]


def same_inputs(engine: PolicyEngine, n: int):
    return [(engine.dummy_observation(seed=i), torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(i))
             .to(engine.device)) for i in range(n)]


def outputs(engine: PolicyEngine, inputs) -> list[np.ndarray]:
    return [engine.predict(obs, noise=noise).normalized for obs, noise in inputs]


def test_context_kv_once_is_bitwise_identical_to_per_step():
    per_step = PolicyEngine(EngineConfig.for_mode("static"))
    once = PolicyEngine(EngineConfig.for_mode("ctxkv"))
    inputs = same_inputs(per_step, 3)
    for a, b in zip(outputs(per_step, inputs), outputs(once, inputs)):
        assert np.array_equal(a, b)


def test_padded_bucket_matches_unpadded_reference():
    eager = PolicyEngine(EngineConfig.for_mode("eager"))
    static = PolicyEngine(EngineConfig.for_mode("static"))
    for text in INSTRUCTIONS[:4]:  # different padding amounts
        obs = eager.dummy_observation()
        obs.instruction = text
        noise = torch.randn(1, 16, 8)
        a, b = eager.predict(obs, noise=noise).normalized, static.predict(obs, noise=noise).normalized
        assert np.abs(a - b).max() < 1e-5, text


def test_fused_projections_keep_keys_and_results(tmp_path):
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv"))
    fused = PolicyEngine(EngineConfig.for_mode("ctxkv", fused=True))
    a, b = plain.model.state_dict(), fused.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    inputs = same_inputs(plain, 2)
    for x, y in zip(outputs(plain, inputs), outputs(fused, inputs)):
        assert np.abs(x - y).max() < 1e-5
    save_checkpoint(fused.model, tmp_path)  # views of one buffer must still save as separate tensors
    assert load_checkpoint(tmp_path).state_dict().keys() == a.keys()


def test_context_kv_of_every_block_at_once_is_the_per_block_one_up_to_rounding():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", fused=True))
    expert, batched = engine.model.expert, engine.static.context_kv
    assert isinstance(batched, BatchedContextKV)
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(2, 37, engine.model.cfg.llm.dim, generator=g) for _ in expert.blocks]
    state = torch.randn(2, engine.model.cfg.action.state_dim, generator=g)
    with torch.no_grad():
        for (k, v), (bk, bv) in zip(expert.context_kv(hidden, state), batched(hidden, state), strict=True):
            assert torch.allclose(k, bk, rtol=0, atol=1e-5) and torch.allclose(v, bv, rtol=0, atol=1e-5)
            assert k.stride() == bk.stride() and v.stride() == bv.stride()  # the fused kernels' pack reads them
        for (k, v), (sk, sv) in zip(batched(hidden, state), batched(torch.stack(hidden), state), strict=True):
            assert torch.equal(k, sk) and torch.equal(v, sv)   # the layers' one buffer: no stack, same numbers


@pytest.mark.parametrize("compiled", [False, True])
def test_the_llm_writes_its_layers_outputs_into_one_buffer_unchanged(compiled):
    """LLM.forward's hidden_out (the fused engine's, for BatchedContextKV): each layer's output is
    written there by the pass that makes it, the same numbers as without it, eager and compiled."""
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv"))
    llm = engine.model.llm
    regions = list(llm.layers) if compiled else []
    for layer in regions:
        layer.compile(fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    t = 11
    embeds = torch.randn(2, t, llm.cfg.dim, generator=g)
    cos, sin = rope_tables(llm.cfg.head_dim, torch.arange(t), llm.cfg.rope_theta)
    try:
        with torch.no_grad():
            plain = llm(embeds, cos, sin)
            buffer = embeds.new_full((llm.cfg.layers, 2, t, llm.cfg.dim), float("nan"))
            kept = llm(embeds, cos, sin, hidden_out=buffer)
    finally:
        uncompile(regions)
    for i, (a, b) in enumerate(zip(plain, kept, strict=True)):
        assert torch.equal(a, b) and torch.equal(buffer[i], a)


def test_gelu_epilogue_keeps_the_vit_mlp():
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv", fused=True))
    epilogue = PolicyEngine(EngineConfig.for_mode("ctxkv", fused=True, gelu_epilogue=True))
    assert all(b.fc1_gelu is linear_gelu_epilogue for b in epilogue.model.vision.encoder.blocks)
    inputs = same_inputs(plain, 2)
    for x, y in zip(outputs(plain, inputs), outputs(epilogue, inputs)):
        assert np.array_equal(x, y)  # the CPU runs the same two ops


@pytest.mark.parametrize("compiled", [False, True])
def test_aligned_patch_embedding_is_the_patch_embedding(compiled):
    """The patch embedding's GEMM at K padded to a multiple of 8 (zeros in the weights and the
    patches) against the model's, at the ViT's 14-pixel patches (K = 588), compiled and not; and an
    engine with it against one without."""
    from vla_node.model.vision import embed_patches
    from vla_node.runtime.fusion import AlignedPatchEmbedding

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(588, 40)
    pixels = torch.randn(3, 3, 42, 42, generator=g)
    aligned = AlignedPatchEmbedding(linear, compiled=compiled)
    assert aligned.weight.shape == (40, 592) and not aligned.weight[:, 588:].any()
    want = embed_patches(pixels, linear, 14)
    assert (aligned(pixels, linear, 14) - want).abs().max().item() < 1e-5
    if compiled:
        return
    plain = PolicyEngine(EngineConfig.for_mode("fused"))
    padded = PolicyEngine(EngineConfig.for_mode("fused", aligned_patch_embedding=True))
    assert isinstance(padded.model.vision.encoder.embed_patches, AlignedPatchEmbedding)
    inputs = same_inputs(plain, 2)
    for x, y in zip(outputs(plain, inputs), outputs(padded, inputs)):
        assert np.abs(x - y).max() < 1e-5


def test_window_attention_as_plain_ops_is_sdpa():
    """The vision pool's one-query window attention as plain fp32 ops (runtime/fusion) against SDPA,
    padding patches masked, and an engine with it against one without."""
    from vla_node.model.vision import window_sdpa
    from vla_node.runtime.fusion import window_attention_ops

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(50, 4, n, 18, generator=g) for n in (1, 4, 4))
    mask = torch.rand(50, 1, 1, 4, generator=g) > 0.4
    mask[..., 0] = True   # a window's first patch is always real
    assert (window_attention_ops(q, k, v, mask) - window_sdpa(q, k, v, mask)).abs().max().item() < 1e-6
    plain = PolicyEngine(EngineConfig.for_mode("fused"))
    ops = PolicyEngine(EngineConfig.for_mode("fused", window_attention_ops=True))
    assert ops.model.vision.pool.attend is window_attention_ops
    inputs = same_inputs(plain, 2)
    for x, y in zip(outputs(plain, inputs), outputs(ops, inputs)):
        assert np.abs(x - y).max() < 1e-5


def test_vision_cache_reuses_frames_exactly_once():
    layout = LAYOUTS["droid"]
    cached = PolicyEngine(EngineConfig.for_mode("ctxkv", vision_cache=True))
    fresh = PolicyEngine(EngineConfig.for_mode("ctxkv"))
    rng = np.random.default_rng(0)
    frames = {}  # (camera, t) -> image; a stream where each window shares a frame time with the last

    def frame(cam, t):
        if (cam, t) not in frames:
            frames[cam, t] = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        return frames[cam, t]

    store = cached.static.store
    for step in range(5):
        times = [step * layout.stride, (step + 1) * layout.stride]
        ids = [(cam, t) for t in times for cam in layout.cameras]
        obs = Observation(images=[frame(c, t) for c, t in ids], state=np.zeros(8, np.float32),
                          instruction="pick up the red cup", frame_ids=ids)
        noise = torch.randn(1, 16, 8)
        misses = store.misses
        a = cached.predict(obs, noise=noise).normalized
        assert store.misses - misses == (4 if step == 0 else 2)  # only the new frame time is encoded
        b = fresh.predict(obs, noise=noise).normalized
        assert np.abs(a - b).max() < 1e-5
    assert store.hits == 8


@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 12), (torch.float32, 6), (torch.bfloat16, 7)])
def test_frame_store_moves_rows_bit_for_bit(dtype, dim):
    """The store's rows move as 8-byte words where a row's bytes allow (dim 7 of bf16: as elements)."""
    from vla_node.runtime.frame_store import FrameStore
    store = FrameStore(6, 5, dim, dtype, torch.device("cpu"))
    tokens = torch.randn(3, 5, dim).to(dtype)
    tokens.view(-1)[0] = float("nan")   # a NaN's bits kept too
    rows = torch.tensor([4, 0, 2])
    store.write(rows, tokens)
    want = torch.zeros(7, 5, dim, dtype=dtype)
    want.index_copy_(0, rows, tokens)
    assert torch.equal(store.tokens.view(torch.uint8 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.uint8 if dtype == torch.bfloat16 else torch.int32))
    read = store.read(torch.tensor([2, 4]))
    assert read.dtype == dtype and read.shape == (2, 5, dim)
    assert torch.equal(read.view(-1).view(torch.uint8), tokens[[2, 0]].reshape(-1).view(torch.uint8))


def embedding_case(dtype, device="cpu", batch=2, images=3, per_image=5, length=40, dim=24, rows=9):
    """Token ids, a frame store of random tokens, each entry's rows in it and the prompt's patch positions
    (distinct, in order, some text between them) -> the embedding weight and both calls' inputs."""
    from vla_node.runtime.frame_store import FrameStore

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, dim, generator=g).to(device, dtype)
    ids = torch.randint(0, 50, (batch, length), generator=g).to(device)
    store = FrameStore(rows - 1, per_image, dim, dtype, torch.device(device))   # its rows and a scratch row
    store.tokens.copy_(torch.randn(rows, per_image, dim, generator=g))
    frame_rows = torch.randperm(rows, generator=g)[:batch * images].to(device)
    positions = torch.randperm(length, generator=g)[:images * per_image].sort().values
    slot_image = torch.full((length,), -1, dtype=torch.long)
    slot_image[positions] = torch.arange(len(positions))
    return weight, ids, store, frame_rows, positions.to(device), slot_image.to(device)


def embed_as_the_model(weight, ids, store, frame_rows, positions):
    """The static runner's prefill without one_pass_embedding: FrameStore.read, then VLAPolicy.embed
    (on a stand-in that holds the one module it reads, the token embedding)."""
    from types import SimpleNamespace

    from vla_node.model import VLAPolicy

    image = store.read(frame_rows).reshape(ids.shape[0], -1, weight.shape[1])
    model = SimpleNamespace(llm=SimpleNamespace(embed=torch.nn.Embedding.from_pretrained(weight)))
    return VLAPolicy.embed(model, ids, image, positions)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_embedding_is_the_models(dtype, compiled):
    """fusion.embed_from_store against the model's embedding + the store's read + index_add, bit for
    bit (each image slot is one add of the same two values), compiled and not."""
    from vla_node.runtime.fusion import embed_from_store

    weight, ids, store, frame_rows, positions, slot_image = embedding_case(dtype)
    run = torch.compile(embed_from_store, fullgraph=True, dynamic=False) if compiled else embed_from_store
    got = run(weight, ids, store.tokens, frame_rows, slot_image)
    assert torch.equal(got, embed_as_the_model(weight, ids, store, frame_rows, positions))


def test_an_engine_with_the_one_pass_embedding_is_the_same_engine():
    """A static engine's prefill with embed_from_store against one without, at batch 1 and 2 (the
    slot map is the bucket's: Bucket.slot_image), and the switch needs the static buckets."""
    plain = PolicyEngine(EngineConfig.for_mode("fused", max_batch=2))
    one_pass = PolicyEngine(EngineConfig.for_mode("fused", max_batch=2, one_pass_embedding=True))
    inputs = same_inputs(plain, 2)
    for x, y in zip(outputs(plain, inputs), outputs(one_pass, inputs)):
        assert np.array_equal(x, y)
    observations = [obs for obs, _ in inputs]
    noise = torch.cat([n for _, n in inputs])
    a, b = (e.predict_batch(observations, noise=noise) for e in (plain, one_pass))
    assert all(np.array_equal(x.normalized, y.normalized) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="one_pass_embedding needs static_shapes"):
        EngineConfig(one_pass_embedding=True)


def test_the_input_stream_needs_the_static_buckets_on_a_gpu():
    with pytest.raises(ValueError, match="input_stream needs static_shapes"):
        EngineConfig(device="cuda", input_stream=True)
    with pytest.raises(ValueError, match="input_stream needs a CUDA device"):
        EngineConfig.for_mode("static", input_stream=True)


def test_no_recompilation_after_warmup_whatever_the_known_prefix_and_keys_unchanged(tmp_path):
    """Every instruction length and every known-prefix length (none, 1 ... 16 actions: data in
    the bucket's buffers, never a shape) runs the graphs compiled during warm-up."""
    engine = PolicyEngine(EngineConfig.for_mode("compile"))
    keys = list(engine.model.state_dict())
    engine.warmup()
    assert engine.stats.compiled_graphs > 0
    obs = engine.dummy_observation()
    for i in range(20):
        obs.instruction = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        chunk = engine.predict(obs)
        assert np.isfinite(chunk.actions).all()
        obs.known_actions = chunk.actions[:1 + i * 15 // 19] if i % 2 else None
    assert engine.static.recompiles() == 0
    for name in ("recompile_limit", "accumulated_recompile_limit"):  # room for every engine a process holds
        assert getattr(dynamo_config, name) >= RECOMPILE_LIMIT
    obs.known_actions = None
    assert list(engine.model.state_dict()) == keys  # no `_orig_mod.` prefixes
    save_checkpoint(engine.model, tmp_path)
    assert list(load_checkpoint(tmp_path).state_dict()) == keys
    # Leaving the compiled wrapper: eager forward again, same numbers within fp32 rounding.
    noise = torch.randn(1, 16, 8)
    compiled = engine.predict(obs, noise=noise).normalized
    uncompile(engine.static.regions)
    eager = engine.predict(obs, noise=noise).normalized
    assert np.abs(compiled - eager).max() < 1e-4


@pytest.mark.parametrize("mode, overrides", [
    ("eager", {}),
    ("static", {}),                                   # the context recomputed at every step
    ("ctxkv", dict(action_cache="6-7:5")),            # steps that reuse a velocity are inpainted too
    ("ctxkv", dict(action_cache="adaptive:0.5")),     # a host loop over per-step graphs
], ids=["eager", "static", "ctxkv-cache", "ctxkv-adaptive"])
def test_a_known_prefix_starts_the_chunk_exactly_and_queries_without_one_are_unchanged(mode, overrides):
    """The inpaint hand-over's query: the chunk's first k actions are the known ones, bit for bit
    in the model's normalised units (the engine normalises them with the checkpoint's statistics)
    and within float32 round-off once denormalised; the rest is generated around them."""
    engine = PolicyEngine(EngineConfig.for_mode(mode, **overrides))
    obs = engine.dummy_observation()
    noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(0))
    free = engine.predict(obs, noise=noise)
    for k in (1, 6, 16):
        obs.known_actions = free.actions[:k] + 0.05
        chunk = engine.predict(obs, noise=noise)
        known = engine.model.normalize_actions(torch.as_tensor(obs.known_actions)).numpy()
        assert np.array_equal(chunk.normalized[:k], known)
        assert np.abs(chunk.actions[:k] - obs.known_actions).max() < 2e-6   # |actions| < 3 rad: ulps of 2.4e-7
        assert k == 16 or not np.allclose(chunk.normalized[k:], free.normalized[k:])
    obs.known_actions = None
    assert np.array_equal(engine.predict(obs, noise=noise).normalized, free.normalized)


def test_unknown_layout_and_invalid_configs_are_rejected():
    engine = PolicyEngine(EngineConfig.for_mode("static"))
    with pytest.raises(ValueError, match="not one of the engine's layouts"):
        engine.predict(engine.dummy_observation(LAYOUTS["8img"]), layout=LAYOUTS["8img"])
    with pytest.raises(ValueError, match="needs static_shapes"):
        EngineConfig(compile=True)
    with pytest.raises(ValueError, match="unknown mode"):
        EngineConfig.for_mode("turbo")


def test_gemms_without_workspace_are_asked_for_unless_the_user_chose():
    environ = {}
    assert use_gemms_without_workspace(environ) and environ == NO_GEMM_WORKSPACE
    for chosen in ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, {"CUBLASLT_WORKSPACE_SIZE": "1024"},
                   {"TORCH_BLAS_PREFER_CUBLASLT": "1"}):
        environ = dict(chosen)
        assert not use_gemms_without_workspace(environ) and environ == chosen
    assert EngineConfig.for_mode("graphs", device="cuda").workspace_free_gemms
    assert not EngineConfig.for_mode("graphs").workspace_free_gemms   # a CPU engine's ladder skips it
    with pytest.raises(ValueError, match="workspace_free_gemms needs a CUDA device"):
        EngineConfig(workspace_free_gemms=True)


def test_unpadded_gemms_are_a_compile_setting_of_the_gpu_ladder():
    assert EngineConfig.for_mode("compile", device="cuda").unpadded_gemms
    assert not EngineConfig.for_mode("fast").unpadded_gemms   # inductor pads no CPU GEMM: nothing to turn off
    assert not EngineConfig.for_mode("fused", device="cuda").unpadded_gemms
    with pytest.raises(ValueError, match="unpadded_gemms needs compile"):
        EngineConfig(unpadded_gemms=True)


# -- on the GPU -------------------------------------------------------------------------------

def gpu_config(mode: str, **kw) -> EngineConfig:
    return EngineConfig.for_mode(mode, **{"device": "cuda", "dtype": "bfloat16", **kw})


@pytest.mark.cuda
@pytest.mark.parametrize("input_stream", [False, True])
def test_a_warm_query_never_waits_for_the_device_while_it_queues_its_stages(input_stream):
    """The host queues a query's stages while the device runs the one before: a wait in between (a
    device tensor indexed with a list uploads the index and waits; so does a blocking copy) left the
    GPU idle from the end of the vision stage until the host had launched the prefill (5.1 ms of
    cudaStreamSynchronize in the H100 trace of a DROID query). Sync debug mode raises on each such
    wait; the timer's one wait at the end (torch.cuda.synchronize) is not one. Three entries in the
    4-row bucket (a padding row), their noise on the device and a known prefix, as PolicyEngine gives;
    the inputs in stream order and on the input stream."""
    engine = PolicyEngine(gpu_config("graphs", max_batch=4, input_stream=input_stream))
    engine.warmup()
    observations = [engine.dummy_observation(seed=i) for i in range(3)]
    observations[0].known_actions = np.zeros((4, engine.model_cfg.action.action_dim), np.float32)
    noise = torch.randn(3, 16, 8, device="cuda")
    known = engine.known_actions(observations)
    engine.static.predict(observations, noise, engine.layout, known)   # frames and instructions seen once
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = engine.static.predict(observations, noise, engine.layout, known)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3, 16, 8) and torch.isfinite(out).all()


@pytest.mark.cuda
def test_the_input_stream_changes_no_bit():
    """A query's input copies on their own stream against in stream order: the same actions bit for
    bit over queries of 1 to 3 entries whose instructions, states, noise and known prefixes all change
    (each copy lands after the last query's graphs read the buffer and before this one's prefill)."""
    engines = [PolicyEngine(gpu_config("graphs", max_batch=4, tuned_gemms=False, input_stream=beside))
               for beside in (False, True)]
    for engine in engines:
        engine.warmup()
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(6):
        observations = [engines[0].dummy_observation(seed=10 * i + j) for j in range(1 + i % 3)]
        for j, obs in enumerate(observations):
            obs.instruction = INSTRUCTIONS[(i + j) % len(INSTRUCTIONS)]
        if i % 2:
            observations[0].known_actions = np.full((2 + i, 8), 0.1 * i, np.float32)
        noise = torch.randn(len(observations), 16, 8, device="cuda", generator=g)
        plain, beside = (e.static.predict(observations, noise, e.layout, e.known_actions(observations))[0]
                         for e in engines)
        assert torch.equal(plain, beside), i


@pytest.mark.cuda
def test_gpu_preprocess_matches_cpu_within_one_uint8_step():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(4)]
    ref = preprocess_reference(images, 378)
    dev = resize_normalize(torch.from_numpy(np.stack(images)).cuda(), 378).cpu()
    assert (dev - ref).abs().max() * 127.5 <= 1.0


@pytest.mark.cuda
def test_chunks_denormalised_on_the_host_are_the_devices_bit_for_bit():
    """PolicyEngine denormalises each chunk on the host after one copy: the same fp32 ops as the
    model's denormalize_actions on the device, so the same actions."""
    engine = PolicyEngine(EngineConfig(device="cuda", seed=0))
    chunk = engine.predict(engine.dummy_observation())
    with torch.no_grad():
        on_device = engine.model.denormalize_actions(torch.from_numpy(chunk.normalized).cuda()).cpu().numpy()
    assert np.array_equal(chunk.actions, on_device)


@pytest.mark.cuda
def test_one_pass_embedding_is_the_models_on_the_gpu():
    """Compiled on the GPU at DROID's sizes (4 images of 196 tokens in a prompt of 945, width 2560),
    bit for bit against the four kernels it replaces (index_add's atomic bf16 adds included)."""
    from vla_node.runtime.fusion import embed_from_store

    weight, ids, store, frame_rows, positions, slot_image = embedding_case(
        torch.bfloat16, "cuda", batch=2, images=4, per_image=196, length=945, dim=2560, rows=17)
    got = torch.compile(embed_from_store, fullgraph=True, dynamic=False)(weight, ids, store.tokens, frame_rows,
                                                                         slot_image)
    assert torch.equal(got, embed_as_the_model(weight, ids, store, frame_rows, positions))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_epilogue_matches_the_two_pass_vit_mlp_on_the_gpu(dtype):
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(1152, 4304).cuda().to(dtype)
    x = torch.randn(4, 729, 1152, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = linear_gelu(x.float(), copy.deepcopy(fc1).float())  # fp32 sums, the tanh GELU
        got = linear_gelu_epilogue(x, fc1).float()
        two_pass = linear_gelu(x, fc1).float()
    err, err_two_pass = (got - ref).abs().max().item(), (two_pass - ref).abs().max().item()
    # the tanh GELU (erf's would be 5e-4 off), no worse than the two passes it replaces (one rounding, not two)
    assert err < (1e-4 if dtype == torch.float32 else 1.25 * err_two_pass + 1e-3), (err, err_two_pass)


@pytest.mark.cuda
# `fast` has rotary_kernel, add_norm_kernel, pattern_kernel and window_attention_ops
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])   # fp32: once NaN, once 4e-2 off
def test_fast_matches_eager_within_bf16_noise(dtype):
    eager = PolicyEngine(gpu_config("eager", dtype=dtype))
    fast = PolicyEngine(gpu_config("fast", dtype=dtype))
    fast.warmup()
    inputs = same_inputs(eager, 4)
    for a, b in zip(outputs(eager, inputs), outputs(fast, inputs)):
        # fp32 within 1e-4: a TF32 dot anywhere (4e-2 once, the flow loop's attention) fails it
        assert np.linalg.norm(b - a) / np.linalg.norm(a) < (1e-2 if dtype == "bfloat16" else 1e-4)


@pytest.mark.cuda
def test_fast_without_gemm_workspaces_matches_eager_within_bf16_noise():
    """torch sizes cuBLAS's workspace at a process's first GEMM: in a process of its own the fast
    engine's workspace_free_gemms is what every GEMM of the comparison above runs with."""
    env = {name: value for name, value in os.environ.items() if name not in NO_GEMM_WORKSPACE}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                          f"{__file__}::test_fast_matches_eager_within_bf16_noise[bfloat16]"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["graphs", "fast"])   # the flow loop on the compiled blocks, on the fused kernel
def test_inpainting_replays_one_graph_for_every_prefix_length(mode):
    """The flow loop with a known prefix is one more CUDA graph per bucket, captured in warm-up and
    replayed for every prefix length (nothing captured or compiled after warm-up); the prefix is
    kept exactly, and a query without one replays the plain loop's graph as before."""
    engine = PolicyEngine(gpu_config(mode))
    engine.warmup()
    captures = engine.stats.graph_captures
    obs = engine.dummy_observation()
    noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(0)).cuda()
    free = engine.predict(obs, noise=noise)
    for k in (1, 5, 12):
        obs.known_actions = free.actions[:k] + 0.05
        chunk = engine.predict(obs, noise=noise)
        known = engine.model.normalize_actions(torch.as_tensor(obs.known_actions).cuda()).cpu().numpy()
        assert np.array_equal(chunk.normalized[:k], known)
        assert not np.allclose(chunk.normalized[k:], free.normalized[k:])
    obs.known_actions = None
    assert np.array_equal(engine.predict(obs, noise=noise).normalized, free.normalized)
    assert engine.static.graph_captures == captures and engine.static.recompiles() == 0


@pytest.mark.cuda
def test_graph_replay_is_bit_stable():
    fast = PolicyEngine(gpu_config("fast"))
    fast.warmup()
    obs, noise = same_inputs(fast, 1)[0]
    first = fast.predict(obs, noise=noise).normalized
    for _ in range(49):
        assert np.array_equal(fast.predict(obs, noise=noise).normalized, first)


@pytest.mark.cuda
def test_interleaved_buckets_leave_each_other_alone():
    a_layout, b_layout = LAYOUTS["droid"], LAYOUTS["8img"]
    fast = PolicyEngine(gpu_config("fast", layout=a_layout, extra_layouts=(b_layout,)))
    fast.warmup()
    (obs_a, noise_a), = same_inputs(fast, 1)
    obs_b = fast.dummy_observation(b_layout, seed=9)
    first = fast.predict(obs_a, noise=noise_a).normalized
    for _ in range(3):
        fast.predict(obs_b, layout=b_layout)
        assert np.array_equal(fast.predict(obs_a, noise=noise_a).normalized, first)


@pytest.mark.parametrize("pattern", [False, True])
def test_flex_prefill_matches_the_dense_mask(pattern):
    """The prefill's attention pattern through flex attention (compiled, a block mask per bucket),
    or with `pattern` the full prefill and the streaming step as one Triton kernel (interpreted on
    the CPU), gives the dense-mask results:
    full windows, an episode's start, an instruction that types an image special token (the masks
    are rebuilt in place), and streaming steps (queries offset into the cache: flex or the kernel)."""
    opts = dict(vision_cache=True, streaming_kv=True)
    dense = PolicyEngine(EngineConfig.for_mode("ctxkv", **opts))
    flex = PolicyEngine(EngineConfig.for_mode("compile", flex_attention=True, pattern_kernel=pattern, **opts))
    kind = "PatternAttention" if pattern else "BlockMask"
    assert type(flex.static.bucket(flex.layout).attn_mask).__name__ == kind
    layout = flex.layout
    rng = np.random.default_rng(0)
    frames = {(c, t): rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for c in layout.cameras for t in range(4)}
    windows = [([(c, 0) for c in layout.cameras], "pick up the red cup"),             # an episode's start
               ([(c, t) for t in (0, 1) for c in layout.cameras], "pick up the red cup"),
               ([(c, t) for t in (1, 2) for c in layout.cameras], "pick up the red cup"),  # a streaming step
               ([(c, t) for t in (2, 3) for c in layout.cameras], "pick up the <im_patch> cup")]
    for ids, text in windows:
        obs = Observation(images=[frames[i] for i in ids], state=np.zeros(8, np.float32), instruction=text,
                          frame_ids=ids)
        noise = torch.randn(1, 16, 8)
        a, b = dense.predict(obs, noise=noise).normalized, flex.predict(obs, noise=noise).normalized
        assert np.abs(a - b).max() < 1e-5, (ids, text)
    assert flex.static.stream_steps == dense.static.stream_steps >= 1
    assert type(flex.static.bucket(flex.layout).stream.attn_mask).__name__ == kind


@pytest.mark.cuda
def test_page_locked_frames_upload_straight_from_the_caller_with_the_same_actions():
    """Frames in page-locked memory (the engine server's registered shared buffer; vla-bench's
    default) skip the copy into the staging buffer, and the query's actions are the same."""
    engine = PolicyEngine(gpu_config("fused"))
    obs = engine.dummy_observation()
    noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(0)).cuda()
    pageable = engine.predict(obs, noise=noise).normalized
    obs.images = [torch.from_numpy(image).pin_memory().numpy() for image in obs.images]
    staging = engine.static.staging
    staging.host.fill_(7)
    assert np.array_equal(engine.predict(obs, noise=noise).normalized, pageable)
    assert bool((staging.host == 7).all())   # nothing copied through it


@pytest.mark.cuda
def test_page_lock_registers_a_shared_frame_buffer_and_unregisters_it():
    import mmap
    import os

    from vla_node.runtime.preprocess import page_lock, page_unlock

    torch.cuda.synchronize()   # CUDA's context current on this thread, as the engine server's is
    fd = os.memfd_create("frames")
    shape = (2, 480, 640, 3)
    os.ftruncate(fd, int(np.prod(shape)))
    buffer = mmap.mmap(fd, 0)
    os.close(fd)
    pixels = np.ndarray(shape, dtype=np.uint8, buffer=buffer)
    assert not torch.from_numpy(pixels).is_pinned()
    assert page_lock(pixels) and torch.from_numpy(pixels).is_pinned()
    page_unlock(pixels)
    assert not torch.from_numpy(pixels).is_pinned()
    del pixels
    buffer.close()

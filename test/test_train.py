"""vla-train on recorded episodes (CPU smoke run): the official objective decreases on a fixed
batch, a run writes a checkpoint every engine mode loads, and a second run resumes it; a
--causal-images run writes a checkpoint the engine loads causal and streams; on a GPU, --compile's
steps follow the eager ones."""
import json

import numpy as np
import pytest
import torch

from optional import require_simulator
from vla_node.model import build_model, get_preset, init_random_, load_checkpoint
from vla_node.model.training import FlowTimeSampler, flow_matching_loss
from vla_node.runtime import EngineConfig, Observation, PolicyEngine
from vla_node.tools.train import main as train_main


def test_flow_times_follow_the_official_beta():
    torch.manual_seed(0)
    t = FlowTimeSampler()(20000, "cpu")
    assert 0 <= float(t.min()) and float(t.max()) <= 0.999
    assert float(t.mean()) == pytest.approx(0.999 / 2.5, abs=0.01)  # Beta(1, 1.5) has mean 1 / 2.5


def test_objective_decreases_on_a_fixed_batch():
    cfg = get_preset("tiny")
    model = init_random_(build_model(cfg)).train().requires_grad_(True)
    from vla_node.model.sequence import PromptBuilder
    from vla_node.model.tokenizer import load_tokenizer
    from vla_node.model.weights import TINY_TOKENIZER

    prompt = PromptBuilder(load_tokenizer(TINY_TOKENIZER), cfg).build(2, 2, "pick up the cube")
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2 * 4, 3, 98, 98, generator=g) * 2 - 1
    state, actions = torch.rand(2, 8, generator=g), torch.rand(2, 16, 8, generator=g)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 12:] = True
    t, noise = torch.tensor([0.2, 0.7]), torch.randn(2, 16, 8, generator=g)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(15):
        loss = flow_matching_loss(model, pixels, prompt, state, actions, pad, t, noise)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


@pytest.fixture(scope="module")
def demo_bags(tmp_path_factory):
    """Two short simulator episodes (failures kept): the bags every training run here reads."""
    require_simulator()
    from vla_node.sim.cli import main as sim_main

    bags = tmp_path_factory.mktemp("train") / "demos"
    assert sim_main(["record", str(bags), "--episodes", "2", "--workers", "1", "--ticks", "30", "--keep-failures"]) == 0
    return bags


def train_args(bags, out) -> list[str]:
    """A CPU run of a few batches of 2 (add --steps): one episode trains, the other is held out."""
    return ["--bags", str(bags), "--params", "config/sim.yaml", "--preset", "sim", "--out", str(out), "--batch", "2",
            "--val-episodes", "1", "--val-batches", "1", "--eval-every", "2", "--save-every", "2", "--device", "cpu",
            "--workers", "1"]


def test_training_run_writes_a_loadable_checkpoint_and_resumes(demo_bags, tmp_path):
    out = tmp_path / "policy"
    common = train_args(demo_bags, out)
    assert train_main(common + ["--steps", "2"]) == 0
    state = json.loads((out / "train_state" / "state.json").read_text())
    assert state["step"] == 2 and (out / "train_curves.png").is_file()
    assert (out / "model.safetensors").stat().st_size < 25e6
    assert train_main(common + ["--steps", "4", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 4
    assert [r["step"] for r in log if "val_loss" in r] == [2, 4]
    model = load_checkpoint(out)
    assert model.cfg.name == "sim" and float((model.action_stats[1] - model.action_stats[0]).min()) > 0
    engine = PolicyEngine(EngineConfig.for_mode("fused", checkpoint=str(out), camera_height=240, camera_width=320))
    assert engine.layout.cameras == ("exo", "wrist") and engine.history_offset_s == pytest.approx(0.16)
    obs = engine.dummy_observation()
    assert np.isfinite(engine.predict(obs).actions).all()


def test_weight_average_is_what_the_checkpoint_holds_and_resumes(demo_bags, tmp_path):
    """--ema-decay: the checkpoint holds the running average (not the last step's weights), the
    train state keeps both, and a resumed run continues the average it saved."""
    from safetensors.torch import load_file

    out = tmp_path / "ema"
    common = train_args(demo_bags, out) + ["--ema-decay", "0.5", "--lr", "1e-2", "--warmup", "1"]
    assert train_main(common + ["--steps", "2"]) == 0
    state = load_file(str(out / "train_state" / "state.safetensors"))
    names = [n for n, _ in build_model(get_preset("sim")).named_parameters()]
    saved = load_checkpoint(out).state_dict()
    i = next(j for j, name in enumerate(names) if name.endswith("action_in.weight"))
    own, average = state[f"param.{names[i]}"], state[f"ema.{i}"]
    assert not torch.equal(own, average)                                   # the steps moved off the average
    torch.testing.assert_close(saved[names[i]].float(), average.to(torch.bfloat16).float())
    assert train_main(common + ["--steps", "3", "--resume"]) == 0
    resumed = load_file(str(out / "train_state" / "state.safetensors"))
    assert int(state["ema_updates"]) == 2
    decay = min(0.5, (1 + 3) / (10 + 3))   # the resumed average's third update
    torch.testing.assert_close(resumed[f"ema.{i}"], average + (1 - decay) * (resumed[f"param.{names[i]}"] - average))


def test_weight_average_restores_the_model_after_use():
    from vla_node.tools.train import WeightAverage, averaged

    model = init_random_(build_model(get_preset("tiny")))
    average = WeightAverage(model, decay=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update(model)                  # first update: decay (1 + 1) / (10 + 1)
    w = 2 / 11
    with averaged(model, average):
        for p, b in zip(model.parameters(), before):
            torch.testing.assert_close(p.detach(), b + (1 - w))
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b + 1.0)


@pytest.mark.cuda
def test_compiled_steps_follow_the_eager_ones(demo_bags, tmp_path):
    """--compile compiles every window group on stand-in batches while the bags are read; its steps
    then move the weights as the eager steps do (bf16 autocast: the held-out loss after each step
    within 2 %)."""
    val = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        args = train_args(demo_bags, tmp_path / name) + ["--steps", "3", "--eval-every", "1", "--device", "cuda"]
        assert train_main(args + extra) == 0
        log = [json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        val[name] = [r["val_loss"] for r in log if "val_loss" in r]
    assert len(val["compiled"]) == 3
    np.testing.assert_allclose(val["compiled"], val["eager"], rtol=0.02)


def sliding_windows(engine: PolicyEngine, n: int):
    """Windows of frame times k and k + 1 (frames `stride` apart), k = 0 ... n - 1: each moves the
    last on by one frame time, the slide streaming_kv reuses. Frame time k's images are
    dummy_observation(seed=k)'s first ones, so a frame id always names the same image."""
    layout, base = engine.layout, engine.dummy_observation()
    cams = len(layout.cameras)
    for k in range(n):
        ids = [(c, t * layout.stride) for t in (k, k + 1) for c in layout.cameras]
        images = [image for t in (k, k + 1) for image in engine.dummy_observation(seed=t).images[:cams]]
        yield Observation(images=images, state=base.state, instruction=base.instruction, frame_ids=ids)


def test_causal_images_train_a_checkpoint_the_engine_loads_causal_and_streams(demo_bags, tmp_path):
    out = tmp_path / "causal"
    common = train_args(demo_bags, out)
    assert train_main(common + ["--steps", "2", "--causal-images"]) == 0
    assert json.loads((out / "config.json").read_text())["prompt"]["bidirectional_images"] is False
    # Continuing it under the other attention is refused before any bag is read.
    with pytest.raises(SystemExit, match="trained with causal image attention: run with --causal-images"):
        train_main(common + ["--steps", "4", "--resume"])
    with pytest.raises(SystemExit, match="trained with causal image attention"):
        train_main(train_args(demo_bags, tmp_path / "other") + ["--init", str(out / "model.safetensors")])
    # Fine-tuned to the other attention on purpose: its config says what it was trained with last.
    assert train_main(train_args(demo_bags, tmp_path / "other") + ["--steps", "1", "--init", str(out),
                                                                     "--init-other-attention"]) == 0
    assert json.loads((tmp_path / "other" / "config.json").read_text())["prompt"]["bidirectional_images"] is True

    options = dict(checkpoint=str(out), camera_height=240, camera_width=320, vision_cache=True)
    streamed = PolicyEngine(EngineConfig.for_mode("ctxkv", streaming_kv=True, **options))
    full = PolicyEngine(EngineConfig.for_mode("ctxkv", **options))
    bucket = streamed.static.bucket(streamed.layout)
    assert torch.equal(bucket.mask, bucket.mask.tril())     # no image token sees a later one
    a = streamed.model_cfg.action
    noise = torch.randn(1, a.horizon, a.action_dim, generator=torch.Generator().manual_seed(0))
    deviations = []
    for obs in sliding_windows(streamed, 5):
        s, f = streamed.predict(obs, noise=noise).normalized, full.predict(obs, noise=noise).normalized
        assert np.isfinite(s).all()
        deviations.append(float(np.abs(s - f).max()))
    assert streamed.static.stream_steps == 4
    assert deviations[0] < 1e-5     # the first window is a full prefill in both engines
    # Not exact under causal attention either (streaming.py): a surviving frame's keys/values were
    # computed with the evicted frames before it visible, under its old "Image <f> View <c>" label.
    # Measured max|dev| 0.24-0.33 of the normalised range on this 2-step checkpoint (0.23-0.26 on its
    # bidirectional twin; 0.06-0.11 with labels that do not change on a slide; 0.08-0.13 between
    # consecutive windows' own actions).
    assert min(deviations[1:]) > 1e-3

"""vla-train on recorded episodes (CPU smoke run): the official objective decreases on a fixed
batch, a run writes a checkpoint every engine mode loads, and a second run resumes it."""
import json

import numpy as np
import pytest
import torch

from optional import require_simulator
from vla_node.model import build_model, get_preset, init_random_, load_checkpoint
from vla_node.model.training import FlowTimeSampler, flow_matching_loss
from vla_node.runtime import EngineConfig, PolicyEngine
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


def test_training_run_writes_a_loadable_checkpoint_and_resumes(tmp_path):
    require_simulator()     # the episodes it trains on come from the simulator
    from vla_node.sim.cli import main as sim_main

    bags, out = tmp_path / "demos", tmp_path / "policy"
    assert sim_main(["record", str(bags), "--episodes", "2", "--workers", "1", "--ticks", "30", "--keep-failures"]) == 0
    common = ["--bags", str(bags), "--params", "config/sim.yaml", "--preset", "sim", "--out", str(out), "--batch", "2",
              "--val-episodes", "1", "--val-batches", "1", "--eval-every", "2", "--save-every", "2", "--device", "cpu",
              "--workers", "1"]
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

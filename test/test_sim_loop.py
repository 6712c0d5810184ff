"""The closed loop without DDS (vla-sim eval): chunks run on the ticks they were computed for,
through the node's Plan and SafetyFilter, with latency in sim time; and the command line writes
its report with a random-weight engine."""
import dataclasses
import json
import os
import time

import numpy as np
import pytest

from optional import require_simulator

require_simulator()

from vla_node.ros.control import latency_ticks  # noqa: E402
from vla_node.runtime import ActionChunk, Observation  # noqa: E402
from vla_node.sim import SIM_POLICY  # noqa: E402
from vla_node.sim.aloha import CONTROL_PERIOD_NS, EPISODE_START_NS, RenderConfig, TransferCube  # noqa: E402
from vla_node.sim.cli import DEFAULT_PARAMS, main  # noqa: E402
from vla_node.sim.closed_loop import ARM_JOINTS, ClosedLoop, ControlSettings, wilson_interval  # noqa: E402
from vla_node.sim.expert import expert_trajectory  # noqa: E402

HORIZON = 16


class ExpertReplay:
    """A policy that knows the scripted expert's commands: its chunk for an observation whose
    newest frame is from tick d holds the expert's commands for ticks d + 1 ... d + 16 (the
    node's convention). What the loop executes is then checkable tick for tick."""

    history_offset_s = 0.16  # the sim preset's: 8 ticks

    def __init__(self, seed: int):
        self.commands = expert_trajectory(seed)
        self.queried_ticks, self.images = [], []

    def reset_stream(self) -> None:
        self.queried_ticks, self.images = [], []

    def predict(self, obs: Observation) -> ActionChunk:
        tick = round((obs.stamp * 1e9 - EPISODE_START_NS) / CONTROL_PERIOD_NS)
        self.queried_ticks.append(tick)
        self.images.append(len(obs.images))
        actions = self.commands[np.clip(np.arange(tick + 1, tick + 1 + HORIZON), 0, len(self.commands) - 1)]
        return ActionChunk(actions=actions.astype(np.float32), normalized=actions, stamp=obs.stamp)


class Recording(TransferCube):
    def reset(self, seed):
        self.sent = []
        return super().reset(seed)

    def step(self, target):
        self.sent.append(np.array(target))
        return super().step(target)


@pytest.fixture(scope="module")
def settings():
    return ControlSettings.from_params_file(DEFAULT_PARAMS, camera_height=48, camera_width=64)


@pytest.fixture(scope="module")
def env(settings):
    with Recording(RenderConfig(settings.camera_names, 48, 64)) as sim:
        yield sim


@pytest.mark.parametrize("handover,latency_s", [("rtc", 0.0), ("rtc", 0.15), ("average", 0.15)])
def test_chunks_execute_on_the_ticks_they_were_computed_for(env, settings, handover, latency_s):
    policy = ExpertReplay(seed=2)
    loop = ClosedLoop(env, policy, dataclasses.replace(settings, handover=handover), latency_s=latency_s,
                      ticks=400, stop_on_success=False)
    result = loop.run(2)
    latency_ticks = max(1, int(np.ceil(latency_s / 0.02 - 1e-9)))
    # The first query goes out at the first tick with the current frames only (no history yet,
    # as the official wrapper); the chunk comes back latency_ticks later.
    assert policy.queried_ticks[0] == 0 and policy.images[0] == len(settings.camera_names)
    assert max(policy.images) == settings.history_frames * len(settings.camera_names)
    first_planned = latency_ticks + 1
    sent = np.stack(env.sent)
    # Until then the loop holds the start pose; from then on it sends the expert's commands
    # through the safety filter (which catches the arm up with the expert's, 0.2 rad per tick):
    # every chunk agrees with the plan it replaces, so no hand-over may change them.
    np.testing.assert_allclose(sent[:first_planned], np.broadcast_to(sent[0], (first_planned, 14)))
    expected = settings.safety().rollout(policy.commands[first_planned:], sent[first_planned - 1])
    np.testing.assert_allclose(sent[first_planned:], expected, atol=1e-6)
    assert np.abs(expected - policy.commands[first_planned:])[5:].max() < 1e-9   # caught up
    assert set(result.latency_ticks) == {latency_ticks}
    assert result.late_chunks == 0 and result.underruns == 0
    assert result.success and result.first_success_tick < 400
    # Queries come whenever replan_threshold actions remain: every 16 - 8 ticks.
    assert np.diff(policy.queried_ticks).max() <= HORIZON - settings.replan_threshold + latency_ticks
    assert result.step_at_boundary and result.step_inside


def test_a_chunk_slower_than_the_horizon_is_dropped_and_the_arm_holds(env, settings):
    loop = ClosedLoop(env, ExpertReplay(seed=1), settings, latency_s=0.4, ticks=60)
    result = loop.run(1)
    assert result.chunks == 0 and result.late_chunks >= 1
    sent = np.stack(env.sent)
    np.testing.assert_allclose(sent, np.broadcast_to(sent[0], sent.shape))


class Shifting(ExpertReplay):
    """ExpertReplay whose n-th chunk is 0.01 * n rad off on the arm joints (which chunk a command
    comes from shows), the first one slow (0.11 s measured: 6 ticks, the freeze of the next ten,
    which answer at once), recording each query's known prefix."""

    def reset_stream(self) -> None:
        super().reset_stream()
        self.known = []

    def predict(self, obs: Observation) -> ActionChunk:
        chunk = super().predict(obs)
        n = len(self.queried_ticks)
        chunk.actions[:, ARM_JOINTS] += 0.01 * n
        self.known.append(obs.known_actions)
        if n == 1:
            time.sleep(0.11)
        return chunk


def test_inpaint_publishes_the_old_plan_for_the_frozen_ticks_then_the_new_chunk_as_it_is(env, settings):
    """The inpaint hand-over in the closed loop: each query carries the old plan's actions for the
    ticks of the freeze; those ticks command exactly them, also the ones after the chunk arrived,
    and the next tick the new chunk's own action (no blend: the engine made it continue them)."""
    policy = Shifting(seed=2)
    loop = ClosedLoop(env, policy, dataclasses.replace(settings, handover="inpaint"), latency_s=None, ticks=100,
                      stop_on_success=False)
    result = loop.run(2)
    sent = np.stack(env.sent)
    assert policy.known[0] is None and result.late_chunks == 0
    frozen_ahead = 0
    # From the third query on (the arm caught up with the expert during the second chunk): the
    # request after tick d (the newest frame's step s = d - 1) knows steps s + 1 ... s + k.
    for n, (s, known, latency) in enumerate(zip(policy.queried_ticks, policy.known, result.latency_ticks), start=1):
        if n < 3:
            continue
        steps = np.arange(s + 1, s + 1 + len(known))
        old = policy.commands[steps].astype(np.float32)
        old[:, ARM_JOINTS] += 0.01 * (n - 1)
        np.testing.assert_array_equal(known, old)                # the old plan's actions ...
        np.testing.assert_array_equal(sent[steps], known)       # ... are what the frozen ticks commanded
        new = policy.commands[steps[-1] + 1].astype(np.float32)
        new[ARM_JOINTS] += 0.01 * n
        np.testing.assert_array_equal(sent[steps[-1] + 1], new)  # then the new chunk's
        frozen_ahead += len(known) > latency                     # frozen ticks after the chunk was taken
    assert frozen_ahead >= 4


class Poisoned(ExpertReplay):
    """ExpertReplay whose third chunk is all NaN."""

    def predict(self, obs: Observation) -> ActionChunk:
        chunk = super().predict(obs)
        if len(self.queried_ticks) == 3:
            chunk.actions[:] = np.nan
        return chunk


def test_a_non_finite_chunk_holds_the_arm_as_in_the_node(env, settings):
    """The node's control loop (loop.ControlLoop) in the simulator too: a chunk with NaN is dropped
    and holds ("output"): the plan is dropped, the command held, until the next chunk arrives.
    The simulator used to ignore it and run on the old plan."""
    latency_s, latency = 0.1, 5
    clean = ClosedLoop(env, ExpertReplay(seed=2), settings, latency_s=latency_s, ticks=120, stop_on_success=False)
    clean.run(2)
    moving = np.stack(env.sent)
    policy = Poisoned(seed=2)
    result = ClosedLoop(env, policy, settings, latency_s=latency_s, ticks=120, stop_on_success=False).run(2)
    sent = np.stack(env.sent)
    assert result.non_finite_chunks == 1 and result.holds == 1 and result.chunks >= 4
    taken = policy.queried_ticks[2] + 1 + latency    # the tick that took the NaN chunk (step index: tick - 1)
    np.testing.assert_array_equal(sent[:taken], moving[:taken])
    held = sent[taken:taken + latency]                # blocked from the next tick until a new chunk comes
    np.testing.assert_array_equal(held, np.broadcast_to(sent[taken - 1], held.shape))
    assert np.abs(moving[taken:taken + latency] - moving[taken - 1]).max() > 1e-3   # the clean run moves there


def test_wilson_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(45, 50)
    assert low == pytest.approx(0.786, abs=1e-3) and high == pytest.approx(0.957, abs=1e-3)
    assert wilson_interval(50, 50) == pytest.approx((0.929, 1.0), abs=1e-3)


def test_settings_come_from_the_node_params_file(settings):
    assert settings.camera_names == ("top", "angle") and settings.handover == "rtc"
    assert len(settings.joint_lower_limits) == 14
    from vla_node.sim.aloha import INSTRUCTION
    assert settings.instruction == INSTRUCTION
    with pytest.raises(ValueError, match="control_rate_hz"):
        ControlSettings.from_params_file(DEFAULT_PARAMS, control_rate_hz=30.0)
    assert ControlSettings.from_params_file(DEFAULT_PARAMS, handover="inpaint").handover == "inpaint"
    with pytest.raises(ValueError, match=r"handover must be one of \['rtc', 'average', 'inpaint'\], got 'blend'"):
        ControlSettings.from_params_file(DEFAULT_PARAMS, handover="blend")


def random_sim_checkpoint(folder):
    """Random weights of the tiny preset with the simulator's 14 joints as state and action."""
    from vla_node.model import build_model, get_preset, init_random_, save_checkpoint
    tiny = get_preset("tiny")
    config = dataclasses.replace(tiny, name="tiny-aloha",
                                 action=dataclasses.replace(tiny.action, action_dim=14, state_dim=14))
    return save_checkpoint(init_random_(build_model(config), 0), folder)


def test_an_episode_commands_the_same_whatever_ran_before_it(env, settings, tmp_path):
    """A policy's episode is a function of its seed: the engine's noise stream restarts with each
    episode, so `vla-sim eval` gives the same per-seed results however its workers share the seeds
    (and the ROS loop, one engine for every episode, the same as the engine-only loop)."""
    from vla_node.runtime import EngineConfig, PolicyEngine

    config = EngineConfig.for_mode("eager", checkpoint=str(random_sim_checkpoint(tmp_path / "policy")),
                                   layout=settings.layout, camera_height=48, camera_width=64)
    loop = lambda: ClosedLoop(env, PolicyEngine(config), settings, latency_s=0.04, ticks=30,  # noqa: E731
                              stop_on_success=False)
    alone = loop()
    alone.run(1001)
    first = np.stack(env.sent)
    after_another = loop()
    after_another.run(1000)
    after_another.run(1001)
    np.testing.assert_array_equal(np.stack(env.sent), first)


def test_eval_writes_success_latency_and_handover_per_config(tmp_path, capsys, monkeypatch):
    """Each configuration's success, latency and hand-over in the report, which is saved after each
    configuration with the speedups so far (a device call's time limit may end the list early)."""
    from vla_node.sim import eval as sim_eval

    saves, evaluate = [], sim_eval.evaluate
    monkeypatch.setattr(sim_eval, "evaluate", lambda args, save: evaluate(
        args, save=lambda report: (saves.append(json.loads(json.dumps(report))), save(report))))
    checkpoint = random_sim_checkpoint(tmp_path / "policy")
    report_path = tmp_path / "eval.json"
    code = main(["eval", "--checkpoint", str(checkpoint), "--configs", "eager,static", "--episodes", "1",
                 "--ticks", "40", "--latency-ms", "40", "--height", "48", "--width", "64",
                 "--json", str(report_path), "--video-dir", str(tmp_path / "videos")])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["seeds"] == [1000]
    for name in ("eager", "static"):
        entry = report["configs"][name]
        assert entry["success_rate"] == 0.0 and entry["episodes"] == 1     # random weights
        assert entry["success_ci95"][0] == 0.0 and 0.0 < entry["success_ci95"][1] < 1.0
        assert entry["predict_ms"]["n"] >= 2 and entry["chunks"] >= 1
        assert entry["latency_ticks"]["max"] == 2
        assert entry["handover"]["command_step_rad_at_boundaries"]["n"] >= 1
        assert entry["per_episode"][0]["seed"] == 1000
        assert (tmp_path / "videos").exists() and entry["per_episode"][0]["video"]
    assert "speedup_vs_first" in report["configs"]["static"]
    assert [list(saved["configs"]) for saved in saves] == [["eager"], ["eager", "static"]]
    assert saves[0]["configs"]["eager"]["speedup_vs_first"] == 1.0
    rows = capsys.readouterr().out.split("report: ")[0].strip().splitlines()[-3:]   # the closing table
    assert rows[0].split()[:3] == ["configuration", "latency", "success"]
    assert [row.split()[:5] for row in rows[1:]] == [["eager", "40.0", "ms", "(2", "ticks)"],
                                                     ["static", "40.0", "ms", "(2", "ticks)"]]
    assert all("0/1 (0 %)" in row for row in rows[1:])


def test_eval_counts_the_queries_that_streamed(tmp_path, capsys):
    """streaming_kv reuses KV only when consecutive windows share frames: here a query every frame
    interval (horizon 16 at replan_threshold 8: every 8 ticks; frames 0.16 s = 8 ticks apart). The
    shipped policy's horizon of 32 at the same threshold never shares one. The report and its
    table say how many queries streamed, so a streaming row that measured nothing shows 0."""
    params = tmp_path / "sim.yaml"
    params.write_text(DEFAULT_PARAMS.read_text().replace("history_offset_s: 0.0 ", "history_offset_s: 0.16"))
    report_path = tmp_path / "eval.json"
    code = main(["eval", "--checkpoint", str(random_sim_checkpoint(tmp_path / "policy")), "--params", str(params),
                 "--configs", "ctxkv,ctxkv:vision_cache=true:streaming_kv=true", "--episodes", "1", "--ticks", "40",
                 "--latency-ms", "40", "--height", "48", "--width", "64", "--json", str(report_path)])
    assert code == 0
    plain, streaming = json.loads(report_path.read_text())["configs"].values()
    assert plain["streamed"] == 0 and 1 <= streaming["streamed"] < streaming["queries"]   # the first one prefills
    rows = capsys.readouterr().out.split("report: ")[0].strip().splitlines()[-3:]
    assert rows[0].split()[-1] == "streamed"
    assert rows[1].split()[-1] == f"0/{plain['queries']}"
    assert rows[2].split()[-1] == f"{streaming['streamed']}/{streaming['queries']}"


def test_eval_fixes_the_latency_measured_alone_for_every_seed(tmp_path):
    """--latency-ms alone: one process times the first seed by itself, then every seed (here two
    workers) runs with that median fixed, and speedups come from the medians measured alone."""
    checkpoint = random_sim_checkpoint(tmp_path / "policy")
    report_path = tmp_path / "eval.json"
    code = main(["eval", "--checkpoint", str(checkpoint), "--configs", "eager,static", "--episodes", "2",
                 "--ticks", "30", "--latency-ms", "alone", "--workers", "2", "--height", "48", "--width", "64",
                 "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    for entry in report["configs"].values():
        alone = entry["latency_alone_ms"]
        assert alone["n"] >= 1 and entry["latency"] == pytest.approx(alone["p50"])
        ticks = latency_ticks(alone["p50"] / 1e3, CONTROL_PERIOD_NS / 1e9)
        taken = entry["latency_ticks"]   # none when a busy machine's median outlasts the 30 ticks
        assert taken["n"] == 0 or taken["mean"] == taken["max"] == ticks   # one fixed latency
    eager, static = report["configs"]["eager"], report["configs"]["static"]
    assert eager["threads_per_worker"] == [max(1, (os.cpu_count() or 1) // 2)]   # each worker its share of the cores
    speedup = eager["latency_alone_ms"]["p50"] / static["latency_alone_ms"]["p50"]
    assert static["speedup_vs_first"] == pytest.approx(speedup)


def test_eval_refuses_a_bad_configuration_before_any_runs(tmp_path, capsys):
    """The fifth of five configurations refused after four had run lost the speedups (seen on the
    H200): every one is checked first, the action cache against the checkpoint's flow steps."""
    report_path = tmp_path / "eval.json"
    code = main(["eval", "--configs", "eager,eager:action_cache=flashdrive", "--episodes", "1", "--ticks", "1",
                 "--json", str(report_path)])
    assert code == 1 and not report_path.exists()
    out, err = capsys.readouterr()
    assert "action cache 'flashdrive' is defined for 8 flow steps, not 10" in err and "loading" not in out


def test_eval_without_a_checkpoint_evaluates_the_shipped_policy(tmp_path):
    """`vla-sim eval` as a new user types it: the trained policy, not random weights (one query)."""
    report_path = tmp_path / "eval.json"
    code = main(["eval", "--episodes", "1", "--ticks", "1", "--height", "48", "--width", "64",
                 "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["checkpoint"] == str(SIM_POLICY)
    assert report["configs"]["eager"]["predict_ms"]["n"] == 1


def test_eval_takes_random_weights_only_when_asked(tmp_path, capsys):
    args = ["--episodes", "1", "--ticks", "5", "--json", str(tmp_path / "r.json")]
    assert main(["eval", "--random-weights", "--preset", "tiny", *args]) == 1   # the tiny preset's 8 joints
    assert "state_dim 8 and action_dim 8; the simulator has 14 joints" in capsys.readouterr().err
    assert main(["eval", "--preset", "tiny", *args]) == 1
    assert "--preset tiny picks the model of --random-weights" in capsys.readouterr().err
    assert main(["eval", "--random-weights", "--checkpoint", str(SIM_POLICY), *args]) == 1
    assert "--random-weights and --checkpoint exclude each other" in capsys.readouterr().err

"""The closed loop without DDS: the simulator, the node's chunk scheduler (vla_node.ros.control:
ChunkScheduler, with its plan and safety filter) and a policy called directly, in sim time.

Each control tick makes the node's control tick's decisions through the same ChunkScheduler:
publish the command for this tick (the plan's action, or hold the last command), take a chunk
whose inference has finished, and send the newest complete observation when at most
replan_threshold actions remain. The simulator then holds that command for the tick.

Inference latency is sim time: a request sent after tick d returns at tick d +
control.latency_ticks(latency, control period), where latency is the policy's measured wall time or
a fixed figure (latency_s), so hand-over modes compare under the latency a robot would see, on any
machine (the node's fixed_latency_s follows the same rule over ROS). The policy sees what the node
would: the window the node's picker forms (vla_node.runtime.windows: frame times history_offset_s
apart, only the newest ones while history does not exist yet at an episode's start), and the joint
state stamped at the newest frame.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import yaml

from ..ros.control import (
    HANDOVER_MODES,
    LATE,
    NON_FINITE,
    TAKEN,
    ChunkScheduler,
    Request,
    SafetyFilter,
    latency_ticks,
)
from ..ros.diagnostics import Faults, Key, NodeTelemetry
from ..ros.engine_protocol import Chunk
from ..ros.loop import QUIET, ControlLoop, Tick
from ..runtime.timeline import InputTimeline, Picked
from ..runtime.types import Observation, Policy, WindowLayout, history_offset
from ..runtime.windows import Wait, WindowSpec, frames_to_keep
from ..tools.stats import summary
from .aloha import CONTROL_PERIOD_NS, GRIPPERS, JOINT_NAMES, SimState, TransferCube
from .video import annotate

ARM_JOINTS = [j for j in range(len(JOINT_NAMES)) if j not in GRIPPERS]


@dataclass(frozen=True)
class ControlSettings:
    """The node parameters the loop follows, as in a vla_node params file."""
    camera_names: tuple[str, ...]
    camera_height: int
    camera_width: int
    history_frames: int
    history_offset_s: float             # 0: the policy's (its checkpoint's)
    wait_for_history: bool
    joint_names: tuple[str, ...]
    instruction: str
    control_rate_hz: float
    replan_threshold: int
    handover: str
    blend_steps: int
    average_weight: float
    joint_lower_limits: tuple[float, ...]
    joint_upper_limits: tuple[float, ...]
    max_step_per_tick: tuple[float, ...]

    @classmethod
    def from_params_file(cls, path: str | Path, **overrides) -> "ControlSettings":
        """The vla_node entry of a ROS 2 params file (`<name>: ros__parameters: ...`), with
        `overrides` (e.g. handover="average") on top."""
        document = yaml.safe_load(Path(path).read_text())
        entries = [v["ros__parameters"] for k, v in document.items() if k.split("/")[-1] == "vla_node"]
        if not entries:
            raise ValueError(f"{path}: no vla_node ros__parameters")
        values = {**entries[0], **overrides}
        missing = [f for f in cls.__dataclass_fields__ if f not in values]
        if missing:
            raise ValueError(f"{path}: parameters {missing} missing")
        kinds = {f: tuple if str(t).startswith("tuple") else None for f, t in cls.__annotations__.items()}
        settings = cls(**{f: tuple(values[f]) if kinds[f] else values[f] for f in cls.__dataclass_fields__})
        settings.check()
        return settings

    def check(self) -> None:
        rate = 1e9 / CONTROL_PERIOD_NS
        if abs(self.control_rate_hz - rate) > 1e-6:
            raise ValueError(f"control_rate_hz is {self.control_rate_hz:g}; the simulator steps at {rate:g} Hz")
        if tuple(self.joint_names) != JOINT_NAMES:
            raise ValueError(f"joint_names must be the simulator's {list(JOINT_NAMES)}")
        if self.handover not in HANDOVER_MODES:
            raise ValueError(f"handover must be one of {list(HANDOVER_MODES)}, got {self.handover!r}")

    @property
    def layout(self) -> WindowLayout:
        return WindowLayout(tuple(self.camera_names), self.history_frames)

    def safety(self) -> SafetyFilter:
        return SafetyFilter.of(self)


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    first_success_tick: Optional[int]
    max_reward: int
    ticks: int
    queries: int = 0
    streamed: int = 0             # queries whose LLM stage reused earlier frames' KV (streaming_kv)
    chunks: int = 0
    late_chunks: int = 0          # returned after their last action's tick: dropped, as in the node
    underruns: int = 0            # the plan ran out before the next chunk: held
    non_finite_chunks: int = 0    # NaN or inf among its actions: dropped, and the loop holds ("output"), as the node
    discarded: int = 0            # answers to a request from before a hold: stale, dropped
    holds: int = 0                # times the output fault held the loop
    predict_ms: list[float] = field(default_factory=list)
    latency_ticks: list[int] = field(default_factory=list)
    # Largest |command change| over the arm joints (rad) per tick: at the first tick of each new
    # plan (a chunk boundary) and at every other planned tick.
    step_at_boundary: list[float] = field(default_factory=list)
    step_inside: list[float] = field(default_factory=list)
    video: Optional[str] = None

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, list)}


class LatencyModel:
    """The engine port of the closed loop (loop.EnginePort): `policy` is run when an observation is
    submitted, and its answer is due latency_ticks(latency, control period) ticks later, latency
    being a fixed figure or the measured wall time of that prediction: inference latency in sim
    time."""

    serving = True

    def __init__(self, policy: Policy, instruction: str, latency_s: Optional[float], period_s: float):
        self.policy, self.instruction, self.latency_s, self.period_s = policy, instruction, latency_s, period_s
        self.predict_ms: list[float] = []
        self.streamed = 0   # queries the policy answered with a streaming step (if it counts them)
        self._answer: Optional[Chunk] = None
        self._wall_s = 0.0

    def submit(self, request_id: int, window: Picked, instruction: str,
               known_actions: Optional[np.ndarray]) -> bool:
        obs = Observation(images=[f.item for _, f in window.frames], state=window.state.astype(np.float32),
                          instruction=instruction, stamp=window.reference.stamp_ns / 1e9, frame_ids=window.frame_ids,
                          known_actions=known_actions)
        streamed = getattr(self.policy, "streamed_queries", 0)
        t0 = time.perf_counter()
        chunk = self.policy.predict(obs)
        self._wall_s = time.perf_counter() - t0
        self.streamed += getattr(self.policy, "streamed_queries", 0) - streamed
        self.predict_ms.append(self._wall_s * 1e3)
        self._answer = Chunk(request_id, chunk.actions, chunk.normalized, chunk.timings, predict_ms=self._wall_s * 1e3)
        return True

    def latency_ticks(self, request: Request) -> int:
        return latency_ticks(self._wall_s if self.latency_s is None else self.latency_s, self.period_s)

    def poll(self) -> Optional[Chunk]:
        return None     # every answer has a due tick: wait() takes it then

    def wait(self, request_id: int) -> Optional[Chunk]:
        answer, self._answer = self._answer, None
        return answer

    def reset_stream(self) -> None:
        self.policy.reset_stream()


class RenderedInputs:
    """The input port of the closed loop (loop.InputPort): the simulator's rendered frames and
    joint positions, through the InputTimeline the node and the bag reader use (every camera
    renders at each camera tick, with the joint state of that instant)."""

    def __init__(self, settings: ControlSettings, offset_s: float, rate_hz: float):
        layout = settings.layout
        spec = WindowSpec.of(layout.frames, offset_s, wait_for_history=settings.wait_for_history)
        self.timeline = InputTimeline(layout.cameras, JOINT_NAMES, spec, frames_to_keep(layout.frames, offset_s,
                                                                                         rate_hz))
        self.qpos: Optional[np.ndarray] = None

    def render(self, stamp_ns: int, images: dict, qpos: np.ndarray) -> None:
        for camera, name in enumerate(self.timeline.cameras):
            self.timeline.add_frame(camera, stamp_ns, images[name], stamp_ns)
        self.timeline.add_joint_states(stamp_ns, JOINT_NAMES, qpos, stamp_ns)

    def check(self, now_ns: int) -> bool:
        return False     # a simulation's stamps never step back within an episode

    def take_window(self, now_ns: int) -> Picked | Wait:
        picked = self.timeline.window()
        if not isinstance(picked, Wait):
            self.timeline.take(picked)
        return picked

    def not_sending(self) -> None:
        pass

    def measured(self) -> Optional[np.ndarray]:
        return self.qpos

    def release_window(self) -> None:
        pass


class Commands:
    """The sink of the closed loop (loop.Sink): the command of the tick goes to the simulator."""

    def command(self, command: np.ndarray) -> None:
        pass

    def trajectory(self, commands: Optional[np.ndarray]) -> None:
        pass


class ClosedLoop:
    """Runs episodes of `env` under `policy` with the node's control settings. latency_s None:
    each query's measured predict time is its latency; a number: every query takes that long."""

    def __init__(self, env: TransferCube, policy: Policy, settings: ControlSettings, latency_s: Optional[float] = None,
                 ticks: int = 400, camera_every: int = 1, stop_on_success: bool = True):
        if tuple(env.render_config.cameras) != tuple(settings.camera_names):
            raise ValueError(f"the simulator renders {env.render_config.cameras}, the policy's cameras are "
                             f"{settings.camera_names}")
        if (env.render_config.height, env.render_config.width) != (settings.camera_height, settings.camera_width):
            raise ValueError("the simulator's image size differs from camera_height x camera_width")
        settings.check()
        self.env, self.policy, self.settings = env, policy, settings
        self.latency_s = latency_s
        self.ticks, self.camera_every, self.stop_on_success = ticks, camera_every, stop_on_success
        self.safety = settings.safety()
        self.period_s = CONTROL_PERIOD_NS / 1e9

    def run(self, seed: int, video: Optional[list] = None) -> EpisodeResult:
        """One episode from env.reset(seed). `video`, a list, receives an annotated frame of the
        first camera at every camera tick."""
        s, env = self.settings, self.env
        offset_s = history_offset(s.history_offset_s, self.policy.history_offset_s)
        inputs = RenderedInputs(s, offset_s, 1e9 / CONTROL_PERIOD_NS / self.camera_every)
        engine = LatencyModel(self.policy, s.instruction, self.latency_s, self.period_s)
        faults = Faults(QUIET, on_change=lambda: None)
        telemetry = NodeTelemetry()
        loop = ControlLoop(ChunkScheduler(s, self.safety), engine, inputs, Commands(), faults, telemetry, lambda: s)
        engine.reset_stream()
        boundary_tick: Optional[int] = None
        state: SimState = env.reset(seed)
        result = EpisodeResult(seed, False, None, state.reward, 0)
        frame = None
        for step in range(self.ticks):
            if step % self.camera_every == 0:
                frame = env.render()
                inputs.render(state.stamp_ns, frame, state.qpos)
            inputs.qpos = state.qpos
            previous = loop.control.state.last_command
            tick = loop.tick(state.stamp_ns)
            boundary_tick = self._record(result, tick, previous, boundary_tick, loop)
            command = tick.command
            if video is not None and step % self.camera_every == 0:
                video.append(annotate(frame[s.layout.cameras[0]], tick.target if tick.target is None else command,
                                      state.qpos, JOINT_NAMES, np.asarray(s.joint_lower_limits),
                                      np.asarray(s.joint_upper_limits),
                                      f"seed {seed} t {step * self.period_s:.2f}s r{state.reward}"
                                      f"{' success' if state.success else ''}"))
            state = env.step(command)
            result.ticks = step + 1
            result.max_reward = max(result.max_reward, state.reward)
            if state.success and result.first_success_tick is None:
                result.success, result.first_success_tick = True, state.tick
                if self.stop_on_success:
                    break
        result.predict_ms, result.streamed = engine.predict_ms, engine.streamed
        result.discarded = telemetry.counts[Key.DISCARDED]
        result.holds = faults.events["output"]
        return result

    @staticmethod
    def _record(result: EpisodeResult, tick: Tick, previous: Optional[np.ndarray], boundary_tick: Optional[int],
                loop: ControlLoop) -> Optional[int]:
        """The tick's statistics; the tick of the newest plan's first action."""
        now = loop.control.state.tick
        result.underruns += tick.ran_out
        if tick.target is not None and previous is not None:
            step_rad = float(np.abs(tick.command - previous)[ARM_JOINTS].max())
            (result.step_at_boundary if now == boundary_tick else result.step_inside).append(step_rad)
        if tick.answered is not None:
            result.latency_ticks.append(now - tick.answered.tick)
            if tick.outcome == TAKEN:
                result.chunks += 1
                boundary_tick = loop.control.state.plan.start
            result.late_chunks += tick.outcome == LATE
            result.non_finite_chunks += tick.outcome == NON_FINITE
        result.queries += tick.sent is not None
        return boundary_tick


# -- statistics -----------------------------------------------------------------------------------
def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def percentiles(samples: Sequence[float]) -> dict:
    return summary(samples)


def summarize(results: Sequence[EpisodeResult]) -> dict:
    """Success rate with its 95 % interval, latency, and the command's step per tick at chunk
    boundaries against inside chunks, over episodes."""
    wins = sum(r.success for r in results)
    low, high = wilson_interval(wins, len(results))
    join = lambda name: [x for r in results for x in getattr(r, name)]  # noqa: E731
    boundary, inside = join("step_at_boundary"), join("step_inside")
    return {
        "episodes": len(results), "successes": wins, "success_rate": wins / max(1, len(results)),
        "success_ci95": [low, high],
        "predict_ms": percentiles(join("predict_ms")),
        "latency_ticks": percentiles(join("latency_ticks")),
        "handover": {
            "command_step_rad_at_boundaries": percentiles(boundary),
            "command_step_rad_inside_chunks": percentiles(inside),
            "boundary_p99_over_inside_p99": (float(np.percentile(boundary, 99) / max(np.percentile(inside, 99), 1e-12))
                                             if boundary and inside else None),
        },
        "queries": sum(r.queries for r in results), "streamed": sum(r.streamed for r in results),
        "chunks": sum(r.chunks for r in results), "late_chunks": sum(r.late_chunks for r in results),
        "underruns": sum(r.underruns for r in results),
        "per_episode": [r.summary() for r in results],
    }

"""Every tunable of the node: one table of declarations and one validation function.

The defaults are the embedded configuration (config/tiny.yaml spells them out). A parameter is
read-only when changing it needs a reload (the model, the camera set, the joint set); everything
that only steers the control loop can change at run time.

The engine's options are validated by building the EngineConfig the engine process receives
(engine_config): its rules are the engine's, stated once in runtime/types.py. A parameter named
like an EngineConfig field is passed to it as it is, so a new engine option is its EngineConfig
field and its entry in SPECS.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType, SetParametersResult
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.parameter import Parameter

from ..model.config import FRANKA_HIGH, FRANKA_LOW, PRESETS
from ..runtime.action_cache import FlowSchedule
from ..runtime.types import MODES, EngineConfig, WindowLayout
from ..runtime.windows import MAX_CAMERA_RATE_HZ, PANDA_JOINTS, STATE_SLOP_S, SYNC_SLOP_S
from .control import HANDOVER_MODES, latency_ticks

# Per 20 ms tick: ~2.5 rad/s for the arm joints, the full gripper range in 0.1 s.
PANDA_MAX_STEP = [0.05] * 7 + [0.2]

POSTPROCESS_MODES = ("checkpoint", "none")
STATE_SYNC_MODES = ("frame", "newest")

_TYPES = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
          float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}
_ARRAY_TYPES = {int: ParameterType.PARAMETER_INTEGER_ARRAY, float: ParameterType.PARAMETER_DOUBLE_ARRAY,
                str: ParameterType.PARAMETER_STRING_ARRAY}


@dataclass(frozen=True)
class Spec:
    default: Any
    description: str
    read_only: bool = False
    range: Optional[tuple] = None   # inclusive (low, high) for int and double parameters

    def type_error(self, name: str) -> str:
        """The sentence for a value of another type, at start-up (declare) and at run time (check_types)."""
        value = self.default
        if isinstance(value, list):
            return f"{name} must be a list of " + {int: "integers", float: "doubles", str: "strings"}[type(value[0])]
        # A whole number for a double is the usual slip: YAML, -p and `ros2 param set` read 15 as an integer.
        return f"{name} must be " + {bool: "true or false", int: "an integer", str: "a string",
                                     float: "a double, written with a decimal point (15.0, not 15)"}[type(value)]

    @property
    def type(self) -> Parameter.Type:
        return Parameter.Type.from_parameter_value(self.default)

    def descriptor(self, name: str) -> ParameterDescriptor:
        value = self.default
        kind = _ARRAY_TYPES[type(value[0])] if isinstance(value, list) else _TYPES[type(value)]
        d = ParameterDescriptor(name=name, type=kind, description=self.description, read_only=self.read_only)
        if self.range is not None:
            low, high = self.range
            if isinstance(value, float):
                d.floating_point_range = [FloatingPointRange(from_value=float(low), to_value=float(high))]
            else:
                d.integer_range = [IntegerRange(from_value=int(low), to_value=int(high))]
            d.additional_constraints = f"{low} <= value <= {high}"
        return d


SPECS: dict[str, Spec] = {
    # -- start-up --------------------------------------------------------------------------
    "autostart": Spec(False, "configure and activate at start-up instead of waiting for lifecycle transitions",
                      read_only=True),
    "exit_on_finalize": Spec(True, "after the shutdown transition (finalized) the process exits with code 0, and "
                                   "a launch with it; false: it stays, finalized, until Ctrl-C", read_only=True),
    # -- engine (a change needs a reload: read-only) ----------------------------------------
    "model_preset": Spec("tiny", "model preset used when no checkpoint is given (vla_node.model.PRESETS)",
                         read_only=True),
    "checkpoint": Spec("", "checkpoint folder (config.json + model.safetensors + tokenizer); empty: none, "
                           "configure fails unless random_weights is true", read_only=True),
    "random_weights": Spec(False, "with no checkpoint: random weights of model_preset (benchmarks, tests; a robot "
                                  "would move at random). Ignored when checkpoint is set", read_only=True),
    "engine_mode": Spec("eager", f"engine speed mode, each adding one lossless feature: {', '.join(MODES)}",
                        read_only=True),
    "device": Spec("cpu", "torch device of the engine, e.g. cpu or cuda:0", read_only=True),
    "dtype": Spec("float32", "model dtype: float32 or bfloat16", read_only=True),
    "seed": Spec(0, "seed of random weights and of the flow-matching noise", read_only=True, range=(0, 2**31 - 1)),
    "flow_steps": Spec(0, "flow-matching Euler steps; 0: the model's default", read_only=True, range=(0, 1000)),
    "max_instruction_tokens": Spec(96, "token budget of the chat turn holding the instruction: the longest it "
                                       "may be (the prompt pads to the smallest of it and instruction_tiers that "
                                       "holds it)", read_only=True, range=(1, 4096)),
    "instruction_tiers": Spec([48], "shorter token budgets of the instruction's chat turn, each a static bucket "
                                    "of its own (warm-up captures them all): a query runs in the smallest that holds "
                                    "its instruction. Values at or above max_instruction_tokens add none",
                              read_only=True),
    "engine_threads": Spec(1, "torch CPU threads of the engine process; 0: torch's default. One thread leaves "
                              "a core to the control loop on small machines", read_only=True, range=(0, 1024)),
    "engine_nice": Spec(10, "niceness added to the engine process, so the control loop wins the CPU",
                        read_only=True, range=(0, 19)),
    "engine_start_timeout_s": Spec(600.0, "longest wait for the engine to load and warm up during configure",
                                   read_only=True, range=(1.0, 7200.0)),
    "engine_restart_s": Spec(0.0, "when the engine process dies: hold, wait this long, start a new one and resume "
                                  "once it is warm (retried at this period); 0: off, cleanup + configure restart it",
                             range=(0.0, 3600.0)),
    "engine_server": Spec("", "socket path of a shared engine server (vla-engine-server) this node attaches to "
                              "instead of starting its own engine process; empty: its own", read_only=True),
    "streaming_kv": Spec(False, "opt-in: reuse surviving frames' LLM keys/values when the window slides by one "
                                "frame time (changes the actions; needs engine_mode fast)", read_only=True),
    "fp8": Spec("off", "opt-in: e4m3 LLM linears, off | rowwise | tensorwise (changes the actions; CUDA)",
                read_only=True),
    "action_cache": Spec("", "the engine's action-cache schedule (empty: every flow step computed; e.g. "
                             "flashdrive, 3-6:2, adaptive:0.05; see vla_node/runtime/action_cache.py); "
                             "changeable at run time"),
    # -- inputs (read-only: they shape the observation and the subscriptions) --------------
    "camera_names": Spec(["exo", "wrist"], "camera names in the model's layout order", read_only=True),
    # Input topics are relative: a node in namespace /robot1 listens to /robot1/joint_states, ...
    "camera_topics": Spec(["cameras/exo/image_raw", "cameras/wrist/image_raw"],
                          "one topic per camera, in camera_names order; a name ending in /compressed is a "
                          "sensor_msgs/CompressedImage (jpeg or png), otherwise sensor_msgs/Image",
                          read_only=True),
    "camera_height": Spec(480, "camera image height in pixels", read_only=True, range=(1, 8192)),
    "camera_width": Spec(640, "camera image width in pixels", read_only=True, range=(1, 8192)),
    "history_frames": Spec(2, "frames per camera in one observation: the newest and history_frames - 1 older",
                           read_only=True, range=(1, 16)),
    "history_offset_s": Spec(0.0, "seconds between the frame times of one observation (t, t - offset, ...), "
                                  "whatever the camera rate; 0: the checkpoint's (its obs_step_delta at its "
                                  "training control rate; 8/15 s for random weights)", read_only=True,
                             range=(0.0, 60.0)),
    "max_camera_rate_hz": Spec(MAX_CAMERA_RATE_HZ, "camera frame rate the frame buffer is sized for (the history "
                                                   "span at this rate); a faster camera's history is thinned evenly",
                               read_only=True, range=(1.0, 1000.0)),
    "joint_names": Spec(list(PANDA_JOINTS), "joints of the state and the action, in model order; joint states "
                                            "are assembled to this by name, from one message or several",
                        read_only=True),
    "joint_states_topic": Spec("joint_states", "sensor_msgs/JointState input", read_only=True),
    "instruction_topic": Spec("instruction", "std_msgs/String input; sets the instruction parameter",
                              read_only=True),
    "estop_topic": Spec("estop", "std_msgs/Bool input; true holds position until false", read_only=True),
    "publish_joint_command": Spec(False, "also publish each command as sensor_msgs/JointState on "
                                         "~/joint_command", read_only=True),
    # -- run time ---------------------------------------------------------------------------
    "instruction": Spec("pick up the red cup and put it in the bowl",
                        "the task in words; empty: hold until one arrives"),
    "control_rate_hz": Spec(50.0, "rate of ~/command; one chunk action per tick", range=(1.0, 1000.0)),
    "replan_threshold": Spec(8, "start the next inference when this many planned actions remain "
                                "(at most the model's horizon)", range=(1, 1024)),
    "postprocess": Spec("checkpoint", "action post-processing: checkpoint (its official deployment's, e.g. "
                                      "MolmoBot-DROID: gripper binarised at 128 to 0/255, arm moves from the measured "
                                      "joints scaled down so none exceeds 0.2 rad per tick) or none (raw actions); the "
                                      "safety limits apply after either"),
    "max_joint_delta_scale": Spec(1.0, "postprocess=checkpoint: factor on the checkpoint's largest move per joint and "
                                       "tick from the measured joints", range=(0.01, 100.0)),
    "handover": Spec("rtc", "chunk hand-over: rtc (keep the actions that run during the inference latency, "
                            "blend the rest), average (weighted average over the overlap) or inpaint (keep "
                            "them, and the model generates the new chunk from them: no blend)"),
    "blend_steps": Spec(4, "rtc: steps after the frozen ones over which the old plan fades out",
                        range=(0, 1024)),
    "average_weight": Spec(0.5, "average: weight of the new chunk over the overlap", range=(0.0, 1.0)),
    "wait_for_history": Spec(False, "false: while a history frame does not exist (episode start, a camera gap, "
                                    "a restarted timeline) send the newest frame times only, as the policy's own "
                                    "inference wrapper does; true: hold until every history frame exists"),
    "sync_slop_s": Spec(SYNC_SLOP_S, "largest stamp difference between frames of different cameras in one "
                                     "observation", range=(0.0, 10.0)),
    "state_sync": Spec("frame", "robot state given to the policy, assembled per joint by name across joint "
                                "state messages: frame (each joint's sample stamped nearest the observation's "
                                "newest frame, within state_slop_s) or newest (each joint's newest sample at "
                                "inference time, stamps ignored)"),
    "state_slop_s": Spec(STATE_SLOP_S, "state_sync frame: largest stamp difference between each joint's sample "
                                       "and the frame", range=(0.0, 10.0)),
    "input_timeout_s": Spec(0.5, "hold when a camera or the joint states are silent for longer",
                            range=(0.001, 60.0)),
    "fixed_latency_s": Spec(0.0, "simulation only (needs use_sim_time): every chunk is taken at the first control "
                                 "tick this long after its request, as if inference always took this long; the "
                                 "tick waits for a slower engine. With a simulator in lockstep (vla-sim run "
                                 "--lockstep) the closed loop is the same on any machine; 0: off, chunks are "
                                 "taken when they arrive", range=(0.0, 60.0)),
    "joint_lower_limits": Spec(list(FRANKA_LOW), "lower command limit per joint (joint_names order)"),
    "joint_upper_limits": Spec(list(FRANKA_HIGH), "upper command limit per joint (joint_names order)"),
    "max_step_per_tick": Spec(PANDA_MAX_STEP, "largest command change per control tick, per joint"),
}

MAX_INSTRUCTION_CHARS = 4096


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    """A validated, immutable snapshot of every parameter: the engine's options as the
    EngineConfig the engine process is built from, the node's own one by one."""
    engine: EngineConfig
    autostart: bool
    exit_on_finalize: bool
    random_weights: bool
    engine_mode: str
    engine_threads: int
    engine_nice: int
    engine_start_timeout_s: float
    engine_restart_s: float
    engine_server: str
    camera_names: tuple
    camera_topics: tuple
    camera_height: int
    camera_width: int
    history_frames: int
    history_offset_s: float
    max_camera_rate_hz: float
    joint_names: tuple
    joint_states_topic: str
    instruction_topic: str
    estop_topic: str
    publish_joint_command: bool
    instruction: str
    control_rate_hz: float
    replan_threshold: int
    postprocess: str
    max_joint_delta_scale: float
    handover: str
    blend_steps: int
    average_weight: float
    wait_for_history: bool
    sync_slop_s: float
    state_sync: str
    state_slop_s: float
    input_timeout_s: float
    fixed_latency_s: float
    joint_lower_limits: tuple
    joint_upper_limits: tuple
    max_step_per_tick: tuple

    @property
    def control_period_s(self) -> float:
        return 1.0 / self.control_rate_hz

    @property
    def fixed_latency_ticks(self) -> Optional[int]:
        """fixed_latency_s in control ticks (control.latency_ticks); None: off."""
        return latency_ticks(self.fixed_latency_s, self.control_period_s) if self.fixed_latency_s else None


def validate(values: Mapping[str, Any], horizon: Optional[int] = None) -> Settings:
    """The one place that decides whether a set of parameter values is usable: those of SPECS and
    rclpy's use_sim_time (false if absent). `horizon` is the loaded model's chunk length (None
    before configure). Raises SettingsError(reason)."""
    # Arrays arrive as lists, tuples or array.array (parameter services): compare them as tuples.
    v = {name: (x if isinstance(x, str) or not hasattr(x, "__len__") else tuple(x)) for name, x in values.items()}
    for name in ("model_preset", "engine_mode", "device", "dtype"):
        if not v[name].strip():
            raise SettingsError(f"{name} must not be empty")
    cameras, topics = v["camera_names"], v["camera_topics"]
    if not cameras or any(not c.strip() for c in cameras) or len(set(cameras)) != len(cameras):
        raise SettingsError(f"camera_names must be non-empty and unique, got {list(cameras)}")
    if len(topics) != len(cameras):
        raise SettingsError(f"camera_topics has {len(topics)} entries, camera_names {len(cameras)}")
    if any(not t.strip() for t in topics) or len(set(topics)) != len(topics):
        raise SettingsError(f"camera_topics must be non-empty and unique, got {list(topics)}")
    for name in ("joint_states_topic", "instruction_topic", "estop_topic"):
        if not v[name].strip():
            raise SettingsError(f"{name} must not be empty")
    joints = v["joint_names"]
    if not joints or any(not j.strip() for j in joints) or len(set(joints)) != len(joints):
        raise SettingsError(f"joint_names must be non-empty and unique, got {list(joints)}")
    for name in ("joint_lower_limits", "joint_upper_limits", "max_step_per_tick"):
        if len(v[name]) != len(joints):
            raise SettingsError(f"{name} has {len(v[name])} values, joint_names {len(joints)}")
        if not all(math.isfinite(x) for x in v[name]):
            raise SettingsError(f"{name} must be finite")
    bad = [j for j, lo, hi in zip(joints, v["joint_lower_limits"], v["joint_upper_limits"]) if not lo < hi]
    if bad:
        raise SettingsError(f"joint_lower_limits must be below joint_upper_limits; not for {bad}")
    if any(x <= 0 for x in v["max_step_per_tick"]):
        raise SettingsError("max_step_per_tick must be > 0 for every joint")
    if v["postprocess"] not in POSTPROCESS_MODES:
        raise SettingsError(f"postprocess must be one of {list(POSTPROCESS_MODES)}, got {v['postprocess']!r}")
    if v["handover"] not in HANDOVER_MODES:
        raise SettingsError(f"handover must be one of {list(HANDOVER_MODES)}, got {v['handover']!r}")
    if v["state_sync"] not in STATE_SYNC_MODES:
        raise SettingsError(f"state_sync must be one of {list(STATE_SYNC_MODES)}, got {v['state_sync']!r}")
    if len(v["instruction"]) > MAX_INSTRUCTION_CHARS:
        raise SettingsError(f"instruction has {len(v['instruction'])} characters, at most {MAX_INSTRUCTION_CHARS}")
    if horizon is not None and v["replan_threshold"] > horizon:
        raise SettingsError(f"replan_threshold {v['replan_threshold']} exceeds the model's horizon {horizon}")
    # rclpy enforces the descriptor ranges on declare and set; checked here too so that this
    # function alone decides, whoever calls it.
    for name, spec in SPECS.items():
        if spec.range is not None and not spec.range[0] <= v[name] <= spec.range[1]:
            raise SettingsError(f"{name}={v[name]} outside [{spec.range[0]}, {spec.range[1]}]")
    if v["fixed_latency_s"]:
        if not v.get("use_sim_time", False):
            raise SettingsError("fixed_latency_s needs use_sim_time: true (its control ticks wait for the engine: "
                                "on the wall clock a robot's commands would stall); set it to 0 on a robot")
        ticks = latency_ticks(v["fixed_latency_s"], 1.0 / v["control_rate_hz"])
        if horizon is not None and ticks >= horizon:
            raise SettingsError(f"fixed_latency_s {v['fixed_latency_s']:g} is {ticks} control ticks, not less than "
                                f"the model's horizon {horizon}: every chunk would arrive after its last action")
    return Settings(engine=engine_config(v), **{f.name: v[f.name] for f in fields(Settings) if f.name != "engine"})


# Parameters that shape the engine under another name or in another form than an EngineConfig
# field: engine_config() translates them. Every other parameter named like an EngineConfig field
# is passed to it as it is.
TRANSLATED = {"model_preset", "engine_mode", "checkpoint", "flow_steps", "camera_names", "history_frames"}


def engine_config(v: Mapping[str, Any]) -> EngineConfig:
    """The engine's configuration, as the engine process will build it: its construction is the
    validation (EngineConfig's rules), its ValueError the reason a value is refused."""
    same = {f.name: v[f.name] for f in fields(EngineConfig) if f.name in v and f.name not in TRANSLATED}
    try:
        config = EngineConfig.for_mode(v["engine_mode"], **same, preset=v["model_preset"],
                                       checkpoint=v["checkpoint"] or None, flow_steps=v["flow_steps"] or None,
                                       layout=WindowLayout(tuple(v["camera_names"]), frames=v["history_frames"]))
        # The flow steps a schedule must fit: a checkpoint's config.json may set others, and the
        # engine checks again when it loads.
        FlowSchedule.parse(config.action_cache, config.flow_steps or PRESETS[config.preset].action.flow_steps)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    return config


def declare(node) -> Settings:
    """Declare every parameter with its descriptor and return the validated start-up values.
    A start-up value (params file, -p) that rclpy refuses raises SettingsError with a sentence."""
    for name, spec in SPECS.items():
        try:
            node.declare_parameter(name, spec.default, spec.descriptor(name))
        except InvalidParameterTypeException:
            raise SettingsError(spec.type_error(name)) from None
        except InvalidParameterValueException:
            raise SettingsError(f"{name} must be within [{spec.range[0]}, {spec.range[1]}]") from None
    return validate(current_values(node))


class RefusedType(Parameter):
    """A change of the wrong type as check_types() hands it on: the parameter's current value, which
    passes rclpy's checks, and the sentence check_changes() refuses the change with."""

    def __init__(self, current: Parameter, reason: str):
        super().__init__(current.name, current.type_, current.value)
        self.reason = reason


def check_types(node, changes: list[Parameter]) -> list[Parameter]:
    """The node's pre-set callback. rclpy compares a change's type with the descriptor's before the
    on-set callback sees it and refuses it in its own words ("Wrong parameter type, expected '3'
    got '2'"); this runs before that comparison and turns a change of the wrong type into a
    RefusedType, which check_changes() refuses with the sentence start-up gives."""
    checked = []
    for p in changes:
        spec = SPECS.get(p.name)
        if spec is not None and p.type_ not in (spec.type, Parameter.Type.NOT_SET):
            p = RefusedType(node.get_parameter(p.name), spec.type_error(p.name))
        checked.append(p)
    return checked


def check_changes(node, changes: list[Parameter], horizon: Optional[int]) -> SetParametersResult:
    """The node's answer to a parameter change: validate() on its values with the changes."""
    refused = [p.reason for p in changes if isinstance(p, RefusedType)]
    if refused:
        return SetParametersResult(successful=False, reason="; ".join(refused))
    values = current_values(node)
    values.update({p.name: p.value for p in changes if p.name in values})
    try:
        validate(values, horizon=horizon)
    except SettingsError as e:
        return SetParametersResult(successful=False, reason=str(e))
    return SetParametersResult(successful=True)


def current_values(node) -> dict[str, Any]:
    """The values validate() decides on: every parameter of SPECS, and rclpy's use_sim_time."""
    return {name: node.get_parameter(name).value for name in (*SPECS, "use_sim_time")}

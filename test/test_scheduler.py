"""The control loop's decisions (vla_node.ros.control.ChunkScheduler) tick by tick, without DDS or
an engine: which action runs, when the next observation goes, which answers are taken. The node
and the simulator's closed loop run this class; test_node_* check the node around it over DDS."""
from dataclasses import dataclass

import numpy as np
import pytest

from vla_node.ros.control import (
    LATE,
    NON_FINITE,
    STALE,
    TAKEN,
    ChunkScheduler,
    PostProcess,
    SafetyFilter,
    latency_ticks,
)
from vla_node.runtime.windows import Wait

HORIZON, JOINTS = 8, 2


@dataclass
class Params:
    replan_threshold: int = 4
    handover: str = "rtc"
    blend_steps: int = 0
    average_weight: float = 0.5


def scheduler(**params) -> ChunkScheduler:
    return ChunkScheduler(Params(**params), SafetyFilter([-1e3] * JOINTS, [1e3] * JOINTS, [1e3] * JOINTS))


def chunk(value: float, horizon: int = HORIZON) -> np.ndarray:
    """[horizon, JOINTS] action i = value + i: which chunk and which of its actions runs shows."""
    return (value + np.arange(horizon, dtype=np.float64))[:, None].repeat(JOINTS, axis=1)


def run_tick(c: ChunkScheduler, blocked=None) -> np.ndarray:
    target, _ = c.next_tick(blocked)
    return c.command(target, np.zeros(JOINTS))


def send(c: ChunkScheduler):
    assert c.wants_observation()
    request = c.request()
    c.sent(request)
    return request


def answer(c: ChunkScheduler, request, actions) -> str:
    return c.take(c.answered(request.id), actions)


def test_a_chunk_runs_on_the_ticks_it_was_computed_for():
    c = scheduler()
    run_tick(c)                                  # tick 1: nothing planned, hold the measured joints
    assert c.state.hold == "waiting for a chunk"
    request = send(c)                            # sent after tick 1: action i is for tick 2 + i
    assert not c.wants_observation()             # one request in flight at a time
    for _ in range(3):
        run_tick(c)                              # ticks 2..4 hold
    assert answer(c, request, chunk(100.0)) == TAKEN   # collected at tick 4
    assert [run_tick(c)[0] for _ in range(4)] == [103.0, 104.0, 105.0, 106.0]   # ticks 5..8
    assert c.state.hold is None and list(c.state.latency_ticks) == [3]


@pytest.mark.parametrize("latency_s, ticks", [(0.0, 1), (0.001, 1), (0.02, 1), (0.021, 2), (0.04, 2), (0.15, 8)])
def test_a_latency_in_ticks_is_the_first_tick_at_least_that_long_after_the_request(latency_s, ticks):
    assert latency_ticks(latency_s, 0.02) == ticks


def test_a_fixed_latency_takes_the_chunk_at_its_due_tick_exactly():
    """fixed_latency_s (the node) and vla-sim eval --latency-ms: an answer that is there early is
    held back, and the due tick must take it, whenever the engine really finished."""
    c = scheduler()
    run_tick(c)                                  # tick 1
    request = c.request()
    c.sent(request, fixed_latency_ticks=3)       # due at tick 4
    for _ in range(2):
        run_tick(c)                              # ticks 2, 3: an answer there now waits
        assert c.answer_held_back() and c.due_request() is None
    run_tick(c)                                  # tick 4: this tick takes it, waiting if need be
    assert c.due_request() is request and not c.answer_held_back()
    assert answer(c, request, chunk(100.0)) == TAKEN
    assert c.due_request() is None and list(c.state.latency_ticks) == [3]
    assert run_tick(c)[0] == 103.0               # tick 5 runs action 3 (action i is for tick 2 + i)


def test_an_overdue_fixed_latency_answer_is_no_longer_waited_for():
    c = scheduler()
    run_tick(c)
    request = c.request()
    c.sent(request, fixed_latency_ticks=1)
    run_tick(c)
    assert c.due_request() is request
    c.answer_overdue()                           # the engine did not answer in the time allowed
    assert c.due_request() is None and not c.answer_held_back() and c.state.in_flight is request


def test_a_chunk_after_its_last_action_is_late_and_the_arm_holds():
    c = scheduler()
    run_tick(c)
    request = send(c)
    held = [run_tick(c) for _ in range(HORIZON + 1)]  # slower than the horizon
    assert answer(c, request, chunk(100.0)) == LATE
    assert c.state.plan.actions is None and c.wants_observation()
    np.testing.assert_array_equal(run_tick(c), held[-1])


def test_an_answer_to_a_request_from_before_a_reset_is_stale():
    """Deactivate and activate while a chunk is computed: its answer arrives after the reset,
    when the next request may already be in flight (the engine answers in order)."""
    c = scheduler()
    run_tick(c)
    before = send(c)
    c.reset()
    run_tick(c)
    after = send(c)
    assert c.answered(before.id) is None                     # not the request in flight ...
    assert c.take(None, chunk(100.0)) == STALE              # ... so its chunk is not taken
    assert c.state.in_flight is after and c.state.plan.actions is None
    assert answer(c, after, chunk(200.0)) == TAKEN
    assert after.id != before.id


def test_an_estop_drops_the_plan_and_the_chunk_in_flight():
    c = scheduler(replan_threshold=HORIZON)
    run_tick(c)
    answer(c, send(c), chunk(100.0))
    planned = run_tick(c)
    request = send(c)
    target, _ = c.next_tick("estop")
    assert target is None and c.state.hold == "estop" and c.state.plan.actions is None
    np.testing.assert_array_equal(c.command(target, np.zeros(JOINTS)), planned)   # holds the last command
    assert answer(c, request, chunk(300.0)) == STALE         # computed before the e-stop
    run_tick(c, "estop")
    run_tick(c)                                               # released: nothing resumes by itself
    assert c.state.hold == "waiting for a chunk" and c.wants_observation()
    assert answer(c, send(c), chunk(400.0)) == TAKEN
    assert run_tick(c)[0] == 400.0


def test_the_rtc_freeze_is_the_largest_recent_latency():
    """rtc keeps the old plan's actions for the ticks an inference takes; after a slow chunk the
    freeze stays that long for the next LATENCY_WINDOW chunks, even when the next one is fast."""
    c = scheduler(replan_threshold=100)
    run_tick(c)
    first = send(c)
    for _ in range(5):
        run_tick(c)
    assert answer(c, first, chunk(100.0, horizon=20)) == TAKEN   # latency 5 ticks: planned up to tick 21
    fast = send(c)                                           # after tick 6: action i for tick 7 + i
    assert fast.known_actions is None                        # only inpaint sends the plan along
    run_tick(c)                                              # tick 7
    assert answer(c, fast, chunk(500.0)) == TAKEN            # latency 1, but the freeze is 5
    ran = [run_tick(c)[0] for _ in range(6)]                 # ticks 8..13
    # Ticks before 7 + freeze keep the old plan; with a freeze of 1, tick 8 would run 501.
    assert ran == [106.0, 107.0, 108.0, 109.0, 505.0, 506.0]


def test_inpaint_sends_the_frozen_plan_with_the_request_and_runs_its_chunk_unblended_after_it():
    """inpaint: a request carries the planned actions for the ticks its inference may take (the
    rtc freeze), the chunk is generated to start with them; the old plan runs those ticks, the
    new chunk from the next one on, as it is (rtc would fade over blend_steps there)."""
    c = scheduler(replan_threshold=100, handover="inpaint", blend_steps=4)
    run_tick(c)
    first = send(c)
    assert first.known_actions is None                       # nothing planned yet
    for _ in range(5):
        run_tick(c)
    assert answer(c, first, chunk(100.0, horizon=20)) == TAKEN   # latency 5 ticks: 105 runs at tick 7
    fast = send(c)                                           # after tick 6
    assert fast.known_actions.dtype == np.float32
    np.testing.assert_array_equal(fast.known_actions, chunk(105.0, horizon=5))   # ticks 7..11
    run_tick(c)                                              # tick 7
    assert answer(c, fast, chunk(500.0)) == TAKEN            # latency 1: ticks 8..11 of the prefix are ahead
    ran = [run_tick(c)[0] for _ in range(6)]                 # ticks 8..13
    assert ran == [106.0, 107.0, 108.0, 109.0, 505.0, 506.0]


def test_a_non_finite_chunk_is_dropped_and_the_plan_kept():
    c = scheduler(replan_threshold=HORIZON)
    run_tick(c)
    answer(c, send(c), chunk(100.0))
    bad = chunk(200.0)
    bad[3, 1] = np.nan
    assert answer(c, send(c), bad) == NON_FINITE
    assert run_tick(c)[0] == 100.0


def test_lateness_counts_from_when_the_observation_was_due():
    c = scheduler()
    wait = Wait("waiting for camera 'wrist'", sync=False)
    run_tick(c)
    c.waiting(wait)
    for _ in range(4):
        run_tick(c)
        c.waiting(wait)
    assert c.state.hold == wait.reason
    request = send(c)
    assert (request.late_ticks, request.late_because) == (4, wait.reason)
    c = scheduler()
    run_tick(c)
    c.waiting(wait)
    run_tick(c)
    c.waiting(None)                                # a fault holds requests: not the inputs' delay
    run_tick(c)
    assert send(c).late_ticks == 0


def test_a_plan_that_runs_out_names_its_cause():
    """During a camera dropout the node said "inference slower than replan_threshold ticks allow"
    while inference took 14 ms."""
    c = scheduler(replan_threshold=1)
    dropout = Wait("camera 'wrist' has no frame within sync_slop_s of camera 'exo'", sync=True)
    run_tick(c)
    answer(c, send(c), chunk(0.0, horizon=3))      # planned for ticks 2..4
    runs_out = []
    for _ in range(4):
        runs_out.append(c.next_tick(None)[1])
        if c.wants_observation():
            c.waiting(dropout)
    assert runs_out == [False, False, False, True]
    assert c.underrun_cause() == f"no observation could be sent: {dropout.reason}"
    request = send(c)
    assert c.underrun_cause() == f"its observation was sent {request.late_ticks} ticks late: {dropout.reason}"
    for _ in range(3):
        c.next_tick(None)
    answer(c, request, chunk(0.0, horizon=1))
    c.next_tick(None)
    send(c)
    for _ in range(9):
        c.next_tick(None)
    assert c.underrun_cause() == "inference slower than replan_threshold ticks allow (in flight for 9 ticks)"


def test_commands_wait_for_a_measurement_then_are_post_processed_and_limited():
    c = ChunkScheduler(Params(), SafetyFilter([-1.0, 0.0], [1.0, 255.0], [0.1, 255.0]),
                       PostProcess(gripper_dims=(1,), gripper_threshold=128.0, gripper_values=(0.0, 255.0)))
    target, _ = c.next_tick(None)
    assert c.command(target, None) is None               # no joint state yet: nothing to hold
    np.testing.assert_array_equal(c.command(None, np.array([0.5, 0.0])), [0.5, 0.0])
    request = send(c)
    c.next_tick(None)
    c.command(None, np.array([0.5, 0.0]))
    assert answer(c, request, np.array([[0.0, 0.0], [5.0, 200.0], [5.0, 100.0]])) == TAKEN
    # Gripper binarised (200 -> 255), then the arm limited to 1.0 and 0.1 per tick.
    np.testing.assert_allclose(c.command(*c.next_tick(None)[:1], np.array([0.5, 0.0])), [0.6, 255.0])
    np.testing.assert_allclose(c.upcoming_commands(np.array([0.5, 0.0])), [[0.7, 0.0]])


def test_params_are_read_at_every_decision():
    params = Params(replan_threshold=2)
    c = ChunkScheduler(params, SafetyFilter([-1e3] * JOINTS, [1e3] * JOINTS, [1e3] * JOINTS))
    run_tick(c)
    answer(c, send(c), chunk(0.0))
    assert not c.wants_observation()
    params.replan_threshold = HORIZON
    assert c.wants_observation()

"""runtime/timeline.py's rule, message by message (the bags: test_timelines.py, test_windows.py)."""
from vla_node.runtime.timeline import REPEATED, RETURNED, STEPPED_BACK, InputTimeline, Picked
from vla_node.runtime.windows import WindowSpec

MS = 1_000_000
SPEC = WindowSpec(frames=2, offset_ns=100 * MS, sync_slop_ns=20 * MS, state_slop_ns=50 * MS)


def timeline():
    return InputTimeline(["a"], ["j"], SPEC, keep=50)


def feed(t, start_ms, end_ms, value=0.0, step_ms=10):
    """Frames every 30 ms and joint samples every 10 ms (value + stamp), in stamp order; the changes."""
    changes = []
    for ms in range(start_ms, end_ms, step_ms):
        changes.append(t.add_joint_states(ms * MS, ["j"], [value + ms / 1e3])[1])
        if ms % 30 == 0:
            changes.append(t.add_frame(0, ms * MS, f"frame {ms}"))
    return [c for c in changes if c is not None]


def test_a_joint_stamp_repeated_with_another_value_is_a_timeline_change_and_holds_a_history_span():
    t = timeline()
    assert feed(t, 0, 1000) == []
    assert t.add_joint_states(990 * MS, ["j"], [0.99])[1] is None          # the same sample again: no change
    change = t.add_joint_states(990 * MS, ["j"], [5.0])[1]
    assert change.rule == REPEATED and change.ambiguous and t.counts.timeline_restarts == 1
    feed(t, 1000, 1080, value=5.0)
    held = t.window()
    assert not isinstance(held, Picked) and held.lacks == "timeline"      # within a history span of it
    feed(t, 1080, 1400, value=5.0)
    window = t.window()
    assert isinstance(window, Picked) and min(f.stamp_ns for _, f in window.frames) >= (990 + 100) * MS


def test_another_sources_step_onto_the_new_timeline_is_the_same_change_and_drops_its_old_samples():
    t = timeline()
    feed(t, 0, 3000)
    change = t.add_frame(0, 1020 * MS, "new")                                # the camera steps back 2 s
    assert change.rule == STEPPED_BACK and change.back_ns == 1950 * MS and not change.ambiguous
    assert t.add_joint_states(2990 * MS + 5 * MS, ["j"], [9.0])[1] is None   # the joint's last old sample: kept
    assert t.add_joint_states(1020 * MS, ["j"], [1.02])[1] is None           # its own step: it joins
    assert t.counts.timeline_restarts == 1 and t.counts.old_timeline_dropped == 1
    assert feed(t, 1030, 1300) == []
    window = t.window()
    assert isinstance(window, Picked) and window.state.tolist() == [1.29]   # no old sample in it
    assert [f.item for _, f in window.frames][-1] == "frame 1290"


def test_a_source_stepping_back_and_forth_changes_the_timeline_each_time_without_a_new_fault():
    t = timeline()
    feed(t, 0, 3000)
    assert t.add_frame(0, 1020 * MS, "new").rule == STEPPED_BACK
    returned = t.add_frame(0, 3020 * MS, "old again")                      # back to the old timeline
    assert returned.rule == RETURNED and not returned.announce and [f.item for f in t.frames(0)] == ["old again"]
    assert t.add_frame(0, 1050 * MS, "new again").rule == STEPPED_BACK
    assert [f.item for f in t.frames(0)] == ["new again"] and t.counts.timeline_restarts == 3

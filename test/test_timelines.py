"""Two timelines interleaved (a recording across a simulation reset whose log order alternates
the old and the new timeline's messages for 2 s: sample_bag.InterleavedSpec), offline and live: no
observation mixes them (before runtime/timeline.py, offline replay mixed them in 70 of 214 queries
with the same stamps on both timelines and in 31 of 193 with the new clock 10 ms behind), and
observations come from both timelines."""
import numpy as np
import pytest

from vla_node.runtime import LAYOUTS
from vla_node.tools.bag_io import Bag, ObservationStream, resolve_inputs
from vla_node.tools.demo import NodeProcess, tiny_config
from vla_node.tools.live import LiveOptions, logged_observations, replay_live
from vla_node.tools.sample_bag import (
    JOINT_NAMES,
    START_NS,
    InterleavedSpec,
    interleaved_positions,
    timelines_of,
    write_interleaved_bag,
)

OFFSET_S = 8 / 15
LAYOUT = LAYOUTS["droid"]


def offline(path, **options):
    with Bag(path) as bag:
        stream = ObservationStream(bag, resolve_inputs(bag, LAYOUT.cameras), LAYOUT, OFFSET_S, **options)
        return list(stream), stream.stats


@pytest.fixture(scope="module", params=[0.0, 0.01, 2.0], ids=["same-stamps", "10ms-behind", "2s-behind"])
def bag(request, tmp_path_factory):
    spec = InterleavedSpec(back_s=request.param)
    path = tmp_path_factory.mktemp("interleaved") / "interleaved.mcap"
    return spec, path, write_interleaved_bag(path, spec)


def test_offline_replay_never_mixes_interleaved_timelines(bag):
    spec, path, truth = bag
    queries, stats = offline(path)
    used = [timelines_of(truth, q.observation.frame_ids, q.observation.state, q.state_stamps_ns) for q in queries]
    mixing = [q.observation.frame_ids for q, t in zip(queries, used) if len(t) != 1]
    assert not mixing, f"{len(mixing)} of {len(queries)} queries mix the timelines, e.g. {mixing[0]}"
    assert stats.timeline_restarts >= 1
    # The old timeline alone for reset_s, the new one alone for the last 2.5 s (less a history
    # span where the two cannot be told apart by their stamps): queries on both.
    assert [t.pop() for t in used].count(0) > 50 and sum(1 for q in queries if timelines_of(
        truth, q.observation.frame_ids, q.observation.state, q.state_stamps_ns) == {1}) > 40


def test_state_sync_newest_works_offline(bag):
    """state_sync newest (the node's parameter) offline: each query's state is the newest sample of
    every joint when its window completed, stamps 0."""
    spec, path, truth = bag
    queries, _ = offline(path, state_sync="newest")
    assert len(queries) > 90
    for q in queries:
        assert q.state_stamps_ns.tolist() == [0] * 8
        frame_timeline = {next(iter(truth[tuple(k)])) for k in q.observation.frame_ids}
        assert len(frame_timeline) == 1
        timeline = frame_timeline.pop()
        # the newest joint sample of that timeline when the window completed: near the frame's stamp
        t = q.stamp_ns / 1e9 - 1_700_000_000
        near = [interleaved_positions(timeline, round(t + dt, 2)) for dt in np.arange(-0.05, 0.06, 0.01)]
        assert min(np.abs(q.observation.state - n.astype(np.float32)).max() for n in near) < 1e-5


def add_preroll_samples(truth: dict, observations) -> None:
    """Until the node reacts, the live player publishes the bag's first joint states (timeline 0's,
    stamped START_NS) stamped with the wall clock before playback starts: the node may pair the
    first frames with such a sample, stamped before the bag's first on the bag's time base."""
    for _, _, stamps in observations:
        for name, stamp in zip(JOINT_NAMES, stamps.tolist()):
            if stamp < START_NS:
                truth[name, stamp] = truth[name, START_NS]


@pytest.mark.parametrize("back_s", [0.0, 0.01], ids=["same-stamps", "10ms-behind"])
def test_the_node_never_mixes_interleaved_timelines(tmp_path, back_s):
    """Live, through DDS into a `vla-node` process that logs every observation it sends (before
    runtime/timeline.py the node mixed the timelines in 14 of 46 observations with the same stamps
    on both, 2 of 41 with the new clock 10 ms behind)."""
    spec = InterleavedSpec(back_s=back_s)
    path = tmp_path / "interleaved.mcap"
    truth = write_interleaved_bag(path, spec)
    queries, _ = offline(path)
    size = {"camera_height": spec.size[0], "camera_width": spec.size[1]}
    with NodeProcess(tiny_config(), tmp_path / "node.log", size, ("--log-level", "vla_node:=debug")) as node:
        replay_live(LiveOptions(bag=path, out=tmp_path / "live", wait_s=120.0, abort_if=node.exited),
                    progress=lambda m: None)
    text = (tmp_path / "node.log").read_text()
    observations, hits = logged_observations(text, [q.stamp_ns for q in queries])
    assert len(observations) > 10 and hits >= len(observations) // 2
    add_preroll_samples(truth, observations)
    used = [timelines_of(truth, frames, state, stamps) for frames, state, stamps in observations]
    mixing = [frames for (frames, _, _), t in zip(observations, used) if len(t) != 1]
    assert not mixing, f"{len(mixing)} of {len(observations)} observations mix the timelines, e.g. {mixing[0]}"
    assert {0, 1} <= {t.pop() for t in used}
    assert "holding: timeline: " in text

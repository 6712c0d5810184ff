"""One engine for several nodes (vla-engine-server): each attached node gets what an engine of
its own would give it (the same actions for the same seed), a node with other engine parameters
is refused in one line, a node that dies mid-request or sends garbage loses only its own session,
and a server that is gone is an EngineError for every node attached to it. Queries that meet in
the batching window run as one batch and each answer says so; a malformed one is refused alone.
No ROS here; the nodes on a server are test_node_engine_server.py."""
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from ros_helpers import ROOT, EngineServer
from vla_node.ros.engine_process import EngineError, EngineProcess
from vla_node.ros.engine_protocol import WorkerOptions
from vla_node.runtime import EngineConfig, PolicyEngine

pytestmark = pytest.mark.timeout(300)

WORKER = WorkerOptions("eager", 1, 0)
# Long enough that two requests sent one after the other meet on any machine; a window is only
# waited out when an attached node sends nothing, which these tests never leave it to.
BATCH_WINDOW_MS = 1000.0


def attach(path: str, config: EngineConfig = EngineConfig()) -> EngineProcess:
    engine = EngineProcess(config, WORKER, server=path)
    engine.start(120, lambda _: None, lambda _: None, lambda: None)
    return engine


@pytest.fixture
def server(tmp_path):
    s = EngineServer(str(tmp_path / "engine.sock"))
    yield s
    s.stop()


def test_each_node_gets_what_an_engine_of_its_own_gives(server):
    config = EngineConfig(seed=3)
    own = EngineProcess(config, WORKER)   # a node's own engine process, with the same thread count
    own.start(120, lambda _: None, lambda _: None, lambda: None)
    obs = [PolicyEngine(config).dummy_observation(seed=s) for s in range(3)]
    expected = [own.predict(o).actions for o in obs]
    assert own.answer(own.request(obs[0])).batch_size == 1   # a node's own engine: batches of one
    own.close()
    a, b = attach(server.path, config), attach(server.path, config)
    other_seed = attach(server.path, EngineConfig(seed=4))
    try:
        assert a.info.pid == b.info.pid == server.proc.pid   # one engine
        for o, want in zip(obs, expected):   # interleaved: neither's noise stream moves the other's
            np.testing.assert_array_equal(a.predict(o).actions, want)
            other_seed.predict(o)
            np.testing.assert_array_equal(b.predict(o).actions, want)
        assert not np.array_equal(other_seed.predict(obs[0]).actions, expected[0])
    finally:
        for e in (a, b, other_seed):
            e.close()
    server.wait_for("session 2 ended (0 left)")


def test_a_node_with_another_engine_is_refused_in_one_line(server):
    a = attach(server.path)
    try:
        with pytest.raises(EngineError, match=r"runs another engine \(max_instruction_tokens 96 against 50\)"):
            attach(server.path, EngineConfig(max_instruction_tokens=50))
        assert a.predict(a_obs()).actions.shape == (16, 8)
    finally:
        a.close()


def a_obs():
    return PolicyEngine(EngineConfig()).dummy_observation()


CLIENT = """
import sys, time
from vla_node.ros.engine_process import EngineProcess
from vla_node.ros.engine_protocol import WorkerOptions
from vla_node.runtime import EngineConfig, PolicyEngine
e = EngineProcess(EngineConfig(), WorkerOptions("eager", 1, 0), server=sys.argv[1])
e.start(120, lambda _: None, lambda _: None, lambda: None)
obs = PolicyEngine(EngineConfig()).dummy_observation()
while True:   # requests it never waits for: killed with one under way
    e.predict(obs)
    print("answered", flush=True)
"""


def test_a_node_that_dies_mid_request_or_sends_garbage_loses_only_its_own_session(server):
    a = attach(server.path)
    obs = a_obs()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.path], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert client.stdout.readline().strip() == "answered"
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        server.wait_for("session 1 ended")
        assert a.predict(obs).actions.shape == (16, 8)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # not a message at all
        raw.connect(server.path)
        raw.sendall(b"\x00\x00\x00\x05hello")
        raw.close()
        garbage = attach(server.path)
        garbage._conn.send_bytes(b"not a pickle")
        server.wait_for("unreadable message")
        assert a.predict(obs).actions.shape == (16, 8)
        assert server.proc.poll() is None
    finally:
        client.kill()
        a.close()


def test_a_server_that_is_gone_is_an_engine_error_and_its_socket_is_removed(server):
    a, b = attach(server.path), attach(server.path)
    obs = a_obs()
    a.predict(obs)
    assert server.stop() == 0
    assert not os.path.exists(server.path)
    for e in (a, b):
        with pytest.raises(EngineError, match="closed the connection"):
            e.poll(5.0)
        e.close()
    with pytest.raises(EngineError, match=f"no engine server at {server.path} .* within 1 s"):
        EngineProcess(EngineConfig(), WORKER, server=server.path).start(1, lambda _: None, lambda _: None,
                                                                         lambda: None)


def test_a_node_started_before_its_server_waits_for_it(tmp_path):
    """A launch may start the server and the nodes together: configure waits for the socket."""
    path = str(tmp_path / "later.sock")
    engine = EngineProcess(EngineConfig(), WORKER, server=path)
    waits = []

    def waiting():
        waits.append(1)
        if len(waits) == 3:   # the node has waited a while: now the server comes
            waiting.server = EngineServer(path)

    try:
        info = engine.start(120, lambda _: None, lambda _: None, waiting)
        assert info.pid == waiting.server.proc.pid and engine.predict(a_obs()).actions.shape == (16, 8)
    finally:
        engine.close()
        waiting.server.stop()


@pytest.fixture
def batching(tmp_path):
    s = EngineServer(str(tmp_path / "batching.sock"), batch_window_ms=BATCH_WINDOW_MS)
    yield s
    s.stop()


def test_queries_that_meet_in_the_window_run_as_one_batch_and_get_what_each_gets_alone(batching):
    """Two nodes' Predicts sent together run as one query of two: both answers say so, and each
    is the node's own query alone (its observation, its noise stream: seed 3 and 4, on the first
    node's weights). A third node that leaves with its query in the batch is dropped; the other
    two get theirs."""
    reference = PolicyEngine(EngineConfig(seed=3))
    obs = [reference.dummy_observation(seed=s) for s in range(2)]
    obs[1].instruction = "open the drawer"   # another prompt length: padded in the batch
    streams = [torch.Generator().manual_seed(s) for s in (3, 4)]
    nodes = [attach(batching.path, EngineConfig(seed=3)), attach(batching.path, EngineConfig(seed=4))]
    leaving = None
    try:
        for size in (2, 3):
            if size == 3:
                leaving = attach(batching.path)
            requests = [node.request(o) for node, o in zip(nodes, obs)]
            if leaving is not None:
                leaving.request(obs[0])
                leaving._conn.close()   # gone, its query in the batch
            answers = [node.answer(r) for node, r in zip(nodes, requests)]
            threads = torch.get_num_threads()
            torch.set_num_threads(WORKER.threads)   # as the server's engine: only the batch reorders sums
            try:
                alone = [reference.predict(o, generator=stream).normalized for o, stream in zip(obs, streams)]
            finally:
                torch.set_num_threads(threads)
            for answer, want in zip(answers, alone):
                assert answer.batch_size == size and answer.batch_wait_ms >= 0.0
                assert np.abs(answer.normalized - want).max() < 1e-5
        batching.wait_for("session 2 ended (2 left)")
    finally:
        for node in nodes + ([leaving] if leaving is not None else []):
            node.close()


def test_a_malformed_request_in_the_window_is_rejected_and_the_others_are_answered(batching):
    good, bad = attach(batching.path), attach(batching.path)
    broken = a_obs()
    broken.state = np.zeros(7, np.float32)
    try:
        rejected, answered = bad.request(broken), good.request(a_obs())
        with pytest.raises(ValueError, match="state must have 8 values, got shape"):
            bad.answer(rejected)
        chunk = good.answer(answered)
        assert chunk.batch_size == 1 and np.isfinite(chunk.actions).all()
        assert batching.proc.poll() is None
    finally:
        good.close()
        bad.close()

"""One engine for several nodes (vla-engine-server): each attached node gets what an engine of
its own would give it (the same actions for the same seed), a node with other engine parameters
is refused in one line, a node that dies mid-request or sends garbage loses only its own session,
and a server that is gone is an EngineError for every node attached to it. No ROS here; the
nodes on a server are test_node_engine_server.py."""
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from ros_helpers import ROOT, EngineServer
from vla_node.ros.engine_process import EngineError, EngineProcess
from vla_node.ros.engine_protocol import WorkerOptions
from vla_node.runtime import EngineConfig, PolicyEngine

pytestmark = pytest.mark.timeout(300)

WORKER = WorkerOptions("eager", 1, 0)


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

"""How the suite keeps to itself: each test module runs in a ROS domain taken from VLA_TEST_DOMAINS
(else 30..101), never in the ROS_DOMAIN_ID it was started with (a robot's), and never in one that
another test run on this machine holds."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vla_node.tools import node_process
from vla_node.tools.node_process import MAX_DOMAIN, claim_ros_domain, ros_domain, ros_domains

ROOT = Path(__file__).resolve().parents[1]


def test_a_domain_range_is_honoured_without_the_domain_the_suite_started_in():
    assert ros_domains("40-43", exclude=None) == [40, 41, 42, 43]
    assert ros_domains("40-43", exclude="42") == [40, 41, 43]
    assert ros_domains("45", exclude=None) == [45]
    assert ros_domains("", exclude="31") == [d for d in range(30, 102) if d != 31]


@pytest.mark.parametrize("spec", ["forty", "60-40", "40-300", "-5"])
def test_a_malformed_range_is_refused_with_a_sentence(spec):
    with pytest.raises(ValueError, match="expected a range of ROS domains such as 40-60"):
        ros_domains(spec, exclude=None)


def test_a_range_holding_only_the_robots_domain_is_refused():
    with pytest.raises(ValueError, match="holds only ROS_DOMAIN_ID 45"):
        ros_domains("45", exclude="45")


def test_ros_domain_picks_from_the_environments_range(monkeypatch):
    monkeypatch.setenv("VLA_TEST_DOMAINS", "50-52")
    monkeypatch.setattr(node_process, "STARTED_IN_DOMAIN", None)
    assert {ros_domain(seed) for seed in range(50)} == {"50", "51", "52"}


def test_runs_on_one_machine_never_claim_the_same_domain(monkeypatch, tmp_path):
    monkeypatch.setenv("VLA_TEST_DOMAINS", "50-51")
    monkeypatch.setattr(node_process, "DOMAIN_LOCKS", tmp_path)
    first, first_claim = claim_ros_domain()
    second, second_claim = claim_ros_domain()
    assert {first, second} == {"50", "51"}
    with pytest.raises(RuntimeError, match="claimed by another test run on this machine"):
        claim_ros_domain()
    first_claim.close()            # the run ended: its domain is free again
    again, again_claim = claim_ros_domain(avoid=second)
    assert again == first
    second_claim.close()
    again_claim.close()


def test_this_module_runs_in_a_domain_it_may_take():
    # conftest.py chose it; the test below runs this one in a suite given a range and a robot's domain.
    assert int(os.environ["ROS_DOMAIN_ID"]) in ros_domains()
    assert os.environ["ROS_DOMAIN_ID"] != node_process.STARTED_IN_DOMAIN


def test_a_suite_started_beside_a_robot_keeps_to_its_range_and_off_the_robots_domain():
    # A range of two: the robot's domain and one the child may take, both outside the range this run's
    # modules claim theirs from. A module holds its claim while it runs: this one's, or under `make test`
    # (two workers) the other worker's, took the child's one domain (1 run in 72 each; CI saw the second).
    claimed = ros_domains()
    low = max(claimed) + 1 if max(claimed) + 2 <= MAX_DOMAIN else min(claimed) - 2
    env = dict(os.environ, VLA_TEST_DOMAINS=f"{low}-{low + 1}", ROS_DOMAIN_ID=str(low))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test/test_suite_isolation.py::test_this_module_runs_in_a_domain_it_may_take"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]

"""The vla-node entry point: the node (node.VLANode) on its executor, from start to a bounded end."""
from __future__ import annotations

import faulthandler
import gc
import signal
import sys

import rclpy
from rclpy.executors import ExternalShutdownException

from . import params
from .executor import TransitionsApartExecutor
from .node import VLANode

# Ctrl-C and SIGTERM end the node, its engine process and its threads in seconds on a busy
# machine (1.0-1.9 s beside three busy loops, 2.3 s when the engine's STOP_GRACE_S runs out;
# BENCHMARKS.md, "CI under load"). Whatever hangs until this timeout (a DDS participant's
# teardown), the process ends then with every thread's stack on stderr and exit code 1, rather
# than never (main is the entry point: this covers the interpreter's exit too).
SHUTDOWN_TIMEOUT_S = 10.0


def main(args=None) -> int:
    # A crash in native code (rcl, Fast DDS) prints every thread's Python stack to stderr, where
    # the process would otherwise end with -11 and nothing said (once seen at Ctrl-C in CI).
    faulthandler.enable()
    # SIGTERM (systemd, docker stop, a launch file's escalation) ends the node as Ctrl-C does, also
    # while configure loads the model. rclpy's own handler, installed by init, shuts the context
    # down and then calls this one.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rclpy.init(args=args)
    node = executor = None
    try:
        node = VLANode()
        executor = TransitionsApartExecutor(node.transition_entities())
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except params.SettingsError as e:
        print(f"vla_node: invalid parameters: {e}", file=sys.stderr)
        return 1
    except Exception:
        # Ctrl-C shuts the context down from rclpy's signal handler, also in the middle of a
        # callback, whose next publish then fails: that is the end that was asked for.
        if rclpy.ok():
            raise
    finally:
        # Ctrl-C also raises KeyboardInterrupt here, and it can come after spin has ended on the
        # shutdown: it must not cut the release of the engine short (bounded: the engine process
        # is killed after a timeout).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        faulthandler.dump_traceback_later(SHUTDOWN_TIMEOUT_S, exit=True)
        if executor is not None:     # a transition under way ends first (a configure: within READY_POLL_S)
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
        # Activation froze every object alive then (gc.freeze): unless they are collected now,
        # the ROS context among them is never destroyed, and neither is its DDS participant,
        # which then leaves its shared memory behind in /dev/shm.
        node = executor = None
        gc.unfreeze()
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())

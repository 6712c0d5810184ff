"""The node's executor: rclpy's single-threaded one, except that lifecycle transitions run on a
thread of their own (after ros2/examples' rclpy/executors custom_executor.py).

Why: configure waits for the engine process to load and warm up (20-45 s on a GPU). On the
spinning thread that wait blocks every callback, so `ros2 lifecycle get`, a lifecycle manager's
state query and the parameter services time out. A transition's callback runs in the node's
default callback group like the control loop, the subscriptions and the timers, so while it runs
on its thread none of those runs (one callback at a time, as on a single thread); the services
that only read (VLANode answers them from a group of their own) keep answering on the spinning
thread. Why not rclpy's MultiThreadedExecutor: it hands every callback to a pool thread, which on
the 2-core VM made the control loop's median period jitter 0.24-0.36 ms, against 0.04-0.13 ms with
the single-threaded executor and 0.07-0.11 ms with this one (vla-node-bench --only node, 30 s
each, 2-3 runs of each side by side); here the control loop runs on the spinning thread as
before.
"""
from __future__ import annotations

import functools
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.executors import ConditionReachedException, Executor, ShutdownException, TimeoutException
from rclpy.task import Task


class TransitionsApartExecutor(Executor):
    """Runs every callback on the thread that spins, except those of `apart` (the entities whose
    callbacks run lifecycle transitions), which run one at a time on a thread of their own."""

    def __init__(self, apart: Iterable, **kwargs):
        super().__init__(**kwargs)
        self._apart = list(apart)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vla_node_transition")
        self._transition: Optional[Task] = None     # the transition under way, or the last one

    def spin_once(self, timeout_sec: Optional[float] = None) -> None:
        try:
            handler, entity, _ = self.wait_for_ready_callbacks(timeout_sec=timeout_sec)
        except (ShutdownException, TimeoutException, ConditionReachedException):
            pass
        else:
            if any(entity is e for e in self._apart):
                self._transition = handler
                self._thread.submit(handler)
            else:
                handler()
                handler.result()    # raise any exception
        if self._transition is not None and self._transition.done():
            transition, self._transition = self._transition, None
            transition.result()     # raise any exception, on the spinning thread

    def shutdown(self, timeout_sec: Optional[float] = None) -> bool:
        """Stop, and wait for the transition under way (configure ends its wait when the context
        shuts down)."""
        done = super().shutdown(timeout_sec)
        self._thread.shutdown(wait=True)
        return done


def transition(callback):
    """A lifecycle callback of `node`: run under `node.teardown` (destroy_node, at main's end on the
    spinning thread, waits for a transition under way: a release in the middle of configure's spawn
    of the engine process would leave that process running), its exception logged with the
    traceback (rclpy turns it into errorprocessing without a word)."""
    @functools.wraps(callback)
    def run(node, state):
        with node.teardown:
            try:
                return callback(node, state)
            except Exception:
                node.get_logger().error(f"{callback.__name__} raised:\n{traceback.format_exc()}")
                raise
    return run


# rclpy's services whose callbacks only read: they answer from their own callback group (VLANode).
ANSWERED_APART = ("get_state", "get_available_states", "get_available_transitions", "get_transition_graph",
                  "get_parameters", "get_parameter_types", "describe_parameters", "list_parameters",
                  "get_type_description")


def answer_apart(node, names: tuple[str, ...]) -> None:
    """Move the node's rclpy services of these names into a callback group of their own."""
    group = ReentrantCallbackGroup()
    for service in node.services:
        if service.srv_name.rsplit("/", 1)[-1] in names:
            service.callback_group = group
            group.add_entity(service)

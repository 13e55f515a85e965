"""What the gateway reports of its generation step: the step counter, the lengths (and
sample groups) completed in it, the token rate and the KV use of its instances.

A new step starts when a request arrives at an idle node (the RL loop's rollout of the
next step); the controller's compute planner reads these figures through telemetry.
Pure bookkeeping: time is an argument.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from node_agent.engines.base import InstanceLoad

RATE_WINDOW_S = 2.0


class StepFigures:
    def __init__(self) -> None:
        self.step = 0
        self.completed: list[int] = []
        self.completed_groups: list[str] = []  # parallel to completed
        self.idle = True
        self.tokens_total = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()

    def arrive(self) -> None:
        """A request arrives: after an idle node, a new generation step starts."""
        if self.idle:
            self.idle = False
            if self.completed:
                self.step += 1
                self.completed = []
                self.completed_groups = []

    def complete(self, length: int, group: str) -> None:
        self.completed.append(length)
        self.completed_groups.append(group)

    def groups(self) -> tuple[str, ...]:
        """The completed requests' groups, or () when none had one."""
        return tuple(self.completed_groups) if any(self.completed_groups) else ()

    def rate(self, now: float) -> float:
        """Tokens per second over the last ``RATE_WINDOW_S`` (at least two readings)."""
        marks = self._marks
        marks.append((now, self.tokens_total))
        while len(marks) > 2 and now - marks[1][0] >= RATE_WINDOW_S:
            marks.popleft()
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def kv_usage(instances: Iterable[tuple[int, InstanceLoad, int, int]]) -> float:
    """The instances' KV use (``(tp, load, calls, max_num_seqs)`` each) weighted by their
    TP degree (their share of the GPUs); an engine that does not report it counts its
    share of seats in use instead."""
    total = used = 0.0
    for tp, load, calls, seats in instances:
        total += tp
        if load.kv_usage is not None:
            used += tp * load.kv_usage
        elif seats:
            used += tp * calls / seats
    return min(1.0, used / total) if total else 0.0

"""When the compute planner re-plans proactively: at step start and then at a fixed
interval, the simulator's ``replan_interval_s`` (the cadence its results are measured at).

Between re-plans, reactive balancing (:func:`scheduler.compute.balance`) handles
stragglers. The points are not fractions of the plan's predicted step: that prediction
comes from the performance model, and where the model does not describe the hardware
(engines on a CPU, another GPU, a miscalibrated model) every point falls early and the
rest of the step is never re-planned. Pure: the caller passes the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrrl import errors

MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 3600.0


def check_seconds(value: float, field: str) -> float:
    """An interval of the scheduling loop, in seconds; the error names ``field``."""
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and MIN_INTERVAL_S <= value <= MAX_INTERVAL_S
    ):
        raise errors.field_error(
            field, value, f"seconds between {MIN_INTERVAL_S} and {MAX_INTERVAL_S:g}"
        )
    return value


@dataclass(frozen=True)
class ReplanSchedule:
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        check_seconds(self.interval_s, "replan_interval_s")

    def due(self, *, step_started_at: float, now: float, last_plan_at: float | None) -> bool:
        """Whether to re-plan now: no plan yet in this step, or the interval has passed
        since the last one."""
        if last_plan_at is None or last_plan_at < step_started_at:
            return now >= step_started_at
        return now - last_plan_at >= self.interval_s

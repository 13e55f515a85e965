"""When the compute planner re-plans proactively: at step start and at regular points.

The points are fractions of the step's predicted duration (the latest plan's
prediction of when the step ends), so re-plans get denser in absolute time when steps
are short and land where the batch changes shape: early (wide batch) and late (the long
tail). Between re-plans, reactive balancing (:func:`scheduler.compute.balance`) handles
stragglers. Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrrl import errors


@dataclass(frozen=True)
class ReplanSchedule:
    fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.7, 0.85, 0.95)
    min_interval_s: float = 2.0  # never re-plan more often than this

    def __post_init__(self) -> None:
        if not self.fractions or any(not 0.0 <= f < 1.0 for f in self.fractions):
            raise errors.field_error("fractions", self.fractions, "fractions in [0, 1)")
        if tuple(sorted(set(self.fractions))) != self.fractions:
            raise errors.field_error("fractions", self.fractions, "sorted and distinct")
        if self.min_interval_s < 0:
            raise errors.field_error("min_interval_s", self.min_interval_s, ">= 0")

    def points(self, step_started_at: float, predicted_step_s: float) -> tuple[float, ...]:
        """Absolute times of the re-planning points of a step."""
        span = max(0.0, predicted_step_s)
        return tuple(step_started_at + f * span for f in self.fractions)

    def due(
        self,
        *,
        step_started_at: float,
        predicted_step_s: float,
        now: float,
        last_plan_at: float | None,
    ) -> bool:
        """Whether a point has passed since the last plan of this step (or none was made
        since the step started) and the minimum interval has elapsed."""
        if last_plan_at is None or last_plan_at < step_started_at:
            return now >= step_started_at
        if now - last_plan_at < self.min_interval_s:
            return False
        return any(last_plan_at < p <= now for p in self.points(step_started_at, predicted_step_s))

    def next_at(
        self, *, step_started_at: float, predicted_step_s: float, after: float
    ) -> float | None:
        """The first point strictly after ``after`` (None: no point left in the step)."""
        for p in self.points(step_started_at, predicted_step_s):
            if p > after:
                return max(p, after + self.min_interval_s) if after >= step_started_at else p
        return None

"""Asynchronous RL over the gateways: a rollout producer the trainer takes batches from.

``AsyncGroups`` keeps prompt groups in flight through the gateways
(:class:`orchestrrl.rollout.AsyncRollout`) while the trainer trains, within AReaL's
staleness bound: at most ``consumed + (1 + max_staleness) x N`` groups started in all
(AReaL's ``(v + 1 + eta) x N`` after ``v`` batches of ``N`` groups; a dropped group counts
as consumed, so the producer replaces it). Every token keeps the weight version
that produced it (the gateways' labels). :meth:`AsyncGroups.take` hands the trainer its
next ``N`` complete groups, oldest complete first; a group whose oldest token is more than
``max_lag`` versions behind the weights it would be trained on is dropped whole and
counted (:attr:`AsyncGroups.dropped`), never handed to the trainer. Every request carries
``max_staleness = max_lag``, so the gateways enforce the bound too: a response they stop
when new weights land too far past its oldest token (finish reason ``"stale"``) makes its
group over-stale, dropped and counted the same way as soon as it completes. New weights reach the
engines without a global pause: the caller pushes them (the controller's weight sync, or
:meth:`AsyncRollout.update_weights`) while the groups run, each gateway loading them as its
``on_weight_update`` policy says ("finish": running requests end on the old weights,
"resume": they stop and resume on the new ones).

The decisions are pure (:mod:`orchestrrl.rl.staleness`, over the simulator's rules in
:mod:`scheduler.async_rollout`); this module only starts calls and waits::

    async with AsyncGroups(rollout, prompt_of, batch_groups=4, n=8, max_staleness=1) as ag:
        for step in range(steps):
            batch = await ag.take(trainer.version)  # complete groups, none too stale
            trainer.step(batch.groups ...); push the new version (in the background)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.rl.staleness import (
    complete_group,
    gateway_stopped,
    groups_to_start,
    split_stale,
)
from orchestrrl.rollout import AsyncRollout, Group
from scheduler.async_rollout import CompleteGroup, take_batch

log = get_logger("orchestrrl.rl.async_groups")


@dataclass(frozen=True)
class Batch:
    """What the trainer got for version ``version``: ``groups`` (to train), their
    ``lags`` (versions behind), the over-stale groups ``dropped`` on the way, and how long
    the trainer waited for them."""

    version: int
    groups: tuple[Group, ...]
    lags: tuple[int, ...]
    dropped: tuple[Group, ...]
    waited_s: float


@dataclass(frozen=True)
class _Done:
    group: Group
    summary: CompleteGroup


class AsyncGroups:
    """See the module docstring. ``prompt_of(k)``: the prompt of the ``k``-th group
    started; ``max_lag``: default ``max_staleness``; ``max_in_flight_groups``: default
    the admission bound's own; ``generate``: keyword arguments of
    :meth:`AsyncRollout.generate` (``max_tokens``, ``temperature``, ``on_weight_update``,
    ...; ``seed``: group ``k`` gets ``seed + k * n``)."""

    def __init__(
        self,
        rollout: AsyncRollout,
        prompt_of: Callable[[int], Sequence[int]],
        *,
        batch_groups: int,
        n: int,
        max_staleness: int,
        max_lag: int | None = None,
        max_in_flight_groups: int = 0,
        **generate: Any,
    ) -> None:
        p = errors.Problems()
        for name, value, lo, hi in (
            ("batch_groups", batch_groups, 1, 1024),
            ("n", n, 1, 64),
            ("max_staleness", max_staleness, 0, 64),
            ("max_lag", max_staleness if max_lag is None else max_lag, 0, 64),
            ("max_in_flight_groups", max_in_flight_groups, 0, 65536),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                p.add(str(errors.field_error(name, value, f"an integer in {lo}..{hi}")))
        if p:
            raise p.error()
        self.rollout = rollout
        self.prompt_of = prompt_of
        self.batch_groups = batch_groups
        self.n = n
        self.max_staleness = max_staleness
        self.max_lag = max_staleness if max_lag is None else max_lag
        self.cap = max_in_flight_groups or (max_staleness + 1) * batch_groups
        self.generate = dict(generate)
        self.seed = self.generate.pop("seed", None)
        self.consumed = 0  # groups the trainer took
        self.started = 0
        self.version = 0  # the trainer's version, for groups that start now
        self.trained: list[Group] = []  # handed to the trainer
        self.dropped: list[Group] = []  # over-stale, never handed to the trainer
        self.cancelled = 0  # in flight when closed
        self._stopped: list[Group] = []  # dropped as the gateways stopped them, not reported
        self._queue: list[_Done] = []  # complete, oldest complete first
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()
        self._failed: BaseException | None = None
        self._producer: asyncio.Task[None] | None = None

    # -- life cycle --

    async def __aenter__(self) -> AsyncGroups:
        self._producer = asyncio.get_running_loop().create_task(self._produce())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop starting groups and cancel those in flight (their calls are dropped)."""
        tasks = [t for t in (self._producer, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def waiting(self) -> int:
        """Complete groups not taken yet."""
        return len(self._queue)

    def accounting(self) -> dict[str, int]:
        """Every group started is in exactly one place: trained, dropped, waiting, in
        flight or cancelled by :meth:`close` (``lost`` counts the others: 0 unless
        something went wrong)."""
        placed = (
            len(self.trained)
            + len(self.dropped)
            + len(self._queue)
            + len(self._tasks)
            + self.cancelled
        )
        return {
            "started": self.started,
            "trained": len(self.trained),
            "dropped": len(self.dropped),
            "waiting": len(self._queue),
            "in_flight": len(self._tasks),
            "cancelled": self.cancelled,
            "lost": self.started - placed,
        }

    # -- the producer --

    async def _produce(self) -> None:
        while True:
            k = groups_to_start(
                self.max_staleness,
                self.consumed,
                self.batch_groups,
                self.started,
                len(self._tasks),
                self.cap,
            )
            for _ in range(k):
                self._start(self.started)
                self.started += 1
            self._wake.clear()
            await self._wake.wait()

    def _start(self, index: int) -> None:
        gid = f"g{index}"
        started_at = self.version
        prompt = tuple(self.prompt_of(index))
        kwargs = {**self.generate, "max_staleness": self.max_lag}  # the gateways' bound too
        if self.seed is not None:
            kwargs["seed"] = self.seed + index * self.n

        async def run() -> None:
            try:
                (group,) = await self.rollout.generate(
                    [prompt], n=self.n, group_ids=[gid], **kwargs
                )
                if gateway_stopped(s.finish_reason for s in group.samples):
                    self._drop_stopped(group)
                    return
                summary = complete_group(
                    gid, [s.versions for s in group.samples], len(prompt), started_at
                )
                self._queue.append(_Done(group, summary))
            except asyncio.CancelledError:
                self.cancelled += 1  # closed while in flight: counted, not lost
                raise
            except Exception as exc:  # reported by take(): nothing is lost silently
                log.error("async_group_failed", group=gid, error=str(exc))
                if self._failed is None:
                    self._failed = exc
            finally:
                self._tasks.pop(gid, None)
                self._arrived.set()
                self._wake.set()

        self._tasks[gid] = asyncio.get_running_loop().create_task(run())

    # -- the trainer's side --

    def set_version(self, version: int) -> None:
        """The trainer now holds ``version`` (groups started from now on count from it)."""
        self.version = version

    async def take(self, version: int) -> Batch:
        """The next ``batch_groups`` complete groups to train ``version`` on, oldest
        complete first; over-stale ones met on the way are dropped and counted."""
        t0 = time.perf_counter()
        dropped: list[Group] = []
        while True:
            if self._failed is not None:
                raise errors.FailedPrecondition(
                    f"a rollout group failed: {self._failed}"
                ) from self._failed
            dropped += self._drop_stale(version)
            dropped += self._stopped
            self._stopped = []
            took = take_batch(
                [d.summary for d in self._queue], version, self.batch_groups, self.max_lag
            )
            if took is not None:
                break
            self._arrived.clear()
            await self._arrived.wait()
        by_name = {d.summary.name: d.group for d in self._queue}
        trained = tuple(by_name[g.name] for g in took.trained)
        gone = {g.name for g in took.trained}
        self._queue = [d for d in self._queue if d.summary.name not in gone]
        self.trained += trained
        self.consumed += len(trained)
        self._wake.set()
        return Batch(version, trained, took.lags, tuple(dropped), time.perf_counter() - t0)

    def _drop_stopped(self, group: Group) -> None:
        """A gateway stopped one of ``group``'s responses beyond ``max_lag``: the group is
        over-stale, dropped and counted (and replaced) as :meth:`_drop_stale` does."""
        self.dropped.append(group)
        self._stopped.append(group)
        self.consumed += 1
        stale = [s.request_id for s in group.samples if s.finish_reason == "stale"]
        log.info("async_group_dropped", group=group.group_id, stopped_by_gateway=stale)

    def _drop_stale(self, version: int) -> list[Group]:
        """Drop (and count) the waiting groups beyond ``max_lag`` at ``version``; each
        frees its place under the bound like a trained one, so the producer replaces it."""
        _, stale = split_stale([d.summary for d in self._queue], version, self.max_lag)
        names = {g.name for g in stale}
        out = [d.group for d in self._queue if d.summary.name in names]
        if out:
            self._queue = [d for d in self._queue if d.summary.name not in names]
            self.dropped += out
            self.consumed += len(out)
            for g in out:
                log.info("async_group_dropped", group=g.group_id, version=version)
            self._wake.set()
        return out

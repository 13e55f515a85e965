"""Roles of a controller in an HA group (issue 17, docs/ha.md): leader or standby.

``Role`` is what the rest of the controller asks before it acts: whether this process
leads now, with which fencing token, and, on a standby, where the leader is. A single
controller (the SQLite store) is a leader for life with token 0: nothing changes for it.

With etcd, :class:`Leadership` runs the terms of one daemon: campaign as a standby;
on winning, open the store fenced with the leader's lease and token, run the same
start-up recovery as a restart (read the journal and the head, observe the switches,
roll forward or back, repair drift) and serve; on losing the leadership (the lease
expired, keepalives failed, a store write was refused as a deposed leader's) step down
at once and campaign again as a standby. The daemon never exits for a lost leadership.

Step-down rule: ``Role.lose`` is synchronous. From that instant ``Role.is_leader`` is
false, so the servicer answers every call with the standby contract
(``orchestrrl.leader``), the switch I/O refuses to send another OCS batch or route
change (``Role.fencing_token`` raises :class:`NotLeader`), and the epoch manager ends
the change in flight without writing anything more; its journal stays in the store for
the next leader's recovery. A process that was frozen past its lease (SIGSTOP) is not
leader on waking even before its keepalive runs: ``alive`` checks the lease against
the monotonic clock.

This module does not import the etcd client (an optional extra): the election and the
store are handed in by the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from orchestrrl import errors
from orchestrrl.logs import get_logger

if TYPE_CHECKING:
    from fabric_controller.controller import Controller
    from fabric_controller.election import Election
    from fabric_controller.etcd_store import Fence
    from fabric_controller.store import EpochStore

log = get_logger("fabric_controller.leadership")

LEADER_POLL_S = 0.5  # how often a standby reads who leads (for its redirects)
RETRY_S = 1.0  # pause before campaigning again after etcd failed (no quorum)


class NotLeader(errors.Unavailable):
    """This controller does not lead (any more): it refuses to change anything. Servers
    answer it with the standby contract (UNAVAILABLE naming the leader)."""


class Role:
    """Leader or standby, as the rest of the controller sees it.

    ``Role()`` leads for life with fencing token 0 (one controller, no HA);
    ``Role.standby()`` waits for :meth:`lead`. ``on_lost`` callbacks run synchronously
    when leadership ends (the controller logs and publishes ``stepped_down``)."""

    def __init__(self, *, leading: bool = True) -> None:
        self._leading = leading
        self._alive: Callable[[], bool] = lambda: True
        self.token = 0  # the fencing token of the current term (0: no HA)
        self.term = 0  # terms led by this process (1 after the first election won)
        self.leader: str | None = None  # the leader's HOST:PORT, for a standby's redirects
        # a leader whose lease is past due (frozen, partitioned): named to nobody
        self.overdue: str | None = None
        self.reason = "" if leading else "standby: no election won yet"
        self.on_lost: list[Callable[[str], None]] = []
        self._serving = leading  # a new term serves once its recovery has run
        self.lost = asyncio.Event()
        if not leading:
            self.lost.set()

    @classmethod
    def standby(cls) -> Role:
        return cls(leading=False)

    @property
    def is_leader(self) -> bool:
        """Leading now (for a leader by election: its lease surely alive by this clock)."""
        return self._leading and self._alive()

    @property
    def serves(self) -> bool:
        """Leading, and the term's start-up (recovery) done: calls are served."""
        return self._serving and self.is_leader

    @property
    def redirect(self) -> str | None:
        """The leader to name in a standby's answer (None: unknown, or this process,
        still recovering)."""
        return None if self._leading else self.leader

    def serve(self) -> None:
        """The term's start-up is done: serve calls (while leading)."""
        self._serving = self._leading

    def check(self, what: str) -> None:
        """NotLeader naming ``what`` unless this controller leads now. A leader whose
        lease ran out by its own clock (frozen, starved) steps down here."""
        if self._leading and not self._alive():
            self.lose("the lease ran out by this process's clock (frozen or starved)")
        if not self._leading:
            raise NotLeader(
                f"{what}: refused, this controller is not the leader ({self.reason}); it "
                "changes nothing"
            )

    def fencing_token(self, what: str = "switch command") -> int:
        """The token to stamp on a southbound command; NotLeader when not leading."""
        self.check(what)
        return self.token

    def lead(self, token: int, alive: Callable[[], bool], address: str) -> None:
        """Begin a term: lead with ``token`` while ``alive()`` (the election's view)."""
        self.token = token
        self._alive = alive
        self.term += 1
        self.leader = address
        self.overdue = None
        self.reason = ""
        self.lost = asyncio.Event()
        self._serving = False
        self._leading = True

    def lose(self, reason: str) -> bool:
        """End the term (idempotent); False when it had ended already."""
        if not self._leading:
            return False
        self._leading = False
        self._serving = False
        self.reason = reason
        self.leader = None
        self.lost.set()
        for callback in list(self.on_lost):
            callback(reason)
        return True


class Leadership:
    """The terms of one daemon on etcd: standby, campaign, lead, step down, again.

    ``new_election(on_lost)``: a fresh :class:`~fabric_controller.election.Election`
    (one per term: a lost election cannot campaign again). ``open_store(fence)``: the
    store fenced with the term's fence. ``while_leading``: what runs only while this
    controller leads (the drift check, the compute scheduler: they program the fabric);
    cancelled when the term ends; an exception of it ends the daemon as it would without
    HA."""

    def __init__(
        self,
        controller: Controller,
        address: str,
        new_election: Callable[[Callable[[str], None]], Election],
        open_store: Callable[[Fence], Awaitable[EpochStore]],
        *,
        while_leading: Callable[[], Coroutine[Any, Any, None]] | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.controller = controller
        self.role = controller.role
        self.address = address
        self._new_election = new_election
        self._open_store = open_store
        self.while_leading = while_leading
        self._retry_s = retry_s

    async def run(self) -> None:
        """Terms until cancelled (cancelling resigns: a standby takes over at once)."""
        while True:
            try:
                await self._term()
            except errors.OrlError as exc:  # etcd without a quorum, a store refusal, ...
                self.role.lose(f"leadership interrupted: {exc}")
                self.role.leader = None  # not known any more
                log.warning("campaign_failed", error=str(exc), retry_in_s=self._retry_s)
            await self.controller.epochs.quiesce()  # the change in flight has ended
            await asyncio.sleep(self._retry_s)

    async def _term(self) -> None:
        election = self._new_election(self._lost)
        async with election:
            follow = asyncio.create_task(self._follow(election), name="leader-follow")
            try:
                log.info("campaigning", address=self.address, ttl_s=election.ttl_s)
                fence = await election.campaign()
            finally:
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follow
            store = await self._open_store(fence)
            await self.controller.lead(store, fence.token, lambda: election.is_leader,
                                       self.address)  # fmt: skip
            if not self.role.is_leader:  # lost during the recovery
                return
            lost = asyncio.create_task(self.role.lost.wait(), name="leadership-lost")
            tasks: set[asyncio.Task[Any]] = {lost}
            if self.while_leading is not None:
                tasks.add(asyncio.create_task(self.while_leading(), name="while-leading"))
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {lost}:
                    task.result()  # a loop that failed: raise it (it ends the daemon)
            finally:
                self.role.lose("shutting down: resigned")  # (no-op when already lost)
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    def _lost(self, reason: str) -> None:
        self.role.lose(reason)

    async def _follow(self, election: Election) -> None:
        """While a standby: who leads, for the redirects (None while unknown, or while
        the leader's lease is past due: callers sent there would wait on a frozen or
        partitioned process; issue 28)."""
        while True:
            try:
                async with asyncio.timeout(2 * LEADER_POLL_S):  # etcd without a quorum
                    found = await election.leader_standing()
            except (errors.OrlError, TimeoutError):
                found = None
            if not self.role.is_leader:
                named = found.address if found is not None else None
                if named == self.address:
                    named = None
                overdue = named if found is not None and found.past_due else None
                leader = None if overdue else named
                if (leader, overdue) != (self.role.leader, self.role.overdue):
                    if overdue:
                        log.warning(
                            "leader_past_due",
                            leader=overdue,
                            lease_left_s=found.remaining_s if found else None,
                            effect="callers are not sent there until it renews or a "
                            "standby takes over",
                        )
                    else:
                        log.info("standing_by", leader=leader or "not elected yet")
                self.role.leader = leader
                self.role.overdue = overdue
            await asyncio.sleep(LEADER_POLL_S)

"""Leader election on an etcd lease: one active controller, any number of standbys.

A candidate holds a lease (TTL ``ttl_s``, default 2 s) that it keeps alive every third
of the TTL. It campaigns by creating the election key, with its advertised address as
the value and attached to its lease, in one transaction that succeeds only if the key is
absent; the key's create revision is the leader's **fencing token**: etcd's revision only
grows, so every new leader holds a larger token than every leader before it. The key
vanishes when the lease ends (expired, revoked), and a standby's next attempt wins.

Leadership is lost when the lease expires or keepalives fail until its TTL has passed,
counted on this process's monotonic clock from when the last successful keepalive was
sent (so a process that was frozen, e.g. with SIGSTOP, knows on resuming that it lost,
before anything answers it). Then ``lost`` is set, ``on_lost`` is called with the reason,
and ``is_leader`` is false. Writes to the ``EtcdStore`` are fenced independently of this
local view: etcd itself refuses a deposed leader's writes.

    async with Election(etcd, address="10.0.0.5:50051") as election:
        fence = await election.campaign()
        store = base_store.fenced(fence)
        ...  # serve; stop serving when election.lost is set
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from fabric_controller.etcd_store import _T, Etcd, Fence, NotLeader
from orchestrrl import errors

DEFAULT_KEY = "/orchestrrl/leader"
DEFAULT_TTL_S = 2
POLL_S = 0.1  # how often a standby looks whether the key is free

log = structlog.get_logger("election")


def past_due(remaining_s: int, granted_s: int) -> bool:
    """Whether a leader's lease, with ``remaining_s`` left (etcd's LeaseTimeToLive: whole
    seconds, rounded down; -1 when gone) of ``granted_s``, is past due: its holder has not
    renewed it for about two renewal intervals (it renews every third of the TTL, so a
    live holder keeps at least two thirds). Past due, the leader is frozen, partitioned
    or starved: a standby stops sending callers to it (issue 28) well before etcd ends
    the lease (at the TTL, plus up to half a second of etcd's expiry sweep)."""
    return remaining_s < 0 or granted_s <= 0 or remaining_s < granted_s / 3


@dataclass(frozen=True)
class LeaderStanding:
    """Who leads, as a standby sees it (:meth:`Election.leader_standing`)."""

    address: str
    past_due: bool
    remaining_s: int  # of its lease, in etcd's whole seconds (-1: gone)
    granted_s: int


class Election:
    def __init__(
        self,
        etcd: Etcd,
        address: str,
        *,
        key: str = DEFAULT_KEY,
        ttl_s: int = DEFAULT_TTL_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not address:
            raise errors.field_error("election address", address, "the leader's host:port")
        if not isinstance(ttl_s, int) or ttl_s < 1:
            raise errors.field_error("election ttl_s", ttl_s, "whole seconds >= 1")
        self.etcd = etcd
        self.address = address
        self.key = key.encode()
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.lease = 0
        self.token = 0  # the fencing token while leading (0: not leading)
        self._valid_until = 0.0  # monotonic: the lease surely lives until then
        self._leading = False
        self._keepalive: asyncio.Task[None] | None = None
        self._failing = ""  # why the keepalives since the last good one failed

    # -- lifecycle --

    async def __aenter__(self) -> Election:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Grant the lease and start keeping it alive."""
        sent = time.monotonic()
        lease = await self.etcd.run("grant a lease", lambda c: c.lease(self.ttl_s))
        self.lease = int(lease.id)
        self._valid_until = sent + int(lease.ttl)
        self._keepalive = asyncio.create_task(self._keep_alive(), name="election-keepalive")

    async def close(self) -> None:
        """Resign (revoke the lease: the election key goes with it) and stop."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        if self.lease and not self.lost.is_set():
            with contextlib.suppress(errors.OrlError):
                await self.etcd.run(
                    "revoke the lease", lambda c: c.revoke_lease(self.lease), deadline_s=1.0
                )
        if self._leading:
            log.info("leader_resigned", token=self.token, address=self.address)
        self._leading = False
        self.token = 0

    # -- state --

    @property
    def is_leader(self) -> bool:
        """Leading, with the lease surely alive now (by this process's clock)."""
        return self._leading and not self.lost.is_set() and time.monotonic() < self._valid_until

    @property
    def fence(self) -> Fence:
        """What this leader's writes compare; NotLeader when not leading."""
        if not self.is_leader:
            raise NotLeader(
                f"not the leader: {self.lost_reason or 'no election won'} "
                f"(election key {self.key.decode()!r})"
            )
        return Fence(self.key, self.lease, self.token)

    async def leader(self) -> tuple[str, int] | None:
        """The current leader's address and fencing token, or None if nobody leads."""

        async def op(c: Any) -> tuple[str, int] | None:
            got = await c.get(self.key)
            if got is None:
                return None
            return bytes(got.value).decode(), int(got.create_revision)

        return await self.etcd.run("read the leader", op)

    async def leader_address(self) -> str | None:
        found = await self.leader()
        return None if found is None else found[0]

    async def leader_standing(self) -> LeaderStanding | None:
        """The current leader's address and whether its lease is past due (see
        :func:`past_due`), or None if nobody leads: two reads."""

        async def op(c: Any) -> tuple[str, int] | None:
            got = await c.get(self.key)
            return None if got is None else (bytes(got.value).decode(), int(got.lease))

        found = await self.etcd.run("read the leader", op)
        if found is None:
            return None
        address, lease = found
        info = await self.etcd.run(
            "read the leader's lease", lambda c: c.get_lease_info(lease, keys=False)
        )
        remaining, granted = int(info.TTL), int(info.grantedTTL)
        return LeaderStanding(address, past_due(remaining, granted), remaining, granted)

    # -- campaign --

    async def campaign(self) -> Fence:
        """Wait until this candidate leads; returns its fence. NotLeader if the lease was
        lost meanwhile (a new Election must be started)."""
        if not self.lease:
            raise errors.FailedPrecondition("campaign before start(): use `async with`")
        while True:
            if self.lost.is_set():
                raise NotLeader(f"cannot campaign: {self.lost_reason}")
            won = await self._try()
            if won is not None:
                self.token = won
                self._leading = True
                log.info("leader_elected", token=won, address=self.address, lease=f"{self.lease:x}")
                return Fence(self.key, self.lease, won)
            await asyncio.sleep(POLL_S)

    async def _try(self) -> int | None:
        """One attempt: the token if this candidate holds the key now, else None."""

        async def op(c: Any) -> tuple[bool, list[Any]]:
            ok, responses = await c.transaction(
                compare=[_T.version(self.key) == 0],
                success=[_T.put(self.key, self.address.encode(), lease=self.lease),
                         _T.get(self.key)],
                failure=[_T.get(self.key)],
            )  # fmt: skip
            return bool(ok), list(responses)

        try:
            ok, responses = await self.etcd.run("campaign", op)
        except errors.FailedPrecondition as exc:  # e.g. "requested lease not found"
            self._lose(f"campaign refused: {exc}")
            raise NotLeader(f"cannot campaign: {self.lost_reason}") from None
        kvs = responses[1] if ok else responses[0]
        if not kvs:
            return None  # deleted between compare and read: try again
        kv = kvs[0][1]
        # ours also when an earlier attempt was applied but its answer was lost
        return int(kv.create_revision) if int(kv.lease) == self.lease else None

    # -- keepalive --

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_reason = reason
        self.lost.set()
        was_leader = self._leading
        self._leading = False
        if was_leader:
            log.warning("leadership_lost", reason=reason, token=self.token, address=self.address)
        if self.on_lost is not None:
            self.on_lost(reason)

    async def _keep_alive(self) -> None:
        interval = self.ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now >= self._valid_until:
                late = now - self._valid_until
                if self._failing:
                    self._lose(
                        f"keepalives failed until lease {self.lease:x} expired "
                        f"{late:.1f} s ago: {self._failing}"
                    )
                else:
                    self._lose(
                        f"lease {self.lease:x} expired {late:.1f} s ago while this process "
                        "did not renew it (frozen or starved)"
                    )
                return
            sent = now
            try:
                reply = await self.etcd.run(
                    "keep the lease alive",
                    lambda c: c.refresh_lease(self.lease),
                    deadline_s=max(0.05, self._valid_until - time.monotonic()),
                )
            except errors.OrlError as exc:
                if time.monotonic() >= self._valid_until:
                    self._lose(f"keepalive failed until lease {self.lease:x} expired: {exc}")
                    return
                self._failing = str(exc)
                continue
            self._failing = ""
            ttl = 0 if reply is None else int(reply.TTL)
            if ttl <= 0:
                self._lose(f"lease {self.lease:x} expired (etcd no longer knows it)")
                return
            self._valid_until = sent + ttl

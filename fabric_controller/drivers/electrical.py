"""Electrical (packet) switch drivers behind one Protocol: routes with ECMP next hops.

``LinuxSwitchDriver`` programs a Linux-based switch (a real box running the controller's
netlink access, or a network namespace of the local testbed) through the netlink
adapter. Route values are ``orchestrrl.routing.RouteSpec``; only routes OrchestrRL
installed (route protocol ``orchestrrl.netlink.OWNER_PROTO``) are listed, replaced or
pruned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from orchestrrl.logs import get_logger
from orchestrrl.netlink import Netlink
from orchestrrl.routing import RouteChange, RouteDiff, RouteSpec

log = get_logger("fabric_controller.drivers.electrical")


class ElectricalDriver(Protocol):
    """What the controller needs from an electrical switch."""

    name: str

    async def ensure(self, routes: Iterable[RouteSpec], prune: bool) -> RouteChange:
        """Install missing routes, replace differing ones, remove our stale ones if prune;
        verified by reading back. Bad input (unknown device, conflict with a route we did
        not install) raises before anything changes; a kernel refusal is rolled back."""
        ...

    async def routes(self) -> frozenset[RouteSpec]:
        """OrchestrRL's routes on the switch, as the kernel reports them."""
        ...

    async def verify(self, routes: Iterable[RouteSpec], prune: bool) -> RouteDiff:
        """What ``ensure(routes, prune)`` would still change (empty: in sync)."""
        ...

    async def close(self) -> None: ...


class LinuxSwitchDriver:
    """A Linux switch in network namespace ``netns`` (None: the controller's own)."""

    def __init__(self, name: str, netns: str | None, *, verify_timeout_s: float = 2.0) -> None:
        self.name = name
        self.netns = netns
        self._netlink = Netlink(netns, verify_timeout_s=verify_timeout_s)
        self._opened = False
        self._open_lock = asyncio.Lock()
        self._log = log.bind(switch=name, netns=netns)

    async def _adapter(self) -> Netlink:
        async with self._open_lock:
            if not self._opened:
                await self._netlink.open()
                self._opened = True
        return self._netlink

    async def ensure(self, routes: Iterable[RouteSpec], prune: bool) -> RouteChange:
        change = await (await self._adapter()).ensure_routes(routes, prune)
        self._log.debug(
            "switch_routes_ensured",
            added=change.added,
            replaced=change.replaced,
            removed=change.removed,
            unchanged=change.unchanged,
        )
        return change

    async def routes(self) -> frozenset[RouteSpec]:
        return await (await self._adapter()).routes()

    async def verify(self, routes: Iterable[RouteSpec], prune: bool) -> RouteDiff:
        return await (await self._adapter()).verify_routes(routes, prune)

    async def close(self) -> None:
        async with self._open_lock:
            if self._opened:
                await self._netlink.close()
                self._opened = False

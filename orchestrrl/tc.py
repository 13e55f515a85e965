"""Traffic control through pyroute2: port-to-port redirects (the testbed's optical
circuits) and link state, in one network namespace.

Like ``orchestrrl.netlink`` (whose namespace socket and error mapping it reuses), this
is the only module that makes these pyroute2 calls: it takes and returns our own
values and maps kernel error codes to ``orchestrrl.errors``.

A redirect ``a -> b`` is the u32 filter that matches every packet entering ``a``
and sends it out of ``b``, the same as
``tc filter add dev a parent ffff: protocol all u32 match u32 0 0 action mirred egress
redirect dev b`` (``matchall`` is missing on some kernels; ``u32 match u32 0 0`` is
not). A device carries at most one redirect: setting one replaces what was there.

Links are listed by a small codec of our own (``RTM_GETLINK`` without statistics, three
fields decoded): pyroute2 decodes every attribute of every link, about 20 ms for the 33
links of a 32-port OCS, and port health is read before every batch and every
``ListPorts``.

pyroute2's ``AsyncIPRoute`` cannot open its socket on uvloop (which the daemons run on:
"cannot open a UDP handle, invalid family 16"), so this adapter drives the synchronous
``IPRoute`` from one dedicated thread per instance: calls never block the event loop,
and the socket is only ever used by the thread that created it.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from pyroute2 import NetlinkError

from orchestrrl import errors, rtnl
from orchestrrl.netlink import (
    PyrouteThread,
    check_netns,
    kernel_error,
    namespace_errors,
    netlink_socket,
)

INGRESS = 0xFFFF0000  # the ingress qdisc's handle, parent of its filters ("ffff:")
ETH_P_ALL = 0x0003
# pyroute2 insists on a target (class id) for u32 filters; with a mirred action the
# kernel never classifies into it, so any value does.
UNUSED_CLASSID = 0x00010001
MATCH_ALL = ["0x0/0x0+0"]  # u32: the 32-bit word at offset 0, mask 0 - every packet

T = TypeVar("T")


def _dump_links(sock: socket.socket, seq: int) -> dict[str, LinkState]:
    """One RTM_GETLINK dump on a blocking rtnetlink socket (runs on the Tc thread), read
    with orchestrrl.rtnl's codec."""
    sock.send(rtnl.link_dump_request(seq))
    found: dict[str, LinkState] = {}
    while True:
        data = sock.recv(1 << 16)
        try:
            walked = list(rtnl.frames(data, strict=True))
        except ValueError:  # a truncated message: nothing more to trust in this dump
            return found
        for header, start, end in walked:
            if header.seq != seq:
                continue
            if header.type == rtnl.NLMSG_DONE:
                return found
            if header.type == rtnl.NLMSG_ERROR:
                raise NetlinkError(-rtnl.I32.unpack_from(data, start)[0])
            if header.type == rtnl.RTM_NEWLINK:
                link = rtnl.parse_link(data, start, end)
                if link is not None:
                    found[link.name] = LinkState(
                        link.name, link.ifindex, bool(link.flags & rtnl.IFF_UP), link.oper_up
                    )


@dataclass(frozen=True)
class LinkState:
    name: str
    index: int
    admin_up: bool  # IFF_UP: set by `ip link set NAME up`
    oper_up: bool  # the kernel says the link works (carrier, peer up)


class Tc:
    """Ingress redirects and link state of one namespace (None: this process's own).

    Use as ``async with Tc("ns") as tc: ...``; calls are serialised per instance.
    """

    def __init__(self, netns: str | None = None) -> None:
        self.netns = check_netns(netns)
        self.where = f"netns {netns!r}" if netns else "the host namespace"
        self._py: PyrouteThread | None = None
        self._lock = asyncio.Lock()
        self._indexes: dict[str, int] = {}  # name -> ifindex, as last listed
        self._links: socket.socket | None = None  # our own socket for link dumps
        self._seq = 0

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking pyroute2 call on this instance's own thread."""
        if self._py is None:
            raise errors.FailedPrecondition(f"traffic control of {self.where} is not open")
        return await self._py.call(fn, *args, **kwargs)

    async def open(self) -> Tc:
        if self._py is not None:
            return self
        needs = (
            "traffic control needs root (CAP_NET_ADMIN and, to enter a named namespace, "
            "CAP_SYS_ADMIN)"
        )
        self._py = PyrouteThread(self.netns, "tc")
        try:
            with namespace_errors(self.netns, self.where, needs):
                self._links = await asyncio.to_thread(netlink_socket, self.netns)
                await self._py.open()
                await self.links()
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        if self._py is not None:
            await self._py.close()
            self._py = None
        if self._links is not None:
            self._links.close()
            self._links = None

    async def __aenter__(self) -> Tc:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _require(self) -> Any:
        if self._py is None or self._py.ipr is None:
            raise errors.FailedPrecondition(f"traffic control of {self.where} is not open")
        return self._py.ipr

    async def links(self) -> dict[str, LinkState]:
        self._require()
        sock = self._links
        if sock is None:
            raise errors.FailedPrecondition(f"traffic control of {self.where} is not open")
        self._seq += 1
        try:
            found = await self._call(_dump_links, sock, self._seq)
        except NetlinkError as exc:
            raise kernel_error(exc.code, f"list interfaces in {self.where}") from None
        except OSError as exc:
            raise kernel_error(exc.errno or errno.EIO, f"list interfaces in {self.where}") from None
        self._indexes = {name: link.index for name, link in found.items()}
        return found

    async def _index(self, name: str) -> int:
        """The device's index: listing every link costs milliseconds per call in
        pyroute2, so the last listing is reused (a device that was deleted and created
        again under the same name gets a new index: the kernel then answers ENODEV and
        the caller sees the error, and the next ``links()`` refreshes the map)."""
        if name not in self._indexes:
            await self.links()
        if name not in self._indexes:
            raise errors.field_error("device", name, f"no such interface in {self.where}")
        return self._indexes[name]

    async def add_ingress(self, names: Iterable[str]) -> None:
        """Give each device an ingress qdisc (where redirects hang); existing ones stay."""
        ipr = self._require()
        async with self._lock:
            links = await self.links()
            for name in names:
                if name not in links:
                    raise errors.field_error("device", name, f"no such interface in {self.where}")
                try:
                    await self._call(ipr.tc, "add", "ingress", links[name].index)
                except NetlinkError as exc:
                    if exc.code != errno.EEXIST:
                        raise kernel_error(
                            exc.code, f"add an ingress qdisc to {name} in {self.where}"
                        ) from None

    async def redirect(self, name: str, to: str) -> None:
        """Send every packet entering ``name`` out of ``to`` (replacing any redirect)."""
        ipr = self._require()
        async with self._lock:
            index, target = await self._index(name), await self._index(to)
            await self._clear(index, name)
            try:
                await self._call(
                    ipr.tc,
                    "add-filter",
                    "u32",
                    index,
                    parent=INGRESS,
                    protocol=ETH_P_ALL,
                    keys=MATCH_ALL,
                    target=UNUSED_CLASSID,
                    action={
                        "kind": "mirred",
                        "direction": "egress",
                        "action": "redirect",
                        "ifindex": target,
                    },
                )
            except NetlinkError as exc:
                raise kernel_error(
                    exc.code, f"redirect {name} -> {to} in {self.where}", _hint(exc.code)
                ) from None

    async def clear(self, name: str) -> None:
        """Remove every filter of ``name``'s ingress (no redirect left); idempotent."""
        self._require()
        async with self._lock:
            await self._clear(await self._index(name), name)

    async def _clear(self, index: int, name: str) -> None:
        try:
            await self._call(self._require().tc, "del-filter", index=index, parent=INGRESS)
        except NetlinkError as exc:
            if exc.code not in (errno.ENOENT, errno.EINVAL):  # nothing there, or no qdisc
                raise kernel_error(exc.code, f"clear {name}'s redirect in {self.where}") from None

    async def redirects(self) -> dict[str, str]:
        """Every redirect as ``{from: to}``, read from the kernel."""
        ipr = self._require()
        links = await self.links()
        names = {link.index: link.name for link in links.values()}

        def dump() -> dict[int, int]:
            redirects: dict[int, int] = {}
            for qdisc in ipr.get_qdiscs():
                if qdisc.get("kind") != "ingress":
                    continue
                index = int(qdisc["index"])
                for msg in ipr.get_filters(index=index, parent=INGRESS):
                    target = _mirred_target(msg)
                    if target is not None:
                        redirects[index] = target
            return redirects

        try:
            raw = await self._call(dump)
        except NetlinkError as exc:
            raise kernel_error(exc.code, f"list redirects in {self.where}") from None
        return {names.get(a, str(a)): names.get(b, str(b)) for a, b in raw.items()}

    async def set_up(self, name: str, up: bool) -> None:
        """``ip link set NAME up|down``."""
        ipr = self._require()
        async with self._lock:
            index = await self._index(name)
            try:
                await self._call(ipr.link, "set", index=index, state="up" if up else "down")
            except NetlinkError as exc:
                state = "up" if up else "down"
                raise kernel_error(exc.code, f"set {name} {state} in {self.where}") from None


def _hint(code: int) -> str:
    if code == errno.EINVAL:
        return "the kernel refused the filter (is there an ingress qdisc on the device?)"
    return ""


def _mirred_target(msg: Any) -> int | None:
    """The egress device index of a u32 filter's mirred redirect, if it has one."""
    options = msg.get_attr("TCA_OPTIONS")
    actions = options.get_attr("TCA_U32_ACT") if options is not None else None
    if actions is None:
        return None
    for _name, action in actions["attrs"]:
        if not hasattr(action, "get_attr") or action.get_attr("TCA_ACT_KIND") != "mirred":
            continue
        params = action.get_attr("TCA_ACT_OPTIONS")
        parms = params.get_attr("TCA_MIRRED_PARMS") if params is not None else None
        if parms is not None:
            return int(parms["ifindex"])
    return None

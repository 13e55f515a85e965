"""THE netlink adapter: every pyroute2 call of the project lives in this module.

It takes and returns our own frozen values (``RouteSpec``, ``RuleSpec``, ``LinkInfo``,
``RouteChange``), maps kernel error codes to ``orchestrrl.errors``, and never lets a
pyroute2 object or ``**kwargs`` escape.

- Links (lookup, MTU) and policy rules go through pyroute2's ``IPRoute``, driven from
  one dedicated thread per adapter: pyroute2's ``AsyncIPRoute`` cannot open its socket
  on uvloop, which the daemons run on, and the calls then never block the event loop.
- Routes are the bulk object (thousands per switch at a phase change), so they go
  through our own small codec (``orchestrrl.rtnl``) in batches of hundreds of messages
  per ``send`` on a plain rtnetlink socket. See ``orchestrrl.rtnl`` for the
  measurements behind that choice and ``bench/routes.py`` for the comparison with
  ``ip -batch``.
- Both sockets are created inside the namespace by :func:`netlink_socket` (pyroute2's
  ``setns`` in a short-lived thread; no fork).

Ownership: everything OrchestrRL installs carries the route/rule protocol
``OWNER_PROTO`` = 77. Number 99, which one might pick, is RTPROT_OPENR in
linux/rtnetlink.h; 77 is unassigned there and in FRR's list. To make ``ip route``
print the name, add ``77 orchestrrl`` to ``/etc/iproute2/rt_protos.d/orchestrrl.conf``.
Prune only ever removes routes and rules with that protocol; a desired route whose key
(table, destination, metric) is held by anyone else's route is refused before anything
changes.

Ensure semantics: validate everything (syntax in ``RouteSpec``, devices, conflicts)
before touching the kernel; apply additions and replacements before removals (make
before break); if the kernel refuses any message, undo the ones it accepted and raise;
then read back and poll briefly until the kernel shows the desired state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from pyroute2 import IPRoute, NetlinkError
from pyroute2.netns import setns

from orchestrrl import errors, rtnl
from orchestrrl.logs import get_logger
from orchestrrl.routing import (
    KernelHop,
    RouteChange,
    RouteDiff,
    RouteKey,
    RouteSpec,
    RuleChange,
    RuleSpec,
    diff_routes,
    diff_rules,
    foreign_conflicts,
    index_routes,
    unknown_devices,
)

T = TypeVar("T")
log = get_logger("orchestrrl.netlink")

OWNER_PROTO = 77
OWNER_PROTO_NAME = "orchestrrl"
NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NETLINK_GET_STRICT_CHK = 12
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
SOCKET_BUFFER = 8 << 20
RECV_SIZE = 1 << 17
ACK_TRUESIZE = 1024  # generous bound of the kernel's memory per queued ACK
MAX_BATCH = 256  # messages per send; also how long the event loop waits at most (~5 ms)
DUMP_RETRIES = 5
EXCHANGE_TIMEOUT_S = 60.0
FR_ACT_TO_TBL = 1
FIB_RULE_INVERT = 2
OTHER_RULE_MATCHES = (
    "FRA_FWMARK",
    "FRA_OIFNAME",
    "FRA_UID_RANGE",
    "FRA_IP_PROTO",
    "FRA_SPORT_RANGE",
    "FRA_DPORT_RANGE",
    "FRA_L3MDEV",
    "FRA_TUN_ID",
    "FRA_GOTO",
)
FAMILY_OF = {4: socket.AF_INET, 6: socket.AF_INET6}
VERSION_OF = {socket.AF_INET: 4, socket.AF_INET6: 6}
NETNS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$")
TOLERATED_ON_DELETE = frozenset({errno.ENOENT, errno.ESRCH})


@dataclass(frozen=True)
class LinkInfo:
    name: str
    index: int
    mtu: int
    min_mtu: int  # 0 when the kernel does not say
    max_mtu: int
    oper_up: bool
    kind: str  # "veth", "bridge", ...; "" for a physical NIC


def check_netns(name: str | None, field: str = "netns") -> str | None:
    """A namespace name as ``ip netns`` creates them (a file under /run/netns), or None."""
    if not name:
        return None
    if not NETNS_RE.match(name):
        raise errors.field_error(
            field, name, "expected a network namespace name as listed by `ip netns list`"
        )
    return name


def kernel_error(code: int, what: str, detail: str = "") -> errors.OrlError:
    """One place that turns a kernel errno into a domain error a person can act on."""
    reason = detail or os.strerror(code)
    if code in (errno.EPERM, errno.EACCES):
        return errors.FailedPrecondition(
            f"{what}: {reason}: changing routes, rules or links needs root or "
            "CAP_NET_ADMIN; run the service as root or grant it CAP_NET_ADMIN"
        )
    if code == errno.ENODEV:
        return errors.InvalidArgument(f"{what}: no such interface ({reason})")
    if code in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return errors.InvalidArgument(
            f"{what}: a gateway is not on a connected network ({reason}); give the "
            "interface an address in the gateway's subnet, or fix the gateway"
        )
    if code in (errno.EINVAL, errno.ERANGE, errno.EAFNOSUPPORT, errno.EOPNOTSUPP):
        return errors.InvalidArgument(f"{what}: the kernel refused it: {reason}")
    if code == errno.EEXIST:
        return errors.Aborted(
            f"{what}: it appeared while we were applying (another process is changing "
            "the same table); retry"
        )
    if code == errno.ENOBUFS:
        return errors.Unavailable(f"{what}: netlink buffer overflow ({reason}); retry")
    return errors.FailedPrecondition(f"{what}: {reason} (errno {code})")


@contextlib.asynccontextmanager
async def _socket_errors(what: str) -> AsyncIterator[None]:
    """Socket-level failures (buffer overrun, a kernel that stops answering) as domain
    errors. The kernel answers every request, so the timeout only guards against bugs."""
    try:
        async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
            yield
    except TimeoutError:
        raise errors.Unavailable(
            f"{what}: no answer from the kernel within {EXCHANGE_TIMEOUT_S:g}s"
        ) from None
    except OSError as exc:
        raise kernel_error(exc.errno or errno.EIO, what, exc.strerror or "") from None


class _RouteSocket:
    """A raw rtnetlink socket speaking ``orchestrrl.rtnl`` messages in batches."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._seq = int(time.time()) & 0xFFFF_FFF
        self._lock = asyncio.Lock()
        # An exchange that did not finish (error, cancellation) may leave a dump running
        # or ACKs unread: such a socket is replaced rather than reused.
        self.broken = False
        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self.batch = max(16, min(MAX_BATCH, rcvbuf // ACK_TRUESIZE))
        self.batch_bytes = max(4096, sndbuf // 2 - 32)

    @classmethod
    def open(cls, netns: str | None) -> _RouteSocket:
        """Blocking (starts a thread to enter the namespace): call off the event loop."""
        sock = netlink_socket(netns)
        try:
            for force, plain in (
                (SO_SNDBUFFORCE, socket.SO_SNDBUF),
                (SO_RCVBUFFORCE, socket.SO_RCVBUF),
            ):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
                except PermissionError:
                    sock.setsockopt(socket.SOL_SOCKET, plain, SOCKET_BUFFER)
            for option in (NETLINK_CAP_ACK, NETLINK_EXT_ACK, NETLINK_GET_STRICT_CHK):
                sock.setsockopt(SOL_NETLINK, option, 1)
            sock.bind((0, 0))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def close(self) -> None:
        self._sock.close()

    @contextlib.asynccontextmanager
    async def _exchange(self, what: str) -> AsyncIterator[None]:
        if self.broken:
            raise errors.Unavailable(f"{what}: the netlink socket was abandoned; reopen it")
        try:
            async with _socket_errors(what):
                yield
        except BaseException:
            self.broken = True
            raise

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFF_FFFF or 1
        return self._seq

    async def _recv(self, drain: bool) -> list[rtnl.Message]:
        """The next datagram's messages, waiting if none is queued; with ``drain``, also
        every datagram queued behind it (ACKs: one datagram each). Not for dumps: each
        read makes the kernel produce the next chunk, so draining never ends early."""
        loop = asyncio.get_running_loop()
        chunks = [await loop.sock_recv(self._sock, RECV_SIZE)]
        while drain:
            try:
                chunks.append(self._sock.recv(RECV_SIZE))
            except BlockingIOError:
                break
        return [m for chunk in chunks for m in rtnl.iter_messages(chunk)]

    async def request(self, build: Sequence[Callable[[int], bytes]]) -> list[tuple[int, str]]:
        """Send messages (callables seq -> bytes) in batches; (errno, text) of each ACK."""
        async with self._lock, self._exchange("route changes"):
            return await self._request(build)

    async def _request(self, build: Sequence[Callable[[int], bytes]]) -> list[tuple[int, str]]:
        results: list[tuple[int, str]] = []
        start = 0
        while start < len(build):
            seqs: dict[int, int] = {}
            payload = bytearray()
            while start < len(build) and len(seqs) < self.batch:
                seq = self._next_seq()
                message = build[start](seq)
                if seqs and len(payload) + len(message) > self.batch_bytes:
                    break
                payload += message
                seqs[seq] = start
                start += 1
            acks: dict[int, tuple[int, str]] = {}
            await asyncio.get_running_loop().sock_sendall(self._sock, bytes(payload))
            while len(acks) < len(seqs):
                for reply in await self._recv(drain=True):
                    if reply.kind == rtnl.NLMSG_ERROR and reply.seq in seqs:
                        acks[reply.seq] = rtnl.decode_error(reply)
            results.extend(acks[seq] for seq in seqs)
            # The kernel answers synchronously, so nothing above ever waits: give the
            # event loop a turn per batch (gRPC, telemetry, timeouts, cancellation).
            await asyncio.sleep(0)
        return results

    async def dump(
        self, version: int, table: int = 0, proto: int = 0, skip_proto: int = -1
    ) -> list[rtnl.WireRoute]:
        """Routes of one family, filtered by the kernel on ``table`` and ``proto`` (0: any);
        routes of ``skip_proto`` are dropped before they are decoded."""
        async with self._lock, self._exchange(f"IPv{version} route dump"):
            for _ in range(DUMP_RETRIES):
                routes, interrupted = await self._dump_once(version, table, proto, skip_proto)
                if not interrupted:
                    return routes
        raise errors.Aborted(
            f"route dump kept being interrupted by concurrent changes ({DUMP_RETRIES} tries)"
        )

    async def _dump_once(
        self, version: int, table: int, proto: int, skip_proto: int
    ) -> tuple[list[rtnl.WireRoute], bool]:
        seq = self._next_seq()
        await asyncio.get_running_loop().sock_sendall(
            self._sock, rtnl.encode_dump(seq, version, table, proto)
        )
        routes: list[rtnl.WireRoute] = []
        interrupted = False
        while True:
            await asyncio.sleep(0)  # as in _request: let the loop run between chunks
            for message in await self._recv(drain=False):
                if message.seq != seq:
                    continue  # a late ACK of a cancelled request
                interrupted |= bool(message.flags & rtnl.NLM_F_DUMP_INTR)
                if message.kind == rtnl.NLMSG_DONE:
                    return routes, interrupted
                if message.kind == rtnl.NLMSG_ERROR:
                    code, text = rtnl.decode_error(message)
                    if code == errno.ENOENT:  # IPv4: the table does not exist yet
                        return [], False
                    raise kernel_error(code, f"dump IPv{version} routes", text)
                if message.kind == rtnl.RTM_NEWROUTE:
                    if rtnl.route_proto(message.payload) == skip_proto:
                        continue
                    route = rtnl.decode_route(message.payload)
                    if route is not None:
                        routes.append(route)


def netlink_socket(netns: str | None) -> socket.socket:
    """An rtnetlink socket inside ``netns`` (None: this process's namespace). Blocking.

    Entering a namespace (setns) moves only the calling thread, so a fresh thread enters
    it, creates the socket and ends; the socket stays in that namespace. pyroute2's own
    ``netns=`` forks a helper process instead, and a fork next to gRPC's threads crashes
    the child (seen here: SIGSEGV) - so we never fork. A fresh thread rather than a pool
    thread, so that no reused thread is left in another namespace.
    """
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
    outcome: list[socket.socket | BaseException] = []

    def enter() -> None:
        try:
            setns(netns, flags=0, fork=False)  # flags=0: never create it as a side effect
            outcome.append(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE))
        except BaseException as exc:  # handed to the caller below
            outcome.append(exc)

    thread = threading.Thread(target=enter, name=f"enter-netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _op_route(
    op: rtnl.RouteOp, route: RouteSpec, ifindexes: dict[str, int]
) -> Callable[[int], bytes]:
    return lambda seq: rtnl.encode_route(seq, op, route, OWNER_PROTO, ifindexes)


@contextlib.contextmanager
def namespace_errors(netns: str | None, where: str, needs: str) -> Iterator[None]:
    """Map the OS errors of entering a namespace to ours: a missing namespace is bad
    input naming it; missing privileges say which (``needs``)."""
    try:
        yield
    except FileNotFoundError:
        raise errors.field_error(
            "netns", netns, "no such network namespace (see `ip netns list`)"
        ) from None
    except PermissionError as exc:
        raise errors.FailedPrecondition(f"open {where}: {exc}: {needs}") from None


class PyrouteThread:
    """pyroute2's blocking ``IPRoute`` on one dedicated thread, opened inside a namespace.

    ``AsyncIPRoute`` cannot open its socket on uvloop (which the daemons run on), so the
    blocking API runs here instead: calls never block the event loop, and the socket is
    only ever used by the thread that created it. Other blocking netlink work of the
    same owner (raw dumps) may run on this thread too, through :meth:`call`.
    """

    def __init__(self, netns: str | None, label: str) -> None:
        self.netns = netns
        self.ipr: Any = None
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix=f"{label}-{netns or 'host'}"
        )

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._thread is None:
            raise errors.FailedPrecondition(f"netlink thread for {self.netns!r} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    async def open(self) -> Any:
        """Open ``IPRoute`` on a socket created inside the namespace; returns it."""
        sock = await asyncio.to_thread(netlink_socket, self.netns)
        fd = sock.detach()  # pyroute2 takes the descriptor over
        try:
            self.ipr = await self.call(IPRoute, fileno=fd, groups=0)
        except BaseException:
            os.close(fd)
            raise
        return self.ipr

    async def close(self) -> None:
        if self.ipr is not None:
            ipr, self.ipr = self.ipr, None
            with contextlib.suppress(Exception):
                await self.call(ipr.close)
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None


class Netlink:
    """Routes, rules and links of one network namespace (None: the agent's own).

    Use as ``async with Netlink("ns1") as nl: ...``. Mutating calls are serialised per
    instance; separate instances on the same namespace are only as safe as the kernel's
    own per-message atomicity (which the read-back after every ensure reports on).
    """

    def __init__(self, netns: str | None = None, *, verify_timeout_s: float = 2.0) -> None:
        self.netns = check_netns(netns)
        self.verify_timeout_s = verify_timeout_s
        self.where = f"netns {netns!r}" if netns else "the host namespace"
        self._py: PyrouteThread | None = None
        self._routes: _RouteSocket | None = None
        self._lock = asyncio.Lock()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking pyroute2 call on this adapter's own thread."""
        if self._py is None:
            raise errors.FailedPrecondition(f"netlink adapter for {self.where} is not open")
        return await self._py.call(fn, *args, **kwargs)

    async def open(self) -> Netlink:
        if self._py is not None:
            return self
        needs = (
            "entering a named network namespace needs CAP_SYS_ADMIN (and changing it "
            "CAP_NET_ADMIN); run as root or grant both"
        )
        try:
            with namespace_errors(self.netns, self.where, needs):
                self._py = PyrouteThread(self.netns, "nl")
                self._routes = await asyncio.to_thread(_RouteSocket.open, self.netns)
                await self._py.open()
                await self.links()  # fail now, not at first use
        except NetlinkError as exc:
            await self.close()
            raise kernel_error(exc.code, f"open {self.where}") from None
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        if self._py is not None:
            await self._py.close()
            self._py = None
        if self._routes is not None:
            self._routes.close()
            self._routes = None

    async def __aenter__(self) -> Netlink:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _require(self) -> tuple[Any, _RouteSocket]:
        """The open sockets; a route socket abandoned mid-exchange is replaced first."""
        if self._py is None or self._py.ipr is None or self._routes is None:
            raise errors.FailedPrecondition(f"netlink adapter for {self.where} is not open")
        if self._routes.broken:
            self._routes.close()
            self._routes = await asyncio.to_thread(_RouteSocket.open, self.netns)
        return self._py.ipr, self._routes

    # -- links ------------------------------------------------------------------------

    async def links(self) -> dict[str, LinkInfo]:
        ipr, _ = await self._require()
        found: dict[str, LinkInfo] = {}
        try:
            for msg in await self._call(lambda: list(ipr.get_links())):
                info = LinkInfo(
                    name=str(msg.get("ifname")),
                    index=int(msg["index"]),
                    mtu=int(msg.get("mtu") or 0),
                    min_mtu=int(msg.get("min_mtu") or 0),
                    max_mtu=int(msg.get("max_mtu") or 0),
                    oper_up=msg.get("operstate") == "UP",
                    kind=str(msg.get(("linkinfo", "kind")) or ""),
                )
                found[info.name] = info
        except NetlinkError as exc:
            raise kernel_error(exc.code, f"list interfaces in {self.where}") from None
        return found

    async def set_mtu(self, name: str, mtu: int) -> LinkInfo:
        """Set an interface's MTU (``ip link set NAME mtu MTU``) and return it read back."""
        ipr, _ = await self._require()
        async with self._lock:
            link = (await self.links()).get(name)
            if link is None:
                raise errors.field_error("interface", name, f"no such interface in {self.where}")
            low, high = link.min_mtu or 68, link.max_mtu or 65535
            if not low <= mtu <= high:
                raise errors.field_error("mtu", mtu, f"{name} accepts {low}..{high}")
            if link.mtu != mtu:
                try:
                    await self._call(ipr.link, "set", index=link.index, mtu=mtu)
                except NetlinkError as exc:
                    raise kernel_error(
                        exc.code, f"set mtu {mtu} on {name} in {self.where}"
                    ) from None
            return await self._poll_link(name, lambda info: info.mtu == mtu)

    async def _poll_link(self, name: str, done: Callable[[LinkInfo], bool]) -> LinkInfo:
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.01
        while True:
            link = (await self.links()).get(name)
            if link is None:
                raise errors.Aborted(f"interface {name} disappeared from {self.where}")
            if done(link) or time.monotonic() >= deadline:
                return link
            await asyncio.sleep(delay)
            delay = min(0.2, delay * 2)

    # -- routes -----------------------------------------------------------------------

    async def routes(self) -> frozenset[RouteSpec]:
        """The routes OrchestrRL installed (protocol ``OWNER_PROTO``), in every table."""
        _, sock = await self._require()
        names = {link.index: link.name for link in (await self.links()).values()}
        return frozenset(await self._owned_routes(sock, names))

    async def _owned_routes(self, sock: _RouteSocket, names: dict[int, str]) -> list[RouteSpec]:
        owned = []
        hop_sets: dict[tuple[rtnl.WireHop, ...], tuple[KernelHop, ...]] = {}
        for version in (4, 6):
            for wire in await sock.dump(version, proto=OWNER_PROTO):
                if wire.proto != OWNER_PROTO or wire.kind != rtnl.RTN_UNICAST:
                    continue
                spec = _route_from_wire(wire, names, hop_sets)
                if spec is None:
                    log.warning("owned_route_unreadable", route=repr(wire), netns=self.netns)
                else:
                    owned.append(spec)
        return owned

    async def _foreign_keys(
        self, sock: _RouteSocket, desired: Iterable[RouteSpec]
    ) -> set[RouteKey]:
        keys: set[RouteKey] = set()
        for version, table in sorted({(r.family, r.table) for r in desired}):
            for wire in await sock.dump(version, table=table, skip_proto=OWNER_PROTO):
                if wire.table == table:
                    keys.add((version, wire.table, wire.destination, wire.metric))
        return keys

    async def check_routes(self, desired: Iterable[RouteSpec]) -> None:
        """Everything that can be known before touching the kernel; raises, changes nothing."""
        _, sock = await self._require()
        want = list(desired)
        index_routes(want)
        links = await self.links()
        self._check_devices(want, links)
        names = {link.index: link.name for link in links.values()}
        ours = {r.key for r in await self._owned_routes(sock, names)}
        await self._check_conflicts(sock, [r for r in want if r.key not in ours])

    def _check_devices(self, routes: Sequence[RouteSpec], links: dict[str, LinkInfo]) -> None:
        """Every device a route names (shared or per hop) must exist; the error names the
        field as the route spells it (``device`` or ``nexthops[i].device``)."""
        missing = unknown_devices(routes, links)
        if missing:
            first = missing[0]
            others = sorted({m.device for m in missing[1:]} - {first.device})
            also = f"; also missing: {', '.join(others)}" if others else ""
            raise errors.field_error(
                first.field,
                first.device,
                f"no such interface in {self.where} (it has: {', '.join(sorted(links))}), "
                f"in route {first.route.describe()}{also}",
            )

    async def _check_conflicts(self, sock: _RouteSocket, new: Sequence[RouteSpec]) -> None:
        """Refuse routes whose key someone else's route holds (only keys not yet ours can
        be held by someone else, so only those tables are read)."""
        if not new:
            return
        taken = foreign_conflicts(new, await self._foreign_keys(sock, new))
        if taken:
            more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
            raise errors.FailedPrecondition(
                f"route {taken[0].describe()}{more}: {self.where} already has a route with "
                "this destination, table and metric that OrchestrRL did not install; remove "
                "it or choose another metric"
            )

    async def ensure_routes(self, desired: Iterable[RouteSpec], prune: bool) -> RouteChange:
        """Make OrchestrRL's routes match ``desired``; remove others of ours only if prune."""
        _, sock = await self._require()
        want = list(desired)
        async with self._lock:
            links = await self.links()
            names = {link.index: link.name for link in links.values()}
            keys = index_routes(want)
            self._check_devices(want, links)
            observed = await self._owned_routes(sock, names)
            plan = diff_routes(observed, want, prune)
            await self._check_conflicts(sock, plan.add)
            if plan.empty:
                final = frozenset(observed)
            else:
                await self._apply(sock, plan, observed, links)
                final = await self._settle(sock, names, want, prune)
        change = RouteChange(
            added=len(plan.add),
            removed=len(plan.remove),
            replaced=len(plan.replace),
            unchanged=len(keys) - len(plan.add) - len(plan.replace),
            routes=final,
        )
        if not plan.empty:
            log.info(
                "routes_ensured",
                netns=self.netns,
                added=change.added,
                replaced=change.replaced,
                removed=change.removed,
                unchanged=change.unchanged,
            )
        return change

    async def verify_routes(self, desired: Iterable[RouteSpec], prune: bool) -> RouteDiff:
        """What an ensure would still change now (empty: the kernel matches ``desired``)."""
        _, sock = await self._require()
        names = {link.index: link.name for link in (await self.links()).values()}
        return diff_routes(await self._owned_routes(sock, names), desired, prune)

    async def _apply(
        self,
        sock: _RouteSocket,
        plan: RouteDiff,
        observed: Sequence[RouteSpec],
        links: dict[str, LinkInfo],
    ) -> None:
        ifindexes = {name: link.index for name, link in links.items()}
        before = {r.key: r for r in observed}
        ops: list[tuple[rtnl.RouteOp, RouteSpec]] = [
            *(("add", r) for r in plan.add),
            *(("replace", r) for r in plan.replace),
            *(("delete", r) for r in plan.remove),
        ]
        acks = await sock.request([_op_route(op, r, ifindexes) for op, r in ops])
        failed = [
            (op, route, code, text)
            for (op, route), (code, text) in zip(ops, acks, strict=True)
            if code and not (op == "delete" and code in TOLERATED_ON_DELETE)
        ]
        if not failed:
            return
        done = [op_route for op_route, (code, _) in zip(ops, acks, strict=True) if not code]
        undo: list[tuple[rtnl.RouteOp, RouteSpec]] = []
        for op, route in reversed(done):
            if op == "add":
                undo.append(("delete", route))
            elif op == "replace":
                undo.append(("replace", before[route.key]))
            else:
                undo.append(("replace", route))
        undo_acks = await sock.request([_op_route(op, r, ifindexes) for op, r in undo])
        undo_failed = [
            r.describe() for (_, r), (code, _) in zip(undo, undo_acks, strict=True) if code
        ]
        op, route, code, text = failed[0]
        more = f" ({len(failed) - 1} more messages failed)" if len(failed) > 1 else ""
        undone = (
            f"; rolling back also failed for {len(undo_failed)} routes, e.g. {undo_failed[0]}"
            if undo_failed
            else f"; the {len(done)} changes already made were rolled back"
        )
        log.warning("routes_rolled_back", netns=self.netns, failed=len(failed), undone=len(undo))
        error = kernel_error(code, f"{op} route {route.describe()} in {self.where}", text)
        raise type(error)(f"{error}{more}{undone}")

    async def _settle(
        self,
        sock: _RouteSocket,
        names: dict[int, str],
        want: Sequence[RouteSpec],
        prune: bool,
    ) -> frozenset[RouteSpec]:
        """Read back until the kernel shows the desired state (or give up after a while)."""
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.01
        while True:
            observed = await self._owned_routes(sock, names)
            remaining = diff_routes(observed, want, prune)
            if remaining.empty:
                return frozenset(observed)
            if time.monotonic() >= deadline:
                first = (remaining.add or remaining.replace or remaining.remove)[0]
                raise errors.Aborted(
                    f"routes in {self.where} did not converge within "
                    f"{self.verify_timeout_s:g}s: {len(remaining.add)} missing, "
                    f"{len(remaining.replace)} different, {len(remaining.remove)} stale, "
                    f"e.g. {first.describe()}; another process may be changing them"
                )
            await asyncio.sleep(delay)
            delay = min(0.2, delay * 2)

    # -- rules ------------------------------------------------------------------------

    async def _all_rules(self) -> tuple[list[RuleSpec], list[RuleSpec]]:
        """(ours, everyone else's) rules that select a table."""
        ipr, _ = await self._require()
        ours: list[RuleSpec] = []
        theirs: list[RuleSpec] = []
        try:
            for family in (socket.AF_INET, socket.AF_INET6):
                for msg in await self._call(lambda f=family: list(ipr.get_rules(family=f))):
                    spec = _rule_from_msg(msg)
                    if spec is not None:
                        owned = msg.get_attr("FRA_PROTOCOL") == OWNER_PROTO
                        (ours if owned else theirs).append(spec)
        except NetlinkError as exc:
            raise kernel_error(exc.code, f"list rules in {self.where}") from None
        return ours, theirs

    async def rules(self) -> frozenset[RuleSpec]:
        """The policy rules OrchestrRL installed."""
        return frozenset((await self._all_rules())[0])

    async def check_rules(self, desired: Iterable[RuleSpec]) -> None:
        want = list(desired)
        ours, theirs = await self._all_rules()
        diff_rules(ours, want, prune=False)  # duplicates
        self._check_rule_conflicts(want, theirs)

    def _check_rule_conflicts(self, want: Sequence[RuleSpec], theirs: Sequence[RuleSpec]) -> None:
        taken = sorted({r.describe() for r in want if r in set(theirs)})
        if taken:
            raise errors.FailedPrecondition(
                f"rule {taken[0]}: {self.where} already has this rule and OrchestrRL did not "
                "install it; remove it or change the priority"
            )

    async def ensure_rules(self, desired: Iterable[RuleSpec], prune: bool) -> RuleChange:
        want = list(desired)
        async with self._lock:
            ours, theirs = await self._all_rules()
            plan = diff_rules(ours, want, prune)
            self._check_rule_conflicts(want, theirs)
            done: list[tuple[str, RuleSpec]] = []
            for op, rule in [*(("add", r) for r in plan.add), *(("del", r) for r in plan.remove)]:
                try:
                    await self._rule(op, rule)
                except NetlinkError as exc:
                    if op == "del" and exc.code in TOLERATED_ON_DELETE:
                        continue
                    await self._undo_rules(done)
                    error = kernel_error(exc.code, f"{op} rule {rule.describe()} in {self.where}")
                    raise type(error)(
                        f"{error}; the {len(done)} rule changes already made were rolled back"
                    ) from None
                done.append((op, rule))
            final = await self._settle_rules(want, prune)
        if plan.add or plan.remove:
            log.info(
                "rules_ensured", netns=self.netns, added=len(plan.add), removed=len(plan.remove)
            )
        return RuleChange(
            added=len(plan.add),
            removed=len(plan.remove),
            unchanged=len(want) - len(plan.add),
            rules=final,
        )

    async def _rule(self, op: str, rule: RuleSpec) -> None:
        ipr, _ = await self._require()
        family = FAMILY_OF[rule.family or 4]
        args: dict[str, Any] = {
            "family": family,
            "priority": rule.priority,
            "table": rule.table,
            "action": FR_ACT_TO_TBL,
            "protocol": OWNER_PROTO,
        }
        for name, prefix in (("src", rule.source), ("dst", rule.destination)):
            if prefix:
                address, _, length = prefix.partition("/")
                args[name] = address
                args[f"{name}_len"] = int(length)
        if rule.input_interface:
            args["iifname"] = rule.input_interface
        await self._call(ipr.rule, op, **args)

    async def _undo_rules(self, done: Sequence[tuple[str, RuleSpec]]) -> None:
        for op, rule in reversed(done):
            try:
                await self._rule("del" if op == "add" else "add", rule)
            except NetlinkError as exc:
                log.error("rule_rollback_failed", rule=rule.describe(), errno=exc.code)

    async def _settle_rules(self, want: Sequence[RuleSpec], prune: bool) -> frozenset[RuleSpec]:
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.01
        while True:
            ours = (await self._all_rules())[0]
            if diff_rules(ours, want, prune).empty:
                return frozenset(ours)
            if time.monotonic() >= deadline:
                raise errors.Aborted(
                    f"rules in {self.where} did not converge within {self.verify_timeout_s:g}s;"
                    " another process may be changing them"
                )
            await asyncio.sleep(delay)
            delay = min(0.2, delay * 2)


def _route_from_wire(
    wire: rtnl.WireRoute,
    names: dict[int, str],
    hop_sets: dict[tuple[rtnl.WireHop, ...], tuple[KernelHop, ...]],
) -> RouteSpec | None:
    """One of our routes as a RouteSpec; None if it is not something we could have
    installed (a hop with neither gateway nor known device). ``hop_sets`` memoises the
    translation of wire hops (ifindex, flags) to (gateway, device, onlink) for one dump:
    many routes share a few hop sets."""
    hops = hop_sets.get(wire.nexthops)
    if hops is None:
        hops = tuple(
            (gateway, names.get(ifindex), bool(flags & rtnl.RTNH_F_ONLINK))
            for gateway, ifindex, flags in wire.nexthops
        )
        hop_sets[wire.nexthops] = hops
    if not hops or any(gateway is None and device is None for gateway, device, _ in hops):
        return None
    return RouteSpec.from_kernel(wire.version, wire.destination, hops, wire.table, wire.metric)


def _rule_from_msg(msg: Any) -> RuleSpec | None:
    """A RuleSpec for a rule that selects a table by the matches RuleSpec knows (source,
    destination, input interface); None for any other rule, so it is never confused
    with one of ours."""
    if msg["action"] != FR_ACT_TO_TBL or msg["tos"] or msg["flags"] & FIB_RULE_INVERT:
        return None
    if any(msg.get_attr(name) is not None for name in OTHER_RULE_MATCHES):
        return None
    version = VERSION_OF.get(msg["family"])
    table = msg.get_attr("FRA_TABLE") or msg["table"]
    priority = msg.get_attr("FRA_PRIORITY") or 0
    if version is None or not priority or not table:
        return None
    source = f"{msg.get_attr('FRA_SRC')}/{msg['src_len']}" if msg.get_attr("FRA_SRC") else None
    dest = f"{msg.get_attr('FRA_DST')}/{msg['dst_len']}" if msg.get_attr("FRA_DST") else None
    try:
        return RuleSpec(
            priority=priority,
            table=table,
            source=source,
            destination=dest,
            input_interface=msg.get_attr("FRA_IIFNAME"),
            family=version,
        )
    except errors.InvalidArgument:
        return None

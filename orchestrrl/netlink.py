"""The netlink adapter for routes, links and policy rules of one network namespace.

It takes and returns our own frozen values (``RouteSpec``, ``RuleSpec``, ``LinkInfo``,
``RouteChange``), maps kernel error codes to ``orchestrrl.errors``, and never lets a
pyroute2 object or ``**kwargs`` escape.

Where pyroute2 is used, and where not:

- Routes, links and rule listings go through our own codec (``orchestrrl.rtnl``) on a
  plain rtnetlink socket: routes are the bulk object (thousands per switch at a phase
  change), sent in batches of hundreds of messages per ``send``; link and rule listings
  are small but read at every ApplyRoutes, and pyroute2 decodes every attribute of
  every message. See ``orchestrrl.rtnl`` for the measurements behind that choice and
  ``bench/routes.py`` for the comparison with ``ip -batch``.
- Rule and link changes (add/delete a rule, MTU) go through pyroute2's ``IPRoute``,
  opened on first use (an ApplyRoutes that changes no rule never starts it); traffic
  control (``orchestrrl.tc``) uses it too, through the same :class:`PyrouteThread`; and
  :func:`netlink_socket` (like ``sim_backends.netns``) uses ``pyroute2.netns.setns`` to
  create sockets inside a namespace (in a short-lived thread; no fork).
- ``IPRoute`` runs on one dedicated thread per adapter rather than as ``AsyncIPRoute``
  on the event loop: the daemons run on uvloop, and pyroute2 opens its netlink socket
  with ``loop.create_datagram_endpoint``, which uvloop refuses for AF_NETLINK
  ("ValueError: cannot open a UDP handle, invalid family 16"). Upstream:
  https://github.com/svinota/pyroute2/issues/1335 ("compatibility with uvloop", open;
  pyroute2 0.9.2, uvloop 0.21) and the uvloop side,
  https://github.com/MagicStack/uvloop/issues/676 ("Support datagram endpoints over
  netlink sockets", open). A thread has no running loop, so ``IPRoute`` makes its own
  with ``asyncio.new_event_loop()`` (a plain asyncio loop: ``uvloop.run`` does not change
  the global policy), and the calls never block the daemon's event loop.

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
import bisect
import contextlib
import errno
import functools
import operator
import os
import re
import socket
import struct
import threading
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Container,
    Iterable,
    Iterator,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, chain, groupby, repeat
from types import TracebackType
from typing import Any, TypeVar

from pyroute2 import IPRoute, NetlinkError
from pyroute2.netns import setns

from orchestrrl import errors, rtnl
from orchestrrl.logs import get_logger
from orchestrrl.routing import (
    KernelHop,
    RouteChange,
    RouteColumns,
    RouteDiff,
    RouteKey,
    RouteShape,
    RouteSpec,
    RuleChange,
    RuleSpec,
    by_key,
    collector_paused,
    columns_satisfy,
    diff_indexed,
    diff_routes,
    diff_rules,
    foreign_conflicts,
    index_routes,
    route_shape,
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
FAMILY_OF = {4: socket.AF_INET, 6: socket.AF_INET6}
VERSION_OF: dict[int, int] = {socket.AF_INET: 4, socket.AF_INET6: 6}
NETNS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$")
TOLERATED_ON_DELETE = frozenset({errno.ENOENT, errno.ESRCH})


@dataclass(frozen=True)
class RoutePlan:
    """What an ensure will change, decided from one observation of the kernel (see
    :meth:`Netlink.prepare_routes`)."""

    want: dict[RouteKey, RouteSpec]  # the desired routes by key
    prune: bool
    read: RouteColumns  # OrchestrRL's routes when the plan was made
    diff: RouteDiff
    links: dict[str, LinkInfo]
    names: dict[int, str]  # ifindex -> link name

    @property
    def observed(self) -> tuple[RouteSpec, ...]:
        """OrchestrRL's routes when the plan was made."""
        return self.read.specs()


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

    async def _recv(self, drain: bool) -> list[bytes]:
        """The next datagram, waiting if none is queued; with ``drain``, also every
        datagram queued behind it (ACKs). Not for dumps: each read makes the kernel produce
        the next chunk, so draining never ends early."""
        loop = asyncio.get_running_loop()
        chunks = [await loop.sock_recv(self._sock, RECV_SIZE)]
        while drain:
            try:
                chunks.append(self._sock.recv(RECV_SIZE))
            except BlockingIOError:
                break
        return chunks

    async def request(
        self,
        kinds: Sequence[rtnl.RouteOp],
        routes: Sequence[RouteSpec],
        encoder: rtnl.RouteEncoder,
    ) -> list[tuple[int, str]]:
        """Send route messages (``kinds[i]`` of ``routes[i]``) in batches; (errno, text) of
        each, 0 for success."""
        async with self._lock, self._exchange("route changes"):
            return await self._request(kinds, routes, encoder)

    async def _request(
        self,
        kinds: Sequence[rtnl.RouteOp],
        routes: Sequence[RouteSpec],
        encoder: rtnl.RouteEncoder,
    ) -> list[tuple[int, str]]:
        """Each batch goes out in one ``send``; only its last message asks for an ACK. The
        kernel handles the messages of a send in order, before the send returns, and
        answers every message that fails (NLM_F_ACK or not), so when the last message's
        ACK is read every error of the batch has been read before it: one answer per batch
        instead of one per route, with the same per-message outcome."""
        results: list[tuple[int, str]] = []
        template, pack_seq = encoder.template, rtnl.U32.pack
        count, limit, batch = len(routes), self.batch_bytes, self.batch
        start = 0
        # Consecutive routes usually share their template (same operation, hop set,
        # family, table, prefix length and metric): the last one is tried first.
        last_kind: object = None
        last_hops: object = None
        last_order: tuple[object, ...] = ()
        before_seq = before_dst = after_dst = b""
        length = 0
        ends = _template_runs(kinds, routes)
        while start < count:
            run_end = ends[bisect.bisect_right(ends, start)]
            if run_end - start >= _RUN:
                # A long run of one template: the batch is assembled in C.
                head, middle, tail, message = template(kinds[start], routes[start])
                size = min(run_end - start, batch, max(1, limit // message))
                first = self._seq + 1 if self._seq + size < 0xFFFF_FFFF else 1
                numbers = range(first, first + size)
                self._seq = first + size - 1
                payload = bytearray(
                    b"".join(
                        chain.from_iterable(
                            zip(
                                repeat(head, size),
                                map(pack_seq, numbers),
                                repeat(middle, size),
                                map(_destination_of, map(_order_of, routes[start : start + size])),
                                repeat(tail, size),
                                strict=True,
                            )
                        )
                    )
                )
                start += size
                await self._send_batch(payload, (size - 1) * message, numbers, results)
                continue
            seqs: dict[int, int] = {}
            parts: list[bytes] = []
            size = last = 0  # of the batch; offset of its last message
            seq = self._seq
            for index in range(start, min(count, start + batch)):
                route = routes[index]
                kind, order = kinds[index], route.order
                if (
                    kind is not last_kind
                    or route.nexthops is not last_hops
                    or order[1] != last_order[1]
                    or order[3] != last_order[3]
                    or order[4] != last_order[4]
                    or order[0] != last_order[0]
                ):
                    before_seq, before_dst, after_dst, length = template(kind, route)
                    last_kind, last_hops, last_order = kind, route.nexthops, order
                if seqs and size + length > limit:
                    break
                seq = (seq + 1) & 0xFFFF_FFFF or 1
                parts += (before_seq, pack_seq(seq), before_dst, order[2], after_dst)
                seqs[seq] = index
                last = size
                size += length
            self._seq = seq
            start += len(seqs)
            await self._send_batch(bytearray(b"".join(parts)), last, seqs, results)
        return results

    async def _send_batch(
        self, payload: bytearray, last: int, seqs: Collection[int], results: list[tuple[int, str]]
    ) -> None:
        """Send one batch (its last message at offset ``last``, asked for an ACK) and add
        the outcome of each of its messages (sequence numbers ``seqs``) to ``results``."""
        header = rtnl.nlmsghdr(payload, last)
        _FLAGS_AT.pack_into(payload, last + _FLAGS_OFFSET, header.flags | rtnl.NLM_F_ACK)
        failed: dict[int, tuple[int, str]] = {}
        await asyncio.get_running_loop().sock_sendall(self._sock, payload)
        while header.seq not in failed:
            for chunk in await self._recv(drain=True):
                for frame in rtnl.frames(chunk, strict=True):
                    reply = frame.header
                    if reply.type == rtnl.NLMSG_ERROR and reply.seq in seqs:
                        failed[reply.seq] = rtnl.decode_error(
                            rtnl.Message(
                                reply.type,
                                reply.flags,
                                reply.seq,
                                chunk[frame.start : frame.end],
                            )
                        )
        ok = _OK
        if len(failed) == 1:  # only the answer to the last message: no other failed
            results += [ok] * (len(seqs) - 1)
            results.append(failed[header.seq])
        else:
            results.extend(failed.get(seq, ok) for seq in seqs)
        # The kernel answers synchronously, so nothing above ever waits: give the
        # event loop a turn per batch (gRPC, telemetry, timeouts, cancellation).
        await asyncio.sleep(0)

    async def links(self) -> list[rtnl.Link]:
        """Every link of the namespace (an RTM_GETLINK dump without statistics)."""
        async with self._lock, self._exchange("link dump"):
            for _ in range(DUMP_RETRIES):
                seq = self._next_seq()
                await asyncio.get_running_loop().sock_sendall(
                    self._sock, rtnl.link_dump_request(seq)
                )
                links: list[rtnl.Link] = []
                interrupted = False
                done = False
                while not done:
                    for chunk in await self._recv(drain=False):
                        for header, start, end in rtnl.frames(chunk, strict=True):
                            if header.seq != seq:
                                continue  # a late answer to a cancelled request
                            interrupted |= bool(header.flags & rtnl.NLM_F_DUMP_INTR)
                            if header.type == rtnl.NLMSG_DONE:
                                done = True
                            elif header.type == rtnl.NLMSG_ERROR:
                                code, text = rtnl.decode_error(
                                    rtnl.Message(header.type, header.flags, seq, chunk[start:end])
                                )
                                raise kernel_error(code, "list interfaces", text)
                            elif header.type == rtnl.RTM_NEWLINK:
                                link = rtnl.parse_link(chunk, start, end)
                                if link is not None:
                                    links.append(link)
                if not interrupted:
                    return links
        raise errors.Aborted(
            f"link dump kept being interrupted by concurrent changes ({DUMP_RETRIES} tries)"
        )

    async def dump(
        self,
        version: int,
        take: Callable[[bytes, int, int], T | None],
        table: int = 0,
        proto: int = 0,
        bulk: Callable[[bytes, int], list[T] | None] | None = None,
    ) -> list[T]:
        """Routes of one family, filtered by the kernel on ``table`` and ``proto`` (0: any):
        what ``take(datagram, start, end)`` makes of each RTM_NEWROUTE body
        ``datagram[start:end]``, None ones left out. ``bulk(datagram, seq)``, if given,
        is offered each datagram first: what ``take`` would make of all its messages, or
        None when it cannot tell (the datagram is then read message by message)."""
        return await self._dump(
            lambda seq: rtnl.encode_dump(seq, version, table, proto),
            rtnl.RTM_NEWROUTE,
            take,
            f"IPv{version} route",
            f"dump IPv{version} routes",
            missing=errno.ENOENT,  # IPv4: the table does not exist yet
            bulk=bulk,
        )

    async def rules(self, version: int, what: str) -> list[rtnl.WireRule]:
        """The policy rules of one family; kernel errors say ``what``."""
        return await self._dump(
            lambda seq: rtnl.rule_dump_request(seq, version),
            rtnl.RTM_NEWRULE,
            rtnl.decode_rule,
            f"IPv{version} rule",
            what,
        )

    async def _dump(
        self,
        request: Callable[[int], bytes],
        answer: int,
        take: Callable[[bytes, int, int], T | None],
        name: str,
        what: str,
        missing: int = 0,
        bulk: Callable[[bytes, int], list[T] | None] | None = None,
    ) -> list[T]:
        async with self._lock, self._exchange(f"{name} dump"):
            for _ in range(DUMP_RETRIES):
                found, interrupted = await self._dump_once(
                    request, answer, take, what, missing, bulk
                )
                if not interrupted:
                    return found
        raise errors.Aborted(
            f"{name.split()[-1]} dump kept being interrupted by concurrent changes "
            f"({DUMP_RETRIES} tries)"
        )

    async def _dump_once(
        self,
        request: Callable[[int], bytes],
        answer: int,
        take: Callable[[bytes, int, int], T | None],
        what: str,
        missing: int,
        bulk: Callable[[bytes, int], list[T] | None] | None = None,
    ) -> tuple[list[T], bool]:
        """One dump: what ``take`` makes of each ``answer`` message (or ``bulk`` of a whole
        datagram, see :meth:`dump`); an error ``missing`` is an empty answer. The message
        walk is rtnl.frames written out (tens of thousands of routes per dump: no tuple
        per message)."""
        seq = self._next_seq()
        await asyncio.get_running_loop().sock_sendall(self._sock, request(seq))
        found: list[T] = []
        add = found.append
        unpack_header, head = rtnl.NLMSGHDR.unpack_from, rtnl.NLMSGHDR.size
        interrupted = False
        while True:
            await asyncio.sleep(0)  # as in _request: let the loop run between chunks
            for chunk in await self._recv(drain=False):
                if bulk is not None:
                    items = bulk(chunk, seq)
                    if items is not None:
                        found += items
                        continue
                offset, size = 0, len(chunk)
                while offset + head <= size:
                    length, kind, flags, mseq, _ = unpack_header(chunk, offset)
                    if length < head or offset + length > size:
                        raise ValueError(
                            f"truncated netlink message at offset {offset} (length {length})"
                        )
                    start, end = offset + head, offset + length
                    offset += (length + 3) & ~3
                    if mseq != seq:
                        continue  # a late ACK of a cancelled request
                    if flags & rtnl.NLM_F_DUMP_INTR:
                        interrupted = True
                    if kind == answer:
                        item = take(chunk, start, end)
                        if item is not None:
                            add(item)
                    elif kind == rtnl.NLMSG_DONE:
                        return found, interrupted
                    elif kind == rtnl.NLMSG_ERROR:
                        code, text = rtnl.decode_error(
                            rtnl.Message(kind, flags, mseq, chunk[start:end])
                        )
                        if code and code == missing:
                            return [], False
                        raise kernel_error(code, what, text)


_DST_AT = 24  # offset of the destination address in an RTM_NEWROUTE body laid out as
# rtmsg (12 bytes), RTA_TABLE (8), RTA_DST (4 + address): how the kernel writes them
_DST_END: dict[int, int] = {socket.AF_INET: _DST_AT + 4, socket.AF_INET6: _DST_AT + 16}
_LAYOUT = struct.Struct("=HHIHH")  # RTA_TABLE (len, type, u32), RTA_DST (len, type)
# Routes read back, column-wise: their shapes and packed destinations (RouteColumns)
_Batch = tuple[list[RouteShape], list[bytes]]


class _OwnedReader:
    """OrchestrRL's routes (protocol ``OWNER_PROTO``, unicast) as batches of
    :class:`RouteColumns` (shapes, packed destinations), from the RTM_NEWROUTE bodies of
    dumps, for :meth:`_RouteSocket.dump`.

    Routes that differ only in their destination (the bulk of a dump: a fabric has many
    routes over a few hop sets) have the same bytes but for the address: the first route
    of each such shape is decoded in full, the others only cut out their address."""

    def __init__(self, names: dict[int, str], netns: str | None) -> None:
        self._names = names
        self._netns = netns
        self._decoder = rtnl.RouteDecoder()
        # body without the address -> its shape; None: not ours, skip it
        self._shapes: dict[bytes, RouteShape | None] = {}
        # (message length, end of the address in the body) -> layout, see bulk(); and
        # the layout that cuts out only the address, see _one_shape()
        self._layouts: dict[tuple[int, int], struct.Struct] = {}
        self._cuts: dict[tuple[int, int], struct.Struct] = {}

    def __call__(self, chunk: bytes, start: int, end: int) -> _Batch | None:
        if end - start < _DST_AT:
            return self._first(chunk, start, end, start, b"")
        dst_end = start + _DST_END.get(chunk[start], 0)  # rtm_family
        key = chunk[start : _DST_AT + start] + chunk[dst_end:end]
        shape = self._shapes.get(key, _UNKNOWN)
        if shape is None:
            return None
        if shape is _UNKNOWN:
            return self._first(chunk, start, end, dst_end, key)
        return [shape], [chunk[_DST_AT + start : dst_end]]

    def bulk(self, chunk: bytes, seq: int) -> list[_Batch] | None:
        """The routes of a whole datagram (for :meth:`_RouteSocket.dump`), when it holds
        only RTM_NEWROUTE messages of dump ``seq``, uninterrupted, all of one length and
        family with the usual layout (the bulk of a dump): the messages are cut apart in
        C (``struct.iter_unpack``), and a datagram of one known shape is recognised as a
        whole (:meth:`_one_shape`). None otherwise: read them one by one."""
        size = len(chunk)
        if size < rtnl.NLMSGHDR.size + _DST_AT:
            return None
        length = rtnl.U32.unpack_from(chunk, 0)[0]
        dst_end = _DST_END.get(chunk[rtnl.NLMSGHDR.size], 0)  # rtm_family
        if length & 3 or not dst_end or length < rtnl.NLMSGHDR.size + dst_end or size % length:
            return None
        same = self._one_shape(chunk, seq, length, dst_end)
        if same is not None:
            return same
        layout = self._layouts.get((length, dst_end))
        if layout is None:
            tail = length - rtnl.NLMSGHDR.size - dst_end
            layout = struct.Struct(f"=IHHII{_DST_AT}s{dst_end - _DST_AT}s{tail}s")
            self._layouts[length, dst_end] = layout
        lengths, kinds, flags, seqs, _, heads, addresses, tails = zip(
            *layout.iter_unpack(chunk), strict=True
        )
        if (
            set(lengths) != {length}
            or set(kinds) != {rtnl.RTM_NEWROUTE}
            or set(seqs) != {seq}
            or any(f & rtnl.NLM_F_DUMP_INTR for f in set(flags))
        ):
            return None
        found: list[RouteShape] = []
        found_at: list[bytes] = []
        shapes = self._shapes
        last_head = last_tail = b""
        known: RouteShape | None = _UNKNOWN
        start = rtnl.NLMSGHDR.size
        for head, packed, tail in zip(heads, addresses, tails, strict=True):
            if head != last_head or tail != last_tail or known is _UNKNOWN:
                last_head, last_tail = head, tail
                known = shapes.get(head + tail, _UNKNOWN)
            if known is _UNKNOWN:
                first = self._first(
                    chunk, start, start + length - rtnl.NLMSGHDR.size, start + dst_end, head + tail
                )
                if first is not None:
                    found += first[0]
                    found_at += first[1]
            elif known is not None:
                found.append(known)
                found_at.append(packed)
            start += length
        return [(found, found_at)]

    def _one_shape(self, chunk: bytes, seq: int, length: int, dst_end: int) -> list[_Batch] | None:
        """The routes of a datagram of messages of ``length`` bytes that are all its first
        message but for the destination address (one dump's routes of one known shape:
        the bulk of a dump). Checked by rebuilding the datagram from the first message
        and the addresses and comparing, in C; None when it is not so (or the shape is
        not known yet)."""
        head = rtnl.NLMSGHDR.size
        _, kind, flags, first_seq, _ = rtnl.NLMSGHDR.unpack_from(chunk, 0)
        if kind != rtnl.RTM_NEWROUTE or first_seq != seq or flags & rtnl.NLM_F_DUMP_INTR:
            return None
        before, after = chunk[: head + _DST_AT], chunk[head + dst_end : length]
        shape = self._shapes.get(before[head:] + after, _UNKNOWN)
        if shape is _UNKNOWN:
            return None
        cut = self._cuts.get((length, dst_end))
        if cut is None:
            cut = struct.Struct(f"={head + _DST_AT}x{dst_end - _DST_AT}s{len(after)}x")
            self._cuts[length, dst_end] = cut
        addresses = list(map(_first_item, cut.iter_unpack(chunk)))
        rebuilt = b"".join(chain.from_iterable(zip(repeat(before), addresses, repeat(after))))
        if rebuilt != chunk:
            return None
        return [] if shape is None else [([shape] * len(addresses), addresses)]

    def _first(self, chunk: bytes, start: int, end: int, dst_end: int, key: bytes) -> _Batch | None:
        """Decode in full; remember the shape if the body has the usual layout."""
        wire = self._decoder.decode(chunk[start:end])
        usual = start < dst_end <= end and len(self._shapes) < rtnl.HOP_CACHE
        if usual:
            table_len, table_type, _, dst_len, dst_type = _LAYOUT.unpack_from(chunk, start + 12)
            usual = (table_len, table_type, dst_len, dst_type) == (
                8,
                rtnl.RTA_TABLE,
                dst_end - start - 20,
                rtnl.RTA_DST,
            )
        if wire is None or wire.proto != OWNER_PROTO or wire.kind != rtnl.RTN_UNICAST:
            if usual:
                self._shapes[key] = None
            return None
        hops = _kernel_hops(wire.nexthops, self._names)
        if not hops:  # not remembered: warned about every time
            log.warning("owned_route_unreadable", route=repr(wire), netns=self._netns)
            return None
        address, _, length_text = wire.destination.partition("/")
        shape = route_shape(wire.version, hops, wire.table, int(length_text), wire.metric)
        if usual:
            self._shapes[key] = shape
        return [shape], [socket.inet_pton(rtnl.AF_OF[wire.version], address)]


_UNKNOWN = RouteShape(4, 0, 0, 0, ((), (), None, 0))  # marks a shape not seen yet
_first_item = operator.itemgetter(0)


_family_table = operator.attrgetter("family", "table")
_order_of = operator.attrgetter("order")
_family_of = operator.attrgetter("family")
_table_of = operator.attrgetter("table")


def _families_tables(routes: Iterable[RouteSpec]) -> list[tuple[int, int]]:
    """The distinct (family, table) of routes, sorted; gathered in C without a tuple per
    route when they are of one family (the usual case)."""
    routes = routes if isinstance(routes, (list, tuple)) else list(routes)
    families = set(map(_family_of, routes))
    if len(families) == 1:
        family = families.pop()
        return [(family, table) for table in sorted(set(map(_table_of, routes)))]
    return sorted(set(map(_family_table, routes)))


_hops_of = operator.attrgetter("nexthops")
_destination_of = operator.itemgetter(2)  # of an order: the packed destination
_shape_of = operator.itemgetter(0, 1, 3, 4)  # of an order: all but the destination
_RUN = 32  # routes of one template from which a batch is assembled in C


def _template_runs(kinds: Sequence[rtnl.RouteOp], routes: Sequence[RouteSpec]) -> list[int]:
    """Where each run of consecutive messages that share a template (operation, hop set,
    family, table, prefix length, metric) ends, ascending; grouped in C. The collector is
    paused: a run's keys are all alive at once, and would otherwise set off collections
    that walk every route of the request, again and again."""
    keys = zip(
        kinds,
        map(id, map(_hops_of, routes)),  # the routes keep their hop sets alive
        map(_shape_of, map(_order_of, routes)),
        strict=True,
    )
    with collector_paused():
        return list(accumulate(len(list(group)) for _, group in groupby(keys)))


_FLAGS_AT, _FLAGS_OFFSET = struct.Struct("=H"), 6  # nlmsghdr.nlmsg_flags
_OK = (0, "")  # the answer to a message the kernel accepted


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


_NEEDS = (
    "entering a named network namespace needs CAP_SYS_ADMIN (and changing it "
    "CAP_NET_ADMIN); run as root or grant both"
)


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
        self._py_lock = asyncio.Lock()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking pyroute2 call on this adapter's own thread."""
        if self._py is None:
            raise errors.FailedPrecondition(f"netlink adapter for {self.where} is not open")
        return await self._py.call(fn, *args, **kwargs)

    async def open(self) -> Netlink:
        """Open the route socket (routes, links and rule listings); pyroute2, for rule
        and link changes, is opened at its first use."""
        if self._routes is not None:
            return self
        try:
            with namespace_errors(self.netns, self.where, _NEEDS):
                self._routes = await asyncio.to_thread(_RouteSocket.open, self.netns)
                await self.links()  # fail now, not at first use
        except BaseException:
            await self.close()
            raise
        return self

    async def _ipr(self) -> Any:
        """pyroute2's ``IPRoute`` in the namespace, opened on first use."""
        await self._require()
        async with self._py_lock:
            if self._py is None:
                py = PyrouteThread(self.netns, "nl")
                try:
                    with namespace_errors(self.netns, self.where, _NEEDS):
                        await py.open()
                except NetlinkError as exc:
                    await py.close()
                    raise kernel_error(exc.code, f"open {self.where}") from None
                except BaseException:
                    await py.close()
                    raise
                self._py = py
            return self._py.ipr

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

    async def _require(self) -> _RouteSocket:
        """The open route socket; one abandoned mid-exchange is replaced first."""
        if self._routes is None:
            raise errors.FailedPrecondition(f"netlink adapter for {self.where} is not open")
        if self._routes.broken:
            self._routes.close()
            self._routes = await asyncio.to_thread(_RouteSocket.open, self.netns)
        return self._routes

    # -- links ------------------------------------------------------------------------

    async def links(self) -> dict[str, LinkInfo]:
        sock = await self._require()
        return {
            link.name: LinkInfo(
                name=link.name,
                index=link.ifindex,
                mtu=link.mtu,
                min_mtu=link.min_mtu,
                max_mtu=link.max_mtu,
                oper_up=link.oper_up,
                kind=link.kind,
            )
            for link in await sock.links()
        }

    async def set_mtu(self, name: str, mtu: int) -> LinkInfo:
        """Set an interface's MTU (``ip link set NAME mtu MTU``) and return it read back."""
        ipr = await self._ipr()
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
        sock = await self._require()
        names = {link.index: link.name for link in (await self.links()).values()}
        return frozenset((await self._owned_routes(sock, names)).specs())

    async def _owned_routes(self, sock: _RouteSocket, names: dict[int, str]) -> RouteColumns:
        reader = _OwnedReader(names, self.netns)
        batches: list[_Batch] = []
        with collector_paused():
            for version in (4, 6):
                batches += await sock.dump(version, reader, proto=OWNER_PROTO, bulk=reader.bulk)
        return RouteColumns.from_batches(batches)

    async def _foreign_keys(
        self, sock: _RouteSocket, desired: Iterable[RouteSpec]
    ) -> set[RouteKey]:
        keys: set[RouteKey] = set()
        decode = rtnl.RouteDecoder().decode

        def foreign(chunk: bytes, start: int, end: int) -> rtnl.WireRoute | None:
            if chunk[start + 5] == OWNER_PROTO:  # rtm_protocol: ours are never foreign
                return None
            return decode(chunk[start:end])

        for version, table in _families_tables(desired):
            for wire in await sock.dump(version, foreign, table=table):
                if wire.table == table:
                    keys.add((version, wire.table, wire.destination, wire.metric))
        return keys

    async def check_routes(self, desired: Iterable[RouteSpec]) -> None:
        """Everything that can be known before touching the kernel; raises, changes nothing."""
        await self.prepare_routes(desired, prune=False)

    async def prepare_routes(self, desired: Iterable[RouteSpec], prune: bool) -> RoutePlan:
        """Everything that can be known before touching the kernel (syntax, devices,
        conflicts with routes OrchestrRL did not install), and what an ensure would change;
        raises, changes nothing. :meth:`apply_routes` carries the plan out."""
        sock = await self._require()
        async with self._lock:
            return await self._prepare(sock, list(desired), prune, sorted_conflicts=False)

    async def _prepare(
        self, sock: _RouteSocket, want: list[RouteSpec], prune: bool, sorted_conflicts: bool
    ) -> RoutePlan:
        """The plan; conflicts are reported in the order of the request, or with
        ``sorted_conflicts`` in the order of the routes to add (what an ensure has
        always named first)."""
        keys = index_routes(want)
        links = await self.links()
        self._check_devices(want, links)
        names = {link.index: link.name for link in links.values()}
        read = await self._owned_routes(sock, names)
        if read and len(read) >= len(keys) and columns_satisfy(read, keys, prune):
            # Nothing to change (the usual re-apply), decided column-wise: every desired
            # key is ours already, so none can conflict.
            diff = RouteDiff((), (), ())
        else:
            have = by_key(read.specs())
            diff = diff_indexed(have, keys, prune)
            if sorted_conflicts:
                new: Sequence[RouteSpec] = diff.add
            else:
                new = [r for r in want if r.key not in have] if have else want
            await self._check_conflicts(sock, new, keys)
        return RoutePlan(
            want=keys,
            prune=prune,
            read=read,
            diff=diff,
            links=links,
            names=names,
        )

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

    async def _check_conflicts(
        self, sock: _RouteSocket, new: Sequence[RouteSpec], keys: Container[RouteKey]
    ) -> None:
        """Refuse routes whose key someone else's route holds (only keys not yet ours can
        be held by someone else, so only those tables are read). ``keys`` holds the keys
        of ``new`` (and may hold more): the few foreign keys are looked up there first."""
        if not new:
            return
        held = [key for key in await self._foreign_keys(sock, new) if key in keys]
        taken = foreign_conflicts(new, held) if held else ()
        if taken:
            more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
            raise errors.FailedPrecondition(
                f"route {taken[0].describe()}{more}: {self.where} already has a route with "
                "this destination, table and metric that OrchestrRL did not install; remove "
                "it or choose another metric"
            )

    async def ensure_routes(self, desired: Iterable[RouteSpec], prune: bool) -> RouteChange:
        """Make OrchestrRL's routes match ``desired``; remove others of ours only if prune."""
        sock = await self._require()
        async with self._lock:
            plan = await self._prepare(sock, list(desired), prune, sorted_conflicts=True)
            return await self._carry_out(sock, plan)

    async def apply_routes(self, plan: RoutePlan) -> RouteChange:
        """Carry out a plan of :meth:`prepare_routes` (as :meth:`ensure_routes` would, had
        it observed the kernel when the plan was made): write, then read back and verify.
        A change made meanwhile by someone else is caught by the kernel (an add whose key
        appeared fails, and everything is rolled back) or by the verification."""
        sock = await self._require()
        async with self._lock:
            return await self._carry_out(sock, plan)

    async def _carry_out(self, sock: _RouteSocket, plan: RoutePlan) -> RouteChange:
        diff = plan.diff
        if diff.empty:
            final = plan.read
        else:
            await self._apply(sock, diff, plan.observed, plan.links)
            final = await self._settle(sock, plan.names, plan.want, plan.prune)
        change = RouteChange(
            added=len(diff.add),
            removed=len(diff.remove),
            replaced=len(diff.replace),
            unchanged=len(plan.want) - len(diff.add) - len(diff.replace),
            read_back=final,
        )
        if not diff.empty:
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
        sock = await self._require()
        names = {link.index: link.name for link in (await self.links()).values()}
        return diff_routes((await self._owned_routes(sock, names)).specs(), desired, prune)

    async def _apply(
        self,
        sock: _RouteSocket,
        plan: RouteDiff,
        observed: Sequence[RouteSpec],
        links: dict[str, LinkInfo],
    ) -> None:
        encoder = rtnl.RouteEncoder(OWNER_PROTO, {name: link.index for name, link in links.items()})
        routes = [*plan.add, *plan.replace, *plan.remove]
        kinds: list[rtnl.RouteOp] = ["add"] * len(plan.add)
        kinds += ["replace"] * len(plan.replace)
        kinds += ["delete"] * len(plan.remove)
        acks = await sock.request(kinds, routes, encoder)
        if acks.count(_OK) == len(acks):  # in C: the usual case, every message accepted
            return
        ops = list(zip(kinds, routes, strict=True))
        failed = [
            (op, route, code, text)
            for (op, route), (code, text) in zip(ops, acks, strict=True)
            if code and not (op == "delete" and code in TOLERATED_ON_DELETE)
        ]
        if not failed:
            return
        done = [op_route for op_route, (code, _) in zip(ops, acks, strict=True) if not code]
        before = {r.key: r for r in observed}
        undo: list[tuple[rtnl.RouteOp, RouteSpec]] = []
        for op, route in reversed(done):
            if op == "add":
                undo.append(("delete", route))
            elif op == "replace":
                undo.append(("replace", before[route.key]))
            else:
                undo.append(("replace", route))
        undo_acks = await sock.request([op for op, _ in undo], [r for _, r in undo], encoder)
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
        want: dict[RouteKey, RouteSpec],
        prune: bool,
    ) -> RouteColumns:
        """Read back until the kernel shows the desired state (or give up after a while).
        The read-back is compared column-wise first; RouteSpecs are built only when that
        finds a difference (to say which, or to wait for the kernel)."""
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.01
        while True:
            observed = await self._owned_routes(sock, names)
            if columns_satisfy(observed, want, prune):
                return observed
            remaining = diff_indexed(by_key(observed.specs()), want, prune)
            if remaining.empty:
                return observed
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
        sock = await self._require()
        ours: list[RuleSpec] = []
        theirs: list[RuleSpec] = []
        for version in (4, 6):
            for wire in await sock.rules(version, f"list rules in {self.where}"):
                spec = _rule_from_wire(wire)
                if spec is not None:
                    (ours if wire.protocol == OWNER_PROTO else theirs).append(spec)
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
            if plan.add or plan.remove:
                final = await self._settle_rules(want, prune)
            else:  # nothing changed: what was just read is the state
                final = frozenset(ours)
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
        ipr = await self._ipr()
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


def _kernel_hops(hops: tuple[rtnl.WireHop, ...], names: dict[int, str]) -> tuple[KernelHop, ...]:
    """Wire hops (gateway, ifindex, flags) as (gateway, device, onlink); empty when the
    route is not something we could have installed (no hop, or a hop with neither
    gateway nor known device)."""
    kernel = tuple(
        (gateway, names.get(ifindex), bool(flags & rtnl.RTNH_F_ONLINK))
        for gateway, ifindex, flags in hops
    )
    if any(gateway is None and device is None for gateway, device, _ in kernel):
        return ()
    return kernel


def _rule_from_wire(rule: rtnl.WireRule) -> RuleSpec | None:
    """A RuleSpec for a rule that selects a table by the matches RuleSpec knows (source,
    destination, input interface); None for any other rule, so it is never confused
    with one of ours."""
    if rule.action != FR_ACT_TO_TBL or rule.tos or rule.flags & FIB_RULE_INVERT:
        return None
    if rule.other_matches:
        return None
    version = VERSION_OF.get(rule.family)
    if version is None or not rule.priority or not rule.table:
        return None
    source = f"{rule.source}/{rule.src_len}" if rule.source else None
    dest = f"{rule.destination}/{rule.dst_len}" if rule.destination else None
    try:
        return RuleSpec(
            priority=rule.priority,
            table=rule.table,
            source=source,
            destination=dest,
            input_interface=rule.input_interface,
            family=version,
        )
    except errors.InvalidArgument:
        return None

"""The standby's answer and how clients follow it: the one definition of the contract.

A fabric controller that is not the leader (a standby of an HA group, issue 17) answers
**every FabricController RPC** (reads included, to keep one rule: a standby's view may be
stale) with

- status ``UNAVAILABLE``,
- the message ``not the leader; the leader is at HOST:PORT`` (or ``not the leader; no
  leader elected yet`` when it does not know one, or ``not the leader; the leader at
  HOST:PORT is past due renewing its lease ...`` when the leader it knows has not renewed
  its lease for two renewal intervals: frozen or partitioned, so it is named to nobody),
- trailing metadata ``orl-leader`` = ``HOST:PORT`` (absent when unknown).

The FabricController service has no health or status RPC of its own; the standard
``grpc.health.v1.Health`` service and server reflection are separate services and keep
answering on a standby (health says whether the process serves, not whether it leads).

Servers raise the answer with :func:`abort_not_leader`; clients recognise it with
:func:`leader_of` / :func:`is_not_leader`, or with :func:`call`, which turns it into
:class:`NotLeader` (an ``errors.Unavailable`` carrying the leader's address). The lists of
controller addresses that clients and agents take are parsed by :func:`parse_addresses`.

A controller that hangs (SIGSTOP, a stuck host, a partition that still accepts TCP) must
not hold a caller (issue 28). Its kernel may accept the connection, so nothing fails by
itself: gRPC would wait 20 s for the HTTP/2 handshake, and a call on an established
connection would wait for its whole deadline. So every connection to a controller is made
with :func:`channel`: an HTTP/2 ping after ``KEEPALIVE_S`` of silence during a call, and a
ping unanswered for ``PING_TIMEOUT_S`` ends the connection (the call fails UNAVAILABLE);
and :func:`attempt` gives an attempt ``CONNECT_TIMEOUT_S`` to connect before it is
abandoned as :class:`Unreachable`. Controllers accept those pings (:data:`SERVER_OPTIONS`).
A standby stops naming a leader whose lease is past due (``fabric_controller.leadership``),
and callers ask every listed controller at once when the one they believe leads does not
answer promptly (``orchestrrl.client``, ``node_agent.uplink``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from orchestrrl import errors, grpcutil
from orchestrrl.tls import TlsConfig

LEADER_METADATA_KEY = "orl-leader"  # trailing metadata: the leader's HOST:PORT
NOT_LEADER_PREFIX = "not the leader"
MAX_ADDRESSES = 16  # controllers in one list: an HA group is 2-5

T = TypeVar("T")

# Liveness of a connection to a controller, well under the 2 s default lease
CONNECT_TIMEOUT_S = 1.0  # TCP, TLS and the HTTP/2 handshake of an attempt, with others to try
KEEPALIVE_S = 1.0  # a ping after this much silence on a connection with a call in flight
MIN_KEEPALIVE_S = 0.5  # what controllers accept (SERVER_OPTIONS)
PING_TIMEOUT_S = 1.0  # no answer to a ping within this: the connection is dead
CLIENT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),  # (see channel's keepalive_s)
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    # every ping, not only keepalives: a bandwidth probe unanswered would block them
    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),  # an idle client costs the controller nothing
    ("grpc.http2.max_pings_without_data", 0),  # a long phase change sends no data: ping on
    ("grpc.http2.bdp_probe", 0),  # small messages; and no extra pings to police
]
# What a controller's server must accept for those pings
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000)),
]


def not_leader_message(leader: str | None, overdue: str | None = None) -> str:
    """The standby's status message (see the module docstring); ``overdue``: a leader
    whose lease is past due, named in the message but not as the leader."""
    if leader:
        return f"{NOT_LEADER_PREFIX}; the leader is at {leader}"
    if overdue:
        return (
            f"{NOT_LEADER_PREFIX}; the leader at {overdue} is past due renewing its lease "
            "(frozen or partitioned?): a standby takes over when the lease ends"
        )
    return f"{NOT_LEADER_PREFIX}; no leader elected yet"


def not_leader_metadata(leader: str | None) -> tuple[tuple[str, str], ...]:
    """The standby's trailing metadata: ``orl-leader`` when the leader is known."""
    return ((LEADER_METADATA_KEY, leader),) if leader else ()


async def abort_not_leader(
    context: grpc.aio.ServicerContext[Any, Any], leader: str | None, overdue: str | None = None
) -> NoReturn:
    """End the RPC of a standby's servicer with the answer of the contract.

    ``leader``: the leader's HOST:PORT as clients dial it, or None when none is known (or
    ``overdue``: the one known is past due renewing its lease, see the module docstring).
    Works in unary and streaming handlers alike (``context.abort`` raises)."""
    metadata = not_leader_metadata(leader)
    context.set_trailing_metadata(metadata)
    message = not_leader_message(leader, overdue)
    await context.abort(grpc.StatusCode.UNAVAILABLE, message, metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def is_not_leader(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` is a standby's answer (UNAVAILABLE, "not the leader; ...")."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(
        NOT_LEADER_PREFIX
    )


def leader_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The leader's HOST:PORT named by a standby's UNAVAILABLE answer, or None: not a
    standby's answer, no leader known, or a value that is not a dialable HOST:PORT."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    found = None
    for key, value in exc.trailing_metadata() or ():
        if key == LEADER_METADATA_KEY:
            found = value
    if not isinstance(found, str):  # absent, or a binary value
        return None
    try:
        check_address(found, LEADER_METADATA_KEY)
    except errors.InvalidArgument:
        return None
    return found


class NotLeader(errors.Unavailable):
    """A standby answered: ``leader`` is the address it named (None when unknown)."""

    def __init__(self, message: str, leader: str | None) -> None:
        super().__init__(message)
        self.leader = leader


class Unreachable(errors.Unavailable):
    """UNAVAILABLE from a controller that named no leader: it could not be reached, its
    connection broke, or it is not serving."""


async def _classified(what: str, coro: Awaitable[T]) -> T:
    try:
        return await coro
    except grpc.aio.AioRpcError as exc:
        leader = leader_of(exc)
        if is_not_leader(exc) or leader is not None:
            raise NotLeader(f"{what}: {exc.details() or NOT_LEADER_PREFIX}", leader) from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise Unreachable(f"{what}: UNAVAILABLE: {exc.details()}") from None
        raise


async def call(what: str, coro: Awaitable[T]) -> T:
    """:func:`orchestrrl.grpcutil.call` (an RpcError becomes the matching domain error,
    naming ``what``) that tells UNAVAILABLE apart: :class:`NotLeader` for a standby's
    answer, :class:`Unreachable` for any other. Both are ``errors.Unavailable``."""
    return await grpcutil.call(what, _classified(what, coro))


def channel(
    address: str,
    tls: TlsConfig | None,
    *,
    keepalive_s: float = KEEPALIVE_S,
    watched: bool = True,
) -> grpc.aio.Channel:
    """A channel to a controller: :func:`orchestrrl.grpcutil.channel` whose connection is
    declared dead when it stops answering pings (see the module docstring).

    ``watched`` False (a caller with no other controller to turn to): the plain channel,
    whose pings give a busy controller ten seconds; a connection declared dead after one
    second of silence only helps a caller that can ask another controller, and fails the
    calls of one that cannot whenever its controller's host is loaded.

    ``keepalive_s``: the silence before a ping. A call that stays open (an agent's
    telemetry stream, which the controller never answers until it ends) pings at this
    rate for as long as it lives, and each ping wakes the process's gRPC threads a few
    times: the agent uses a longer one (``node_agent.uplink.UplinkSettings``)."""
    if not watched:
        return grpcutil.channel(address, tls)
    options = [
        *(o for o in CLIENT_OPTIONS if o[0] != "grpc.keepalive_time_ms"),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
    ]
    return grpcutil.channel(address, tls, options=options)


async def _ready(ch: grpc.aio.Channel) -> None:
    state = ch.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        await ch.wait_for_state_change(state)
        state = ch.get_state(try_to_connect=True)


async def attempt(
    ch: grpc.aio.Channel, what: str, coro: Awaitable[T], connect_timeout_s: float | None
) -> T:
    """:func:`call` of ``coro`` (a call on ``ch``) with a connect deadline: when ``ch`` has
    no connection yet and gets none within ``connect_timeout_s`` (a frozen or partitioned
    host whose kernel accepts TCP), the call is cancelled and :class:`Unreachable` raised.
    A refused connection fails at once as before (gRPC fails the call itself). ``None``:
    no connect deadline (the call's own deadline only)."""
    task = asyncio.ensure_future(call(what, coro))
    try:
        if connect_timeout_s is None or ch.get_state() is grpc.ChannelConnectivity.READY:
            return await task
        ready = asyncio.ensure_future(_ready(ch))
        try:
            done, _ = await asyncio.wait(
                {task, ready}, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ready
        if not done:
            raise Unreachable(
                f"{what}: no connection within {connect_timeout_s:g} s (the host accepts TCP "
                "but not gRPC: frozen, partitioned or overloaded)"
            )
        return await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.OrlError):
                await task


def check_address(value: str, field: str) -> str:
    """A controller address clients dial: HOST:PORT with a port in 1..65535."""
    _, port = grpcutil.parse_address(value, field)
    if port == 0:
        raise errors.field_error(field, value, "port must be 1..65535 (0 cannot be dialled)")
    return value


def parse_addresses(value: str | Sequence[str], field: str) -> tuple[str, ...]:
    """Controller addresses: a comma-separated string (``a:1,b:2``) or a list of strings;
    each HOST:PORT, at least one, at most MAX_ADDRESSES, none twice. Blanks around commas
    are ignored."""
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise errors.field_error(field, value, "a HOST:PORT string or a list of them")
    allowed = "HOST:PORT, or several separated by commas, e.g. 10.0.0.1:50051,10.0.0.2:50051"
    if not items or items == [""]:
        raise errors.field_error(field, value, allowed)
    if any(not item for item in items):
        raise errors.field_error(field, value, f"an empty address in the list; {allowed}")
    if len(items) > MAX_ADDRESSES:
        raise errors.field_error(field, value, f"at most {MAX_ADDRESSES} controller addresses")
    for item in items:
        check_address(item, field)
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise errors.field_error(field, value, f"each address once ({', '.join(twice)} repeated)")
    return tuple(items)


__all__ = [
    "CLIENT_OPTIONS",
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_S",
    "LEADER_METADATA_KEY",
    "NOT_LEADER_PREFIX",
    "PING_TIMEOUT_S",
    "SERVER_OPTIONS",
    "NotLeader",
    "Unreachable",
    "abort_not_leader",
    "attempt",
    "call",
    "channel",
    "check_address",
    "is_not_leader",
    "leader_of",
    "not_leader_message",
    "not_leader_metadata",
    "parse_addresses",
]

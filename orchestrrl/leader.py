"""The standby's answer and how clients follow it: the one definition of the contract.

A fabric controller that is not the leader (a standby of an HA group, issue 17) answers
**every FabricController RPC** (reads included, to keep one rule: a standby's view may be
stale) with

- status ``UNAVAILABLE``,
- the message ``not the leader; the leader is at HOST:PORT`` (or ``not the leader; no
  leader elected yet`` when it does not know one),
- trailing metadata ``orl-leader`` = ``HOST:PORT`` (absent when unknown).

The FabricController service has no health or status RPC of its own; the standard
``grpc.health.v1.Health`` service and server reflection are separate services and keep
answering on a standby (health says whether the process serves, not whether it leads).

Servers raise the answer with :func:`abort_not_leader`; clients recognise it with
:func:`leader_of` / :func:`is_not_leader`, or with :func:`call`, which turns it into
:class:`NotLeader` (an ``errors.Unavailable`` carrying the leader's address). The lists of
controller addresses that clients and agents take are parsed by :func:`parse_addresses`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from orchestrrl import errors, grpcutil

LEADER_METADATA_KEY = "orl-leader"  # trailing metadata: the leader's HOST:PORT
NOT_LEADER_PREFIX = "not the leader"
MAX_ADDRESSES = 16  # controllers in one list: an HA group is 2-5

T = TypeVar("T")


def not_leader_message(leader: str | None) -> str:
    """The standby's status message (see the module docstring)."""
    if leader:
        return f"{NOT_LEADER_PREFIX}; the leader is at {leader}"
    return f"{NOT_LEADER_PREFIX}; no leader elected yet"


def not_leader_metadata(leader: str | None) -> tuple[tuple[str, str], ...]:
    """The standby's trailing metadata: ``orl-leader`` when the leader is known."""
    return ((LEADER_METADATA_KEY, leader),) if leader else ()


async def abort_not_leader(
    context: grpc.aio.ServicerContext[Any, Any], leader: str | None
) -> NoReturn:
    """End the RPC of a standby's servicer with the answer of the contract.

    ``leader``: the leader's HOST:PORT as clients dial it, or None when none is known.
    Works in unary and streaming handlers alike (``context.abort`` raises)."""
    metadata = not_leader_metadata(leader)
    context.set_trailing_metadata(metadata)
    await context.abort(grpc.StatusCode.UNAVAILABLE, not_leader_message(leader), metadata)
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
    "LEADER_METADATA_KEY",
    "NOT_LEADER_PREFIX",
    "NotLeader",
    "Unreachable",
    "abort_not_leader",
    "call",
    "check_address",
    "is_not_leader",
    "leader_of",
    "not_leader_message",
    "not_leader_metadata",
    "parse_addresses",
]

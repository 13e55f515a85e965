"""ApplyRoutes: host routes and policy rules through the netlink adapter, in the host's
namespace or a named one.

The whole request is checked before anything changes (syntax, devices, conflicts with
routes and rules OrchestrRL did not install). Routes are applied first, then rules, so
traffic is only steered into a table once its routes are there; if the rules fail, the
routes are put back as they were.

Counts in the response cover routes and rules together, and ``added`` includes routes
whose next hops were replaced (the contract has no separate "replaced" count). A rule
without source and destination is an IPv4 rule (the contract's PolicyRule has no
family).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrrl import errors
from orchestrrl.netlink import Netlink, check_netns
from orchestrrl.routing import (
    RouteChange,
    RouteSpec,
    RuleChange,
    RuleSpec,
    rule_sort_key,
    simple_routes,
)
from orchestrrl.v1 import node_agent_pb2


@dataclass(frozen=True)
class RoutesRequest:
    routes: tuple[RouteSpec, ...]
    rules: tuple[RuleSpec, ...]
    netns: str | None
    prune: bool


@dataclass(frozen=True)
class RoutesResult:
    routes: RouteChange
    rules: RuleChange


def request_from_pb(request: node_agent_pb2.ApplyRoutesRequest) -> RoutesRequest:
    """Validate every field; errors name the entry, e.g. ``routes[2].destination=...``."""
    return RoutesRequest(
        routes=_routes(request.routes),
        rules=tuple(_rule(i, r) for i, r in enumerate(request.rules)),
        netns=check_netns(request.netns),
        prune=request.prune,
    )


def _routes(routes: Iterable[node_agent_pb2.Route]) -> tuple[RouteSpec, ...]:
    """A request carries up to tens of thousands of routes over a few gateway sets:
    ``simple_routes`` checks each set once."""
    return tuple(simple_routes(routes, "routes"))


def _rule(index: int, rule: node_agent_pb2.PolicyRule) -> RuleSpec:
    try:
        return RuleSpec(
            priority=rule.priority,
            table=rule.table,
            source=rule.source or None,
            destination=rule.destination or None,
            input_interface=rule.input_interface or None,
        )
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"rules[{index}].{exc}") from None


def response_to_pb(command_id: str, result: RoutesResult) -> node_agent_pb2.ApplyRoutesResponse:
    """Routes are added in place (``repeated.add``): a message built on its own and then
    handed to its parent is copied, and a response can list tens of thousands. They come
    from the read-back's columns, in route order, without a RouteSpec each."""
    routes, rules = result.routes, result.rules
    response = node_agent_pb2.ApplyRoutesResponse(
        command_id=command_id,
        added=routes.added + routes.replaced + rules.added,
        removed=routes.removed + rules.removed,
        unchanged=routes.unchanged + rules.unchanged,
        rules=[
            node_agent_pb2.PolicyRule(
                priority=r.priority,
                source=r.source or "",
                destination=r.destination or "",
                input_interface=r.input_interface or "",
                table=r.table,
            )
            for r in sorted(rules.rules, key=rule_sort_key)
        ],
    )
    add = response.routes.add
    for destination, shape in routes.read_back.sorted_rows():
        add(
            destination=destination,
            gateways=shape.gateways,
            device=shape.device or "",
            table=shape.table,
            metric=shape.metric,
        )
    return response


class HostRoutes:
    """Applies RoutesRequests, one at a time per namespace."""

    def __init__(self, connect: Callable[[str | None], Netlink] = Netlink) -> None:
        self._connect = connect
        self._locks: collections.defaultdict[str | None, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )

    async def apply(self, request: RoutesRequest) -> RoutesResult:
        async with self._locks[request.netns], self._connect(request.netns) as netlink:
            # One observation of the kernel serves the checks, the change and the way back.
            plan = await netlink.prepare_routes(request.routes, request.prune)
            await netlink.check_rules(request.rules)
            route_change = await netlink.apply_routes(plan)
            try:
                rule_change = await netlink.ensure_rules(request.rules, request.prune)
            except errors.OrlError:
                await netlink.ensure_routes(plan.observed, prune=True)
                raise
        return RoutesResult(route_change, rule_change)

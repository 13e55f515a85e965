"""Routes and policy rules as plain values: validation, canonical form and the pure diff.

Nothing here touches the kernel. ``orchestrrl.netlink`` observes the kernel, asks
:func:`diff_routes` / :func:`diff_rules` what to change, and applies the answer.

Canonical form (so that equal intent compares equal):

- ``destination`` is a CIDR prefix with no host bits (``10.1.0.0/16``, ``fd10::/64``);
- ``gateways`` are sorted and unique; one gateway is a plain route, two or more an ECMP
  route with equal weights;
- ``table`` 0 means the main table (254); the local table (255) belongs to the kernel;
- IPv6 ``metric`` 0 is stored by the kernel as 1024, so it is canonicalised to 1024;
- ``device`` ``""`` means "no device" (``None``); with gateways and no device, the
  kernel picks the interface and any device satisfies the spec.

A route is identified by its key (family, table, destination, metric), like the kernel
does: two desired routes with the same key are an error, and a desired route whose key
is held by a route that OrchestrRL did not install is refused rather than overwritten.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from orchestrrl import errors

MAIN_TABLE = 254
LOCAL_TABLE = 255
MAX_U32 = 2**32 - 1
IPV6_DEFAULT_METRIC = 1024
MAX_GATEWAYS = 256
# Linux interface names: 1..15 bytes, no '/', ':' or whitespace.
IFNAME_RE = re.compile(r"^[^/:\s]{1,15}$")

RouteKey = tuple[int, int, str, int]  # family, table, destination, metric
_FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}


class Prefix(NamedTuple):
    version: int  # 4 or 6
    packed: bytes  # network address, network byte order
    length: int
    text: str  # canonical, as the kernel and iproute2 print it


def _address(text: object) -> tuple[int, bytes] | None:
    """(version, packed) of an IP address in text form; None when it is not one."""
    if not isinstance(text, str):
        return None
    version = 6 if ":" in text else 4
    try:
        return version, socket.inet_pton(_FAMILY[version], text)
    except OSError:
        return None


def parse_prefix(value: object, field_name: str) -> Prefix:
    """A CIDR prefix without host bits; the error names the field and shows the fix.

    Parsed with inet_pton rather than ``ipaddress`` (ten times faster, and the
    canonical text is the one the kernel reports back)."""
    allowed = "expected a CIDR prefix such as 10.1.0.0/16 or fd10::/64"
    if not isinstance(value, str):
        raise errors.field_error(field_name, value, allowed)
    address_text, slash, length_text = value.partition("/")
    parsed = _address(address_text)
    if not slash or parsed is None or not length_text.isascii() or not length_text.isdigit():
        raise errors.field_error(field_name, value, allowed)
    version, packed = parsed
    bits = len(packed) * 8
    length = int(length_text)
    if length > bits or (len(length_text) > 1 and length_text[0] == "0"):
        raise errors.field_error(field_name, value, f"prefix length must be 0..{bits}")
    host_mask = (1 << (bits - length)) - 1
    if int.from_bytes(packed, "big") & host_mask:
        loose = ipaddress.ip_network(value, strict=False)
        raise errors.field_error(field_name, value, f"host bits are set; did you mean {loose}?")
    return Prefix(version, packed, length, f"{socket.inet_ntop(_FAMILY[version], packed)}/{length}")


def check_ifname(value: str, field_name: str) -> str:
    if not isinstance(value, str) or not IFNAME_RE.match(value):
        raise errors.field_error(
            field_name, value, "expected a Linux interface name (1-15 chars, no / or :)"
        )
    return value


def _u32(value: int, field_name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_U32:
        raise errors.field_error(field_name, value, f"expected an integer in {low}..{MAX_U32}")
    return value


def _unusable_next_hop(version: int, packed: bytes) -> bool:
    """Unspecified, loopback or multicast: never the address of a neighbour."""
    if version == 4:
        return packed[0] in (0, 127) or 224 <= packed[0] <= 239
    return packed in (bytes(16), bytes(15) + b"\x01") or packed[0] == 0xFF


def _gateways(values: Iterable[str], prefix: Prefix, device: str | None) -> tuple[str, ...]:
    if isinstance(values, str):
        raise errors.field_error("gateways", values, "expected a list of addresses, not a string")
    parsed: list[bytes] = []
    for value in values:
        address = _address(value)
        if address is None:
            raise errors.field_error("gateways", value, "expected an IP address")
        version, packed = address
        if version != prefix.version:
            raise errors.field_error(
                "gateways",
                value,
                f"gateway is IPv{version} but destination {prefix.text} is IPv{prefix.version}",
            )
        if _unusable_next_hop(version, packed):
            raise errors.field_error(
                "gateways", value, "a next hop must be a unicast address of a neighbour"
            )
        link_local = version == 6 and packed[0] == 0xFE and packed[1] & 0xC0 == 0x80
        if link_local and device is None:
            raise errors.field_error(
                "gateways", value, "an IPv6 link-local next hop needs a device"
            )
        parsed.append(packed)
    if len(set(parsed)) != len(parsed):
        raise errors.field_error("gateways", list(values), "each next hop may be listed once")
    if len(parsed) > MAX_GATEWAYS:
        raise errors.field_error(
            "gateways", f"{len(parsed)} next hops", f"at most {MAX_GATEWAYS} next hops per route"
        )
    family = _FAMILY[prefix.version]
    return tuple(socket.inet_ntop(family, packed) for packed in sorted(parsed))


@dataclass(frozen=True)
class RouteSpec:
    """One unicast route; ECMP when it has two or more gateways. Canonicalised on creation."""

    destination: str
    gateways: tuple[str, ...] = ()
    device: str | None = None
    table: int = MAIN_TABLE
    metric: int = 0
    family: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = parse_prefix(self.destination, "destination")
        device = self.device or None
        if device is not None:
            check_ifname(device, "device")
        gateways = _gateways(self.gateways, prefix, device)
        if not gateways and device is None:
            raise errors.field_error(
                "gateways", [], "a route needs at least one gateway or a device"
            )
        table = _u32(self.table, "table") or MAIN_TABLE
        if table == LOCAL_TABLE:
            raise errors.field_error(
                "table", table, "the local table (255) belongs to the kernel; use main (254)"
            )
        metric = _u32(self.metric, "metric")
        if prefix.version == 6 and metric == 0:
            metric = IPV6_DEFAULT_METRIC
        object.__setattr__(self, "destination", prefix.text)
        object.__setattr__(self, "gateways", gateways)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "metric", metric)
        object.__setattr__(self, "family", prefix.version)

    @classmethod
    def from_kernel(
        cls,
        family: int,
        destination: str,
        gateways: Iterable[str],
        device: str | None,
        table: int,
        metric: int,
    ) -> RouteSpec:
        """A route as the kernel reported it, skipping validation: the kernel's text is
        already canonical (inet_ntop), so only the next-hop order is normalised. Reading
        back tens of thousands of routes would otherwise spend most of its time here."""
        hops = tuple(gateways)
        if len(hops) > 1:
            hops = tuple(sorted(hops, key=lambda g: socket.inet_pton(_FAMILY[family], g)))
        route = object.__new__(cls)
        for name, value in (
            ("destination", destination),
            ("gateways", hops),
            ("device", device),
            ("table", table),
            ("metric", metric),
            ("family", family),
        ):
            object.__setattr__(route, name, value)
        return route

    @property
    def key(self) -> RouteKey:
        return (self.family, self.table, self.destination, self.metric)

    def describe(self) -> str:
        """``10.1.0.0/16 via 10.0.0.2,10.0.0.3 dev eth0 table 254 metric 0``"""
        parts = [self.destination]
        if self.gateways:
            parts.append("via " + ",".join(self.gateways))
        if self.device:
            parts.append(f"dev {self.device}")
        parts.append(f"table {self.table} metric {self.metric}")
        return " ".join(parts)


@dataclass(frozen=True)
class RuleSpec:
    """A policy rule: traffic matching (source, destination, input interface) uses ``table``."""

    priority: int
    table: int
    source: str | None = None
    destination: str | None = None
    input_interface: str | None = None
    family: int | None = None  # 4 or 6; None: from source/destination, else 4

    def __post_init__(self) -> None:
        priority = _u32(self.priority, "priority", low=1)
        table = _u32(self.table, "table", low=1)
        nets = {
            name: parse_prefix(value, name)
            for name, value in (("source", self.source), ("destination", self.destination))
            if value
        }
        versions: set[int] = {prefix.version for prefix in nets.values()}
        if self.family is not None and self.family not in (4, 6):
            raise errors.field_error("family", self.family, "expected 4 or 6")
        if self.family is not None:
            versions.add(self.family)
        if len(versions) > 1:
            raise errors.field_error(
                "source/destination",
                {k: v.text for k, v in nets.items()},
                "source, destination and family must be the same IP version",
            )
        iif = self.input_interface or None
        if iif is not None:
            check_ifname(iif, "input_interface")
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "source", nets["source"].text if "source" in nets else None)
        object.__setattr__(
            self, "destination", nets["destination"].text if "destination" in nets else None
        )
        object.__setattr__(self, "input_interface", iif)
        object.__setattr__(self, "family", versions.pop() if versions else 4)

    def describe(self) -> str:
        parts = [f"{self.priority}:", f"from {self.source or 'all'}"]
        if self.destination:
            parts.append(f"to {self.destination}")
        if self.input_interface:
            parts.append(f"iif {self.input_interface}")
        parts.append(f"lookup {self.table} (IPv{self.family})")
        return " ".join(parts)


class RouteDiff(NamedTuple):
    """What to change so that the observed routes satisfy the desired ones."""

    add: tuple[RouteSpec, ...]
    replace: tuple[RouteSpec, ...]  # the desired spec; the observed one has the same key
    remove: tuple[RouteSpec, ...]

    @property
    def empty(self) -> bool:
        return not (self.add or self.replace or self.remove)


class RuleDiff(NamedTuple):
    add: tuple[RuleSpec, ...]
    remove: tuple[RuleSpec, ...]

    @property
    def empty(self) -> bool:
        return not (self.add or self.remove)


@dataclass(frozen=True)
class RouteChange:
    """What an ensure did, and OrchestrRL's routes as read back afterwards."""

    added: int
    removed: int
    replaced: int
    unchanged: int
    routes: frozenset[RouteSpec] = frozenset()


@dataclass(frozen=True)
class RuleChange:
    added: int
    removed: int
    unchanged: int
    rules: frozenset[RuleSpec] = frozenset()


def route_sort_key(route: RouteSpec) -> tuple[int, int, bytes, int, int]:
    address, _, length = route.destination.partition("/")
    packed = socket.inet_pton(_FAMILY[route.family], address)
    return (route.family, route.table, packed, int(length), route.metric)


def rule_sort_key(rule: RuleSpec) -> tuple[int, int, int, str, str, str]:
    return (
        rule.priority,
        rule.family or 4,
        rule.table,
        rule.source or "",
        rule.destination or "",
        rule.input_interface or "",
    )


def index_routes(routes: Iterable[RouteSpec]) -> dict[RouteKey, RouteSpec]:
    """Routes by key; two routes with one key would overwrite each other in the kernel."""
    indexed: dict[RouteKey, RouteSpec] = {}
    for route in routes:
        other = indexed.get(route.key)
        if other is not None and other != route:
            raise errors.InvalidArgument(
                f"routes {other.describe()!r} and {route.describe()!r} have the same "
                "destination, table and metric; merge their gateways into one ECMP route "
                "or give them different metrics"
            )
        indexed[route.key] = route
    return indexed


def satisfies(observed: RouteSpec, desired: RouteSpec) -> bool:
    """Same key and next hops; a desired route without a device accepts any device."""
    return (
        observed.key == desired.key
        and observed.gateways == desired.gateways
        and (desired.device is None or desired.device == observed.device)
    )


def diff_routes(
    observed: Iterable[RouteSpec], desired: Iterable[RouteSpec], prune: bool
) -> RouteDiff:
    """Add what is missing, replace what differs, remove what is stale (only with prune).

    ``observed`` are the routes OrchestrRL installed (never anyone else's).
    """
    want = index_routes(desired)
    have = {route.key: route for route in observed}
    add = [r for k, r in want.items() if k not in have]
    replace = [r for k, r in want.items() if k in have and not satisfies(have[k], r)]
    remove = [r for k, r in have.items() if k not in want] if prune else []
    return RouteDiff(
        tuple(sorted(add, key=route_sort_key)),
        tuple(sorted(replace, key=route_sort_key)),
        tuple(sorted(remove, key=route_sort_key)),
    )


def diff_rules(observed: Iterable[RuleSpec], desired: Iterable[RuleSpec], prune: bool) -> RuleDiff:
    want: dict[RuleSpec, None] = {}
    for rule in desired:
        if rule in want:
            raise errors.field_error("rules", rule.describe(), "each rule may be listed once")
        want[rule] = None
    have = set(observed)
    add = [r for r in want if r not in have]
    remove = [r for r in have if r not in want] if prune else []
    return RuleDiff(tuple(sorted(add, key=rule_sort_key)), tuple(sorted(remove, key=rule_sort_key)))


def foreign_conflicts(
    desired: Iterable[RouteSpec], foreign: Iterable[RouteKey]
) -> tuple[RouteSpec, ...]:
    """Desired routes whose key is held by a route someone else installed."""
    taken = set(foreign)
    return tuple(r for r in desired if r.key in taken)


def missing_devices(routes: Iterable[RouteSpec], devices: Mapping[str, object]) -> list[str]:
    """Route devices that do not exist, sorted.

    Rule input interfaces may name devices that do not exist yet (the kernel keeps such
    rules dormant until the device appears), so only route devices are checked.
    """
    return sorted({r.device for r in routes if r.device and r.device not in devices})

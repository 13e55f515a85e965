"""Routes and policy rules as plain values: validation, canonical form and the pure diff.

Nothing here touches the kernel. ``orchestrrl.netlink`` observes the kernel, asks
:func:`diff_routes` / :func:`diff_rules` what to change, and applies the answer.

Next hops. A route has one or more :class:`NextHop` values (gateway, output device,
``onlink``); two or more make an ECMP route with equal weights. They can be written two
ways, which mean the same thing:

- the simple form, ``RouteSpec(dst, gateways=(g1, g2), device="eth0")`` (or just
  ``device=`` for a route without a gateway): every hop shares the one device, or none;
- per hop, ``RouteSpec(dst, nexthops=(NextHop(g1, "up0", onlink=True), ...))``: each hop
  has its own device and ``onlink`` flag (routes over optical circuits, where every
  gateway is the far end of a circuit addressed with a /32, hence on-link).

Canonical form (so that equal intent compares equal):

- ``nexthops`` is THE representation: both forms are turned into a tuple of hops sorted
  by (gateway address, device, onlink), each gateway in inet_ntop text; equality and
  hashing look only at ``destination``, ``nexthops``, ``table`` and ``metric``.
  ``gateways`` and ``device`` are read-only views derived from it: the unique gateways in
  address order, and the device every hop shares (``None`` when hops differ or have
  none). So ``RouteSpec(d, (g1, g2), "p0")`` equals
  ``RouteSpec(d, nexthops=(NextHop(g2, "p0"), NextHop(g1, "p0")))``. Errors raised while
  a RouteSpec is built index its hops as the caller gave them; later ones (a device that
  does not exist) index the sorted ``nexthops``, the order :meth:`RouteSpec.describe`
  prints, and show the route;
- ``destination`` is a CIDR prefix with no host bits (``10.1.0.0/16``, ``fd10::/64``);
- ``table`` 0 means the main table (254); the local table (255) belongs to the kernel;
- IPv6 ``metric`` 0 is stored by the kernel as 1024, so it is canonicalised to 1024;
- a device or gateway ``""`` means "none" (``None``); a hop with a gateway and no device
  lets the kernel pick the interface, and any device satisfies it (see
  :func:`satisfies`); the kernel always reports a device, so routes read back carry one.

A route is identified by its key (family, table, destination, metric), like the kernel
does: two desired routes with the same key are an error, and a desired route whose key
is held by a route that OrchestrRL did not install is refused rather than overwritten.
A route whose hops differ in any of gateway, device or onlink is replaced.

Routes read back from the kernel come by the ten thousand in a few shapes (everything
but the destination address: :class:`RouteShape`), so they are kept column-wise
(:class:`RouteColumns`: a shape and a packed address per route) and checked against the
desired routes as sets of addresses (:func:`columns_satisfy`); RouteSpecs are built from
them only when something differs or a caller asks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import ipaddress
import operator
import re
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import NamedTuple, Protocol

from orchestrrl import errors

MAIN_TABLE = 254
LOCAL_TABLE = 255
MAX_U32 = 2**32 - 1
IPV6_DEFAULT_METRIC = 1024
MAX_GATEWAYS = 256
# Linux interface names: 1..15 bytes, no '/', ':' or whitespace.
IFNAME_RE = re.compile(r"^[^/:\s]{1,15}$")
# Distinct next hops / next-hop sets remembered for reading routes back: a fabric has
# few neighbours and many routes over the same few hop sets.
_HOP_CACHE = 4096

RouteKey = tuple[int, int, str, int]  # family, table, destination, metric
RouteOrder = tuple[int, int, bytes, int, int]  # see route_sort_key
KernelHop = tuple[str | None, str | None, bool]  # gateway, device, onlink
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


_LENGTHS = {str(n): n for n in range(129)}  # prefix lengths as written canonically
_V4_HOST = [(1 << (32 - n)) - 1 for n in range(33)]  # host bits of a /n
_V6_HOST = [(1 << (128 - n)) - 1 for n in range(129)]
_AF_INET, _AF_INET6, _inet_pton = socket.AF_INET, socket.AF_INET6, socket.inet_pton


def _prefix_fast(value: str) -> tuple[int, bytes, int, str] | None:
    """(version, packed, length, text) of a valid prefix; None when :func:`parse_prefix`
    must look closer (to accept it or to say what is wrong)."""
    address, _, length_text = value.partition("/")
    length = _LENGTHS.get(length_text)
    if length is None:
        return None
    if ":" not in address:
        try:
            packed = _inet_pton(_AF_INET, address)
        except OSError:
            return None
        # inet_pton takes only canonical IPv4 text (no leading zeros): value is canonical
        if length > 32 or (length < 32 and int.from_bytes(packed, "big") & _V4_HOST[length]):
            return None
        return 4, packed, length, value
    try:
        packed = _inet_pton(_AF_INET6, address)
    except OSError:
        return None
    if length < 128 and int.from_bytes(packed, "big") & _V6_HOST[length]:
        return None
    return 6, packed, length, f"{socket.inet_ntop(_AF_INET6, packed)}/{length}"


def parse_prefix(value: object, field_name: str) -> Prefix:
    """A CIDR prefix without host bits; the error names the field and shows the fix.

    Parsed with inet_pton rather than ``ipaddress`` (ten times faster, and the
    canonical text is the one the kernel reports back)."""
    if type(value) is str:
        fast = _prefix_fast(value)
        if fast is not None:
            return Prefix(*fast)
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
    if version == 4:  # inet_pton takes only canonical IPv4 text (no leading zeros)
        return Prefix(version, packed, length, value)
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
    """Unspecified, loopback, multicast or broadcast: never the address of a neighbour."""
    if version == 4:
        return packed[0] in (0, 127) or packed[0] >= 224
    return packed in (bytes(16), bytes(15) + b"\x01") or packed[0] == 0xFF


def _link_local(version: int, packed: bytes) -> bool:
    return version == 6 and packed[0] == 0xFE and packed[1] & 0xC0 == 0x80


class _WrongVersion(Exception):
    """A gateway of the other IP version (the message needs the destination)."""

    def __init__(self, value: str, version: int) -> None:
        super().__init__(value)
        self.value, self.version = value, version


def _gateways(values: Iterable[str], prefix: Prefix, device: str | None) -> tuple[str, ...]:
    if isinstance(values, str):
        raise errors.field_error("gateways", values, "expected a list of addresses, not a string")
    values = tuple(values)
    try:
        try:
            return _checked_gateways(values, prefix.version, device is not None)
        except TypeError:  # something unhashable among them: check without the cache
            return _checked_gateways.__wrapped__(values, prefix.version, device is not None)
    except _WrongVersion as exc:
        raise errors.field_error(
            "gateways",
            exc.value,
            f"gateway is IPv{exc.version} but destination {prefix.text} is IPv{prefix.version}",
        ) from None


@functools.lru_cache(maxsize=_HOP_CACHE)
def _checked_gateways(values: tuple[str, ...], version: int, has_device: bool) -> tuple[str, ...]:
    """The canonical gateways of the simple form (cached: routes share few gateway sets;
    errors are raised again at every call, never cached)."""
    parsed: list[bytes] = []
    for value in values:
        address = _address(value)
        if address is None:
            raise errors.field_error("gateways", value, "expected an IP address")
        gateway_version, packed = address
        if gateway_version != version:
            raise _WrongVersion(value, gateway_version)
        if _unusable_next_hop(gateway_version, packed):
            raise errors.field_error(
                "gateways", value, "a next hop must be a unicast address of a neighbour"
            )
        if _link_local(gateway_version, packed) and not has_device:
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
    family = _FAMILY[version]
    return tuple(socket.inet_ntop(family, packed) for packed in sorted(parsed))


@dataclass(frozen=True, slots=True)
class NextHop:
    """One next hop of a route: a gateway, an output device, or both.

    ``onlink`` (``ip route ... via G dev D onlink``) makes the kernel take the gateway as
    directly reachable on ``device`` although no address of the device covers it, so it
    needs both. Validated and canonicalised on creation; that the gateway's IP version
    matches the destination is checked by :class:`RouteSpec`.
    """

    gateway: str | None = None
    device: str | None = None
    onlink: bool = False

    def __post_init__(self) -> None:
        gateway = self.gateway or None
        link_local = False
        if gateway is not None:
            address = _address(gateway)
            if address is None:
                raise errors.field_error(
                    "gateway", gateway, "expected an IP address such as 172.16.0.9 or fd00::9"
                )
            version, packed = address
            if _unusable_next_hop(version, packed):
                raise errors.field_error(
                    "gateway", gateway, "a next hop must be a unicast address of a neighbour"
                )
            gateway = socket.inet_ntop(_FAMILY[version], packed)
            link_local = _link_local(version, packed)
        device = self.device or None
        if device is not None:
            check_ifname(device, "device")
        if not isinstance(self.onlink, bool):
            raise errors.field_error("onlink", self.onlink, "expected True or False")
        if gateway is None and device is None:
            raise errors.field_error(
                "gateway", self.gateway, "a next hop needs a gateway, a device or both"
            )
        if self.onlink and (gateway is None or device is None):
            raise errors.field_error(
                "onlink", True, "an onlink next hop needs both a gateway and a device"
            )
        if link_local and device is None:
            raise errors.field_error(
                "gateway", gateway, "an IPv6 link-local next hop needs a device"
            )
        object.__setattr__(self, "gateway", gateway)
        object.__setattr__(self, "device", device)

    def describe(self) -> str:
        """``via 172.16.0.9 dev up0 onlink``, as ``ip route`` writes a next hop."""
        parts = []
        if self.gateway:
            parts.append(f"via {self.gateway}")
        if self.device:
            parts.append(f"dev {self.device}")
        if self.onlink:
            parts.append("onlink")
        return " ".join(parts)


def _hop_sort_key(hop: NextHop) -> tuple[bytes, str, bool]:
    gateway = hop.gateway
    packed = socket.inet_pton(_FAMILY[6 if ":" in gateway else 4], gateway) if gateway else b""
    return (packed, hop.device or "", hop.onlink)


@functools.lru_cache(maxsize=_HOP_CACHE)
def _hop(gateway: str | None, device: str | None, onlink: bool) -> NextHop:
    """The one shared NextHop for these canonical values (interned: hop tuples of many
    routes then compare by identity), built without validation."""
    hop = object.__new__(NextHop)
    object.__setattr__(hop, "gateway", gateway)
    object.__setattr__(hop, "device", device)
    object.__setattr__(hop, "onlink", onlink)
    return hop


# nexthops, gateways, device, hash(nexthops) (computed once per interned hop set)
HopSet = tuple[tuple[NextHop, ...], tuple[str, ...], str | None, int]


def _hop_set(hops: Iterable[NextHop]) -> HopSet:
    """Canonical (sorted, interned) hops and the ``gateways``/``device`` views of them."""
    ordered = tuple(_hop(h.gateway, h.device, h.onlink) for h in sorted(hops, key=_hop_sort_key))
    gateways = tuple(dict.fromkeys(h.gateway for h in ordered if h.gateway))
    devices = {h.device for h in ordered}
    return ordered, gateways, devices.pop() if len(devices) == 1 else None, hash(ordered)


@functools.lru_cache(maxsize=_HOP_CACHE)
def _simple_hop_set(gateways: tuple[str, ...], device: str | None) -> HopSet:
    """The hops of the simple form (validated canonical gateways, one shared device)."""
    if not gateways:
        return _hop_set([_hop(None, device, False)])
    return _hop_set([_hop(gateway, device, False) for gateway in gateways])


@functools.lru_cache(maxsize=_HOP_CACHE)
def _kernel_hop_set(hops: tuple[KernelHop, ...]) -> HopSet:
    return _hop_set([_hop(gateway, device, onlink) for gateway, device, onlink in hops])


def _explicit_hop_set(values: Iterable[NextHop], prefix: Prefix) -> HopSet:
    """Validate the per-hop form against the destination; errors name ``nexthops[i]``
    (index in the caller's order)."""
    if isinstance(values, (str, NextHop)):
        raise errors.field_error("nexthops", values, "expected a list of NextHop values")
    values = tuple(values)
    if not values:
        raise errors.field_error("nexthops", [], "a route needs at least one next hop")
    if len(values) > MAX_GATEWAYS:
        raise errors.field_error(
            "nexthops", f"{len(values)} next hops", f"at most {MAX_GATEWAYS} next hops per route"
        )
    seen: dict[tuple[str | None, str | None], int] = {}
    by_gateway: dict[str, list[NextHop]] = {}
    for i, hop in enumerate(values):
        if not isinstance(hop, NextHop):
            raise errors.field_error(
                f"nexthops[{i}]", hop, "expected NextHop(gateway=..., device=..., onlink=...)"
            )
        if hop.gateway is not None:
            version = 6 if ":" in hop.gateway else 4
            if version != prefix.version:
                raise errors.field_error(
                    f"nexthops[{i}].gateway",
                    hop.gateway,
                    f"gateway is IPv{version} but destination {prefix.text} is IPv{prefix.version}",
                )
            by_gateway.setdefault(hop.gateway, []).append(hop)
        if (hop.gateway, hop.device) in seen:
            raise errors.field_error(
                f"nexthops[{i}]",
                hop.describe(),
                f"the same next hop as nexthops[{seen[hop.gateway, hop.device]}]; "
                "each next hop may be listed once",
            )
        seen[hop.gateway, hop.device] = i
    for gateway, hops in by_gateway.items():
        if len(hops) > 1 and any(hop.device is None for hop in hops):
            raise errors.field_error(
                f"nexthops[{values.index(next(h for h in hops if h.device is None))}].device",
                None,
                f"gateway {gateway} is in several next hops, so each needs its own device",
            )
    return _hop_set(values)


@functools.lru_cache(maxsize=_HOP_CACHE, typed=True)
def _simple_rest(
    version: int, gateways: tuple[str, ...], device: str | None, table: int, metric: int
) -> tuple[HopSet, int, int]:
    """(hops, table, metric) of the simple form, as :class:`RouteSpec` computes them
    after the destination; raises when that would (the error it raises is the one to
    show: errors are never cached)."""
    if device is not None:
        check_ifname(device, "device")
    simple = _checked_gateways(gateways, version, device is not None)
    if not simple and device is None:
        raise errors.field_error("gateways", [], "a route needs at least one gateway or a device")
    table = _u32(table, "table") or MAIN_TABLE
    if table == LOCAL_TABLE:
        raise errors.field_error("table", table, "the local table (255) belongs to the kernel")
    metric = _u32(metric, "metric")
    if version == 6 and metric == 0:
        metric = IPV6_DEFAULT_METRIC
    return _simple_hop_set(simple, device), table, metric


@dataclass(frozen=True, init=False)
class RouteSpec:
    """One unicast route; ECMP when it has two or more next hops. Canonicalised on creation.

    ``RouteSpec(dst, gateways=(...), device=...)`` (the simple form) or
    ``RouteSpec(dst, nexthops=(NextHop(...), ...))`` (per hop), not both; see the module
    docstring for the canonical form. ``gateways`` and ``device`` are derived views.
    """

    destination: str
    nexthops: tuple[NextHop, ...]
    table: int
    metric: int
    gateways: tuple[str, ...] = field(init=False, repr=False, compare=False)
    device: str | None = field(init=False, repr=False, compare=False)
    family: int = field(init=False, repr=False, compare=False)
    # (family, table, destination, metric): how the kernel tells routes apart
    key: RouteKey = field(init=False, repr=False, compare=False)
    # (family, table, packed destination, prefix length, metric): the canonical order of
    # routes (route_sort_key), and the destination as netlink messages carry it
    order: RouteOrder = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        destination: str,
        gateways: Iterable[str] = (),
        device: str | None = None,
        table: int = MAIN_TABLE,
        metric: int = 0,
        *,
        nexthops: Iterable[NextHop] = (),
    ) -> None:
        prefix = parse_prefix(destination, "destination")
        device = device or None
        if nexthops:
            if gateways or device is not None:
                given = ("device", device) if device is not None else ("gateways", gateways)
                raise errors.field_error(
                    *given,
                    "give next hops either as nexthops or as gateways/device, not both "
                    "(each NextHop carries its own gateway and device)",
                )
            hops = _explicit_hop_set(nexthops, prefix)
        else:
            if device is not None:
                check_ifname(device, "device")
            simple = _gateways(gateways, prefix, device)
            if not simple and device is None:
                raise errors.field_error(
                    "gateways", [], "a route needs at least one gateway or a device"
                )
            hops = _simple_hop_set(simple, device)
        table = _u32(table, "table") or MAIN_TABLE
        if table == LOCAL_TABLE:
            raise errors.field_error(
                "table", table, "the local table (255) belongs to the kernel; use main (254)"
            )
        metric = _u32(metric, "metric")
        if prefix.version == 6 and metric == 0:
            metric = IPV6_DEFAULT_METRIC
        self._set(prefix.text, hops, table, metric, prefix.version, prefix.packed, prefix.length)

    @classmethod
    def simple(
        cls,
        destination: str,
        gateways: tuple[str, ...],
        device: str | None,
        table: int,
        metric: int,
    ) -> RouteSpec:
        """``RouteSpec(destination, gateways, device, table, metric)``, the same value and
        the same errors, for callers that build many routes: what depends only on the
        gateways, device, table and metric is checked once per distinct combination."""
        prefix = _prefix_fast(destination) if type(destination) is str else None
        if prefix is None:
            return cls(destination, gateways, device, table, metric)
        version, packed, length, text = prefix
        try:
            hops, table, metric = _simple_rest(version, gateways, device or None, table, metric)
        except (errors.InvalidArgument, _WrongVersion, TypeError):  # the constructor says why
            return cls(destination, gateways, device, table, metric)
        route = object.__new__(cls)
        route._set(text, hops, table, metric, version, packed, length)
        return route

    def _set(
        self,
        destination: str,
        hops: HopSet,
        table: int,
        metric: int,
        family: int,
        packed: bytes,
        length: int,
    ) -> None:
        values = self.__dict__
        values["destination"] = destination
        values["nexthops"], values["gateways"], values["device"], hops_hash = hops
        values["table"] = table
        values["metric"] = metric
        values["family"] = family
        values["key"] = (family, table, destination, metric)
        values["order"] = (family, table, packed, length, metric)
        # equal routes have equal nexthops, hence equal hashes of them
        values["_hash"] = hash((destination, hops_hash, table, metric))

    def __hash__(self) -> int:
        """Of the compared fields (as the dataclass would), with the hop set's hash
        computed once per hop set: routes land in sets and dicts by the ten thousand."""
        return self._hash

    @classmethod
    def from_kernel(
        cls,
        family: int,
        destination: str,
        nexthops: tuple[KernelHop, ...],
        table: int,
        metric: int,
    ) -> RouteSpec:
        """A route as the kernel reported it, skipping validation: the kernel's text is
        already canonical (inet_ntop), so only the next-hop order is normalised (cached
        per hop set). Reading back tens of thousands of routes would otherwise spend most
        of its time here. ``nexthops`` are (gateway, device, onlink), at least one."""
        address, _, length = destination.partition("/")
        packed = socket.inet_pton(_FAMILY[family], address)
        route = object.__new__(cls)
        route._set(
            destination, _kernel_hop_set(nexthops), table, metric, family, packed, int(length)
        )
        return route

    def describe(self) -> str:
        """``10.1.0.0/16 via 10.0.0.2,10.0.0.3 dev eth0 table 254 metric 0``, or with
        per-hop devices or onlink, ``... nexthop via G dev D onlink nexthop ...``."""
        parts = [self.destination]
        hops = self.nexthops
        if len(hops) == 1:
            parts.append(hops[0].describe())
        elif self.device is not None and not any(h.onlink or not h.gateway for h in hops):
            parts.append(f"via {','.join(self.gateways)} dev {self.device}")
        elif all(h.device is None for h in hops):
            parts.append("via " + ",".join(self.gateways))
        else:
            parts.extend(f"nexthop {h.describe()}" for h in hops)
        parts.append(f"table {self.table} metric {self.metric}")
        return " ".join(parts)


class SimpleRoute(Protocol):
    """A route in the simple form as a request message carries it (``device`` "" and
    ``table`` 0 as in :class:`RouteSpec`)."""

    @property
    def destination(self) -> str: ...
    @property
    def gateways(self) -> Sequence[str]: ...
    @property
    def device(self) -> str: ...
    @property
    def table(self) -> int: ...
    @property
    def metric(self) -> int: ...


def simple_routes(routes: Iterable[SimpleRoute], field_name: str = "routes") -> list[RouteSpec]:
    """``RouteSpec.simple`` of each route (the same values, the same errors, prefixed
    ``{field_name}[i].``), with the collector paused: what a request of tens of thousands
    of routes is converted with. IPv4 destinations in canonical form (the usual case)
    are parsed here and their gateways, device, table and metric checked once per
    distinct combination; anything else goes through ``RouteSpec.simple``."""
    simple, new, rest_of = RouteSpec.simple, object.__new__, _simple_rest
    lengths, host_bits, inet_pton, af_inet = _LENGTHS, _V4_HOST, _inet_pton, _AF_INET
    from_bytes = int.from_bytes
    # (gateways, device, table, metric) of IPv4 routes -> (hops, table, metric)
    checked: dict[tuple[tuple[str, ...], str | None, int, int], tuple[HopSet, int, int]] = {}
    specs: list[RouteSpec] = []
    add = specs.append
    with collector_paused():
        for index, route in enumerate(routes):
            destination = route.destination
            gateways = tuple(route.gateways[:])  # a slice is read in one go
            device = route.device or None
            table, metric = route.table, route.metric
            if type(destination) is str:
                address, _, length_text = destination.partition("/")
                length = lengths.get(length_text, 33)
                if length <= 32 and ":" not in address:
                    try:
                        packed = inet_pton(af_inet, address)
                    except OSError:
                        packed = b""
                    if packed and (length == 32 or not from_bytes(packed) & host_bits[length]):
                        args = (gateways, device, table, metric)
                        try:
                            rest = checked.get(args)
                        except TypeError:  # something unhashable: RouteSpec says what
                            rest = None
                        if rest is None:
                            try:
                                rest = checked[args] = rest_of(4, *args)
                            except (errors.InvalidArgument, _WrongVersion, TypeError):
                                rest = None
                        if rest is not None:
                            (hops, gateways_, device_, hops_hash), table_, metric_ = rest
                            spec = new(RouteSpec)  # RouteSpec._set written out
                            values = spec.__dict__
                            values["destination"] = destination
                            values["nexthops"] = hops
                            values["gateways"] = gateways_
                            values["device"] = device_
                            values["table"] = table_
                            values["metric"] = metric_
                            values["family"] = 4
                            values["key"] = (4, table_, destination, metric_)
                            values["order"] = (4, table_, packed, length, metric_)
                            values["_hash"] = hash((destination, hops_hash, table_, metric_))
                            add(spec)
                            continue
            try:
                add(simple(destination, gateways, device, table, metric))
            except errors.InvalidArgument as exc:
                raise errors.InvalidArgument(f"{field_name}[{index}].{exc}") from None
    return specs


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while tens of thousands of routes are
    built (requests, dumps): otherwise it walks them again and again as they are made
    (measured on 10,000 routes: a third of the time of building them). They hold no
    cycles; the collector runs as usual afterwards. Nested or concurrent uses leave it
    enabled once the first one to pause it is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


Slot = tuple[int, int, int, int]  # family, table, prefix length, metric: a key but its address


class RouteShape:
    """Everything of a route but its destination address, as the kernel reports it:
    family, table, prefix length, metric and next hops. A dump has tens of thousands of
    routes in a few shapes: :class:`RouteColumns` keeps one shape and one packed address
    per route and builds RouteSpecs only when asked. Shapes compare by identity; get them
    from :func:`route_shape`, which interns them."""

    __slots__ = (
        "_af",
        "_hops_hash",
        "_suffix",
        "device",
        "family",
        "gateways",
        "length",
        "metric",
        "nexthops",
        "slot",
        "table",
    )

    def __init__(self, family: int, table: int, length: int, metric: int, hops: HopSet) -> None:
        self.family, self.table, self.length, self.metric = family, table, length, metric
        self.nexthops, self.gateways, self.device, self._hops_hash = hops
        self.slot: Slot = (family, table, length, metric)
        self._af, self._suffix = _FAMILY[family], f"/{length}"

    def destination(self, packed: bytes) -> str:
        """The destination text of the route of this shape to ``packed``."""
        return socket.inet_ntop(self._af, packed) + self._suffix

    def route(self, packed: bytes) -> RouteSpec:
        """What :meth:`RouteSpec.from_kernel` builds for the route of this shape to
        ``packed``, with the hops normalised once for all routes of the shape."""
        family, table, metric = self.family, self.table, self.metric
        destination = socket.inet_ntop(self._af, packed) + self._suffix
        route = object.__new__(RouteSpec)  # RouteSpec._set written out: one call less
        values = route.__dict__
        values["destination"] = destination
        values["nexthops"] = self.nexthops
        values["gateways"] = self.gateways
        values["device"] = self.device
        values["table"] = table
        values["metric"] = metric
        values["family"] = family
        values["key"] = (family, table, destination, metric)
        values["order"] = (family, table, packed, self.length, metric)
        values["_hash"] = hash((destination, self._hops_hash, table, metric))
        return route

    def __repr__(self) -> str:
        hops = " ".join(h.describe() for h in self.nexthops)
        return (
            f"RouteShape(IPv{self.family} /{self.length} {hops} "
            f"table {self.table} metric {self.metric})"
        )


@functools.lru_cache(maxsize=_HOP_CACHE)
def route_shape(
    family: int, nexthops: tuple[KernelHop, ...], table: int, length: int, metric: int
) -> RouteShape:
    """The shared :class:`RouteShape` of the routes the kernel reports with these next
    hops (gateway, device, onlink; at least one), table, prefix length and metric."""
    return RouteShape(family, table, length, metric, _kernel_hop_set(nexthops))


_shape_head = operator.attrgetter("family", "table")
_shape_tail = operator.attrgetter("length", "metric")


class RouteColumns:
    """Routes column-wise, as read back from the kernel: route ``i`` is
    ``shapes[i].route(packed[i])``. Checking a read-back against the desired routes
    (:func:`columns_satisfy`) and answering a request (:meth:`sorted_rows`) need no
    RouteSpec per route; :meth:`specs` builds them, once, for everything else. Equal
    when they hold the same routes."""

    __slots__ = ("_specs", "packed", "shapes")

    def __init__(self, shapes: Sequence[RouteShape] = (), packed: Sequence[bytes] = ()) -> None:
        if len(shapes) != len(packed):
            raise ValueError(f"{len(shapes)} shapes for {len(packed)} addresses")
        self.shapes, self.packed = shapes, packed
        self._specs: tuple[RouteSpec, ...] | None = None

    @classmethod
    def from_batches(
        cls, batches: Iterable[tuple[Sequence[RouteShape], Sequence[bytes]]]
    ) -> RouteColumns:
        """From batches of (shapes, packed addresses), one after the other."""
        batches = list(batches)
        if len(batches) == 1:
            return cls(*batches[0])
        shapes = list(chain.from_iterable(shapes for shapes, _ in batches))
        return cls(shapes, list(chain.from_iterable(packed for _, packed in batches)))

    def __len__(self) -> int:
        return len(self.packed)

    def specs(self) -> tuple[RouteSpec, ...]:
        """The routes as RouteSpecs, in the order of the columns (built on first use)."""
        if self._specs is None:
            with collector_paused():
                self._specs = tuple(map(RouteShape.route, self.shapes, self.packed))
        return self._specs

    def by_shape(self) -> dict[RouteShape, list[bytes]]:
        """The packed destinations of each shape."""
        shapes = set(self.shapes)
        if len(shapes) == 1:  # the usual read-back: every route over one hop set
            return {shapes.pop(): list(self.packed)}
        groups: dict[RouteShape, list[bytes]] = {}
        for shape, packed in zip(self.shapes, self.packed, strict=True):
            groups.setdefault(shape, []).append(packed)
        return groups

    def sorted_rows(self) -> list[tuple[str, RouteShape]]:
        """(destination, shape) of every route, in :func:`route_sort_key` order."""
        distinct = set(self.shapes)
        if len(distinct) == 1:  # one shape: the order is the addresses'
            shape = distinct.pop()
            return list(zip(map(shape.destination, sorted(self.packed)), repeat(shape)))
        ordered = sorted(
            zip(
                map(_shape_head, self.shapes),
                self.packed,
                map(_shape_tail, self.shapes),
                range(len(self.packed)),
                strict=True,
            )
        )
        shapes = self.shapes
        return [
            (shapes[index].destination(packed), shapes[index]) for _, packed, _, index in ordered
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteColumns):
            return NotImplemented
        return frozenset(self.specs()) == frozenset(other.specs())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RouteColumns({len(self)} routes in {len(set(self.shapes))} shapes)"


_slot_of_order = operator.itemgetter(0, 1, 3, 4)  # of an order: its Slot
_slot_parts = tuple(map(operator.itemgetter, (0, 1, 3, 4)))  # of an order: each of its Slot
_destination_of = operator.itemgetter(2)  # of an order: the packed destination


def _destinations_by_shape(
    routes: Sequence[RouteSpec],
) -> list[tuple[Slot, tuple[NextHop, ...], set[bytes]]]:
    """(slot, next hops, packed destinations) of routes grouped by slot and hop set
    (interned hop sets: grouped by identity); a request of one shape, the usual one, is
    recognised in C."""
    hop_sets = list(map(_hops_of, routes))
    orders = list(map(_by_order, routes))
    if (
        routes
        and len(set(map(id, hop_sets))) == 1
        and all(len(set(map(part, orders))) == 1 for part in _slot_parts)
    ):
        return [(_slot_of_order(orders[0]), hop_sets[0], set(map(_destination_of, orders)))]
    groups: dict[tuple[Slot, int], tuple[Slot, tuple[NextHop, ...], set[bytes]]] = {}
    for order, hops in zip(orders, hop_sets, strict=True):
        slot = _slot_of_order(order)
        group = groups.get((slot, id(hops)))
        if group is None:
            group = groups[slot, id(hops)] = (slot, hops, set())
        group[2].add(order[2])
    return list(groups.values())


def columns_satisfy(
    observed: RouteColumns, want: Mapping[RouteKey, RouteSpec], prune: bool
) -> bool:
    """Whether ``diff_indexed(by_key(observed.specs()), want, prune)`` is empty, decided
    without a RouteSpec per observed route: within each slot (family, table, prefix
    length, metric), the packed destinations of each desired hop set must be among
    those of the observed shapes whose hops satisfy it (see :func:`satisfies`), and,
    with prune, every observed destination among the desired ones; sets of bytes,
    compared in C, and each pair of hop sets once. False also when the kernel listed a
    key twice (``by_key`` keeps the last): callers then diff the routes themselves,
    which also tells what differs."""
    seen: dict[Slot, list[tuple[RouteShape, set[bytes]]]] = {}
    for shape, packed in observed.by_shape().items():
        destinations = set(packed)
        if len(destinations) != len(packed):
            return False
        seen.setdefault(shape.slot, []).append((shape, destinations))
    for shapes in seen.values():
        if len(shapes) > 1 and len(set().union(*(d for _, d in shapes))) != sum(
            len(d) for _, d in shapes
        ):
            return False
    in_slot: dict[Slot, list[set[bytes]]] = {}
    for slot, hops, destinations in _destinations_by_shape(list(want.values())):
        covered = [d for shape, d in seen.get(slot, ()) if same_hops(shape.nexthops, hops)]
        if len(covered) == 1:
            if not destinations <= covered[0]:
                return False
        elif not destinations <= set().union(*covered):
            return False
        in_slot.setdefault(slot, []).append(destinations)
    if prune:
        for slot, shapes in seen.items():
            wanted_here = in_slot.get(slot, [])
            allowed = wanted_here[0] if len(wanted_here) == 1 else set().union(*wanted_here)
            if any(not d <= allowed for _, d in shapes):
                return False
    return True


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
    """What an ensure did, and OrchestrRL's routes as read back afterwards
    (``read_back``, column-wise; ``routes`` as RouteSpecs, built on first use)."""

    added: int
    removed: int
    replaced: int
    unchanged: int
    read_back: RouteColumns = field(default_factory=RouteColumns)

    @functools.cached_property
    def routes(self) -> frozenset[RouteSpec]:
        return frozenset(self.read_back.specs())


@dataclass(frozen=True)
class RuleChange:
    added: int
    removed: int
    unchanged: int
    rules: frozenset[RuleSpec] = frozenset()


def route_sort_key(route: RouteSpec) -> RouteOrder:
    """Family, table, destination address (as bytes), prefix length, metric."""
    return route.order


_by_order = operator.attrgetter("order")  # route_sort_key, for sorting in C
_key_of = operator.attrgetter("key")
_hops_of = operator.attrgetter("nexthops")


def by_key(routes: Iterable[RouteSpec]) -> dict[RouteKey, RouteSpec]:
    """Routes by key (the last of a key wins), built in C: ``{r.key: r for r in routes}``."""
    routes = routes if isinstance(routes, (list, tuple)) else list(routes)
    return dict(zip(map(_key_of, routes), routes, strict=True))


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
    routes = routes if isinstance(routes, (list, tuple)) else list(routes)
    indexed = by_key(routes)
    if len(indexed) == len(routes):  # no key twice (checked in C)
        return indexed
    indexed = {}
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
    """Same key and the same next hops (gateway, device, onlink), hop by hop in canonical
    order; a desired hop without a device accepts the device the kernel chose.

    Hop by hop is sound because both sides sort by gateway first, and a desired gateway
    without a device is in only one of its hops (RouteSpec enforces that)."""
    return observed.key == desired.key and _same_hops(observed, desired)


def _same_hops(observed: RouteSpec, desired: RouteSpec) -> bool:
    return same_hops(observed.nexthops, desired.nexthops)


def same_hops(have: tuple[NextHop, ...], want: tuple[NextHop, ...]) -> bool:
    """Whether observed next hops satisfy desired ones (see :func:`satisfies`)."""
    if have == want:  # interned hops: usually an identity comparison
        return True
    return len(have) == len(want) and all(
        h.gateway == w.gateway and h.onlink == w.onlink and w.device in (None, h.device)
        for h, w in zip(have, want, strict=True)
    )


def diff_routes(
    observed: Iterable[RouteSpec], desired: Iterable[RouteSpec], prune: bool
) -> RouteDiff:
    """Add what is missing, replace what differs, remove what is stale (only with prune).

    ``observed`` are the routes OrchestrRL installed (never anyone else's).
    """
    return diff_indexed(by_key(observed), index_routes(desired), prune)


def diff_indexed(
    have: Mapping[RouteKey, RouteSpec], want: Mapping[RouteKey, RouteSpec], prune: bool
) -> RouteDiff:
    """:func:`diff_routes` of routes already indexed by key (``want`` as
    :func:`index_routes` gives it), for callers that diff one desired set repeatedly."""
    if not have:
        return RouteDiff(tuple(sorted(want.values(), key=_by_order)), (), ())
    if not want:
        remove = sorted(have.values(), key=_by_order) if prune else []
        return RouteDiff((), (), tuple(remove))
    if (len(have) == len(want) or not prune) and have.keys() >= want.keys():
        # Every desired key is held (and, with prune, nothing else): the usual read-back.
        # Only replacements are possible; the routes are paired by hop sets in C and
        # each distinct pair is compared once.
        held = list(map(have.__getitem__, want))
        wanted = list(want.values())
        pairs = dict(
            zip(
                zip(map(id, map(_hops_of, held)), map(id, map(_hops_of, wanted)), strict=True),
                zip(held, wanted, strict=True),
                strict=True,
            )
        )
        if all(_same_hops(h, w) for h, w in pairs.values()):
            return RouteDiff((), (), ())
    add = [r for k, r in want.items() if k not in have]
    # Whether observed hops satisfy desired ones depends on the two hop sets only, and
    # both are interned: one answer per pair of hop sets (the routes keep them alive).
    # Routes come in runs of one pair of hop sets: the last answer is tried first.
    same: dict[tuple[int, int], bool] = {}
    replace = []
    get = have.get
    last_have: object = None
    last_want: object = None
    ok = True
    for k, r in want.items():
        h = get(k)
        if h is None:
            continue
        have_hops, want_hops = h.nexthops, r.nexthops
        if have_hops is not last_have or want_hops is not last_want:
            pair = (id(have_hops), id(want_hops))
            known = same.get(pair)
            if known is None:
                known = same[pair] = _same_hops(h, r)
            last_have, last_want, ok = have_hops, want_hops, known
        if not ok:
            replace.append(r)
    remove = [r for k, r in have.items() if k not in want] if prune else []
    return RouteDiff(
        tuple(sorted(add, key=_by_order)),
        tuple(sorted(replace, key=_by_order)),
        tuple(sorted(remove, key=_by_order)),
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


class MissingDevice(NamedTuple):
    """A device a route names that does not exist; ``field`` is how the route names it:
    ``device`` when all its hops share it, else ``nexthops[i].device``."""

    route: RouteSpec
    field: str
    device: str


def route_devices(route: RouteSpec) -> Iterable[tuple[str, str]]:
    """(field, device) of every device a route names, as :class:`MissingDevice` spells it."""
    if route.device is not None:
        return [("device", route.device)]
    return [(f"nexthops[{i}].device", h.device) for i, h in enumerate(route.nexthops) if h.device]


def unknown_devices(
    routes: Iterable[RouteSpec], devices: Mapping[str, object]
) -> list[MissingDevice]:
    """Every (route, field, device) whose device is not in ``devices``, in route order.

    Rule input interfaces may name devices that do not exist yet (the kernel keeps such
    rules dormant until the device appears), so only route devices are checked.
    """
    routes = routes if isinstance(routes, (list, tuple)) else list(routes)
    # one route per hop set (routes share a few), gathered in C: usually all is well
    if all(
        device in devices
        for route in dict(zip(map(id, map(_hops_of, routes)), routes, strict=True)).values()
        for _, device in route_devices(route)
    ):
        return []
    missing: list[MissingDevice] = []
    found: set[int] = set()  # ids of hop sets whose devices all exist (routes share them)
    for route in routes:
        if id(route.nexthops) in found:
            continue
        unknown = [
            MissingDevice(route, name, device)
            for name, device in route_devices(route)
            if device not in devices
        ]
        if unknown:
            missing += unknown
        else:
            found.add(id(route.nexthops))
    return missing


def missing_devices(routes: Iterable[RouteSpec], devices: Mapping[str, object]) -> list[str]:
    """Route devices (shared or per hop) that do not exist, sorted and unique."""
    return sorted({m.device for m in unknown_devices(routes, devices)})

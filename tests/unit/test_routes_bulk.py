"""The bulk paths of route programming give what the one-at-a-time paths give: building
routes from a request (``RouteSpec.simple``), reading a dump back (``_OwnedReader``),
encoding from templates, and the collector pause around them; and rules read with our
codec are classified as they were with pyroute2's."""

from __future__ import annotations

import gc
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from orchestrrl import errors, rtnl
from orchestrrl.netlink import OWNER_PROTO, _OwnedReader, _rule_from_wire
from orchestrrl.routing import (
    RouteColumns,
    RouteSpec,
    RuleSpec,
    collector_paused,
    diff_indexed,
    parse_prefix,
    route_shape,
    route_sort_key,
    satisfies,
    simple_routes,
)

pytestmark = pytest.mark.unit

DESTINATIONS = [
    "10.1.0.0/16",
    "10.1.0.1/32",
    "10.1.0.1/16",  # host bits
    "10.1.0.0/33",
    "10.1.0.0/016",
    "10.1.0.0/",
    "10.1.0.0",
    "010.1.0.0/16",
    "10.1.0.300/16",
    "0.0.0.0/0",
    "fd10::/64",
    "FD10:0:0::/64",
    "fd10::1/64",
    "fd10::/129",
    "::ffff:10.1.0.0/120",
    "fd10::/٦٤",  # non-ASCII digits
    "",
    "/",
]
GATEWAYS = ["10.0.0.1", "10.0.0.2", "fd00::1", "fe80::1", "224.0.0.1", "10.0.0", "", "0.0.0.0"]


def outcome(build: object) -> object:
    """The route, or the type and text of the error."""
    try:
        return build() if callable(build) else build
    except (errors.OrlError, TypeError) as exc:
        return type(exc), str(exc)


@given(
    st.sampled_from(DESTINATIONS),
    st.lists(st.sampled_from(GATEWAYS), max_size=3).map(tuple),
    st.sampled_from([None, "", "p0", "bad/name", "x" * 16]),
    st.sampled_from([0, 254, 100, 255, 2**32 - 1, 2**32, -1, True]),
    st.sampled_from([0, 7, 2**32 - 1, 2**32, -1]),
)
def test_simple_builds_what_the_constructor_builds_or_raises_its_error(
    destination: str, gateways: tuple[str, ...], device: str | None, table: int, metric: int
) -> None:
    for _ in range(2):  # the second time from the cache
        expected = outcome(lambda: RouteSpec(destination, gateways, device, table, metric))
        got = outcome(lambda: RouteSpec.simple(destination, gateways, device, table, metric))
        assert got == expected
        if isinstance(got, RouteSpec) and isinstance(expected, RouteSpec):
            assert route_sort_key(got) == route_sort_key(expected)
            assert (got.gateways, got.device, got.key) == (
                expected.gateways,
                expected.device,
                expected.key,
            )


@given(st.booleans(), st.integers(0, 2**128 - 1), st.integers(0, 128))
@example(v6=True, value=2**128 - 1, length=128)  # the all-ones address (found in CI)
def test_prefixes_parse_as_ipaddress_reads_them(v6: bool, value: int, length: int) -> None:
    bits = 128 if v6 else 32
    length %= bits + 1
    value &= (1 << bits) - 1
    kind = ipaddress.IPv6Network if v6 else ipaddress.IPv4Network
    network = kind((value, length), strict=False)
    # the network's address with the low bit of value set: a host bit unless /bits (an OR,
    # not a +, which overflowed at the all-ones address)
    with_bit = type(network.network_address)(int(network.network_address) | (value & 1))
    for text in (str(network), f"{with_bit}/{length}"):
        try:
            expected = kind(text, strict=True)
        except ValueError:
            with pytest.raises(errors.InvalidArgument, match="host bits are set"):
                parse_prefix(text, "destination")
            continue
        prefix = parse_prefix(text, "destination")
        family = socket.AF_INET6 if v6 else socket.AF_INET
        # as the kernel writes it (inet_ntop: "::0.1.0.0", where ipaddress says "::1:0")
        address = socket.inet_ntop(family, expected.network_address.packed)
        assert prefix.text == f"{address}/{length}"
        assert prefix.packed == expected.network_address.packed
        assert (prefix.version, prefix.length) == (expected.version, expected.prefixlen)


def test_a_route_sorts_by_family_table_address_length_metric() -> None:
    routes = [
        RouteSpec("fd00::/64", ("fd00:1::1",)),
        RouteSpec("10.2.0.0/16", ("10.0.0.1",), table=100),
        RouteSpec("10.10.0.0/16", ("10.0.0.1",)),
        RouteSpec("10.2.0.0/24", ("10.0.0.1",)),
        RouteSpec("10.2.0.0/16", ("10.0.0.1",), metric=5),
        RouteSpec("10.2.0.0/16", ("10.0.0.1",)),
    ]
    ordered = sorted(routes, key=route_sort_key)
    assert [r.describe() for r in ordered] == [
        "10.2.0.0/16 via 10.0.0.1 table 100 metric 0",
        "10.2.0.0/16 via 10.0.0.1 table 254 metric 0",
        "10.2.0.0/16 via 10.0.0.1 table 254 metric 5",
        "10.2.0.0/24 via 10.0.0.1 table 254 metric 0",
        "10.10.0.0/16 via 10.0.0.1 table 254 metric 0",
        "fd00::/64 via fd00:1::1 table 254 metric 1024",
    ]


DEVICES = {"p0": 7, "p1": 8}
NAMES = {index: name for name, index in DEVICES.items()}


def kernel_body(message: bytes) -> bytes:
    """An RTM_NEWROUTE body as a dump carries it: our encoding writes RTA_TABLE and
    RTA_DST first, as the kernel does (routes here name their devices, as read back)."""
    return message[rtnl.NLMSGHDR.size :]


def read_route(reader: _OwnedReader, body: bytes) -> RouteSpec | None:
    """One RTM_NEWROUTE body through the reader, as a RouteSpec (None: skipped)."""
    batch = reader(body, 0, len(body))
    if batch is None:
        return None
    ((shape,), (packed,)) = batch
    return shape.route(packed)


def test_the_owned_reader_reads_what_from_kernel_reads() -> None:
    encoder = rtnl.RouteEncoder(OWNER_PROTO, DEVICES)
    foreign = rtnl.RouteEncoder(OWNER_PROTO + 1, DEVICES)
    routes = [
        *(RouteSpec(f"10.1.{i}.0/24", ("10.0.0.1",), "p0") for i in range(5)),
        *(RouteSpec(f"10.2.{i}.0/24", ("10.0.0.1", "10.0.0.2"), "p1") for i in range(5)),
        *(RouteSpec(f"fd{i:02x}::/64", ("fd00::1",), "p0", table=100) for i in range(5)),
        RouteSpec("10.3.0.0/16", ("10.0.0.1",), "p0", metric=9),
    ]
    bodies = [kernel_body(encoder.encode(i, "add", r)) for i, r in enumerate(routes)]
    bodies.insert(
        3, kernel_body(foreign.encode(99, "add", RouteSpec("10.9.0.0/16", ("10.0.0.1",))))
    )
    reader = _OwnedReader(NAMES, None)
    for _ in range(2):  # the second time every shape is known
        read = [read_route(reader, body) for body in bodies]
        assert read.pop(3) is None  # another protocol's route
        assert read == routes
        for got, body in zip(read, bodies[:3] + bodies[4:], strict=True):
            assert got is not None
            wire = rtnl.decode_route(body)
            assert wire is not None
            hops = tuple(
                (g, NAMES.get(i), bool(f & rtnl.RTNH_F_ONLINK)) for g, i, f in wire.nexthops
            )
            expected = RouteSpec.from_kernel(
                wire.version, wire.destination, hops, wire.table, wire.metric
            )
            assert got == expected
            assert (got.key, got.device, got.gateways) == (
                expected.key,
                expected.device,
                expected.gateways,
            )
            assert route_sort_key(got) == route_sort_key(expected)


def test_the_owned_reader_skips_routes_it_cannot_read_and_remembers_no_shape() -> None:
    # a device the encoder does not know goes out as ifindex 0: neither gateway nor device
    route = RouteSpec("10.1.0.0/24", device="zz")
    body = kernel_body(rtnl.RouteEncoder(OWNER_PROTO, DEVICES).encode(1, "add", route))
    reader = _OwnedReader(NAMES, None)
    assert reader(body, 0, len(body)) is None
    assert reader(body, 0, len(body)) is None
    assert reader._shapes == {}


def test_route_shapes_build_what_from_kernel_builds() -> None:
    hops = (("10.0.0.2", "p0", False), ("10.0.0.1", "p1", True))
    shape = route_shape(4, hops, 100, 16, 3)
    assert route_shape(4, hops, 100, 16, 3) is shape  # interned
    route = shape.route(socket.inet_aton("10.1.0.0"))
    expected = RouteSpec.from_kernel(4, "10.1.0.0/16", hops, 100, 3)
    assert route == expected
    assert hash(route) == hash(expected)
    assert route_sort_key(route) == route_sort_key(expected)
    assert (route.key, route.device, route.gateways) == (
        expected.key,
        expected.device,
        expected.gateways,
    )
    assert shape.destination(socket.inet_aton("10.1.0.0")) == "10.1.0.0/16"


@given(
    st.integers(1, 2**32 - 1), st.integers(0, 255), st.sampled_from(["add", "replace", "delete"])
)
def test_messages_from_one_template_differ_only_in_sequence_and_destination(
    seq: int, last: int, op: rtnl.RouteOp
) -> None:
    encoder = rtnl.RouteEncoder(OWNER_PROTO, DEVICES)
    first = RouteSpec("10.1.0.0/24", ("10.0.0.1", "10.0.0.2"), "p0")
    other = RouteSpec(f"10.1.{last}.0/24", ("10.0.0.2", "10.0.0.1"), "p0")
    encoder.encode(1, op, first)  # makes the template
    fresh = rtnl.RouteEncoder(OWNER_PROTO, DEVICES)
    assert encoder.encode(seq, op, other) == fresh.encode(seq, op, other)
    assert encoder.encode(seq, op, other, ack=False) == fresh.encode(seq, op, other, ack=False)
    message = encoder.encode(seq, op, other)
    assert len(message) == encoder.template(op, other, ack=True)[3]


def test_the_collector_pause_restores_the_collector() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # paused by someone else: left to them
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="boom"), collector_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def wire_rule(**changes: Any) -> rtnl.WireRule:
    rule = rtnl.WireRule(
        family=socket.AF_INET,
        dst_len=0,
        src_len=16,
        tos=0,
        table=100,
        action=1,  # FR_ACT_TO_TBL
        flags=0,
        priority=200,
        source="10.20.0.0",
        destination=None,
        input_interface="p1",
        protocol=OWNER_PROTO,
        other_matches=False,
    )
    return rule._replace(**changes)


def test_only_rules_that_select_a_table_by_what_rulespec_knows_are_read() -> None:
    assert _rule_from_wire(wire_rule()) == RuleSpec(
        200, 100, source="10.20.0.0/16", input_interface="p1", family=4
    )
    assert _rule_from_wire(wire_rule(family=socket.AF_INET6, source="fd20::", src_len=64)) == (
        RuleSpec(200, 100, source="fd20::/64", input_interface="p1")
    )
    for other in (
        {"action": 2},  # goto
        {"tos": 4},
        {"flags": 2},  # FIB_RULE_INVERT ("not from ...")
        {"other_matches": True},  # fwmark, oifname, ...
        {"priority": 0},
        {"table": 0},
        {"family": socket.AF_UNSPEC},
        {"source": "10.20.0.1"},  # host bits: not something we install
    ):
        assert _rule_from_wire(wire_rule(**other)) is None, other


@dataclass(frozen=True)
class Row:
    """A route as a request message carries it (the fields ``simple_routes`` reads)."""

    destination: Any
    gateways: Any
    device: Any
    table: Any
    metric: Any


ROW = st.builds(
    Row,
    st.sampled_from(DESTINATIONS),
    st.lists(st.sampled_from(GATEWAYS), max_size=3),
    st.sampled_from(["", "p0", "bad/name", "x" * 16]),
    st.sampled_from([0, 254, 100, 255, 2**32 - 1, 2**32, -1]),
    st.sampled_from([0, 7, 2**32 - 1, -1]),
)


@given(st.lists(ROW, max_size=6))
def test_simple_routes_build_what_simple_builds_or_raise_its_error_with_the_index(
    rows: list[Row],
) -> None:
    expected: list[RouteSpec] = []
    error: object = None
    for index, row in enumerate(rows):
        got = outcome(
            lambda row=row: RouteSpec.simple(
                row.destination, tuple(row.gateways), row.device or None, row.table, row.metric
            )
        )
        if not isinstance(got, RouteSpec):
            assert isinstance(got, tuple)
            error = (got[0], f"routes[{index}].{got[1]}")
            break
        expected.append(got)
    for _ in range(2):
        built = outcome(lambda: simple_routes(rows))
        if error is not None:
            assert built == error
            continue
        assert isinstance(built, list)
        assert built == expected
        for a, b in zip(built, expected, strict=True):
            assert (a.key, a.order, a.gateways, a.device, a.family, hash(a)) == (
                b.key,
                b.order,
                b.gateways,
                b.device,
                b.family,
                hash(b),
            )


def dump_datagram(bodies: list[bytes], seq: int, flags: int = rtnl.NLM_F_MULTI) -> bytes:
    return b"".join(rtnl.message(rtnl.RTM_NEWROUTE, flags, seq, body) for body in bodies)


def test_the_owned_reader_reads_a_whole_datagram_as_message_by_message() -> None:
    encoder = rtnl.RouteEncoder(OWNER_PROTO, DEVICES)
    foreign = rtnl.RouteEncoder(OWNER_PROTO + 1, DEVICES)
    unreadable = RouteSpec("10.7.0.0/24", device="zz")  # goes out as ifindex 0: skipped
    routes = [
        *(RouteSpec(f"10.1.{i}.0/24", ("10.0.0.1",), "p0") for i in range(4)),
        *(RouteSpec(f"10.2.{i}.0/24", ("10.0.0.1", "10.0.0.2"), "p1") for i in range(3)),
        RouteSpec("10.1.9.0/24", ("10.0.0.2",), "p1", metric=9),
    ]
    v4 = [kernel_body(encoder.encode(i, "add", r)) for i, r in enumerate(routes)]
    same_length = [b for b in v4 if len(b) == len(v4[0])]
    bodies = [
        *same_length[:2],
        kernel_body(foreign.encode(99, "add", RouteSpec("10.9.0.0/24", ("10.0.0.1",), "p0"))),
        kernel_body(encoder.encode(98, "add", unreadable)),
        *same_length[2:],
    ]
    bodies = [b for b in bodies if len(b) == len(v4[0])]
    assert len(bodies) >= 6
    one_by_one = [r for b in bodies if (r := read_route(_OwnedReader(NAMES, None), b))]
    reader = _OwnedReader(NAMES, None)
    for _ in range(2):  # the second time every shape is known
        batches = reader.bulk(dump_datagram(bodies, 5), 5)
        assert batches is not None
        got = list(RouteColumns.from_batches(batches).specs())
        assert got == one_by_one
        assert [(r.key, r.order, r.device, hash(r)) for r in got] == [
            (r.key, r.order, r.device, hash(r)) for r in one_by_one
        ]
    v6 = kernel_body(encoder.encode(1, "add", RouteSpec("fd01::/64", ("fd00::1",), "p0")))
    for _ in range(2):  # a datagram of one shape: unknown, then known
        batches = reader.bulk(dump_datagram([v6, v6], 5), 5)
        assert batches is not None
        assert (
            list(RouteColumns.from_batches(batches).specs())
            == [RouteSpec("fd01::/64", ("fd00::1",), "p0")] * 2
        )
    foreign_only = kernel_body(
        foreign.encode(97, "add", RouteSpec("10.9.0.0/24", ("10.0.0.1",), "p0"))
    )
    for _ in range(2):  # a datagram of another protocol's routes: nothing, known or not
        batches = reader.bulk(dump_datagram([foreign_only] * 3, 5), 5)
        assert batches is not None
        assert len(RouteColumns.from_batches(batches)) == 0
    # anything but a run of one dump's route messages of one length: read one by one
    assert reader.bulk(dump_datagram(bodies, 5), 6) is None  # another request's
    assert reader.bulk(dump_datagram(bodies, 5, rtnl.NLM_F_DUMP_INTR), 5) is None
    assert reader.bulk(dump_datagram(bodies[:2], 5) + dump_datagram([v6], 5), 5) is None
    done = rtnl.message(rtnl.NLMSG_DONE, rtnl.NLM_F_MULTI, 5, b"\0" * 4)
    assert reader.bulk(dump_datagram(bodies[:2], 5) + done, 5) is None
    other = bytearray(dump_datagram(bodies[:2], 5))
    other[4] = rtnl.RTM_NEWROUTE + 1  # nlmsg_type of the first message
    assert reader.bulk(bytes(other), 5) is None


def reference_diff(
    have: dict[Any, RouteSpec], want: dict[Any, RouteSpec], prune: bool
) -> tuple[set[RouteSpec], set[RouteSpec], set[RouteSpec]]:
    add = {r for k, r in want.items() if k not in have}
    replace = {r for k, r in want.items() if k in have and not satisfies(have[k], r)}
    remove = {r for k, r in have.items() if k not in want} if prune else set()
    return add, replace, remove


HOPS = st.sampled_from(
    [
        (("10.0.0.1",), None),
        (("10.0.0.1",), "p0"),
        (("10.0.0.1",), "p1"),
        (("10.0.0.1", "10.0.0.2"), None),
    ]
)


@given(
    st.dictionaries(st.integers(0, 7), HOPS, max_size=8),
    st.dictionaries(st.integers(0, 7), HOPS, max_size=8),
    st.booleans(),
)
def test_diff_indexed_finds_what_a_key_by_key_comparison_finds(
    observed: dict[int, tuple[tuple[str, ...], str | None]],
    desired: dict[int, tuple[tuple[str, ...], str | None]],
    prune: bool,
) -> None:
    def routes(spec: dict[int, tuple[tuple[str, ...], str | None]]) -> dict[Any, RouteSpec]:
        made = [RouteSpec(f"10.1.{i}.0/24", hops, device) for i, (hops, device) in spec.items()]
        return {r.key: r for r in made}

    have, want = routes(observed), routes(desired)
    diff = diff_indexed(have, want, prune)
    assert (set(diff.add), set(diff.replace), set(diff.remove)) == reference_diff(have, want, prune)


def test_a_datagram_of_one_shape_is_read_whole_and_anything_else_message_by_message() -> None:
    encoder = rtnl.RouteEncoder(OWNER_PROTO, DEVICES)
    routes = [RouteSpec(f"10.1.{i}.0/24", ("10.0.0.1",), "p0") for i in range(6)]
    bodies = [kernel_body(encoder.encode(i, "add", r)) for i, r in enumerate(routes)]
    reader = _OwnedReader(NAMES, None)

    def read(datagram: bytes, seq: int = 5) -> list[RouteSpec] | None:
        batches = reader.bulk(datagram, seq)
        return None if batches is None else list(RouteColumns.from_batches(batches).specs())

    for _ in range(2):  # unknown shape, then known
        assert read(dump_datagram(bodies, 5)) == routes
    # the same bodies but one with another metric (same length): two shapes
    other = RouteSpec("10.1.9.0/24", ("10.0.0.1",), "p0", metric=7)
    mixed = [*bodies[:3], kernel_body(encoder.encode(9, "add", other)), *bodies[3:]]
    assert read(dump_datagram(mixed, 5)) == [*routes[:3], other, *routes[3:]]
    # one message of the datagram interrupted, or of another dump: not read whole
    interrupted = dump_datagram(bodies[:5], 5) + dump_datagram(
        bodies[5:], 5, rtnl.NLM_F_MULTI | rtnl.NLM_F_DUMP_INTR
    )
    assert read(interrupted) is None
    assert read(dump_datagram(bodies[:5], 5) + dump_datagram(bodies[5:], 6)) is None

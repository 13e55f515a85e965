"""The hand-written rtnetlink route codec: what we encode decodes to the same route."""

from __future__ import annotations

import errno
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import rtnl
from orchestrrl.routing import NextHop, RouteSpec

pytestmark = pytest.mark.unit

PROTO = 77


def body(message: bytes) -> rtnl.Message:
    (only,) = list(rtnl.iter_messages(message))
    return only


DEVICES = {"p0": 7, "up0": 11, "up1": 12}


@st.composite
def routes(draw: st.DrawFn) -> RouteSpec:
    if draw(st.booleans()):
        length = draw(st.integers(0, 32))
        value = draw(st.integers(0, 2**32 - 1)) >> (32 - length) << (32 - length) if length else 0
        dst = ".".join(str(value >> s & 0xFF) for s in (24, 16, 8, 0)) + f"/{length}"
        pool = [f"192.0.2.{i}" for i in range(1, 9)]
    else:
        length = draw(st.integers(0, 64))
        value = draw(st.integers(0, 2**64 - 1)) >> (64 - length) << (64 - length) if length else 0
        groups = [value >> s & 0xFFFF for s in (48, 32, 16, 0)]
        dst = ":".join(f"{g:x}" for g in groups) + f"::/{length}"
        pool = [f"2001:db8::{i}" for i in range(1, 9)]
    table = draw(st.sampled_from([254, 100, 252, 256, 2**32 - 1]))
    metric = draw(st.integers(0, 2**32 - 1))
    gateways = draw(st.lists(st.sampled_from(pool), max_size=4, unique=True))
    if draw(st.booleans()):  # the simple form: one device for every hop, or none
        device = "p0" if not gateways or draw(st.booleans()) else None
        return RouteSpec(dst, tuple(gateways), device, table, metric)
    hops = []  # per hop: own device, onlink, device-only hops
    candidates: list[str | None] = [*gateways] or [None]
    for gateway in candidates:
        device = draw(
            st.sampled_from([None, *DEVICES]) if gateway else st.sampled_from(sorted(DEVICES))
        )
        onlink = gateway is not None and device is not None and draw(st.booleans())
        hops.append(NextHop(gateway, device, onlink))
    return RouteSpec(dst, table=table, metric=metric, nexthops=hops)


@given(routes(), st.integers(1, 2**32 - 1))
def test_an_added_route_decodes_to_itself(route: RouteSpec, seq: int) -> None:
    message = body(rtnl.encode_route(seq, "add", route, PROTO, DEVICES))
    assert message.kind == rtnl.RTM_NEWROUTE
    assert message.seq == seq
    assert message.flags & rtnl.NLM_F_EXCL and message.flags & rtnl.NLM_F_ACK
    wire = rtnl.decode_route(message.payload)
    assert wire is not None
    assert (wire.version, wire.destination, wire.table, wire.metric, wire.proto) == (
        route.family,
        route.destination,
        route.table,
        route.metric,
        PROTO,
    )
    names = {index: name for name, index in DEVICES.items()}
    hops = tuple(
        (gateway, names.get(index), bool(flags & rtnl.RTNH_F_ONLINK))
        for gateway, index, flags in wire.nexthops
    )
    assert RouteSpec.from_kernel(wire.version, wire.destination, hops, wire.table, wire.metric) == (
        route
    )
    assert hops == tuple((h.gateway, h.device, h.onlink) for h in route.nexthops)
    single = len(route.nexthops) == 1
    assert wire.oif == (DEVICES.get(route.nexthops[0].device or "", 0) if single else 0)
    assert wire.flags == (rtnl.RTNH_F_ONLINK if single and route.nexthops[0].onlink else 0)
    link_scope = route.family == 4 and not route.gateways
    assert wire.scope == (rtnl.RT_SCOPE_LINK if link_scope else rtnl.RT_SCOPE_UNIVERSE)


def test_each_multipath_hop_carries_its_own_device_and_onlink() -> None:
    """The rtnexthop layout of linux/rtnetlink.h: u16 len, u8 flags, u8 hops, s32 ifindex."""
    route = RouteSpec(
        "10.0.2.0/24",
        nexthops=(
            NextHop("172.16.0.10", "up1", onlink=True),
            NextHop("172.16.0.9", "up0", onlink=True),
        ),
    )
    payload = body(rtnl.encode_route(1, "add", route, PROTO, DEVICES)).payload
    assert struct.unpack_from("=I", payload, 8)[0] == 0  # rtm_flags: onlink is per hop here
    offset = 12
    multipath = b""
    while offset < len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        assert kind != rtnl.RTA_OIF  # IPv4 would require it to equal the first hop's
        if kind == rtnl.RTA_MULTIPATH:
            multipath = payload[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    gateway_attr = struct.pack("=HH", 8, rtnl.RTA_GATEWAY)
    assert multipath == (
        struct.pack("=HBBi", 16, rtnl.RTNH_F_ONLINK, 0, 11) + gateway_attr + bytes([172, 16, 0, 9])
    ) + (
        struct.pack("=HBBi", 16, rtnl.RTNH_F_ONLINK, 0, 12) + gateway_attr + bytes([172, 16, 0, 10])
    )
    wire = rtnl.decode_route(payload)
    assert wire is not None
    assert wire.nexthops == (("172.16.0.9", 11, 4), ("172.16.0.10", 12, 4))


def test_a_single_onlink_hop_uses_rtm_flags_and_rta_oif() -> None:
    route = RouteSpec("10.0.2.0/24", nexthops=(NextHop("172.16.0.9", "up0", onlink=True),))
    wire = rtnl.decode_route(body(rtnl.encode_route(1, "add", route, PROTO, DEVICES)).payload)
    assert wire is not None
    assert (wire.oif, wire.flags, wire.nexthops) == (11, 4, (("172.16.0.9", 11, 4),))


def test_decoding_keeps_device_only_hops_and_ignores_other_hop_flags() -> None:
    """A multipath entry without a gateway is a hop too; LINKDOWN/DEAD bits pass through
    (the adapter only reads RTNH_F_ONLINK)."""
    hop = struct.pack("=HBBi", 8, 16 | 1, 0, 5)  # no RTA_GATEWAY; LINKDOWN | DEAD
    gw = struct.pack("=HH", 8, rtnl.RTA_GATEWAY) + bytes([10, 0, 0, 1])
    hop2 = struct.pack("=HBBi", 16, rtnl.RTNH_F_ONLINK, 0, 6) + gw
    mp = hop + hop2
    payload = struct.pack("=BBBBBBBBI", 2, 24, 0, 0, 254, PROTO, 0, 1, 0)
    payload += struct.pack("=HH", 4 + len(mp), rtnl.RTA_MULTIPATH) + mp
    wire = rtnl.decode_route(payload)
    assert wire is not None
    assert wire.nexthops == ((None, 5, 17), ("10.0.0.1", 6, 4))


def test_replace_and_delete_flags() -> None:
    route = RouteSpec("10.1.0.0/16", ("192.0.2.1", "192.0.2.2"))
    replace = body(rtnl.encode_route(1, "replace", route, PROTO))
    assert replace.flags & rtnl.NLM_F_REPLACE and replace.flags & rtnl.NLM_F_CREATE
    delete = body(rtnl.encode_route(2, "delete", route, PROTO))
    assert delete.kind == rtnl.RTM_DELROUTE
    wire = rtnl.decode_route(delete.payload)
    assert wire is not None and wire.nexthops == () and wire.proto == PROTO
    assert wire.scope == rtnl.RT_SCOPE_NOWHERE  # any scope, but only our protocol


def test_a_dump_request_filters_by_table_and_protocol() -> None:
    message = body(rtnl.encode_dump(9, 6, table=1000, proto=PROTO))
    assert message.kind == rtnl.RTM_GETROUTE
    assert message.flags == rtnl.NLM_F_REQUEST | rtnl.NLM_F_DUMP
    wire = rtnl.decode_route(message.payload)
    assert wire is not None and (wire.version, wire.table, wire.proto) == (6, 1000, PROTO)


def ack(seq: int, error: int, text: str = "") -> bytes:
    flags = rtnl.NLM_F_CAPPED | (rtnl.NLM_F_ACK_TLVS if text else 0)
    echoed = struct.pack("=IHHII", 60, rtnl.RTM_NEWROUTE, 0, seq, 0)
    payload = struct.pack("=i", -error) + echoed
    if text:
        raw = text.encode() + b"\0"
        payload += struct.pack("=HH", 4 + len(raw), rtnl.NLMSGERR_ATTR_MSG) + raw
        payload += b"\0" * (-len(payload) % 4)
    return struct.pack("=IHHII", 16 + len(payload), rtnl.NLMSG_ERROR, flags, seq, 0) + payload


def test_acks_carry_errno_and_the_kernels_explanation() -> None:
    data = ack(5, 0) + ack(6, errno.ENETUNREACH, "Nexthop has invalid gateway")
    first, second = rtnl.iter_messages(data)
    assert rtnl.decode_error(first) == (0, "")
    assert second.seq == 6
    assert rtnl.decode_error(second) == (errno.ENETUNREACH, "Nexthop has invalid gateway")


def test_a_truncated_datagram_is_an_error_not_garbage() -> None:
    with pytest.raises(ValueError, match="truncated netlink message"):
        list(rtnl.iter_messages(ack(1, 0)[:-4]))


def test_foreign_attributes_are_skipped() -> None:
    route = RouteSpec("10.1.0.0/16", ("192.0.2.1",))
    message = bytearray(body(rtnl.encode_route(1, "add", route, 4)).payload)
    message += struct.pack("=HH", 8, 30) + struct.pack("=I", 12)  # RTA_NH_ID
    wire = rtnl.decode_route(bytes(message))
    assert wire is not None and wire.nexthops == (("192.0.2.1", 0, 0),)
    assert rtnl.route_proto(bytes(message)) == 4

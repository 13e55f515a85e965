"""orchestrrl.rtnl against pyroute2's message classes: the same bytes, decoded both ways.

pyroute2 (a dependency) has its own, independent codec of the same ABI: messages built
and encoded with its ``rtmsg`` / ``ifinfmsg`` / ``tcmsg`` / ``fibmsg`` classes must decode
with ours to the same fields, and what we encode must decode with pyroute2 to what we
meant. No kernel and no root needed.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyroute2.netlink.rtnl.fibmsg import fibmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from orchestrrl import rtnl
from orchestrrl.routing import NextHop, RouteSpec
from tests.unit.test_netlink_wire import DEVICES, routes

pytestmark = pytest.mark.unit

PROTO = 77
u8, u16, u32 = st.integers(0, 255), st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1)


def _header(msg: Any, kind: int, flags: int, seq: int) -> None:
    msg["header"]["type"] = kind
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq


def _address(version: int, value: int) -> str:
    family = rtnl.AF_OF[version]
    return socket.inet_ntop(family, value.to_bytes(4 if version == 4 else 16, "big"))


@st.composite
def pyroute2_routes(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """An RTM_NEWROUTE encoded by pyroute2, and what it says."""
    version = draw(st.sampled_from([4, 6]))
    bits = 32 if version == 4 else 128
    dst = _address(version, draw(st.integers(0, 2**bits - 1)))
    hops = [
        (
            _address(version, draw(st.integers(1, 2**bits - 1))) if draw(st.booleans()) else None,
            draw(st.integers(1, 2**31 - 1)),
            draw(u8),
        )
        for _ in range(draw(st.integers(0, 5)))
    ]
    fields = {
        "family": rtnl.AF_OF[version],
        "dst_len": draw(st.integers(0, bits)),
        "table": draw(u8),
        "proto": draw(u8),
        "scope": draw(u8),
        "type": draw(st.integers(1, 11)),
        "flags": draw(u32),
    }
    table, metric = draw(u32), draw(u32)
    msg = rtmsg()
    msg.update(fields)
    attrs: list[tuple[str, Any]] = [("RTA_TABLE", table), ("RTA_DST", dst)]
    attrs.append(("RTA_PRIORITY", metric))
    if len(hops) == 1:  # the one next hop: RTA_GATEWAY / RTA_OIF
        gateway, oif, _ = hops[0]
        if gateway is not None:
            attrs.append(("RTA_GATEWAY", gateway))
        attrs.append(("RTA_OIF", oif))
    elif hops:
        attrs.append(
            (
                "RTA_MULTIPATH",
                [
                    {
                        "oif": oif,
                        "flags": flags,
                        "hops": 0,
                        "attrs": [("RTA_GATEWAY", gateway)] if gateway else [],
                    }
                    for gateway, oif, flags in hops
                ],
            )
        )
    msg["attrs"] = attrs
    seq = draw(u32)
    _header(msg, rtnl.RTM_NEWROUTE, rtnl.NLM_F_MULTI, seq)
    msg.encode()
    said = {**fields, "version": version, "dst": dst, "table_id": table, "metric": metric}
    return bytes(msg.data), {**said, "hops": hops, "seq": seq}


@given(pyroute2_routes())
def test_routes_pyroute2_encodes_decode_with_ours(case: tuple[bytes, dict[str, Any]]) -> None:
    data, said = case
    ((header, start, end),) = list(rtnl.frames(data, strict=True))
    assert header == rtnl.NlMsgHdr(len(data), rtnl.RTM_NEWROUTE, rtnl.NLM_F_MULTI, said["seq"], 0)
    assert rtnl.rtmsg(data, start) == rtnl.RtMsg(
        said["family"],
        said["dst_len"],
        0,
        0,
        said["table"],
        said["proto"],
        said["scope"],
        said["type"],
        said["flags"],
    )
    for decoder in (rtnl.RouteDecoder(), rtnl.RouteDecoder()):
        for _ in range(2):  # the second decode takes the decoder's memoised path
            wire = decoder.decode(data[start:end])
            assert wire is not None
            assert wire.version == said["version"]
            assert wire.destination == f"{said['dst']}/{said['dst_len']}"
            assert (wire.table, wire.metric, wire.proto) == (
                said["table_id"],
                said["metric"],
                said["proto"],
            )
            assert (wire.scope, wire.kind, wire.flags) == (
                said["scope"],
                said["type"],
                said["flags"],
            )
            hops = said["hops"]
            if len(hops) == 1:
                gateway, oif, _ = hops[0]
                assert wire.nexthops == ((gateway, oif, said["flags"] & 0xFF),)
            else:
                assert wire.nexthops == tuple(hops)


def _pyroute2_view(data: bytes) -> Any:
    msg = rtmsg(data)
    msg.decode()
    return msg


@given(routes(), u32, st.sampled_from(["add", "replace", "delete"]), st.booleans())
def test_routes_we_encode_decode_with_pyroute2(
    route: RouteSpec, seq: int, op: rtnl.RouteOp, ack: bool
) -> None:
    data = rtnl.RouteEncoder(PROTO, DEVICES).encode(seq, op, route, ack=ack)
    msg = _pyroute2_view(data)
    header = msg["header"]
    assert (header["length"], header["sequence_number"]) == (len(data), seq)
    assert header["type"] == (rtnl.RTM_DELROUTE if op == "delete" else rtnl.RTM_NEWROUTE)
    assert bool(header["flags"] & rtnl.NLM_F_ACK) == ack
    assert bool(header["flags"] & rtnl.NLM_F_EXCL) == (op == "add")
    assert bool(header["flags"] & rtnl.NLM_F_REPLACE) == (op == "replace")
    assert msg["family"] == rtnl.AF_OF[route.family]
    address, _, length = route.destination.partition("/")
    assert msg["dst_len"] == int(length)
    assert msg["table"] == (route.table if route.table < 256 else rtnl.RT_TABLE_COMPAT)
    assert (msg["proto"], msg["type"]) == (PROTO, rtnl.RTN_UNICAST)
    assert msg.get_attr("RTA_TABLE") == route.table
    assert msg.get_attr("RTA_PRIORITY") == route.metric
    dst = msg.get_attr("RTA_DST")
    family = rtnl.AF_OF[route.family]
    assert socket.inet_pton(family, dst) == socket.inet_pton(family, address)
    if op == "delete":
        assert msg["scope"] == rtnl.RT_SCOPE_NOWHERE
        assert msg.get_attr("RTA_MULTIPATH") is None and msg.get_attr("RTA_GATEWAY") is None
        return
    link_scope = route.family == 4 and not route.gateways
    assert msg["scope"] == (rtnl.RT_SCOPE_LINK if link_scope else rtnl.RT_SCOPE_UNIVERSE)
    expected = [
        (hop.gateway, DEVICES.get(hop.device or "", 0), hop.onlink) for hop in route.nexthops
    ]
    if len(route.nexthops) == 1:
        gateway, oif, onlink = expected[0]
        got = msg.get_attr("RTA_GATEWAY")
        assert (got and socket.inet_pton(family, got)) == (
            gateway and socket.inet_pton(family, gateway)
        )
        assert (msg.get_attr("RTA_OIF") or 0) == oif
        assert msg["flags"] == (rtnl.RTNH_F_ONLINK if onlink else 0)
    else:
        assert msg["flags"] == 0 and msg.get_attr("RTA_OIF") is None
        hops = [
            (hop.get_attr("RTA_GATEWAY"), hop["oif"], bool(hop["flags"] & rtnl.RTNH_F_ONLINK))
            for hop in msg.get_attr("RTA_MULTIPATH")
        ]
        assert [(g and socket.inet_pton(family, g), o, f) for g, o, f in hops] == [
            (g and socket.inet_pton(family, g), o, f) for g, o, f in expected
        ]


def test_a_dump_request_decodes_with_pyroute2() -> None:
    msg = _pyroute2_view(rtnl.encode_dump(5, 6, table=1000, proto=PROTO))
    assert msg["header"]["type"] == rtnl.RTM_GETROUTE
    assert msg["header"]["flags"] == rtnl.NLM_F_REQUEST | rtnl.NLM_F_DUMP
    assert (msg["family"], msg["table"], msg["proto"]) == (
        socket.AF_INET6,
        rtnl.RT_TABLE_COMPAT,
        PROTO,
    )
    assert msg.get_attr("RTA_TABLE") == 1000


OPERSTATES = ["UNKNOWN", "NOTPRESENT", "DOWN", "LOWERLAYERDOWN", "TESTING", "DORMANT", "UP"]
names = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=15)


@given(
    names,
    st.integers(1, 2**31 - 1),
    u32,
    st.sampled_from(OPERSTATES),
    st.lists(st.sampled_from(["IFLA_MTU", "IFLA_MIN_MTU", "IFLA_MAX_MTU"]), unique=True),
    u32,
    st.sampled_from([None, "veth", "bridge", "bond"]),
    u32,
)
def test_links_pyroute2_encodes_decode_with_ours(
    name: str,
    index: int,
    flags: int,
    operstate: str,
    mtus: list[str],
    mtu: int,
    kind: str | None,
    seq: int,
) -> None:
    msg = ifinfmsg()
    msg["index"], msg["flags"], msg["change"] = index, flags, 0
    attrs: list[tuple[str, Any]] = [(mtu_attr, mtu) for mtu_attr in mtus]
    attrs += [("IFLA_IFNAME", name), ("IFLA_OPERSTATE", operstate)]
    if kind is not None:  # nested: IFLA_LINKINFO / IFLA_INFO_KIND
        attrs.append(("IFLA_LINKINFO", {"attrs": [("IFLA_INFO_KIND", kind)]}))
    msg["attrs"] = attrs
    _header(msg, rtnl.RTM_NEWLINK, rtnl.NLM_F_MULTI, seq)
    msg.encode()
    data = bytes(msg.data)
    ((header, start, end),) = list(rtnl.frames(data, strict=True))
    assert (header.type, header.seq, header.length) == (rtnl.RTM_NEWLINK, seq, len(data))
    assert rtnl.ifinfomsg(data, start) == rtnl.IfInfoMsg(0, 0, index, flags, 0)
    assert rtnl.parse_link(data, start, end) == rtnl.Link(
        ifindex=index,
        name=name,
        flags=flags,
        oper_up=operstate == "UP",
        mtu=mtu if "IFLA_MTU" in mtus else 0,
        min_mtu=mtu if "IFLA_MIN_MTU" in mtus else 0,
        max_mtu=mtu if "IFLA_MAX_MTU" in mtus else 0,
        kind=kind or "",
    )
    by_type = rtnl.attr_map(data, start + rtnl.IFINFOMSG.size, end)
    assert rtnl.attr_str(data, by_type[rtnl.IFLA_IFNAME]) == name
    if kind is not None:
        linkinfo = by_type[rtnl.IFLA_LINKINFO]
        inner = rtnl.attr_map(data, linkinfo.start, linkinfo.end)
        assert rtnl.attr_str(data, inner[rtnl.IFLA_INFO_KIND]) == kind


def test_the_link_dump_request_decodes_with_pyroute2() -> None:
    msg = ifinfmsg(rtnl.link_dump_request(3))
    msg.decode()
    assert msg["header"]["type"] == rtnl.RTM_GETLINK
    assert msg["header"]["flags"] == rtnl.NLM_F_REQUEST | rtnl.NLM_F_DUMP
    assert msg["header"]["sequence_number"] == 3
    assert (msg["family"], msg["index"], msg["flags"]) == (socket.AF_UNSPEC, 0, 0)
    assert msg.get_attr("IFLA_EXT_MASK") == rtnl.RTEXT_FILTER_SKIP_STATS


@given(st.integers(1, 2**31 - 1), u32, u32, u32, st.sampled_from(["u32", "ingress", "tbf"]))
def test_tc_messages_pyroute2_encodes_decode_with_ours(
    index: int, handle: int, parent: int, info: int, kind: str
) -> None:
    msg = tcmsg()
    msg["index"], msg["handle"], msg["parent"], msg["info"] = index, handle, parent, info
    msg["attrs"] = [("TCA_KIND", kind)]
    _header(msg, 44, rtnl.NLM_F_MULTI, 1)  # RTM_NEWTFILTER
    msg.encode()
    data = bytes(msg.data)
    ((header, start, end),) = list(rtnl.frames(data, strict=True))
    assert header.type == 44
    assert rtnl.tcmsg(data, start) == rtnl.TcMsg(0, index, handle, parent, info)
    (tca_kind,) = rtnl.attrs(data, start + rtnl.TCMSG.size, end)
    assert (tca_kind.type, rtnl.attr_str(data, tca_kind)) == (1, kind)  # TCA_KIND


def test_an_onlink_multipath_route_reads_the_same_both_ways() -> None:
    """A fixed example of the hypothesis tests above, easy to read when they fail."""
    route = RouteSpec(
        "10.0.2.0/24",
        nexthops=(NextHop("172.16.0.9", "up0", onlink=True), NextHop("172.16.0.10", "up1")),
    )
    data = rtnl.encode_route(1, "add", route, PROTO, DEVICES)
    hops = _pyroute2_view(data).get_attr("RTA_MULTIPATH")
    assert [(h.get_attr("RTA_GATEWAY"), h["oif"], h["flags"]) for h in hops] == [
        ("172.16.0.9", 11, rtnl.RTNH_F_ONLINK),  # canonical order: by address
        ("172.16.0.10", 12, 0),
    ]
    wire = rtnl.decode_route(data[rtnl.NLMSGHDR.size :])
    assert wire is not None
    assert wire.nexthops == (("172.16.0.9", 11, rtnl.RTNH_F_ONLINK), ("172.16.0.10", 12, 0))


OTHER_RULE_ATTRS = [
    ("FRA_FWMARK", 7),
    ("FRA_OIFNAME", "p9"),
    ("FRA_GOTO", 300),
    ("FRA_IP_PROTO", 6),
    ("FRA_L3MDEV", 1),
    ("FRA_TUN_ID", 5),
]


@given(
    st.sampled_from([4, 6]),
    st.integers(0, 2**128 - 1),
    st.integers(0, 2**128 - 1),
    st.booleans(),
    st.booleans(),
    u8,
    u8,
    u8,
    u32,
    st.one_of(st.none(), u32),
    st.one_of(st.none(), u8),
    st.one_of(st.none(), st.sampled_from(["p0", "up1"])),
    st.one_of(st.none(), st.sampled_from(OTHER_RULE_ATTRS)),
)
def test_rules_pyroute2_encodes_decode_with_ours(
    version: int,
    src: int,
    dst: int,
    with_src: bool,
    with_dst: bool,
    tos: int,
    table: int,
    action: int,
    flags: int,
    priority: int | None,
    protocol: int | None,
    iifname: str | None,
    other: tuple[str, Any] | None,
) -> None:
    bits = 32 if version == 4 else 128
    source = _address(version, src % 2**bits) if with_src else None
    destination = _address(version, dst % 2**bits) if with_dst else None
    msg = fibmsg()
    msg["family"] = rtnl.AF_OF[version]
    msg["src_len"], msg["dst_len"] = src % (bits + 1), dst % (bits + 1)
    msg["tos"], msg["table"], msg["action"], msg["flags"] = tos, table, action, flags
    attrs: list[tuple[str, Any]] = [("FRA_TABLE", table + 1000)]
    for name, value in (
        ("FRA_SRC", source),
        ("FRA_DST", destination),
        ("FRA_PRIORITY", priority),
        ("FRA_PROTOCOL", protocol),
        ("FRA_IIFNAME", iifname),
    ):
        if value is not None:
            attrs.append((name, value))
    if other is not None:
        attrs.append(other)
    msg["attrs"] = attrs
    _header(msg, rtnl.RTM_NEWRULE, rtnl.NLM_F_MULTI, 1)
    msg.encode()
    data = bytes(msg.data)
    ((header, start, end),) = list(rtnl.frames(data, strict=True))
    assert header.type == rtnl.RTM_NEWRULE
    assert rtnl.decode_rule(data, start, end) == rtnl.WireRule(
        rtnl.AF_OF[version],
        dst % (bits + 1),
        src % (bits + 1),
        tos,
        table + 1000,
        action,
        flags,
        priority or 0,
        source,
        destination,
        iifname,
        protocol,
        other is not None,
    )


def test_the_rule_dump_request_decodes_with_pyroute2() -> None:
    msg = fibmsg(rtnl.rule_dump_request(5, 6))
    msg.decode()
    assert msg["header"]["type"] == rtnl.RTM_GETRULE
    assert msg["header"]["flags"] == rtnl.NLM_F_REQUEST | rtnl.NLM_F_DUMP
    assert msg["header"]["sequence_number"] == 5
    assert msg["family"] == socket.AF_INET6
    assert (msg["table"], msg["action"], msg["flags"]) == (0, 0, 0)

"""Input validation before anything touches the kernel: routes, rules, requests, errors."""

from __future__ import annotations

import errno

import pytest

from node_agent.routes import request_from_pb
from orchestrrl import errors
from orchestrrl.netlink import check_netns, kernel_error
from orchestrrl.routing import RouteSpec, RuleSpec
from orchestrrl.v1 import node_agent_pb2 as pb

pytestmark = pytest.mark.unit


def test_routes_are_canonicalised() -> None:
    route = RouteSpec("FD10:0:0::/64", ("fd00::3", "FD00::2"), "", 0, 0)
    assert route.destination == "fd10::/64"
    assert route.gateways == ("fd00::2", "fd00::3")
    assert route.device is None
    assert route.table == 254
    assert route.metric == 1024  # what the kernel stores for an IPv6 metric of 0
    assert route.family == 6
    assert route == RouteSpec("fd10::/64", ("fd00::2", "fd00::3"), None, 254, 1024)
    assert route.describe() == "fd10::/64 via fd00::2,fd00::3 table 254 metric 1024"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"destination": "10.1.0.300/16"}, "destination='10.1.0.300/16' is not valid"),
        ({"destination": "10.1.0.0"}, "expected a CIDR prefix"),
        ({"destination": "10.1.0.0/33"}, "prefix length must be 0..32"),
        ({"destination": "10.1.0.1/16"}, "did you mean 10.1.0.0/16"),
        ({"gateways": ("10.0.0",)}, "gateways='10.0.0' is not valid: expected an IP address"),
        ({"gateways": ("fd00::1",)}, "gateway is IPv6 but destination 10.1.0.0/16 is IPv4"),
        ({"gateways": ("10.0.0.1", "10.0.0.1")}, "each next hop may be listed once"),
        ({"gateways": ("224.0.0.1",)}, "unicast address of a neighbour"),
        ({"gateways": "10.0.0.1"}, "not a string"),
        ({"gateways": ()}, "at least one gateway or a device"),
        ({"device": "a/b"}, "device='a/b' is not valid"),
        ({"table": 255}, "the local table (255) belongs to the kernel"),
        ({"table": -1}, "table=-1 is not valid"),
        ({"metric": 2**32}, "metric=4294967296 is not valid"),
    ],
)
def test_bad_routes_name_the_field_and_value(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"destination": "10.1.0.0/16", "gateways": ("10.0.0.1",)}
    args.update(kwargs)
    with pytest.raises(errors.InvalidArgument) as info:
        RouteSpec(**args)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_an_ipv6_link_local_next_hop_needs_a_device() -> None:
    with pytest.raises(errors.InvalidArgument, match="link-local next hop needs a device"):
        RouteSpec("fd10::/64", ("fe80::1",))
    assert RouteSpec("fd10::/64", ("fe80::1",), "eth0").gateways == ("fe80::1",)


def test_rules_are_validated_and_take_their_family_from_prefixes() -> None:
    assert RuleSpec(100, 10).family == 4
    assert RuleSpec(100, 10, source="fd00::/8").family == 6
    assert RuleSpec(100, 10, source="", input_interface="").source is None
    with pytest.raises(errors.InvalidArgument, match="same IP version"):
        RuleSpec(100, 10, source="10.0.0.0/8", destination="fd00::/8")
    with pytest.raises(errors.InvalidArgument, match="priority=0 is not valid"):
        RuleSpec(0, 10)
    with pytest.raises(errors.InvalidArgument, match="table=0 is not valid"):
        RuleSpec(100, 0)
    with pytest.raises(errors.InvalidArgument, match=r"source='10\.0\.0\.1/8' is not valid"):
        RuleSpec(100, 10, source="10.0.0.1/8")


def test_netns_names_cannot_escape_run_netns() -> None:
    assert check_netns("") is None
    assert check_netns("sw-1.a") == "sw-1.a"
    for bad in ("/proc/1/ns/net", "../x", "a b"):
        with pytest.raises(errors.InvalidArgument, match="netns="):
            check_netns(bad)


@pytest.mark.parametrize(
    ("code", "klass", "text"),
    [
        (errno.EPERM, errors.FailedPrecondition, "needs root or CAP_NET_ADMIN"),
        (errno.ENODEV, errors.InvalidArgument, "no such interface"),
        (errno.ENETUNREACH, errors.InvalidArgument, "not on a connected network"),
        (errno.EINVAL, errors.InvalidArgument, "the kernel refused it"),
        (errno.EEXIST, errors.Aborted, "retry"),
        (errno.EIO, errors.FailedPrecondition, "errno 5"),
    ],
)
def test_kernel_errors_map_to_domain_errors(code: int, klass: type, text: str) -> None:
    error = kernel_error(code, "add route 10.1.0.0/16")
    assert isinstance(error, klass)
    assert str(error).startswith("add route 10.1.0.0/16: ")
    assert text in str(error)


def test_apply_routes_requests_are_converted_with_indexed_errors() -> None:
    request = pb.ApplyRoutesRequest(
        command_id="c1",
        netns="sw0",
        prune=True,
        routes=[
            pb.Route(destination="10.1.0.0/16", gateways=["10.0.0.2", "10.0.0.1"]),
            pb.Route(destination="10.2.0.0/16", device="eth0", table=100, metric=5),
        ],
        rules=[pb.PolicyRule(priority=100, source="10.1.0.0/16", table=100)],
    )
    converted = request_from_pb(request)
    assert converted.netns == "sw0" and converted.prune
    assert converted.routes[0] == RouteSpec("10.1.0.0/16", ("10.0.0.1", "10.0.0.2"))
    assert converted.routes[1] == RouteSpec("10.2.0.0/16", (), "eth0", 100, 5)
    assert converted.rules == (RuleSpec(100, 100, source="10.1.0.0/16"),)
    request.routes[1].destination = "10.2.0.1/16"
    with pytest.raises(errors.InvalidArgument) as info:
        request_from_pb(request)
    assert str(info.value).startswith("routes[1].destination='10.2.0.1/16' is not valid")
    assert "did you mean 10.2.0.0/16" in str(info.value)

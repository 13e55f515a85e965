"""Next hops with their own device and onlink flag: validation, one canonical form, diff."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.routing import (
    NextHop,
    RouteDiff,
    RouteSpec,
    diff_routes,
    missing_devices,
    satisfies,
    unknown_devices,
)

pytestmark = pytest.mark.unit

# The route of the brief: `ip route add 10.0.2.0/24 proto 77
#   nexthop via 172.16.0.9 dev up0 onlink nexthop via 172.16.0.10 dev up1 onlink`
CIRCUITS = RouteSpec(
    "10.0.2.0/24",
    nexthops=(
        NextHop(gateway="172.16.0.9", device="up0", onlink=True),
        NextHop(gateway="172.16.0.10", device="up1", onlink=True),
    ),
)


def hops(route: RouteSpec) -> list[tuple[str | None, str | None, bool]]:
    return [(h.gateway, h.device, h.onlink) for h in route.nexthops]


def test_the_route_over_two_circuits() -> None:
    assert hops(CIRCUITS) == [("172.16.0.9", "up0", True), ("172.16.0.10", "up1", True)]
    assert CIRCUITS.gateways == ("172.16.0.9", "172.16.0.10")
    assert CIRCUITS.device is None  # no device shared by every hop
    assert (CIRCUITS.table, CIRCUITS.metric, CIRCUITS.family) == (254, 0, 4)
    assert CIRCUITS.describe() == (
        "10.0.2.0/24 nexthop via 172.16.0.9 dev up0 onlink "
        "nexthop via 172.16.0.10 dev up1 onlink table 254 metric 0"
    )


def test_equal_intent_compares_equal_whatever_the_spelling() -> None:
    swapped = RouteSpec(
        "10.0.2.0/24",
        nexthops=[NextHop("172.16.0.10", "up1", True), NextHop("172.16.0.9", "up0", True)],
    )
    assert swapped == CIRCUITS and hash(swapped) == hash(CIRCUITS)
    # the simple form is the same thing as one hop per gateway sharing the device
    simple = RouteSpec("10.1.0.0/16", ("10.0.0.3", "10.0.0.2"), "p0")
    per_hop = RouteSpec(
        "10.1.0.0/16", nexthops=(NextHop("10.0.0.2", "p0"), NextHop("10.0.0.3", "p0"))
    )
    assert simple == per_hop and hash(simple) == hash(per_hop)
    assert (per_hop.gateways, per_hop.device) == (("10.0.0.2", "10.0.0.3"), "p0")
    assert (
        simple.describe()
        == per_hop.describe()
        == ("10.1.0.0/16 via 10.0.0.2,10.0.0.3 dev p0 table 254 metric 0")
    )
    assert RouteSpec("10.2.0.0/24", device="p1") == RouteSpec(
        "10.2.0.0/24", nexthops=(NextHop(device="p1"),)
    )
    assert RouteSpec("fd10::/64", ("fd00::a",)) == RouteSpec(
        "fd10::/64", nexthops=(NextHop("FD00:0::A", ""),)
    )
    # the kernel's reading, in its own hop order, is the same value again
    read_back = RouteSpec.from_kernel(
        4,
        "10.0.2.0/24",
        (("172.16.0.10", "up1", True), ("172.16.0.9", "up0", True)),
        254,
        0,
    )
    assert read_back == CIRCUITS and hash(read_back) == hash(CIRCUITS)
    assert (read_back.gateways, read_back.device) == (CIRCUITS.gateways, None)


def test_hops_are_sorted_by_address_not_by_text() -> None:
    route = RouteSpec(
        "10.0.2.0/24", nexthops=[NextHop("172.16.0.10", "up1"), NextHop("172.16.0.9", "up0")]
    )
    assert [h.gateway for h in route.nexthops] == ["172.16.0.9", "172.16.0.10"]


def test_one_gateway_over_two_devices_is_two_hops() -> None:
    route = RouteSpec(
        "10.0.2.0/24",
        nexthops=[NextHop("172.16.0.9", "up1", True), NextHop("172.16.0.9", "up0", True)],
    )
    assert hops(route) == [("172.16.0.9", "up0", True), ("172.16.0.9", "up1", True)]
    assert route.gateways == ("172.16.0.9",)


def test_dataclass_replace_keeps_the_hops() -> None:
    moved = dataclasses.replace(CIRCUITS, metric=5)
    assert moved.nexthops == CIRCUITS.nexthops and moved.metric == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gateway": "10.0.0"}, "gateway='10.0.0' is not valid: expected an IP address"),
        ({"gateway": "224.0.0.1"}, "unicast address of a neighbour"),
        ({"gateway": None}, "gateway=None is not valid: a next hop needs a gateway, a device"),
        ({"device": "a/b"}, "device='a/b' is not valid"),
        ({"onlink": "yes", "device": "up0"}, "onlink='yes' is not valid"),
        ({"onlink": True}, "onlink=True is not valid: an onlink next hop needs both"),
        ({"gateway": None, "device": "up0", "onlink": True}, "needs both a gateway and a device"),
        ({"gateway": "fe80::1"}, "an IPv6 link-local next hop needs a device"),
    ],
)
def test_bad_next_hops_name_the_field_and_value(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"gateway": "172.16.0.9"}
    args.update(kwargs)
    with pytest.raises(errors.InvalidArgument) as info:
        NextHop(**args)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"nexthops": (NextHop("172.16.0.9", "up0"), NextHop("fd00::9", "up1"))},
            "nexthops[1].gateway='fd00::9' is not valid: gateway is IPv6 but destination "
            "10.0.2.0/24 is IPv4",
        ),
        (
            {"nexthops": (NextHop("172.16.0.9", "up0"), NextHop("172.16.0.9", "up0", True))},
            "nexthops[1]='via 172.16.0.9 dev up0 onlink' is not valid: the same next hop as "
            "nexthops[0]",
        ),
        (
            {"nexthops": (NextHop("172.16.0.9", "up0"), NextHop("172.16.0.9"))},
            "nexthops[1].device=None is not valid: gateway 172.16.0.9 is in several next hops",
        ),
        ({"nexthops": (("172.16.0.9", "up0", True),)}, "nexthops[0]=("),
        ({"nexthops": NextHop("172.16.0.9", "up0")}, "expected a list of NextHop values"),
        ({"nexthops": iter(())}, "nexthops=[] is not valid: a route needs at least one next hop"),
        ({"nexthops": ()}, "gateways=[] is not valid: a route needs at least one gateway"),
        (
            {"nexthops": (NextHop("172.16.0.9", "up0"),), "gateways": ("172.16.0.9",)},
            "gateways=('172.16.0.9',) is not valid: give next hops either as nexthops or",
        ),
        (
            {"nexthops": (NextHop("172.16.0.9", "up0"),), "device": "up0"},
            "device='up0' is not valid: give next hops either",
        ),
        (
            {"nexthops": [NextHop(f"172.16.{i // 250}.{i % 250 + 1}") for i in range(257)]},
            "at most 256 next hops per route",
        ),
    ],
)
def test_bad_per_hop_routes_name_the_hop(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        RouteSpec("10.0.2.0/24", **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


# -- the diff -------------------------------------------------------------------------


def with_hops(*hop_list: NextHop) -> RouteSpec:
    return RouteSpec("10.0.2.0/24", nexthops=hop_list)


def test_only_a_hops_device_changing_is_a_replace() -> None:
    moved = with_hops(NextHop("172.16.0.9", "up0", True), NextHop("172.16.0.10", "up2", True))
    assert moved.key == CIRCUITS.key and moved.gateways == CIRCUITS.gateways
    assert diff_routes([CIRCUITS], [moved], prune=True) == RouteDiff((), (moved,), ())
    assert diff_routes([moved], [CIRCUITS], prune=True) == RouteDiff((), (CIRCUITS,), ())


def test_only_onlink_or_a_gateway_changing_is_a_replace() -> None:
    plain = with_hops(NextHop("172.16.0.9", "up0"), NextHop("172.16.0.10", "up1", True))
    assert diff_routes([CIRCUITS], [plain], prune=False).replace == (plain,)
    other = with_hops(NextHop("172.16.0.9", "up0", True), NextHop("172.16.0.11", "up1", True))
    assert diff_routes([CIRCUITS], [other], prune=False).replace == (other,)
    assert diff_routes([CIRCUITS], [CIRCUITS], prune=True).empty


def test_a_hop_without_a_device_accepts_the_kernels_choice_of_that_hop_only() -> None:
    observed = RouteSpec.from_kernel(
        4, "10.0.2.0/24", (("172.16.0.9", "up0", False), ("172.16.0.10", "up1", True)), 254, 0
    )
    loose = with_hops(NextHop("172.16.0.9"), NextHop("172.16.0.10", "up1", True))
    assert satisfies(observed, loose)
    assert not satisfies(observed, with_hops(NextHop("172.16.0.9"), NextHop("172.16.0.10")))
    assert not satisfies(
        observed, with_hops(NextHop("172.16.0.9"), NextHop("172.16.0.10", "up0", True))
    )


def test_devices_are_named_as_the_route_spells_them() -> None:
    shared = RouteSpec("10.1.0.0/16", ("10.0.0.1",), "eth9")
    missing = unknown_devices([shared, CIRCUITS], {"up0": object()})
    assert [(m.route, m.field, m.device) for m in missing] == [
        (shared, "device", "eth9"),
        (CIRCUITS, "nexthops[1].device", "up1"),
    ]
    assert missing_devices([shared, CIRCUITS], {"up0": object()}) == ["eth9", "up1"]
    assert missing_devices([CIRCUITS], {"up0": object(), "up1": object()}) == []


# -- properties -----------------------------------------------------------------------

GATEWAYS = [f"172.16.0.{i}" for i in range(9, 13)]
DEVICES = ["up0", "up1", "up2"]


@st.composite
def circuit_routes(draw: st.DrawFn) -> RouteSpec:
    destination = draw(st.sampled_from(["10.0.1.0/24", "10.0.2.0/24", "10.0.3.0/24"]))
    hop_list = []
    for gateway in draw(st.lists(st.sampled_from(GATEWAYS), min_size=1, max_size=3, unique=True)):
        device = draw(st.sampled_from([None, *DEVICES]))
        onlink = device is not None and draw(st.booleans())
        hop_list.append(NextHop(gateway, device, onlink))
    return RouteSpec(destination, nexthops=hop_list, metric=draw(st.sampled_from([0, 10])))


def kernel_apply(observed: Iterable[RouteSpec], plan: RouteDiff) -> list[RouteSpec]:
    """What the kernel holds after the plan: it picks a device for every hop without one."""
    state = {s.key: s for s in observed}
    for s in plan.remove:
        del state[s.key]
    for s in (*plan.add, *plan.replace):
        state[s.key] = RouteSpec.from_kernel(
            s.family,
            s.destination,
            tuple((h.gateway, h.device or "up0", h.onlink) for h in s.nexthops),
            s.table,
            s.metric,
        )
    return list(state.values())


unique = st.lists(circuit_routes(), max_size=8).map(
    lambda rs: list({r.key: r for r in rs}.values())
)


@given(unique, unique, st.booleans())
def test_plans_over_per_hop_routes_converge(
    observed: list[RouteSpec], desired: list[RouteSpec], prune: bool
) -> None:
    after = kernel_apply(observed, diff_routes(observed, desired, prune))
    assert diff_routes(after, desired, prune).empty
    by_key = {s.key: s for s in after}
    assert all(satisfies(by_key[d.key], d) for d in desired)


@given(circuit_routes(), st.randoms())
def test_the_order_hops_are_given_in_does_not_matter(route: RouteSpec, rnd: random.Random) -> None:
    shuffled = list(route.nexthops)
    rnd.shuffle(shuffled)
    again = RouteSpec(route.destination, nexthops=shuffled, metric=route.metric)
    assert again == route and hash(again) == hash(route)

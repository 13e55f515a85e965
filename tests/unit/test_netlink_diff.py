"""The pure decision of the netlink adapter: what to add, replace and remove."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.routing import (
    RouteDiff,
    RouteSpec,
    RuleSpec,
    diff_routes,
    diff_rules,
    foreign_conflicts,
    missing_devices,
    satisfies,
)

pytestmark = pytest.mark.unit


def r(dst: str, *gws: str, dev: str | None = None, table: int = 254, metric: int = 0) -> RouteSpec:
    return RouteSpec(dst, gws, dev, table, metric)


def test_missing_routes_are_added_in_a_stable_order() -> None:
    want = [r("10.2.0.0/16", "10.0.0.1"), r("10.1.0.0/16", "10.0.0.1", "10.0.0.2")]
    plan = diff_routes([], want, prune=False)
    assert plan == RouteDiff(add=(want[1], want[0]), replace=(), remove=())


def test_changed_next_hops_are_replaced_not_added() -> None:
    have = [r("10.1.0.0/16", "10.0.0.1")]
    want = [r("10.1.0.0/16", "10.0.0.1", "10.0.0.2")]
    assert diff_routes(have, want, prune=True) == RouteDiff((), tuple(want), ())


def test_a_metric_is_part_of_the_key() -> None:
    have = [r("10.1.0.0/16", "10.0.0.1", metric=10)]
    want = [r("10.1.0.0/16", "10.0.0.1", metric=20)]
    assert diff_routes(have, want, prune=True) == RouteDiff(tuple(want), (), tuple(have))


def test_stale_routes_are_removed_only_with_prune() -> None:
    have = [r("10.1.0.0/16", "10.0.0.1"), r("10.9.0.0/16", "10.0.0.1")]
    want = [r("10.1.0.0/16", "10.0.0.1")]
    assert diff_routes(have, want, prune=False).empty
    assert diff_routes(have, want, prune=True) == RouteDiff((), (), (have[1],))


def test_a_desired_route_without_device_accepts_the_kernels_choice() -> None:
    have = [r("10.1.0.0/16", "10.0.0.1", dev="eth0")]
    assert diff_routes(have, [r("10.1.0.0/16", "10.0.0.1")], prune=True).empty
    moved = diff_routes(have, [r("10.1.0.0/16", "10.0.0.1", dev="eth1")], prune=True)
    assert len(moved.replace) == 1


def test_two_desired_routes_with_one_key_are_refused() -> None:
    want = [r("10.1.0.0/16", "10.0.0.1"), r("10.1.0.0/16", "10.0.0.2")]
    with pytest.raises(errors.InvalidArgument, match="merge their gateways into one ECMP"):
        diff_routes([], want, prune=False)


def test_a_repeated_identical_route_is_harmless() -> None:
    want = [r("10.1.0.0/16", "10.0.0.1"), r("10.1.0.0/16", "10.0.0.1")]
    assert len(diff_routes([], want, prune=False).add) == 1


def test_foreign_conflicts_and_missing_devices() -> None:
    want = [r("10.1.0.0/16", "10.0.0.1"), r("10.2.0.0/16", dev="eth9")]
    assert foreign_conflicts(want, [(4, 254, "10.1.0.0/16", 0)]) == (want[0],)
    assert foreign_conflicts(want, [(4, 254, "10.1.0.0/16", 5)]) == ()
    assert missing_devices(want, {"eth0": object()}) == ["eth9"]


def test_rules_are_added_and_pruned_as_a_set() -> None:
    a = RuleSpec(100, 10, source="10.1.0.0/16")
    b = RuleSpec(101, 11, input_interface="eth0")
    plan = diff_rules([a, b], [a], prune=True)
    assert plan.add == () and plan.remove == (b,)
    assert diff_rules([a, b], [a], prune=False).empty
    with pytest.raises(errors.InvalidArgument, match="each rule may be listed once"):
        diff_rules([], [a, a], prune=False)


# -- properties -----------------------------------------------------------------------

# Small pools, so that observed and desired routes often share keys.
V4 = (
    ["10.1.0.0/16", "10.2.0.0/16", "10.2.0.0/24", "0.0.0.0/0"],
    [f"10.0.0.{i}" for i in range(1, 5)],
)
V6 = (["fd10::/64", "fd20::/48", "::/0"], [f"fd00::{i}" for i in range(1, 5)])


@st.composite
def routes(draw: st.DrawFn) -> RouteSpec:
    destinations, pool = draw(st.sampled_from([V4, V6]))
    return RouteSpec(
        draw(st.sampled_from(destinations)),
        tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))),
        draw(st.sampled_from([None, "p0", "p1"])),
        draw(st.sampled_from([254, 100, 70000])),
        draw(st.sampled_from([0, 10])),
    )


def unique_keys(specs: Iterable[RouteSpec]) -> list[RouteSpec]:
    return list({s.key: s for s in specs}.values())


def kernel_apply(observed: Iterable[RouteSpec], plan: RouteDiff) -> list[RouteSpec]:
    """What the kernel holds after the plan; it fills in a device when none was given."""
    state = {s.key: s for s in observed}
    for s in plan.remove:
        del state[s.key]
    for s in (*plan.add, *plan.replace):
        state[s.key] = (
            s if s.device else RouteSpec(s.destination, s.gateways, "p0", s.table, s.metric)
        )
    return list(state.values())


observed_routes = st.lists(routes(), max_size=12).map(unique_keys)
desired_routes = st.lists(routes(), max_size=12).map(unique_keys)


@given(observed_routes, desired_routes, st.booleans())
def test_applying_the_plan_then_planning_again_yields_nothing(
    observed: list[RouteSpec], desired: list[RouteSpec], prune: bool
) -> None:
    after = kernel_apply(observed, diff_routes(observed, desired, prune))
    assert diff_routes(after, desired, prune).empty
    by_key = {s.key: s for s in after}
    assert all(satisfies(by_key[d.key], d) for d in desired)


@given(observed_routes, desired_routes, st.booleans())
def test_the_plan_is_disjoint_and_only_prunes_what_is_not_wanted(
    observed: list[RouteSpec], desired: list[RouteSpec], prune: bool
) -> None:
    plan = diff_routes(observed, desired, prune)
    keys = [s.key for part in plan for s in part]
    assert len(keys) == len(set(keys))
    wanted = {d.key for d in desired}
    assert all(s.key not in wanted for s in plan.remove)
    assert all(s in observed for s in plan.remove)
    assert prune or not plan.remove
    unchanged = len(wanted) - len(plan.add) - len(plan.replace)
    assert unchanged == sum(
        1 for o in observed for d in desired if o.key == d.key and satisfies(o, d)
    )


@given(desired_routes, st.booleans())
def test_a_table_that_holds_exactly_the_desired_routes_needs_nothing(
    desired: list[RouteSpec], prune: bool
) -> None:
    assert diff_routes(desired, desired, prune).empty


@given(
    st.lists(st.builds(RuleSpec, st.integers(1, 5), st.integers(1, 3)), unique=True),
    st.lists(st.builds(RuleSpec, st.integers(1, 5), st.integers(1, 3)), unique=True),
    st.booleans(),
)
def test_rule_plans_converge(
    observed: list[RuleSpec], desired: list[RuleSpec], prune: bool
) -> None:
    plan = diff_rules(observed, desired, prune)
    after = (set(observed) - set(plan.remove)) | set(plan.add)
    assert diff_rules(after, desired, prune).empty
    assert set(desired) <= after

"""Routes read back column-wise (``RouteColumns``): the column-wise verification says
"all is well" exactly when the RouteSpec diff finds nothing to change, and the columns
give the same routes, in the same order, as the RouteSpecs built from them."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl.routing import (
    KernelHop,
    RouteColumns,
    RouteSpec,
    by_key,
    columns_satisfy,
    diff_indexed,
    index_routes,
    route_shape,
    route_sort_key,
)

pytestmark = pytest.mark.unit

HOP_SETS: list[tuple[KernelHop, ...]] = [
    (("10.0.0.1", "p0", False),),
    (("10.0.0.2", "p0", False),),
    (("10.0.0.1", "p1", False),),
    (("10.0.0.1", "p0", False), ("10.0.0.2", "p0", False)),
    (("10.0.0.1", "p0", True), ("10.0.0.2", "p1", True)),
]


def read_back(routes: list[tuple[str, int, int, int]]) -> RouteColumns:
    """Columns of IPv4 routes (destination, hop set index, table, metric), as a dump
    would give them."""
    shapes, packed = [], []
    for destination, hops, table, metric in routes:
        address, _, length = destination.partition("/")
        shapes.append(route_shape(4, HOP_SETS[hops], table, int(length), metric))
        packed.append(socket.inet_aton(address))
    return RouteColumns(shapes, packed)


def desired(destination: str, hops: int, table: int = 254, metric: int = 0) -> RouteSpec:
    """A desired route over a hop set of HOP_SETS; -1: the gateway 10.0.0.1, no device."""
    if hops == -1:
        return RouteSpec(destination, ("10.0.0.1",), table=table, metric=metric)
    return RouteSpec.from_kernel(4, destination, HOP_SETS[hops], table, metric)


def verdicts(observed: RouteColumns, want: list[RouteSpec], prune: bool) -> tuple[bool, bool]:
    """(column-wise, RouteSpec diff) verdicts: True when nothing is left to change."""
    indexed = index_routes(want)
    spec_diff = diff_indexed(by_key(observed.specs()), indexed, prune)
    return columns_satisfy(observed, indexed, prune), spec_diff.empty


ROUTES = [("10.1.0.0/24", 0, 254, 0), ("10.1.1.0/24", 0, 254, 0), ("10.2.0.0/16", 3, 100, 5)]
WANT = [desired("10.1.0.0/24", 0), desired("10.1.1.0/24", 0), desired("10.2.0.0/16", 3, 100, 5)]


@pytest.mark.parametrize("prune", [False, True])
def test_a_read_back_that_matches_is_satisfied(prune: bool) -> None:
    assert verdicts(read_back(ROUTES), WANT, prune) == (True, True)


@pytest.mark.parametrize("prune", [False, True])
def test_a_missing_route_is_caught(prune: bool) -> None:
    assert verdicts(read_back(ROUTES[1:]), WANT, prune) == (False, False)
    # a request of one shape (recognised without grouping route by route)
    assert verdicts(read_back(ROUTES[1:2]), WANT[:2], prune) == (False, False)
    assert verdicts(read_back(ROUTES[:2]), WANT[:2], prune) == (True, True)


@pytest.mark.parametrize("prune", [False, True])
def test_a_route_over_another_gateway_or_device_is_caught(prune: bool) -> None:
    other_gateway = [("10.1.0.0/24", 1, 254, 0), *ROUTES[1:]]
    assert verdicts(read_back(other_gateway), WANT, prune) == (False, False)
    other_device = [("10.1.0.0/24", 2, 254, 0), *ROUTES[1:]]
    assert verdicts(read_back(other_device), WANT, prune) == (False, False)


@pytest.mark.parametrize("prune", [False, True])
def test_a_route_in_another_table_or_with_another_metric_is_caught(prune: bool) -> None:
    for moved in (("10.1.0.0/24", 0, 100, 0), ("10.1.0.0/24", 0, 254, 7)):
        assert verdicts(read_back([moved, *ROUTES[1:]]), WANT, prune) == (False, False)


def test_a_stale_route_is_caught_only_with_prune() -> None:
    stale = read_back([*ROUTES, ("10.3.0.0/24", 0, 254, 0)])
    assert verdicts(stale, WANT, prune=True) == (False, False)
    assert verdicts(stale, WANT, prune=False) == (True, True)


def test_a_desired_hop_without_device_accepts_the_device_the_kernel_chose() -> None:
    want = [desired("10.1.0.0/24", -1), desired("10.1.1.0/24", 0), WANT[2]]
    assert verdicts(read_back(ROUTES), want, prune=True) == (True, True)
    on_p1 = [("10.1.0.0/24", 2, 254, 0), *ROUTES[1:]]
    assert verdicts(read_back(on_p1), want, prune=True) == (True, True)
    assert verdicts(read_back(on_p1), WANT, prune=True) == (False, False)


def test_a_key_listed_twice_is_left_to_the_route_diff() -> None:
    twice = read_back([("10.1.0.0/24", 1, 254, 0), *ROUTES])
    assert verdicts(twice, WANT, prune=False)[0] is False


ADDRESSES = [f"10.1.{i}.0/24" for i in range(4)] + ["10.2.0.0/16", "10.1.0.0/16"]
observed_routes = st.dictionaries(
    st.tuples(st.sampled_from(ADDRESSES), st.sampled_from([254, 100]), st.sampled_from([0, 5])),
    st.integers(0, len(HOP_SETS) - 1),
    max_size=8,
)
desired_routes = st.dictionaries(
    st.tuples(st.sampled_from(ADDRESSES), st.sampled_from([254, 100]), st.sampled_from([0, 5])),
    st.integers(-1, len(HOP_SETS) - 1),
    max_size=8,
)


@given(observed_routes, desired_routes, st.booleans())
def test_the_column_verdict_is_the_route_diffs(
    observed: dict[tuple[str, int, int], int], want: dict[tuple[str, int, int], int], prune: bool
) -> None:
    columns = read_back([(d, hops, t, m) for (d, t, m), hops in observed.items()])
    routes = [desired(d, hops, t, m) for (d, t, m), hops in want.items()]
    column_verdict, diff_verdict = verdicts(columns, routes, prune)
    assert column_verdict == diff_verdict


@given(observed_routes)
def test_columns_give_their_routes_in_route_order(
    observed: dict[tuple[str, int, int], int],
) -> None:
    columns = read_back([(d, hops, t, m) for (d, t, m), hops in observed.items()])
    specs = sorted(columns.specs(), key=route_sort_key)
    rows = columns.sorted_rows()
    assert [d for d, _ in rows] == [r.destination for r in specs]
    assert [(s.gateways, s.device, s.table, s.metric) for _, s in rows] == [
        (r.gateways, r.device, r.table, r.metric) for r in specs
    ]
    assert columns == RouteColumns.from_batches([(columns.shapes, columns.packed)])
    assert len(columns) == len(observed)

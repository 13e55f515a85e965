"""The asynchronous rollout's pure decisions on real gateways (orchestrrl.rl.staleness)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.rl.staleness import (
    bad_token_versions,
    complete_group,
    first_version,
    gateway_stopped,
    groups_to_start,
    split_stale,
    tokens_by_version,
    version_number,
)
from scheduler.async_rollout import take_batch

pytestmark = pytest.mark.unit


def test_version_labels() -> None:
    assert [version_number(v) for v in ("0", "7", "12")] == [0, 7, 12]
    for bad in ("", "v1", "-1", "1.5", " 1", "9" * 19):
        with pytest.raises(errors.InvalidArgument, match=r"^weight_version=.* is not valid"):
            version_number(bad)


def test_a_response_a_gateway_stopped_makes_its_group_over_stale() -> None:
    assert gateway_stopped(["length", "stale", "stop"])
    assert not gateway_stopped(["length", "stop", ""]) and not gateway_stopped([])


def test_first_version_and_tokens() -> None:
    samples = [("2", "2", "3"), ("3",), ()]
    assert first_version(samples, 5) == 2
    assert first_version([(), ()], 5) == 5  # no token yet: the version it started on
    assert tokens_by_version(samples) == {2: 2, 3: 2}
    g = complete_group("g1", samples, prompt_tokens=4, started_at=1)
    assert (g.name, g.first_version, g.tokens, g.responses) == ("g1", 2, 3 * 4 + 4, 3)


@given(
    st.integers(0, 8),
    st.integers(0, 50),
    st.integers(1, 16),
    st.integers(0, 400),
    st.integers(0, 400),
    st.integers(1, 400),
)
def test_groups_to_start_keeps_the_bound_and_the_cap(
    eta: int, batches: int, n: int, started: int, in_flight: int, cap: int
) -> None:
    consumed = batches * n
    if in_flight > started:
        with pytest.raises(errors.InvalidArgument, match="in_flight_groups="):
            groups_to_start(eta, consumed, n, started, in_flight, cap)
        return
    k = groups_to_start(eta, consumed, n, started, in_flight, cap)
    assert k >= 0
    bound = consumed + (1 + eta) * n
    if k:
        assert started + k <= bound and in_flight + k <= cap
        # and as many as both allow
        assert started + k == bound or in_flight + k == cap
    else:
        assert started >= bound or in_flight >= cap


def test_groups_to_start_fractional_and_bad_values() -> None:
    assert groups_to_start(0.5, 0, 4, 0, 0, 100) == 6  # verl's fractional form
    assert groups_to_start(1, 8, 4, 16, 0, 100) == 0  # bound reached: wait for the trainer
    with pytest.raises(errors.InvalidArgument, match="max_in_flight_groups=0"):
        groups_to_start(1, 0, 4, 0, 0, 0)
    with pytest.raises(errors.InvalidArgument, match="bound=nan"):
        groups_to_start(math.nan, 0, 4, 0, 0, 1)


@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), min_size=0, max_size=12),
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_no_over_stale_group_is_ever_trained(
    groups: list[list[int]], version: int, n: int, max_lag: int
) -> None:
    """Through the real path's summaries: every group handed to the trainer is within
    the bound, every one met beyond it is dropped (counted), nothing lost or repeated."""
    queue = [
        complete_group(f"g{k}", [(str(min(v, version)),) for v in vs], 3, 0)
        for k, vs in enumerate(groups)
    ]
    took = take_batch(queue, version, n, max_lag)
    if took is None:
        trainable = [g for g in queue if version - g.first_version <= max_lag]
        assert len(trainable) < n
        return
    assert len(took.trained) == n
    assert all(version - g.first_version <= max_lag for g in took.trained)
    assert all(version - g.first_version > max_lag for g in took.dropped)
    names = [g.name for g in (*took.trained, *took.dropped, *took.rest)]
    assert sorted(names) == sorted(g.name for g in queue) and len(set(names)) == len(names)


@given(st.lists(st.integers(0, 5), max_size=30), st.integers(0, 5))
def test_bad_token_versions(vs: list[int], newest: int) -> None:
    bad = bad_token_versions([str(v) for v in vs], newest)
    assert bad == (vs != sorted(vs) or any(v > newest for v in vs))


@given(st.lists(st.integers(0, 6), max_size=12), st.integers(6, 9), st.integers(0, 3))
def test_split_stale_partitions_in_order(firsts: list[int], version: int, max_lag: int) -> None:
    queue = [complete_group(f"g{k}", [(str(v),)], 2, 0) for k, v in enumerate(firsts)]
    keep, stale = split_stale(queue, version, max_lag)
    assert [g for g in queue if g in keep] == list(keep)
    assert [g for g in queue if g in stale] == list(stale)
    assert len(keep) + len(stale) == len(queue)
    assert all(version - g.first_version <= max_lag for g in keep)
    assert all(version - g.first_version > max_lag for g in stale)
    # what is kept holds no group take_batch would drop
    took = take_batch(list(keep), version, 1, max_lag)
    assert took is None or took.dropped == ()

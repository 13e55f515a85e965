"""The asynchronous mode's rules: admission, lag, the trainer's batches, weight updates,
circuit leases and the policy's validation (scheduler.async_rollout)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.async_rollout import (
    Action,
    AsyncPolicy,
    CompleteGroup,
    Pull,
    WeightUpdate,
    admission_limit,
    leased_transfer_s,
    take_batch,
    update_action,
    version_lag,
)

pytestmark = pytest.mark.unit


def test_admission_is_areals_rule_and_verls_fraction() -> None:
    # AReaL: N_r <= (i + eta + 1) B; version 3 consumed 3 B groups
    assert admission_limit(2.0, 3 * 512, 512) == (3 + 2 + 1) * 512
    # verl: (1 + staleness_threshold) B between syncs, what is outstanding included
    assert admission_limit(0.5, 0, 512) == 768
    assert admission_limit(0.5, 4 * 512, 512) == 4 * 512 + 768
    assert admission_limit(0.0, 1024, 512) == 1536  # synchronous: one batch ahead at most
    assert admission_limit(0.1, 0, 7) == 7  # floor(7.7)


@pytest.mark.parametrize(
    ("args", "field"),
    [((-0.5, 0, 8), "bound"), ((math.inf, 0, 8), "bound"), ((1.0, -1, 8), "consumed_groups")],
)
def test_admission_rejects_bad_inputs(args: tuple[float, int, int], field: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=field):
        admission_limit(*args)


@given(
    st.floats(0, 16),
    st.floats(0, 16),
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.integers(1, 2048),
)
def test_admission_grows_with_the_bound_and_the_consumed_groups(
    a: float, b: float, c1: int, c2: int, n: int
) -> None:
    lo, hi = sorted((a, b))
    c_lo, c_hi = sorted((c1, c2))
    assert admission_limit(lo, c_lo, n) <= admission_limit(hi, c_hi, n)
    assert admission_limit(lo, c_lo, n) >= c_lo + n  # always at least one batch ahead


def test_lag_counts_versions_back_to_the_oldest_token() -> None:
    assert version_lag(5, 5) == 0 and version_lag(5, 3) == 2
    with pytest.raises(errors.InvalidArgument, match="first_version"):
        version_lag(2, 3)


def _q(*firsts: int) -> list[CompleteGroup]:
    return [CompleteGroup(f"g{i}", v, 100 * (i + 1), 4) for i, v in enumerate(firsts)]


def test_the_trainer_takes_the_oldest_complete_groups_and_waits_for_enough() -> None:
    queue = _q(3, 3, 4, 4, 4)
    take = take_batch(queue, 4, 3, None)
    assert take is not None
    assert [g.name for g in take.trained] == ["g0", "g1", "g2"]
    assert [g.name for g in take.rest] == ["g3", "g4"] and take.lags == (1, 1, 0)
    assert take.tokens == 100 + 200 + 300 and take.dropped == ()
    assert take_batch(queue, 4, 6, None) is None


def test_over_stale_groups_are_dropped_and_never_trained() -> None:
    queue = _q(1, 4, 2, 5, 5)
    take = take_batch(queue, 5, 2, max_lag=1)
    assert take is not None
    assert [g.name for g in take.trained] == ["g1", "g3"]  # lags 1 and 0
    assert [g.name for g in take.dropped] == ["g0", "g2"]  # lags 4 and 3
    assert [g.name for g in take.rest] == ["g4"]


@given(
    st.lists(st.integers(0, 10), max_size=30),
    st.integers(1, 8),
    st.one_of(st.none(), st.integers(0, 4)),
)
def test_a_take_partitions_the_queue_in_order_and_respects_the_bound(
    firsts: list[int], groups: int, max_lag: int | None
) -> None:
    queue = _q(*firsts)
    take = take_batch(queue, 10, groups, max_lag)
    if take is None:
        ok = [g for g in queue if max_lag is None or 10 - g.first_version <= max_lag]
        assert len(ok) < groups
        return
    assert len(take.trained) == groups
    assert all(max_lag is None or lag <= max_lag for lag in take.lags)
    scanned = sorted([*take.trained, *take.dropped], key=queue.index)
    assert [*scanned, *take.rest] == queue  # a prefix scanned, the rest left in order


@pytest.mark.parametrize(
    ("engine", "relay", "running", "pull", "pinned", "action"),
    [
        (3, 3, 10, Pull.DRAIN, False, Action.KEEP),
        (3, 2, 10, Pull.ABORT, False, Action.KEEP),
        (3, 4, 0, Pull.DRAIN, False, Action.LOAD),
        (3, 4, 0, Pull.ABORT, True, Action.LOAD),
        (3, 4, 5, Pull.DRAIN, False, Action.DRAIN),
        (3, 4, 5, Pull.ABORT, False, Action.ABORT),
        (3, 4, 5, Pull.ABORT, True, Action.DRAIN),  # a repacked tail keeps its version
    ],
)
def test_what_an_engine_does_when_its_relay_holds_a_newer_version(
    engine: int, relay: int, running: int, pull: Pull, pinned: bool, action: Action
) -> None:
    assert update_action(engine, relay, running, pull, pinned=pinned) is action


def test_a_lease_carries_the_wave_and_the_rest_runs_on_the_standing_circuits() -> None:
    assert leased_transfer_s(0.4, 1.6, 1.0) == 0.4  # done within the lease
    # 2 s on leased circuits, 8 s on standing ones, a 1 s lease: half done, half at 8 s
    assert leased_transfer_s(2.0, 8.0, 1.0) == pytest.approx(1.0 + 0.5 * 8.0)
    assert leased_transfer_s(2.0, 8.0, 0.0) == pytest.approx(8.0)
    with pytest.raises(errors.InvalidArgument, match="lease_s"):
        leased_transfer_s(1.0, 1.0, -1.0)


def test_the_default_policy_is_valid_and_bad_values_name_key_value_and_range() -> None:
    assert AsyncPolicy().problems() == []
    bad = AsyncPolicy(
        WeightUpdate.RELAY,
        Pull.DRAIN,
        local_updates=0,
        max_lag=-3,
        reshard=True,
        tail_fraction=0.0,
        repack_interval_s=0.0,
        plan_every=0,
        min_train_gpus=12,
        lease_s=-1.0,
        repack_lease_s=601.0,
    )
    problems = "\n".join(bad.problems("async", gpus=32, unit=8))
    for needle in (
        "async.local_updates=0 is not valid: an integer from 1 to 64",
        "async.max_lag=-3 is not valid: -1 (no limit) or an integer from 0 to 64",
        "async.reshard=True is not valid: false unless async.repack = true",
        "async.tail_fraction=0.0 is not valid: a number in (0, 1]",
        "async.repack_interval_s=0.0 is not valid: a number from 0.1 to 3600 seconds",
        "async.plan_every=0 is not valid: an integer from 1 to 1000 versions",
        "async.min_train_gpus=12 is not valid: 0 (no bound) or a multiple of 8 GPUs from 8 to 24",
        "async.lease_s=-1.0 is not valid: a number from 0 (no lease) to 600 seconds",
        "async.repack_lease_s=601.0 is not valid: a number from 0 (no lease) to 600 seconds",
    ):
        assert needle in problems
    assert AsyncPolicy(max_lag=-1).lag_limit is None and AsyncPolicy(max_lag=2).lag_limit == 2

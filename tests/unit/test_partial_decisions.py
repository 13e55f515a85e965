"""The pure decisions of partial rollout on real gateways (orchestrrl.partial_rollout)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl import partial_rollout as pr
from orchestrrl.partial_rollout import Piece

pytestmark = pytest.mark.unit


def test_partial_rule_keeps_the_simulators_keys_and_ranges() -> None:
    rule = pr.partial_rule(over_provision=1.25, max_staleness=2)
    assert rule.partial and rule.end is pr.StepEnd.GROUPS
    assert (rule.over_provision, rule.max_staleness) == (1.25, 2)
    assert pr.partial_rule(end="tokens", token_budget=100).token_budget == 100
    assert pr.partial_rule(end="time", time_budget_s=2).time_budget_s == 2.0
    assert pr.check_rule(rule) is rule


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"over_provision": 2.01}, "rollout.over_provision=2.01 is not valid: a number from 1.0"),
        ({"over_provision": float("nan")}, "rollout.over_provision=nan"),
        ({"over_provision": True}, "rollout.over_provision=True is not valid: a number"),
        ({"max_staleness": -1}, "rollout.max_staleness=-1 is not valid: an integer from 0 to 16"),
        ({"max_staleness": 1.5}, "rollout.max_staleness=1.5 is not valid: an integer"),
        ({"end": "all"}, "rollout.end='all'"),
        ({"end": "tokens"}, "rollout.token_budget=0 is not valid: a number > 0"),
        ({"token_budget": 5}, "rollout.token_budget=5 is not valid: 0 unless"),
        ({"end": 3}, "rollout.end=3"),
    ],
)
def test_bad_values_name_the_key_the_value_and_the_range(
    kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        pr.partial_rule(**kwargs)  # type: ignore[arg-type]
    assert says in str(e.value)


def test_only_partial_rules_are_taken() -> None:
    from scheduler.rollout import FULL

    with pytest.raises(errors.InvalidArgument, match='mode = "partial"'):
        pr.check_rule(FULL)


def test_versions_are_ordered_as_announced_and_never_go_back() -> None:
    order = pr.version_order((), "0")
    order = pr.version_order(order, "step-1")
    assert pr.version_order(order, "step-1") == ("0", "step-1")  # the same again: unchanged
    with pytest.raises(errors.InvalidArgument, match=r"version='0'.*never go back"):
        pr.version_order(order, "0")
    with pytest.raises(errors.InvalidArgument, match="version=''"):
        pr.version_order(order, "")


def test_pieces_from_per_token_labels_and_unknown_labels() -> None:
    assert pr.pieces_of(["0", "0", "a", "a", "a"], ["0", "a"]) == (Piece(0, 2), Piece(1, 3))
    assert pr.pieces_of([], ["0"]) == ()
    with pytest.raises(errors.FailedPrecondition, match="version 'x'"):
        pr.pieces_of(["0", "x"], ["0"])
    assert pr.pieces_from_counts({1: 3, 0: 2, 2: 0}) == (Piece(0, 2), Piece(1, 3))


def group(
    gid: str, order: int, *responses: tuple[bool, tuple[Piece, ...]], size: int = 2
) -> pr.GroupState:
    return pr.group_state(
        gid, size, order, [(f"{gid}-{i}", done, p) for i, (done, p) in enumerate(responses)]
    )


def test_a_step_ends_when_the_rule_is_met_counting_only_trainable_groups() -> None:
    rule = pr.partial_rule(over_provision=2.0, max_staleness=1)
    done_now = group("a", 0, (True, (Piece(2, 4),)), (True, (Piece(2, 3),)))
    done_old = group("b", 1, (True, (Piece(0, 4),)), (True, (Piece(1, 3),)))  # 2 versions back
    running = group("c", 2, (True, (Piece(2, 4),)), (False, (Piece(2, 1),)))
    queued = group("d", 3)  # nothing started yet: both of its samples are in flight
    states = [done_now, done_old, running, queued]
    p = pr.progress(rule, 2, states, elapsed_s=1.0, tokens=10)
    assert (p.complete_groups, p.in_flight, p.tokens) == (1, 3, 10)
    assert not pr.step_done(rule, 2, p)
    assert pr.step_done(rule, 1, p)
    assert pr.trainable_complete(rule, 1, states) == 2  # at version 1 b is not too stale
    with pytest.raises(errors.InvalidArgument, match="elapsed_s=-1"):
        pr.progress(rule, 2, states, elapsed_s=-1, tokens=0)


def test_closing_a_step_carries_unfinished_groups_and_drops_stale_ones() -> None:
    rule = pr.partial_rule(over_provision=2.0, max_staleness=1)
    states = [
        group("fresh", 0, (True, (Piece(1, 4),)), (True, (Piece(1, 2),))),
        group("carried", 1, (True, (Piece(0, 2), Piece(1, 2))), (True, (Piece(0, 3), Piece(1, 1)))),
        group("running", 2, (False, (Piece(1, 5),)), (True, (Piece(1, 2),))),
        group("stale", 3, (False, (Piece(0, 5), Piece(1, 1))), (True, (Piece(0, 2),))),
        group("waits", 4, (True, (Piece(1, 1),)), (True, (Piece(1, 1),))),
    ]
    closed = pr.close_step(rule, 1, 2, states)
    assert closed.trained == ("carried", "fresh")  # the oldest first token first
    assert closed.waiting == ("waits",)
    assert closed.carried == ("running-0",) and closed.carried_groups == ("running",)
    assert closed.dropped == ("stale",) and closed.dropped_responses == 2
    assert closed.dropped_tokens == 8
    assert closed.trained_by_version == ((0, 5), (1, 9)) and closed.offpolicy_tokens == 5


def test_token_shares() -> None:
    shares = pr.tokens_by_version([("0", "0", "1"), ("1",), ()])
    assert shares == (("0", 2), ("1", 2))
    assert pr.offpolicy_share(shares, "1") == 0.5
    assert pr.offpolicy_share((), "1") == 0.0


pieces = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 6)).map(lambda t: Piece(*t)), max_size=3
).map(lambda ps: tuple(sorted(ps, key=lambda p: p.version)))
groups = st.lists(
    st.lists(st.tuples(st.booleans(), pieces), min_size=1, max_size=3), min_size=0, max_size=6
)


@given(
    responses=groups,
    version=st.integers(0, 5),
    staleness=st.integers(0, 3),
    n_groups=st.integers(1, 4),
    op=st.sampled_from([1.0, 1.5, 2.0]),
)
def test_every_group_ends_in_exactly_one_place_and_no_trained_token_is_too_stale(
    responses: list[list[tuple[bool, tuple[Piece, ...]]]],
    version: int,
    staleness: int,
    n_groups: int,
    op: float,
) -> None:
    rule = pr.partial_rule(over_provision=op, max_staleness=staleness)
    states = [
        pr.group_state(f"g{k}", len(rs), k, [(f"g{k}-{i}", d, p) for i, (d, p) in enumerate(rs)])
        for k, rs in enumerate(responses)
    ]
    closed = pr.close_step(rule, version, n_groups, states)
    placed = [*closed.trained, *closed.waiting, *closed.carried_groups, *closed.dropped]
    assert sorted(placed) == sorted(g.id for g in states)  # none lost, none twice
    assert len(closed.trained) <= n_groups
    by_id = {g.id: g for g in states}
    for gid in closed.trained:
        g = by_id[gid]
        assert g.complete and not pr.too_stale(g.first_version, version, staleness)
    for gid in (*closed.waiting, *closed.carried_groups):  # trainable at the next version
        assert not pr.too_stale(by_id[gid].first_version, version + 1, staleness)
    assert set(closed.carried) == {
        r.id for gid in closed.carried_groups for r in by_id[gid].responses if not r.done
    }
    p = pr.progress(rule, version, states, elapsed_s=0.0, tokens=0)
    if pr.step_done(rule, n_groups, p) and p.in_flight:
        assert len(closed.trained) == n_groups  # a groups rule ends with a full batch

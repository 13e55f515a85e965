"""Partial rollout's pure rule (scheduler.rollout): validation, when a step ends, what the
trainer gets, what is carried and what is dropped."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.rollout import (
    FULL,
    MAX_STALENESS_LIMIT,
    GroupState,
    Piece,
    ResponseState,
    RolloutMode,
    RolloutRule,
    StepEnd,
    StepPhases,
    StepProgress,
    build_rule,
    close_step,
    groups_in_flight,
    groups_to_start,
    rule_met,
    step_deadline,
    step_done,
    step_seconds,
)

pytestmark = pytest.mark.unit

PARTIAL = RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS)


# -- validation ---------------------------------------------------------------------------


def test_defaults_are_full_rollout_and_partial_ends_by_groups() -> None:
    assert build_rule() == (FULL, [])
    rule, problems = build_rule(mode="partial", over_provision=1.5)
    assert problems == [] and rule is not None
    assert rule.end is StepEnd.GROUPS and rule.partial and rule.max_staleness == 1
    assert build_rule(mode="partial", end="time", time_budget_s=60.0)[0] is not None
    assert build_rule(mode="partial", end="tokens", token_budget=10**6)[0] is not None
    assert PARTIAL.check() is PARTIAL


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "half"}, "rollout.mode='half' is not valid: one of full, partial, async"),
        (
            {"mode": "partial", "over_provision": 2.5},
            "rollout.over_provision=2.5 is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"mode": "partial", "over_provision": 0.9},
            "rollout.over_provision=0.9 is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"mode": "partial", "over_provision": math.nan},
            "rollout.over_provision=nan is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"over_provision": 1.5},
            'rollout.over_provision=1.5 is not valid: 1.0 unless rollout.mode = "partial"',
        ),
        (
            {"mode": "partial", "max_staleness": -1},
            f"rollout.max_staleness=-1 is not valid: an integer from 0 to {MAX_STALENESS_LIMIT}",
        ),
        (
            {"mode": "partial", "max_staleness": 17},
            "rollout.max_staleness=17 is not valid: an integer from 0 to 16",
        ),
        ({"mode": "partial", "end": "soon"}, "rollout.end='soon' is not valid: one of all,"),
        ({"mode": "partial", "end": "all"}, "rollout.end='all' is not valid: one of groups,"),
        ({"mode": "full", "end": "groups"}, "rollout.end='groups' is not valid: all with"),
        (
            {"mode": "partial", "end": "tokens"},
            'rollout.token_budget=0 is not valid: a number > 0 with rollout.end = "tokens"',
        ),
        (
            {"mode": "partial", "end": "time", "time_budget_s": -5.0},
            "rollout.time_budget_s=-5.0 is not valid: a number > 0",
        ),
        (
            {"mode": "partial", "token_budget": 100},
            'rollout.token_budget=100 is not valid: 0 unless rollout.end = "tokens"',
        ),
    ],
)
def test_every_bad_value_is_named_with_what_is_allowed(
    kwargs: dict[str, object], expected: str
) -> None:
    rule, problems = build_rule(**kwargs)  # type: ignore[arg-type]
    assert rule is None
    assert any(p.startswith(expected) for p in problems), problems


def test_every_problem_is_reported_at_once_and_check_raises() -> None:
    bad = RolloutRule(RolloutMode.PARTIAL, 3.0, -1, StepEnd.TOKENS, 0, 1.0)
    problems = bad.problems("x")
    assert [p.split("=")[0] for p in problems] == [
        "x.over_provision",
        "x.max_staleness",
        "x.token_budget",
        "x.time_budget_s",
    ]
    with pytest.raises(errors.InvalidArgument, match=r"over_provision=3\.0"):
        bad.check()


# -- starting and ending a step -------------------------------------------------------------


def test_groups_to_start_fills_up_to_over_provision() -> None:
    assert groups_in_flight(PARTIAL, 512) == 640
    assert groups_to_start(PARTIAL, 512, 0) == 640
    assert groups_to_start(PARTIAL, 512, 200) == 440
    assert groups_to_start(PARTIAL, 512, 700) == 0
    assert groups_to_start(FULL, 512, 0) == 512
    assert groups_in_flight(RolloutRule(RolloutMode.PARTIAL, 1.1, 1, StepEnd.GROUPS), 10) == 11
    with pytest.raises(errors.InvalidArgument, match="groups_per_step=0"):
        groups_to_start(PARTIAL, 0, 0)
    with pytest.raises(errors.InvalidArgument, match="open_groups=-1"):
        groups_to_start(PARTIAL, 4, -1)


@given(
    n=st.integers(1, 5000),
    op=st.floats(1.0, 2.0),
    open_groups=st.integers(0, 20000),
)
def test_groups_to_start_never_exceeds_the_budget(n: int, op: float, open_groups: int) -> None:
    rule = RolloutRule(RolloutMode.PARTIAL, op, 1, StepEnd.GROUPS)
    started = groups_to_start(rule, n, open_groups)
    cap = groups_in_flight(rule, n)
    assert n <= cap <= math.ceil(op * n)
    assert 0 <= started <= cap
    assert started == 0 or started + open_groups == cap


def _p(
    elapsed: float, complete: int = 0, tokens: int = 0, in_flight: int = 5, min_end: float = 0.0
) -> StepProgress:
    return StepProgress(elapsed, complete, tokens, in_flight, min_end)


def test_each_rule_ends_the_step_at_its_own_condition() -> None:
    assert not rule_met(FULL, 4, _p(10.0, complete=4))
    assert rule_met(FULL, 4, _p(10.0, in_flight=0))
    assert not rule_met(PARTIAL, 4, _p(10.0, complete=3))
    assert rule_met(PARTIAL, 4, _p(10.0, complete=4))
    tokens = RolloutRule(RolloutMode.PARTIAL, 1.0, 1, StepEnd.TOKENS, token_budget=1000)
    assert not rule_met(tokens, 4, _p(10.0, tokens=999))
    assert rule_met(tokens, 4, _p(10.0, tokens=1000))
    timed = RolloutRule(RolloutMode.PARTIAL, 1.0, 1, StepEnd.TIME, time_budget_s=30.0)
    assert not rule_met(timed, 4, _p(29.9))
    assert rule_met(timed, 4, _p(30.0))
    # never before the trainer is done with the previous batch
    assert not step_done(PARTIAL, 4, _p(10.0, complete=9, min_end=12.0))
    assert step_done(PARTIAL, 4, _p(12.0, complete=9, min_end=12.0))
    assert not step_done(FULL, 4, _p(5.0, in_flight=0, min_end=12.0))


def test_the_deadline_is_the_earliest_end_or_the_time_budget() -> None:
    timed = RolloutRule(RolloutMode.PARTIAL, 1.0, 1, StepEnd.TIME, time_budget_s=30.0)
    assert step_deadline(timed, 12.0) == 30.0
    assert step_deadline(timed, 45.0) == 45.0
    assert step_deadline(PARTIAL, 12.0) == 12.0


def test_step_seconds_is_the_one_step_asynchronous_pipeline() -> None:
    assert step_seconds(RolloutMode.FULL, StepPhases(10.0, 12.0, 1.0)) == 13.0
    assert step_seconds(RolloutMode.PARTIAL, StepPhases(15.0, 12.0, 1.0)) == 16.0
    with pytest.raises(errors.InvalidArgument, match="mode"):
        step_seconds("fully-async", StepPhases(1.0, 1.0, 1.0))  # type: ignore[arg-type]


def test_an_asynchronous_step_is_the_trainers_own_time() -> None:
    # generation never pauses the trainer: its wait, its training, its blocking push
    phases = StepPhases(gen_s=500.0, train_s=100.0, sync_s=0.5, wait_s=20.0)
    assert step_seconds(RolloutMode.ASYNC, phases) == 120.5


def test_the_asynchronous_bound_takes_either_form() -> None:
    areal, problems = build_rule(mode="async", max_staleness=2)
    assert problems == [] and areal is not None
    assert areal.asynchronous and not areal.partial and areal.end is StepEnd.ALL
    assert areal.admission_bound == 2.0
    verl, problems = build_rule(mode="async", staleness_threshold=0.5)
    assert problems == [] and verl is not None and verl.admission_bound == 0.5


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"mode": "async", "staleness_threshold": -0.1},
            "rollout.staleness_threshold=-0.1 is not valid: a number from 0 to 16",
        ),
        (
            {"mode": "async", "staleness_threshold": 16.5},
            "rollout.staleness_threshold=16.5 is not valid: a number from 0 to 16",
        ),
        (
            {"mode": "async", "staleness_threshold": math.nan},
            "rollout.staleness_threshold=nan is not valid: a number from 0 to 16",
        ),
        (
            {"mode": "partial", "staleness_threshold": 0.5},
            'rollout.staleness_threshold=0.5 is not valid: 0 unless rollout.mode = "async"',
        ),
        (
            {"mode": "async", "end": "groups"},
            "rollout.end='groups' is not valid: all with rollout.mode = \"async\"",
        ),
        (
            {"mode": "async", "over_provision": 1.5},
            'rollout.over_provision=1.5 is not valid: 1.0 unless rollout.mode = "partial"',
        ),
    ],
)
def test_bad_asynchronous_rules_name_the_key_value_and_range(
    kwargs: dict[str, object], expected: str
) -> None:
    rule, problems = build_rule(**kwargs)  # type: ignore[arg-type]
    assert rule is None
    assert any(p.startswith(expected) for p in problems), problems


# -- closing a step -------------------------------------------------------------------------


def _r(rid: str, *pieces: tuple[int, int], done: bool = True) -> ResponseState:
    return ResponseState(rid, tuple(Piece(v, t) for v, t in pieces), done)


def _g(gid: str, order: int, *responses: ResponseState, size: int = 2) -> GroupState:
    return GroupState(gid, size, order, responses)


def test_full_rollout_trains_every_group() -> None:
    groups = [_g(f"g{i}", i, _r(f"g{i}a", (3, 10)), _r(f"g{i}b", (3, 20))) for i in range(3)]
    close = close_step(FULL, 3, 3, groups)
    assert close.trained == ("g0", "g1", "g2")
    assert close.carried == close.waiting == close.dropped == ()
    assert close.trained_tokens == 90 and close.trained_responses == 6
    assert close.offpolicy_tokens == 0 and close.trained_by_version == ((3, 90),)


def test_partial_trains_the_oldest_complete_groups_and_carries_the_rest() -> None:
    groups = [
        _g("old", 5, _r("o1", (2, 100), (3, 50)), _r("o2", (2, 40))),  # carried last step
        _g("a", 1, _r("a1", (3, 10)), _r("a2", (3, 10))),
        _g("b", 2, _r("b1", (3, 10)), _r("b2", (3, 10))),
        _g("c", 3, _r("c1", (3, 10)), _r("c2", (3, 5), done=False)),
        _g("d", 4, _r("d1", (3, 0), done=False), size=2),  # one sample started, no token yet
    ]
    close = close_step(PARTIAL, 3, 2, groups)
    assert close.trained == ("old", "a")  # oldest first token first, then arrival order
    assert close.waiting == ("b",)
    assert close.carried_groups == ("c", "d") and close.carried == ("c2", "d1")
    assert close.dropped == ()
    assert close.trained_by_version == ((2, 140), (3, 70))
    assert close.offpolicy_tokens == 140 and close.trained_tokens == 210


def test_staleness_drops_responses_and_their_groups() -> None:
    groups = [
        # began at version 2: carrying it into version 4 would make it 2 versions stale
        _g("late", 1, _r("l1", (2, 100), (3, 100), done=False), _r("l2", (2, 30))),
        _g("ok", 2, _r("k1", (3, 100), done=False), _r("k2", (3, 30))),
        # complete but waiting: in the next batch it would be 2 versions stale
        _g("wait", 3, _r("w1", (2, 1)), _r("w2", (3, 1))),
        _g("now", 0, _r("n1", (3, 1)), _r("n2", (3, 1))),
    ]
    close = close_step(PARTIAL, 3, 1, groups)
    assert close.trained == ("wait",)  # the oldest complete one is still fresh enough now
    assert close.waiting == ("now",) and close.dropped == ("late",)
    stale = close_step(PARTIAL, 3, 1, [groups[0], groups[1], groups[3]])
    assert stale.dropped == ("late",) and stale.dropped_responses == 2
    assert stale.dropped_tokens == 230 and stale.carried == ("k1",)
    zero = close_step(RolloutRule(RolloutMode.PARTIAL, 1.25, 0, StepEnd.GROUPS), 3, 5, groups)
    assert set(zero.dropped) == {"late", "ok", "wait"} and zero.carried == ()
    assert zero.trained == ("now",)


def test_full_mode_drops_what_is_unfinished_and_duplicate_groups_are_refused() -> None:
    close = close_step(FULL, 1, 2, [_g("a", 0, _r("a1", (1, 4), done=False), _r("a2", (1, 4)))])
    assert close.dropped == ("a",) and close.carried == ()
    with pytest.raises(errors.InvalidArgument, match="distinct group ids"):
        close_step(FULL, 1, 2, [_g("a", 0), _g("a", 1)])
    with pytest.raises(errors.InvalidArgument, match="groups_per_step=0"):
        close_step(FULL, 1, 0, [])


@st.composite
def _groups(draw: st.DrawFn) -> tuple[int, list[GroupState]]:
    version = draw(st.integers(2, 6))
    out = []
    for i in range(draw(st.integers(0, 12))):
        size = draw(st.integers(1, 3))
        responses = []
        for j in range(draw(st.integers(0, size))):
            first = draw(st.integers(max(0, version - 3), version))
            pieces = tuple(Piece(v, draw(st.integers(0, 50))) for v in range(first, version + 1))
            responses.append(ResponseState(f"g{i}r{j}", pieces, draw(st.booleans())))
        out.append(GroupState(f"g{i}", size, draw(st.integers(0, 100)), tuple(responses)))
    return version, out


@settings(max_examples=300)
@given(
    case=_groups(),
    n=st.integers(1, 6),
    staleness=st.integers(0, 3),
    end=st.sampled_from([StepEnd.GROUPS, StepEnd.TOKENS, StepEnd.TIME]),
)
def test_close_step_accounts_for_every_group_and_respects_staleness(
    case: tuple[int, list[GroupState]], n: int, staleness: int, end: StepEnd
) -> None:
    version, groups = case
    rule = RolloutRule(
        RolloutMode.PARTIAL,
        1.5,
        staleness,
        end,
        token_budget=10 if end is StepEnd.TOKENS else 0,
        time_budget_s=1.0 if end is StepEnd.TIME else 0.0,
    )
    close = close_step(rule, version, n, groups)
    by_id = {g.id: g for g in groups}
    parts = [close.trained, close.waiting, close.carried_groups, close.dropped]
    assert sorted(x for p in parts for x in p) == sorted(by_id)  # each group exactly once
    if end is StepEnd.GROUPS:
        assert len(close.trained) <= n
    for gid in close.trained + close.waiting:
        assert by_id[gid].complete
    for gid in close.trained:
        first = by_id[gid].first_version
        assert first is None or version - first <= staleness
    for gid in close.waiting + close.carried_groups:
        first = by_id[gid].first_version
        assert first is None or version + 1 - first <= staleness
    carried = {r.id for gid in close.carried_groups for r in by_id[gid].responses if not r.done}
    assert set(close.carried) == carried
    assert close.dropped_responses == sum(len(by_id[g].responses) for g in close.dropped)
    assert close.trained_tokens == sum(by_id[g].tokens for g in close.trained)
    assert 0 <= close.offpolicy_tokens <= close.trained_tokens
    assert sum(t for _, t in close.trained_by_version) == close.trained_tokens

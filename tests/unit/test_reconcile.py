"""Pure reconciliation helpers: batches, make-before-break steps, verification."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_controller.reconcile import batches_by_ocs, check_applied, converge, ours, steps
from orchestrrl.model import Circuit, Wiring
from scheduler.circuits import diff

pytestmark = pytest.mark.unit


def test_batches_and_verification() -> None:
    observed = {Circuit("o", 1, 2), Circuit("o", 3, 4), Circuit("p", 1, 2)}
    desired = {Circuit("o", 1, 3), Circuit("p", 1, 2)}
    plan = diff(observed, desired)
    assert batches_by_ocs(plan) == {"o": ([(1, 2), (3, 4)], [(1, 3)])}
    assert check_applied(plan, desired) == []
    assert check_applied(plan, observed) == [
        "circuit o:1<->3 is missing",
        "circuit o:1<->2 is still connected",
        "circuit o:3<->4 is still connected",
    ]


def test_make_before_break_adds_on_free_ports_first() -> None:
    observed = {Circuit("o", 1, 2)}
    desired = {Circuit("o", 1, 3), Circuit("o", 5, 6)}
    s = steps(diff(observed, desired))
    assert len(s) == 2
    (make,), (brk,) = s
    assert (make.disconnect, make.connect) == ((), ((5, 6),))
    assert (brk.disconnect, brk.connect) == (((1, 2),), ((1, 3),))


def test_steps_omit_empty_parts() -> None:
    assert steps(diff({Circuit("o", 1, 2)}, set())) == [
        [steps(diff({Circuit("o", 1, 2)}, set()))[0][0]]
    ]
    assert steps(diff(set(), set())) == []
    only_make = steps(diff(set(), {Circuit("o", 1, 2)}))
    assert len(only_make) == 1 and only_make[0][0].connect == ((1, 2),)


def test_converge_leaves_foreign_circuits(example_wiring: Wiring) -> None:
    foreign = Circuit("elsewhere", 1, 2)
    mine = Circuit("ocs0", 1, 9)
    assert ours(example_wiring, {foreign, mine}) == {mine}
    plan = converge(example_wiring, {foreign, mine}, frozenset())
    assert plan.remove == {mine} and plan.add == frozenset()


circuit_sets = st.frozensets(
    st.tuples(st.integers(1, 12), st.integers(1, 12))
    .filter(lambda t: t[0] != t[1])
    .map(lambda t: Circuit("o", *t)),
    max_size=6,
)


def _valid(cs: frozenset[Circuit]) -> bool:
    ports = [p for c in cs for p in c.ports()]
    return len(ports) == len(set(ports))


@settings(max_examples=200)
@given(observed=circuit_sets.filter(_valid), desired=circuit_sets.filter(_valid))
def test_steps_keep_every_intermediate_state_valid(
    observed: frozenset[Circuit], desired: frozenset[Circuit]
) -> None:
    state = set(observed)
    for step in steps(diff(observed, desired)):
        for batch in step:
            for a, b in batch.disconnect:
                state.remove(Circuit(batch.ocs, a, b))
            for a, b in batch.connect:
                state.add(Circuit(batch.ocs, a, b))
            assert _valid(frozenset(state)), "a port is in two circuits at once"
    assert state == desired

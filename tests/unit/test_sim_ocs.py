"""The simulated OCS model: validation, atomicity, replay, port health, invariants."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from sim_backends.ocs import REPLAY_CACHE_SIZE, Pair, SimulatedOcs

pytestmark = pytest.mark.unit

PORTS = 8


@pytest.fixture
def ocs() -> SimulatedOcs:
    """Ports 1..8 with circuits 1-2 and 3-4."""
    sw = SimulatedOcs("ocs-test", PORTS)
    sw.apply([], [(1, 2), (3, 4)])
    return sw


def test_connect_is_bidirectional_and_sorted() -> None:
    sw = SimulatedOcs("ocs-test", PORTS)
    result = sw.apply([], [(6, 5)])
    assert result.cross_connects == {(5, 6)}
    assert result.added == {(5, 6)}
    assert not result.removed
    assert not result.replayed
    assert sw.is_connected(5, 6)
    assert sw.is_connected(6, 5)
    assert sw.peer(5) == 6
    assert sw.peer(6) == 5
    assert sw.peer(7) is None


def test_disconnect_accepts_either_order(ocs: SimulatedOcs) -> None:
    result = ocs.apply([(2, 1)], [])
    assert result.cross_connects == {(3, 4)}
    assert result.removed == {(1, 2)}
    assert ocs.peer(1) is None
    assert ocs.peer(2) is None


def test_disconnect_then_connect_reuses_ports_in_one_batch(ocs: SimulatedOcs) -> None:
    result = ocs.apply([(1, 2), (3, 4)], [(1, 3), (2, 4)])
    assert ocs.cross_connects() == {(1, 3), (2, 4)}
    assert result.added == {(1, 3), (2, 4)}
    assert result.removed == {(1, 2), (3, 4)}


def test_reconnecting_the_same_pair_is_no_net_change(ocs: SimulatedOcs) -> None:
    result = ocs.apply([(1, 2)], [(1, 2)])
    assert ocs.cross_connects() == {(1, 2), (3, 4)}
    assert not result.changed


def test_empty_batch_changes_nothing(ocs: SimulatedOcs) -> None:
    result = ocs.apply([], [])
    assert result.cross_connects == {(1, 2), (3, 4)}
    assert not result.changed


@pytest.mark.parametrize(
    ("disconnect", "connect", "message"),
    [
        ([], [(5, 0)], "connect[0].b=0 is not valid: port must be 1..8"),
        ([], [(5, 6), (9, 7)], "connect[1].a=9 is not valid: port must be 1..8"),
        ([(0, 1)], [], "disconnect[0].a=0 is not valid: port must be 1..8"),
        ([], [(5, 5)], "connect[0].b=5 is not valid: must differ from a"),
        ([(5, 5)], [], "disconnect[0].b=5 is not valid: must differ from a"),
        (
            [],
            [(1, 5)],
            "connect[0].a=1 is not valid: port 1 is already connected to port 2; "
            "disconnect (1, 2) first",
        ),
        (
            [],
            [(5, 6), (7, 6)],
            "connect[1].b=6 is not valid: port 6 is already used by connect[0] of this batch",
        ),
        (
            [(1, 3)],
            [],
            "disconnect[0]=(1, 3) is not valid: ports 1 and 3 are not cross-connected "
            "(port 1 is connected to 2, port 3 is connected to 4)",
        ),
        (
            [(5, 6)],
            [],
            "disconnect[0]=(5, 6) is not valid: ports 5 and 6 are not cross-connected "
            "(port 5 is free, port 6 is free)",
        ),
        (
            [(1, 2), (2, 1)],
            [],
            "disconnect[1]=(1, 2) is not valid: already listed as disconnect[0]",
        ),
    ],
)
def test_invalid_batch_is_rejected_with_a_readable_message(
    ocs: SimulatedOcs, disconnect: list[Pair], connect: list[Pair], message: str
) -> None:
    before = ocs.cross_connects()
    with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
        ocs.apply(disconnect, connect)
    assert ocs.cross_connects() == before


def test_every_problem_of_a_batch_is_reported(ocs: SimulatedOcs) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        ocs.apply([(5, 6)], [(7, 40), (1, 8)])
    text = str(info.value)
    assert "disconnect[0]=(5, 6)" in text
    assert "connect[0].b=40" in text
    assert "connect[1].a=1" in text


def test_a_batch_with_one_bad_item_changes_nothing(ocs: SimulatedOcs) -> None:
    before = ocs.port_states()
    with pytest.raises(errors.InvalidArgument, match=r"connect\[2\]\.b=40"):
        ocs.apply([(1, 2)], [(1, 5), (2, 6), (7, 40)])
    assert ocs.port_states() == before
    assert ocs.is_connected(1, 2)
    assert ocs.peer(5) is None


def test_applying_the_same_batch_twice_without_an_id_fails_the_second_time(
    ocs: SimulatedOcs,
) -> None:
    ocs.apply([(1, 2)], [(1, 5)])
    with pytest.raises(errors.InvalidArgument):
        ocs.apply([(1, 2)], [(1, 5)])
    assert ocs.cross_connects() == {(1, 5), (3, 4)}


def test_repeated_request_id_replays_the_first_answer(ocs: SimulatedOcs) -> None:
    first = ocs.apply([(1, 2)], [(1, 5)], request_id="r1")
    ocs.apply([(3, 4)], [], request_id="r2")
    again = ocs.apply([(1, 2)], [(1, 5)], request_id="r1")
    assert again.replayed
    assert not again.changed
    assert again.cross_connects == first.cross_connects == {(1, 5), (3, 4)}
    assert again.added == first.added
    assert ocs.cross_connects() == {(1, 5)}


def test_request_id_reused_for_another_batch_is_rejected(ocs: SimulatedOcs) -> None:
    ocs.apply([], [(5, 6)], request_id="r1")
    with pytest.raises(errors.InvalidArgument, match="request_id='r1' is not valid: was already"):
        ocs.apply([], [(7, 8)], request_id="r1")
    assert ocs.peer(7) is None


def test_failed_batches_are_not_remembered(ocs: SimulatedOcs) -> None:
    with pytest.raises(errors.InvalidArgument):
        ocs.apply([], [(1, 5)], request_id="r1")
    result = ocs.apply([(1, 2)], [(1, 5)], request_id="r1")
    assert not result.replayed


def test_replay_cache_forgets_the_least_recently_used_id() -> None:
    sw = SimulatedOcs("ocs-test", 2)
    sw.apply([], [(1, 2)], request_id="oldest")
    for i in range(REPLAY_CACHE_SIZE):
        sw.apply([], [], request_id=f"r{i}")
    with pytest.raises(errors.InvalidArgument, match="already connected"):
        sw.apply([], [(1, 2)], request_id="oldest")


def test_down_port_refuses_new_circuits_but_keeps_existing_ones(ocs: SimulatedOcs) -> None:
    ocs.set_port_health(1, up=False)
    ocs.set_port_health(5, up=False)
    states = {s.port: s for s in ocs.port_states()}
    assert not states[1].up
    assert states[1].peer == 2
    assert states[2].up
    assert ocs.is_connected(1, 2)
    with pytest.raises(
        errors.InvalidArgument, match=r"connect\[0\]\.b=5 is not valid: port 5 is DOWN"
    ):
        ocs.apply([], [(6, 5)])
    ocs.apply([(1, 2)], [])  # tearing down a circuit on a DOWN port is allowed
    with pytest.raises(errors.InvalidArgument, match="port 1 is DOWN"):
        ocs.apply([], [(1, 2)])
    ocs.set_port_health(1, up=True)
    ocs.apply([], [(1, 2)])
    assert ocs.is_connected(1, 2)


def test_injected_fault_fails_the_next_apply_only(ocs: SimulatedOcs) -> None:
    ocs.fail_next_apply("mirror 7 stuck")
    with pytest.raises(errors.FailedPrecondition, match="ocs-test: injected fault: mirror 7 stuck"):
        ocs.apply([(1, 2)], [(1, 5)])
    assert ocs.cross_connects() == {(1, 2), (3, 4)}
    ocs.apply([(1, 2)], [(1, 5)])
    assert ocs.is_connected(1, 5)


def test_injected_fault_does_not_hit_a_replay(ocs: SimulatedOcs) -> None:
    ocs.apply([], [(5, 6)], request_id="r1")
    ocs.fail_next_apply()
    assert ocs.apply([], [(5, 6)], request_id="r1").replayed
    with pytest.raises(errors.FailedPrecondition):
        ocs.apply([], [(7, 8)])


@pytest.mark.parametrize("port", [0, PORTS + 1])
def test_questions_reject_ports_out_of_range(ocs: SimulatedOcs, port: int) -> None:
    with pytest.raises(
        errors.InvalidArgument, match=f"port={port} is not valid: port must be 1..8"
    ):
        ocs.peer(port)
    with pytest.raises(errors.InvalidArgument, match=f"b={port} is not valid"):
        ocs.is_connected(1, port)
    with pytest.raises(errors.InvalidArgument, match=f"port={port} is not valid"):
        ocs.set_port_health(port, up=False)


@pytest.mark.parametrize(
    ("name", "ports", "switching_time_s", "message"),
    [
        ("", 8, 0.0, "name='' is not valid"),
        ("ocs0", 0, 0.0, "port_count=0 is not valid: must be 1..4096"),
        ("ocs0", 8, -1.0, "switching_time_s=-1.0 is not valid: must be >= 0"),
        ("ocs0", 8, float("inf"), "switching_time_s=inf is not valid"),
    ],
)
def test_constructor_validates(
    name: str, ports: int, switching_time_s: float, message: str
) -> None:
    with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
        SimulatedOcs(name, ports, switching_time_s)


# Properties

Batch = tuple[list[Pair], list[Pair]]


def valid_batch(table: frozenset[Pair]) -> st.SearchStrategy[Batch]:
    """A batch valid against ``table`` by construction (port health aside)."""

    @st.composite
    def build(draw: st.DrawFn) -> Batch:
        disconnect = sorted(draw(st.sets(st.sampled_from(sorted(table))))) if table else []
        kept = table - set(disconnect)
        free = [p for p in range(1, PORTS + 1) if all(p not in pair for pair in kept)]
        order = draw(st.permutations(free))
        count = draw(st.integers(0, len(order) // 2))
        connect = [(order[2 * i + 1], order[2 * i]) for i in range(count)]  # unsorted on purpose
        return disconnect, connect

    return build()


@st.composite
def valid_steps(draw: st.DrawFn) -> list[Batch]:
    """A sequence of batches, each valid against the table the previous ones leave."""
    table: frozenset[Pair] = frozenset()
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        disconnect, connect = draw(valid_batch(table))
        table = (table - set(disconnect)) | {(min(c), max(c)) for c in connect}
        steps.append((disconnect, connect))
    return steps


def assert_consistent(sw: SimulatedOcs) -> None:
    table = sw.cross_connects()
    used = [p for pair in table for p in pair]
    assert len(used) == len(set(used)), "a port has more than one peer"
    assert all(a < b for a, b in table)
    for a, b in table:
        assert sw.peer(a) == b
        assert sw.peer(b) == a
    for state in sw.port_states():
        if state.peer is not None:
            assert sw.peer(state.peer) == state.port


# Any port number, 0 and PORTS + 1 being out of range: an extra item of this kind is often
# (not always) invalid, so the batches below are a mix of valid and invalid ones.
any_pair = st.tuples(st.integers(0, PORTS + 1), st.integers(0, PORTS + 1))


@given(data=st.data(), down=st.sets(st.integers(1, PORTS), max_size=2))
def test_any_batch_keeps_the_table_symmetric_and_a_failed_one_changes_nothing(
    data: st.DataObject, down: set[int]
) -> None:
    sw = SimulatedOcs("ocs-prop", PORTS)
    for p in down:
        sw.set_port_health(p, up=False)
    for _ in range(data.draw(st.integers(1, 10), label="batches")):
        before = sw.cross_connects()
        disconnect, connect = data.draw(valid_batch(before), label="batch")
        extra = data.draw(st.lists(any_pair, max_size=1), label="extra")
        if data.draw(st.booleans(), label="extra is a disconnect"):
            disconnect = [*extra, *disconnect]
        else:
            connect = [*connect, *extra]
        try:
            result = sw.apply(disconnect, connect)
        except errors.InvalidArgument:
            assert sw.cross_connects() == before
        else:
            assert result.cross_connects == sw.cross_connects()
            assert result.added == result.cross_connects - before
            assert result.removed == before - result.cross_connects
        assert_consistent(sw)


@given(steps=valid_steps())
def test_valid_batches_always_apply_and_match_a_model(
    steps: list[tuple[list[Pair], list[Pair]]],
) -> None:
    sw = SimulatedOcs("ocs-prop", PORTS)
    model: set[Pair] = set()
    for disconnect, connect in steps:
        sw.apply(disconnect, connect)
        model = (model - set(disconnect)) | {(min(c), max(c)) for c in connect}
        assert sw.cross_connects() == model
        assert_consistent(sw)


@given(steps=valid_steps())
def test_undoing_a_batch_restores_the_table(steps: list[tuple[list[Pair], list[Pair]]]) -> None:
    sw = SimulatedOcs("ocs-prop", PORTS)
    for disconnect, connect in steps:
        before = sw.cross_connects()
        result = sw.apply(disconnect, connect)
        sw.apply(sorted(result.added), sorted(result.removed))
        assert sw.cross_connects() == before
        sw.apply(disconnect, connect)


@given(steps=valid_steps(), retries=st.lists(st.integers(0, 100), min_size=8, max_size=8))
def test_resending_with_a_request_id_never_changes_the_table(
    steps: list[tuple[list[Pair], list[Pair]]], retries: list[int]
) -> None:
    sw = SimulatedOcs("ocs-prop", PORTS)
    for i, ((disconnect, connect), retry) in enumerate(zip(steps, retries, strict=False)):
        first = sw.apply(disconnect, connect, request_id=f"r{i}")
        after = sw.cross_connects()
        j = retry % (i + 1)  # resend this step or an earlier one
        again = sw.apply(*steps[j], request_id=f"r{j}")
        assert again.replayed
        assert sw.cross_connects() == after
        if j == i:
            assert again.cross_connects == first.cross_connects


def test_a_switch_that_lies_answers_with_its_true_table(ocs: SimulatedOcs) -> None:
    ocs.ignore_next_apply()
    result = ocs.apply([(1, 2)], [(5, 6)])
    assert result.cross_connects == {(1, 2), (3, 4)} and not result.changed
    assert ocs.cross_connects() == {(1, 2), (3, 4)}
    # only once
    assert ocs.apply([(1, 2)], [(5, 6)]).cross_connects == {(3, 4), (5, 6)}


def test_invalid_batch_is_still_refused_by_a_lying_switch(ocs: SimulatedOcs) -> None:
    ocs.ignore_next_apply()
    with pytest.raises(errors.InvalidArgument):
        ocs.apply([], [(1, 5)])


def test_down_ports_are_listed(ocs: SimulatedOcs) -> None:
    assert ocs.down_ports() == frozenset()
    ocs.set_port_health(7, up=False)
    ocs.set_port_health(1, up=False)
    assert ocs.down_ports() == {1, 7}


# -- bounded errors (issue 14) -----------------------------------------------------------


def test_a_batch_longer_than_the_switch_could_take_is_refused_before_validation() -> None:
    # 1e6 bad pairs once made a 108 MB message and stalled the switch for seconds
    sw = SimulatedOcs("ocs-big", 4096)
    with pytest.raises(errors.InvalidArgument) as info:
        sw.apply([], [(9999, 9999)] * 1_000_000)
    text = str(info.value)
    assert text == (
        "connect='1000000 pairs' is not valid: at most 2048 pairs: this switch has 4096 "
        "ports and a batch lists each port once"
    )
    with pytest.raises(errors.InvalidArgument, match="disconnect='5 pairs'"):
        SimulatedOcs("ocs-small", PORTS).apply([(1, 2)] * 5, [])
    assert not sw.cross_connects()


def test_many_bad_items_name_the_first_five_and_count_the_rest() -> None:
    sw = SimulatedOcs("ocs-big", 4096)
    with pytest.raises(errors.InvalidArgument) as info:
        sw.apply([], [(5000 + i, 6000 + i) for i in range(2048)])
    text = str(info.value)
    assert text.count("is not valid") == 5
    assert text.startswith("connect[0].a=5000 is not valid: port must be 1..4096; ")
    assert text.endswith("; and 4091 more")  # both ends of 2048 pairs, 5 named
    assert len(text) < 1000

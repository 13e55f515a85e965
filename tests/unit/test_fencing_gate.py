"""The fencing gate's rules as properties: a deposed leader's token is refused, the
newest token only grows, and only a command that was carried out and changed something
moves it (an empty, refused or far-ahead command cannot jam the fence)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.fencing import MAX_TOKEN_STEP, FencingGate

pytestmark = pytest.mark.unit

TOKENS = st.one_of(
    st.just(0),
    st.integers(1, 50),
    st.integers(MAX_TOKEN_STEP - 5, MAX_TOKEN_STEP + 60),
    st.just(2**63),
    st.integers(-3, -1),
)
# a command: its token and whether it asks for a change
COMMANDS = st.lists(st.tuples(TOKENS, st.booleans()), max_size=30)


def run(gate: FencingGate, commands: list[tuple[int, bool]]) -> list[bool]:
    """Each command checked, and recorded when admitted and changing; the verdicts."""
    verdicts = []
    for token, changes in commands:
        try:
            gate.check(token)
        except errors.OrlError:
            verdicts.append(False)
            continue
        verdicts.append(True)
        if changes:
            gate.record(token)
    return verdicts


@given(COMMANDS)
def test_newest_is_the_largest_token_of_a_change_carried_out(
    commands: list[tuple[int, bool]],
) -> None:
    gate = FencingGate("OCS x")
    newest = []
    for token, changes in commands:
        before = gate.newest
        [admitted] = run(gate, [(token, changes)])
        assert gate.newest >= before  # never decreases
        assert admitted == (
            (token == 0 and before == 0)  # no token: only while no HA leader was seen
            or (token > 0 and before <= token <= before + MAX_TOKEN_STEP)
        )
        newest.append(gate.newest)
    changed = [t for (t, c), ok in zip(commands, run(FencingGate("y"), commands), strict=True)
               if ok and c]  # fmt: skip
    assert gate.newest == max(changed, default=0)
    assert gate.newest <= MAX_TOKEN_STEP * len(commands)


@given(COMMANDS, st.integers(0, 30), TOKENS)
def test_a_command_that_changes_nothing_changes_no_later_verdict(
    commands: list[tuple[int, bool]], at: int, token: int
) -> None:
    at = min(at, len(commands))
    with_it = [*commands[:at], (token, False), *commands[at:]]
    verdicts = run(FencingGate("x"), with_it)
    assert verdicts[:at] + verdicts[at + 1 :] == run(FencingGate("x"), commands)


@given(COMMANDS, st.integers(1, 50))
def test_a_deposed_leaders_token_is_refused(commands: list[tuple[int, bool]], old: int) -> None:
    gate = FencingGate("agent n: ApplyRoutes")
    run(gate, commands)
    if 0 < old < gate.newest:
        with pytest.raises(errors.FailedPrecondition, match=f"fencing token {old} is older"):
            gate.check(old)


def test_the_bound_counts_from_the_newest_token() -> None:
    gate = FencingGate("OCS x")
    gate.check(MAX_TOKEN_STEP)  # the first token: at most the bound from 0
    with pytest.raises(errors.InvalidArgument, match=r"fencing_token=1099511627777 .*, 0:"):
        gate.check(MAX_TOKEN_STEP + 1)
    gate.record(100)
    gate.check(100 + MAX_TOKEN_STEP)
    with pytest.raises(errors.InvalidArgument, match="ahead of the newest seen by OCS x, 100"):
        gate.check(101 + MAX_TOKEN_STEP)

"""Error messages stay bounded whatever the input: values cut, offenders counted."""

from __future__ import annotations

import pytest

from orchestrrl import errors

pytestmark = pytest.mark.unit


def test_a_huge_value_is_shown_cut_with_its_length() -> None:
    message = str(errors.field_error("node", "n" * 1_000_000, "a node name"))
    assert message.startswith("node='nnnn")
    assert message.endswith("nnnn'... (1000000 characters) is not valid: a node name")
    assert len(message) < errors.MAX_VALUE_CHARS + 100


def test_values_are_shown_as_before_when_short() -> None:
    assert str(errors.field_error("port", 40, "1..8")) == "port=40 is not valid: 1..8"
    assert errors.shown("gen0") == "'gen0'"
    assert errors.shown(["a", "a"]) == "['a', 'a']"
    assert errors.shown(b"\x00" * 300).endswith("... (300 bytes)")


def test_a_long_list_shows_its_first_items_and_its_size() -> None:
    assert errors.shown(list(range(1_000_000))) == "[0, 1, 2, 3, 4, ...] (1000000 items)"
    assert errors.shown(["x" * 1000] * 9).endswith("(9 items)")
    assert len(errors.shown(["x" * 1000] * 9)) < 2 * errors.MAX_VALUE_CHARS


def test_listed_names_the_first_few_then_counts() -> None:
    assert errors.listed(["a", "b"]) == "a; b"
    assert errors.listed((str(i) for i in range(100)), ", ") == "0, 1, 2, 3, 4, and 95 more"


def test_problems_keep_the_first_few_and_count_the_rest() -> None:
    found = errors.Problems()
    assert not found
    for i in range(1000):
        found.add(f"item[{i}] is bad")
    assert len(found) == 1000 and found.full
    assert found.text() == (
        "item[0] is bad; item[1] is bad; item[2] is bad; item[3] is bad; item[4] is bad; "
        "and 995 more"
    )
    assert isinstance(found.error(), errors.InvalidArgument)


def test_bounded_keeps_head_and_tail_under_the_byte_limit() -> None:
    assert errors.bounded("short") == "short"
    message = "head " + "é" * 10_000 + " what to do"
    cut = errors.bounded(message)
    assert len(cut.encode()) <= errors.MAX_MESSAGE_BYTES
    assert cut.startswith("head ") and cut.endswith(" what to do")
    assert "bytes cut]" in cut

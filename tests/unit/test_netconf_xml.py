"""The NETCONF driver's pure part: the YANG module's XML both ways, batch rules, the
read-back check and the server's errors, without a server."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_controller.drivers import netconf_xml as nx
from orchestrrl import errors

pytestmark = pytest.mark.unit

NS = nx.NS


def data(pairs: list[tuple[int, int]] = (), ports: str = "", controller: str = "") -> str:  # type: ignore[assignment]
    body = "".join(f"<pair><ingress>{a}</ingress><egress>{b}</egress></pair>" for a, b in pairs)
    return (
        f'<data xmlns="{nx.NC_NS}"><cross-connects xmlns="{NS}">{body}</cross-connects>'
        f'<ports xmlns="{NS}">{ports}</ports><controller xmlns="{NS}">{controller}</controller>'
        "</data>"
    )


def state(*circuits: tuple[int, int], ports: int = 16, **kw: object) -> nx.SwitchState:
    pairs = frozenset(p for a, b in circuits for p in ((a, b), (b, a)))
    return nx.SwitchState(pairs, frozenset(range(1, ports + 1)), **kw)  # type: ignore[arg-type]


def interpret(before: nx.SwitchState, config: str) -> nx.SwitchState:
    """What a NETCONF server does with ``config`` on a candidate equal to ``before``:
    delete / create / replace of pairs (refusing what RFC 6241 refuses), the leaves."""
    root = ET.fromstring(config)
    egress = dict(before.egress)
    for pair in root.iter(f"{{{NS}}}pair"):
        op = pair.get(f"{{{nx.NC_NS}}}operation")
        ingress = int(pair.findtext(f"{{{NS}}}ingress") or 0)
        if op == "delete":
            assert ingress in egress, f"data-missing: {ingress}"
            del egress[ingress]
        elif op == "create":
            assert ingress not in egress, f"data-exists: {ingress}"
            egress[ingress] = int(pair.findtext(f"{{{NS}}}egress") or 0)
        else:
            assert op == "replace", op
            egress[ingress] = int(pair.findtext(f"{{{NS}}}egress") or 0)
    token = root.findtext(f".//{{{NS}}}fencing-token")
    return nx.SwitchState(
        frozenset(egress.items()),
        before.ports,
        before.disabled,
        before.failed,
        int(token) if token else before.fencing_token,
        root.findtext(f".//{{{NS}}}last-batch") or "",
    )


def test_a_get_reply_parses_into_pairs_ports_and_the_controller_leaves() -> None:
    s = nx.parse_state(
        data(
            [(1, 2), (2, 1), (5, 6)],
            "<port><port-id>1</port-id></port>"
            "<port><port-id>2</port-id><admin-state>disabled</admin-state></port>"
            "<port><port-id>3</port-id><oper-state>failed</oper-state></port>"
            "<port><port-id>4</port-id><oper-state>up</oper-state></port>",
            "<fencing-token>7</fencing-token><last-batch>epoch-3-x</last-batch>",
        )
    )
    assert s.pairs == {(1, 2), (2, 1), (5, 6)}
    assert s.ports == {1, 2, 3, 4} and s.disabled == {2} and s.failed == {3}
    assert (s.fencing_token, s.last_batch) == (7, "epoch-3-x")
    # a circuit once; the half pair 5->6 as the circuit of its ports, both down
    assert s.table() == {(1, 2), (5, 6)}
    assert s.half == {5, 6} and s.down() == {2, 3, 5, 6}


@pytest.mark.parametrize(
    ("xml", "match"),
    [
        ("<data", "does not parse"),
        (data([(0, 2)]), r"cross-connects/pair/ingress='0': not a port id"),
        (data([(1, 70000)]), r"pair\[ingress=1\]/egress='70000'"),
        (data([(1, 2), (1, 3)]), "two cross-connect pairs with ingress 1"),
        (data([], "<port><port-id>x</port-id></port>"), "ports/port/port-id='x'"),
        (data([], "", "<fencing-token>many</fencing-token>"), "fencing-token='many'"),
    ],
)
def test_a_reply_that_does_not_follow_the_module_is_refused_by_name(xml: str, match: str) -> None:
    with pytest.raises(errors.FailedPrecondition, match=match):
        nx.parse_state(xml)


def test_batches_are_checked_as_the_simulated_ocs_checks_them() -> None:
    s = state((1, 2), (3, 4), ports=8, disabled=frozenset({7}))
    assert nx.batch_problems(s, [(1, 2)], [(1, 5), (2, 6)]) == []
    assert nx.batch_problems(s, [], [(1, 5)]) == ["connect[0]=(1, 5): port 1 carries 1->2; "
                                                  "disconnect it first"]  # fmt: skip
    assert nx.batch_problems(s, [(5, 6)], []) == [
        "disconnect[0]=(5, 6): ports 5 and 6 are not cross-connected (port 5 is free, "
        "port 6 is free)"
    ]
    assert nx.batch_problems(s, [(1, 2), (2, 1)], []) == [
        "disconnect[1]=(1, 2): already listed as disconnect[0]"
    ]
    assert nx.batch_problems(s, [], [(5, 6), (6, 8)]) == [
        "connect[1]=(6, 8): port 6 is already used by connect[0] of this batch"
    ]
    assert nx.batch_problems(s, [], [(5, 7)]) == [
        "connect[0]=(5, 7): port 7 is disabled (admin-state); enable it or pick another port"
    ]
    assert nx.batch_problems(s, [], [(5, 5)]) == ["connect[0]=(5, 5): a port cannot connect "
                                                  "to itself"]  # fmt: skip
    failed = state(ports=8, failed=frozenset({3}))
    assert "oper-state" in nx.batch_problems(failed, [], [(3, 4)])[0]
    # a port the switch does not list is the switch's to refuse (leafref)
    assert nx.batch_problems(s, [], [(5, 99)]) == []
    many = nx.batch_problems(s, [], [(1, 3)] * 9)
    assert len(many) == errors.MAX_LISTED + 1 and many[-1].startswith("and ")


def test_the_edit_deletes_creates_and_moves_pairs_and_writes_the_controller_leaves() -> None:
    s = state((1, 2), (3, 4))
    ops = nx.directed_ops(s, [(1, 2)], [(1, 5), (2, 6)])
    assert ops == {1: 5, 2: 6, 5: 1, 6: 2}
    config = nx.edit_config(s, ops, "epoch-2-ab", fencing_token=9)
    assert 'operation="replace"><ingress>1</ingress><egress>5</egress>' in config
    assert 'operation="create"><ingress>5</ingress><egress>1</egress>' in config
    after = interpret(s, config)
    assert after.table() == {(1, 5), (2, 6), (3, 4)} and after.half == frozenset()
    assert (after.fencing_token, after.last_batch) == (9, "epoch-2-ab")
    assert nx.landed_problems(after, ops, "epoch-2-ab") == []
    assert nx.batch_landed(after, [(1, 2)], [(1, 5), (2, 6)])
    only_off = nx.directed_ops(s, [(3, 4)], [])
    assert only_off == {3: None, 4: None}
    assert "<fencing-token>" not in nx.edit_config(s, only_off, "b")  # 0: not written
    assert "&lt;x&gt;" in nx.edit_config(s, only_off, "<x>")  # the id is escaped
    with pytest.raises(errors.InvalidArgument, match="batch_id"):
        nx.edit_config(s, only_off, "x" * 129)


def test_a_half_circuit_is_removed_whole_by_disconnecting_its_ports() -> None:
    s = nx.SwitchState(frozenset({(5, 6)}), frozenset(range(1, 9)))
    assert nx.batch_problems(s, [(5, 6)], []) == []
    assert nx.directed_ops(s, [(5, 6)], []) == {5: None}
    assert interpret(s, nx.edit_config(s, {5: None}, "b")).pairs == frozenset()


def test_the_read_back_names_every_pair_that_differs_and_the_batch_id() -> None:
    s = state((1, 2))
    ops = {1: None, 2: None, 3: 4, 4: 3}
    problems = nx.landed_problems(s, ops, "mine")
    assert problems == [
        "pair ingress 1: expected none, read egress 2; pair ingress 2: expected none, read "
        "egress 1; pair ingress 3: expected egress 4, read none; pair ingress 4: expected "
        "egress 3, read none; controller/last-batch: expected 'mine', read ''"
    ]
    assert not nx.batch_landed(s, [(1, 2)], [(3, 4)])
    # the undo puts every touched ingress back as it was
    assert nx.revert_ops(s, ops) == {1: 2, 2: 1, 3: None, 4: None}


def test_rpc_errors_are_described_with_their_details_and_bounded() -> None:
    info = (
        f'<error-info xmlns="{nx.NC_NS}"><session-id>5</session-id>'
        '<error-number xmlns="http://netconfcentral.org/ns/yuma-ncx">268</error-number>'
        "</error-info>"
    )
    e = nx.RpcErrorInfo("lock-denied", "lock denied", "", info)
    assert nx.describe_errors([e]) == "lock-denied: lock denied (session-id=5)"
    assert nx.error_info_value([e], "session-id") == "5"
    assert nx.error_info_value([e], "bad-element") == ""
    unique = nx.RpcErrorInfo("operation-failed", "unique-stmt test failed", "/x:pair", "<bad")
    assert "at /x:pair ('<bad')" in nx.describe_errors([unique])
    huge = nx.RpcErrorInfo("operation-failed", "m" * 100_000)
    text = nx.describe_errors([huge] * 50)
    assert len(text.encode()) < 4000 and text.endswith("and 45 more")
    assert nx.describe_errors([]) == "(the server sent no error details)"


def test_the_module_file_ships_and_its_capability_is_recognised() -> None:
    text = nx.yang_file().read_text()
    assert f'namespace "{NS}"' in text and f"revision {nx.REVISION}" in text
    caps = [
        nx.CAP_CANDIDATE,
        f"{NS}?module={nx.MODULE}&revision={nx.REVISION}",
    ]
    assert nx.module_capability(caps) == caps[1]
    assert nx.module_capability([nx.CAP_CANDIDATE, "urn:other?module=orchestrrl-x"]) is None


@st.composite
def switch_and_batch(
    draw: st.DrawFn,
) -> tuple[nx.SwitchState, list[tuple[int, int]], list[tuple[int, int]]]:
    """A switch with random circuits and a valid make-before-break batch for it."""
    ports = draw(st.integers(4, 24))
    order = draw(st.permutations(range(1, ports + 1)))
    n = draw(st.integers(0, ports // 2))
    circuits = [(min(order[2 * i], order[2 * i + 1]), max(order[2 * i], order[2 * i + 1]))
                for i in range(n)]  # fmt: skip
    s = state(*circuits, ports=ports)
    off = draw(st.lists(st.sampled_from(circuits), unique=True)) if circuits else []
    free = [p for p in range(1, ports + 1) if p not in {x for c in circuits for x in c}]
    free += [x for c in off for x in c]
    free = draw(st.permutations(sorted(free)))
    k = draw(st.integers(0, len(free) // 2))
    on = [(free[2 * i], free[2 * i + 1]) for i in range(k)]
    return s, off, on


@settings(max_examples=100)
@given(switch_and_batch())
def test_any_valid_batch_lands_exactly_and_reverts_exactly(
    case: tuple[nx.SwitchState, list[tuple[int, int]], list[tuple[int, int]]],
) -> None:
    before, off, on = case
    assert nx.batch_problems(before, off, on) == []
    ops = nx.directed_ops(before, off, on)
    after = interpret(before, nx.edit_config(before, ops, "b1", fencing_token=3))
    want = (before.table() - {(min(a, b), max(a, b)) for a, b in off}) | {
        (min(a, b), max(a, b)) for a, b in on
    }
    assert after.table() == want and after.half == frozenset()
    assert nx.landed_problems(after, ops, "b1") == [] and nx.batch_landed(after, off, on)
    undone = interpret(after, nx.edit_config(after, nx.revert_ops(before, ops), ""))
    assert undone.pairs == before.pairs
    # the same batch again is refused (its new circuits are in, its removals gone) unless
    # it only reconnects what it disconnects
    norm = [{(min(a, b), max(a, b)) for a, b in pairs} for pairs in (off, on)]
    assert (nx.batch_problems(after, off, on) == []) == (norm[0] == norm[1])

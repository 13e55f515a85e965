"""The controller's weight-sync decisions: the request, who gets the command, command ids,
circuits per node, and the report."""

from __future__ import annotations

import pytest

from fabric_controller.weight_sync import (
    NodeOutcome,
    NodeSeen,
    Source,
    build_report,
    check_spec,
    circuits_between,
    command_id,
    targets,
)
from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Wiring

pytestmark = pytest.mark.unit

WS = Phase.WEIGHT_SYNC
C64 = "ab" * 32


def test_a_request_is_checked_field_by_field(example_wiring: Wiring) -> None:
    spec = check_spec(example_wiring, WS, "7", "train0-n0")
    assert (spec.in_flight, spec.timeout_s, spec.streams, spec.checksum) == ("finish", 600.0, 4, "")
    cases = [
        ((Phase.GENERATION, "7", "train0-n0"), {}, "checkpoint="),
        ((WS, "../7", "train0-n0"), {}, "checkpoint.version="),
        ((WS, "7", ""), {}, "checkpoint.source_node="),
        ((WS, "7", "nope"), {}, "checkpoint.source_node='nope'"),
        ((WS, "7", "train0-n0"), {"checksum": "AB"}, "checkpoint.checksum="),
        ((WS, "7", "train0-n0"), {"in_flight": "later"}, "checkpoint.in_flight="),
        ((WS, "7", "train0-n0"), {"timeout_s": float("nan")}, "checkpoint.timeout_s="),
        ((WS, "7", "train0-n0"), {"streams": 17}, "checkpoint.streams="),
    ]
    for (phase, version, source), kw, prefix in cases:
        with pytest.raises(errors.InvalidArgument) as info:
            check_spec(example_wiring, phase, version, source, **kw)
        assert str(info.value).startswith(prefix), str(info.value)


def test_every_generation_node_is_a_target_or_reported(example_wiring: Wiring) -> None:
    seen = [
        NodeSeen("gen0-n0", True, "a:1", "0"),
        NodeSeen("gen0-n1", False, "a:2", "0", "down (missed its heartbeat deadline)"),
        NodeSeen("gen1-n0", True, "a:3", "0"),
        NodeSeen("train0-n0", True, "a:4", ""),
    ]
    send, skip = targets(example_wiring, seen)
    assert [s.node for s in send] == ["gen0-n0", "gen1-n0"]
    assert [(s.node, s.why_not) for s in skip] == [
        ("gen0-n1", "down (missed its heartbeat deadline)"),
        ("gen1-n1", "never registered"),
    ]


def test_command_ids_repeat_for_a_retried_request_only(example_wiring: Wiring) -> None:
    spec = check_spec(example_wiring, WS, "7", "train0-n0")
    a = command_id("step3", "n1", spec, C64, "gen0-n0")
    assert a == command_id("step3", "n2", spec, C64, "gen0-n0")  # the request id decides
    assert a != command_id("step3", "n1", spec, C64, "gen0-n1")
    assert a != command_id("step4", "n1", spec, C64, "gen0-n0")
    assert command_id("", "n1", spec, C64, "gen0-n0") != command_id("", "n2", spec, C64, "gen0-n0")
    assert len(a) <= 128


def test_circuits_between_counts_the_pod_pair(example_wiring: Wiring) -> None:
    w = example_wiring
    # train0 uplinks are ocs0 ports 1-8, gen0's 17-24 in the example
    circuits = [Circuit("ocs0", 1, 17), Circuit("ocs0", 2, 18), Circuit("ocs0", 9, 25)]
    pods = {w.circuit_pods(c) for c in circuits}
    assert ("train0", "gen0") in pods or ("gen0", "train0") in pods
    assert circuits_between(w, circuits, "train0-n0", "gen0-n1") == 2
    assert circuits_between(w, circuits, "train0-n0", "train0-n1") == 0  # same pod


def outcome(node: str, ok: bool, at: float, **kw: object) -> NodeOutcome:
    return NodeOutcome(node, ok, "7" if ok else "6", finished_at=at, **kw)  # type: ignore[arg-type]


def test_the_report_is_complete_only_when_every_node_runs_it(example_wiring: Wiring) -> None:
    spec = check_spec(example_wiring, WS, "7", "train0-n0")
    source = Source("train0-n0", "10.0.0.2:50102", C64, 1000)
    done = [
        outcome("gen0-n0", True, 10.0, bytes_fetched=1000, fetch_seconds=0.5),
        outcome("gen0-n1", True, 12.5, cached=True),
    ]
    r = build_report(spec, source, 5, done, 2.5)
    assert (r.complete, r.completed_at, r.epoch) == (True, 12.5, 5)
    assert "serves on all 2 generation node(s): 1000 bytes" in r.message
    assert r.nodes[0].mbytes_per_s == pytest.approx(0.002)
    failed = [*done, outcome("gen1-n0", False, 11.0, error="unreachable")]
    r = build_report(spec, source, 5, failed, 3.0, "the topology was kept")
    assert (r.complete, r.completed_at) == (False, 0.0)
    assert "serves on 2 of 3" in r.message and "gen1-n0: unreachable" in r.message
    assert r.message.endswith("(the topology was kept)")
    assert not build_report(spec, source, 5, [], 0.0).complete

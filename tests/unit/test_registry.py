"""The controller's node registry: telemetry batches and health counts."""

from __future__ import annotations

import pytest

from fabric_controller.registry import Health, Registry
from orchestrrl import errors
from orchestrrl.model import Wiring
from orchestrrl.v1 import node_agent_pb2

pytestmark = pytest.mark.unit


def sample(node: str, tokens_per_s: float) -> node_agent_pb2.TelemetrySample:
    s = node_agent_pb2.TelemetrySample(node=node, timestamp=1.0)
    s.engine.tokens_per_s = tokens_per_s
    return s


def registered(wiring: Wiring) -> Registry:
    r = Registry(wiring, deadline_s=3.0)
    r.register("gen0-n0", "127.0.0.1:1", "sim", now=0.0)
    r.register("gen0-n1", "127.0.0.1:2", "sim", now=0.0)
    return r


def telemetry_of(r: Registry) -> dict[str, float | None]:
    return {
        x.name: (x.telemetry.engine.tokens_per_s if x.telemetry is not None else None)
        for x in r.records()
        if x.name in ("gen0-n0", "gen0-n1")
    }


def test_a_batch_leaves_each_node_its_newest_sample(example_wiring: Wiring) -> None:
    r = registered(example_wiring)
    r.telemetry_batch([sample("gen0-n0", 1.0), sample("gen0-n1", 5.0), sample("gen0-n0", 2.0)], 7.0)
    assert telemetry_of(r) == {"gen0-n0": 2.0, "gen0-n1": 5.0}
    record = next(x for x in r.records() if x.name == "gen0-n0")
    assert (record.last_seen, record.agent_address, record.gpu_backend) == (
        7.0,
        "127.0.0.1:1",
        "sim",
    )


@pytest.mark.parametrize(
    ("node", "error", "message"),
    [
        ("nope", errors.NotFound, "node 'nope' is not in the wiring"),
        ("train0-n0", errors.FailedPrecondition, "telemetry before registration"),
    ],
)
def test_a_bad_sample_rejects_the_whole_batch(
    example_wiring: Wiring, node: str, error: type[Exception], message: str
) -> None:
    r = registered(example_wiring)
    r.telemetry_batch([sample("gen0-n0", 1.0)], 1.0)
    with pytest.raises(error, match=message):
        r.telemetry_batch([sample("gen0-n0", 9.0), sample(node, 9.0), sample("gen0-n1", 9.0)], 2.0)
    assert telemetry_of(r) == {"gen0-n0": 1.0, "gen0-n1": None}  # nothing stored
    assert next(x for x in r.records() if x.name == "gen0-n0").last_seen == 1.0


def test_health_counts_follow_transitions(example_wiring: Wiring) -> None:
    r = Registry(example_wiring, deadline_s=3.0)
    total = len(example_wiring.nodes)
    assert r.counts() == {Health.UP: 0, Health.DOWN: 0, Health.UNKNOWN: total}
    r.register("gen0-n0", "a:1", "sim", now=0.0)
    r.register("gen0-n1", "a:2", "sim", now=0.0)
    r.transitions(1.0)
    assert r.counts() == {Health.UP: 2, Health.DOWN: 0, Health.UNKNOWN: total - 2}
    r.telemetry_batch([sample("gen0-n1", 1.0)], 4.0)  # telemetry counts as being seen
    r.transitions(5.0)
    assert r.counts() == {Health.UP: 1, Health.DOWN: 1, Health.UNKNOWN: total - 2}
    again = r.with_wiring(example_wiring)  # a reload keeps what it knew
    assert again.counts() == r.counts()


def test_other_live_nodes_at_an_agent_address_are_named(example_wiring: Wiring) -> None:
    r = registered(example_wiring)
    assert r.others_at("gen1-n0", "127.0.0.1:1", now=1.0) == ("gen0-n0",)
    assert r.others_at("gen0-n0", "127.0.0.1:1", now=1.0) == ()  # its own address
    assert r.others_at("gen1-n0", "127.0.0.1:9", now=1.0) == ()
    assert r.others_at("gen1-n0", "127.0.0.1:1", now=10.0) == ()  # gen0-n0 is down by then

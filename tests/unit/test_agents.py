"""The agent facade alone: registrations, heartbeats, telemetry and the node listing,
with fake clocks and no controller, switch or store."""

from __future__ import annotations

import dataclasses

import pytest
from structlog.testing import capture_logs

from fabric_controller.agents import IMPLAUSIBLE_WARN_INTERVAL_S, Agents
from fabric_controller.events import EventHub
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.registry import Health
from orchestrrl import errors
from orchestrrl.model import Wiring
from orchestrrl.v1 import node_agent_pb2

pytestmark = pytest.mark.unit

WALL = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build(wiring: Wiring) -> tuple[Agents, EventHub, ControllerMetrics, Clock, list[str]]:
    mono = Clock(10.0)
    events = EventHub(mono)
    metrics = ControllerMetrics()
    contacts: list[str] = []
    agents = Agents(
        wiring, events, metrics, heartbeat_deadline_s=3.0, wall_clock=Clock(WALL),
        monotonic=mono, on_contact=contacts.append,
    )  # fmt: skip
    return agents, events, metrics, mono, contacts


def sample(
    node: str, kv: float = 0.5, taken: float = WALL - 0.25
) -> node_agent_pb2.TelemetrySample:
    s = node_agent_pb2.TelemetrySample(node=node, timestamp=taken)
    s.engine.kv_cache_usage = kv
    return s


def test_register_and_heartbeat_tell_liveness_which_node_spoke(example_wiring: Wiring) -> None:
    agents, events, _, mono, contacts = build(example_wiring)
    record = agents.register("gen0-n0", "10.0.0.1:50051", "sim", 4)
    assert contacts == ["gen0-n0"]
    (event,) = events.recent(10)
    assert event.kind == "node_registered" and event.node == "gen0-n0"
    assert "reports 4 GPUs but the wiring says 8" in event.message

    mono.t += 1.5
    agents.heartbeat("gen0-n0", record.session_id)
    assert contacts == ["gen0-n0", "gen0-n0"]
    with pytest.raises(errors.FailedPrecondition, match="session 'stale' is not current"):
        agents.heartbeat("gen0-n0", "stale")
    assert contacts == ["gen0-n0", "gen0-n0"]  # a refused heartbeat is no contact

    listed = {r.name: (h, age) for r, h, age in agents.nodes()}
    assert listed["gen0-n0"] == (Health.UP, 0.0)
    assert listed["gen0-n1"] == (Health.UNKNOWN, None)
    mono.t += 4.0
    assert {r.name: (h, age) for r, h, age in agents.nodes()}["gen0-n0"] == (Health.DOWN, 4.0)


def test_a_second_live_claimant_of_an_agent_address_is_refused(example_wiring: Wiring) -> None:
    agents, events, _, mono, _ = build(example_wiring)
    first = agents.register("gen0-n0", "10.0.0.1:50051", "sim", 8)
    with pytest.raises(errors.FailedPrecondition) as info:
        agents.register("gen0-n1", "10.0.0.1:50051", "sim", 8)
    assert str(info.value) == (
        "agent_address '10.0.0.1:50051' is registered by node(s) gen0-n0 (up); node "
        "'gen0-n1' may take it only when the agent there is node 'gen0-n1': register this "
        "node's own agent address"
    )
    records = {r.name: r for r, _, _ in agents.nodes()}
    assert records["gen0-n1"].session_id == "" and records["gen0-n0"] == first  # unchanged
    assert len(events.recent(10)) == 1  # only gen0-n0's registration
    agents.register("gen0-n0", "10.0.0.1:50051", "sim", 8)  # its own agent again: fine
    mono.t += 10.0  # gen0-n0 is down: its claim lapses with it
    agents.register("gen0-n1", "10.0.0.1:50051", "sim", 8)


def test_a_proven_owner_takes_its_address_back(example_wiring: Wiring) -> None:
    """The first to register an address cannot lock out the agent it belongs to."""
    agents, events, _, _, _ = build(example_wiring)
    squatter = agents.register("gen0-n1", "10.0.0.1:50051", "sim", 8)
    agents.register(
        "gen0-n0", "10.0.0.1:50051", "sim", 8, proven="the agent there showed it is gen0-n0"
    )
    records = {r.name: r for r, _, _ in agents.nodes()}
    assert records["gen0-n0"].agent_address == "10.0.0.1:50051"
    assert (records["gen0-n1"].agent_address, records["gen0-n1"].session_id) == ("", "")
    with pytest.raises(errors.FailedPrecondition, match="not current"):
        agents.heartbeat("gen0-n1", squatter.session_id)  # it must register again
    assert "node(s) gen0-n1 had registered the same agent address and lost it" in (
        events.recent(1)[0].message
    )


def test_telemetry_is_stored_counted_and_its_lag_observed(example_wiring: Wiring) -> None:
    agents, _, metrics, _, _ = build(example_wiring)
    with pytest.raises(errors.FailedPrecondition, match="telemetry before registration"):
        agents.telemetry(sample("gen1-n0"))
    assert metrics.registry.get_sample_value("orl_telemetry_samples_total") in (None, 0.0)

    agents.register("gen1-n0", "10.0.0.2:50051", "sim", 8)
    agents.telemetry_batch([sample("gen1-n0", kv=0.75)], 3)
    (record,) = [r for r, _, _ in agents.nodes() if r.name == "gen1-n0"]
    assert record.telemetry is not None and record.telemetry.engine.kv_cache_usage == 0.75
    assert metrics.registry.get_sample_value("orl_telemetry_samples_total") == 3.0
    assert metrics.registry.get_sample_value("orl_telemetry_lag_seconds_sum") == 0.25


def test_implausible_telemetry_is_left_out_and_warned_about_at_most_once_a_minute(
    example_wiring: Wiring,
) -> None:
    agents, _, metrics, mono, _ = build(example_wiring)
    agents.register("train0-n1", "10.0.0.3:50051", "sim", 8)
    agents.telemetry(sample("train0-n1", kv=0.5))
    with capture_logs() as logs:
        for _ in range(3):
            agents.telemetry(sample("train0-n1", kv=2.0))  # more than all of the cache
        mono.t += IMPLAUSIBLE_WARN_INTERVAL_S
        agents.telemetry(sample("train0-n1", kv=2.0))
    rejected = metrics.registry.get_sample_value(
        "orl_telemetry_rejected_total", {"reason": "implausible"}
    )
    assert rejected == 4.0
    (record,) = [r for r, _, _ in agents.nodes() if r.name == "train0-n1"]
    assert record.telemetry is not None and record.telemetry.engine.kv_cache_usage == 0.5
    warned = [e["suppressed"] for e in logs if e["event"] == "telemetry_sample_implausible"]
    assert warned == [0, 2]  # the second warning counts the two left out before it


def test_a_reload_keeps_the_state_of_nodes_still_wired(example_wiring: Wiring) -> None:
    agents, _, _, _, _ = build(example_wiring)
    session = agents.register("gen1-n1", "10.0.0.4:50051", "sim", 8).session_id
    gone = "train1-n1"
    smaller = dataclasses.replace(
        example_wiring, nodes=tuple(n for n in example_wiring.nodes if n.name != gone)
    )
    agents.reload(smaller)
    assert agents.wiring is smaller
    agents.heartbeat("gen1-n1", session)  # the session survived the reload
    assert gone not in {r.name for r, _, _ in agents.nodes()}

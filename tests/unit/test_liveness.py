"""Node liveness alone: a registry, an event hub and a fake clock; no controller."""

from __future__ import annotations

import asyncio

import pytest

from fabric_controller.events import EventHub
from fabric_controller.liveness import Liveness
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.registry import Registry
from orchestrrl.model import Wiring

pytestmark = pytest.mark.unit

DEADLINE_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def build(wiring: Wiring) -> tuple[Liveness, Registry, EventHub, ControllerMetrics, Clock]:
    clock = Clock()
    registry = Registry(wiring, DEADLINE_S)
    events = EventHub(clock)
    metrics = ControllerMetrics()
    live = Liveness(lambda: registry, events, metrics, monotonic=clock, interval_s=0.001)
    return live, registry, events, metrics, clock


def kinds(events: EventHub) -> list[tuple[str, str]]:
    return [(e.kind, e.node) for e in events.recent(100)]


def gauge(metrics: ControllerMetrics, health: str) -> float | None:
    return metrics.registry.get_sample_value("orl_nodes", {"health": health})


def test_a_missed_deadline_is_one_down_event_and_a_heartbeat_brings_it_up(
    example_wiring: Wiring,
) -> None:
    live, registry, events, metrics, clock = build(example_wiring)
    session = registry.register("gen0-n0", "127.0.0.1:1", "sim", clock()).session_id
    live.check("gen0-n0")
    assert kinds(events) == []  # unknown -> up is not news
    assert gauge(metrics, "up") == 1 and gauge(metrics, "unknown") == 7

    clock.t += DEADLINE_S  # exactly at the deadline: still up
    live.check()
    assert kinds(events) == []
    clock.t += 0.5
    live.check()
    live.check()  # looked at again: no second event
    assert kinds(events) == [("node_down", "gen0-n0")]
    assert gauge(metrics, "down") == 1 and gauge(metrics, "up") == 0

    registry.seen("gen0-n0", session, clock())
    live.check("gen0-n0")
    assert kinds(events) == [("node_down", "gen0-n0"), ("node_up", "gen0-n0")]
    assert gauge(metrics, "up") == 1 and gauge(metrics, "down") == 0


def test_a_pod_is_down_only_when_every_node_of_it_is(example_wiring: Wiring) -> None:
    live, registry, _, _, clock = build(example_wiring)
    assert live.down_pods() == frozenset()  # never heard is not down
    for node in ("gen0-n0", "gen0-n1", "train0-n0"):
        registry.register(node, f"{node}:1", "sim", clock())
    clock.t += DEADLINE_S + 1
    second = registry.register("gen0-n1", "gen0-n1:1", "sim", clock()).session_id
    # gen0-n0 and train0-n0 are down, but gen0-n1 is up and train0-n1 was never heard
    assert live.down_pods() == frozenset()
    clock.t += DEADLINE_S + 1
    assert live.down_pods() == frozenset({"gen0"})
    registry.seen("gen0-n1", second, clock())
    assert live.down_pods() == frozenset()


def test_the_loop_finds_a_node_that_went_quiet(example_wiring: Wiring) -> None:
    live, registry, events, _, clock = build(example_wiring)
    registry.register("train1-n1", "127.0.0.1:1", "sim", clock())

    async def main() -> None:
        loop = asyncio.create_task(live.run())
        try:
            clock.t += DEADLINE_S + 1
            async with asyncio.timeout(5):
                while not kinds(events):  # noqa: ASYNC110
                    await asyncio.sleep(0.001)
        finally:
            loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(main())
    assert kinds(events) == [("node_down", "train1-n1")]


def test_a_replaced_registry_is_the_one_read(example_wiring: Wiring) -> None:
    """A wiring reload replaces the registry: the getter is read on every look."""
    clock = Clock()
    registries = [Registry(example_wiring, DEADLINE_S)]
    live = Liveness(
        lambda: registries[-1], EventHub(clock), ControllerMetrics(), monotonic=clock,
        interval_s=1.0,
    )  # fmt: skip
    registries.append(Registry(example_wiring, DEADLINE_S))
    for node in ("gen1-n0", "gen1-n1"):
        registries[-1].register(node, f"{node}:1", "sim", clock())
    clock.t += DEADLINE_S + 1
    assert live.down_pods() == frozenset({"gen1"})

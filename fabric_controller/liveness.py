"""Node liveness: health changes become events and metrics, and the pods whose every
node is down are named for the planners (they leave those pods' ports out).

Reads the node registry (:mod:`fabric_controller.registry`, owned by the agent facade
:mod:`fabric_controller.agents`) through a getter, because a wiring reload replaces it;
the clock is injected, so a test drives it with a fake one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fabric_controller.events import Event, EventHub
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.registry import Health, Registry, health
from orchestrrl.logs import get_logger

log = get_logger("fabric_controller")


class Liveness:
    def __init__(
        self,
        registry: Callable[[], Registry],
        events: EventHub,
        metrics: ControllerMetrics,
        *,
        monotonic: Callable[[], float],
        interval_s: float,
    ) -> None:
        self._registry = registry
        self._events = events
        self._metrics = metrics
        self._mono = monotonic
        self.interval_s = interval_s  # how often ``run`` looks at every node

    def check(self, only: str | None = None) -> None:
        """Events for health changes of every node (the liveness loop) or of ``only``
        the one that just spoke (register, heartbeat: no scan of the whole cluster)."""
        registry = self._registry()
        for node, before, after in registry.transitions(self._mono(), only):
            if after is Health.DOWN:
                log.warning("node_down", node=node)
                self._events.publish(
                    Event("node_down", node=node, message="heartbeat deadline missed")
                )
            elif after is Health.UP and before is Health.DOWN:
                log.info("node_up", node=node)
                self._events.publish(Event("node_up", node=node, message="heartbeats resumed"))
        for h, n in registry.counts().items():
            self._metrics.nodes.labels(h.value).set(n)

    def down_pods(self) -> frozenset[str]:
        """Pods whose every node is down: planners leave them (and their ports) out."""
        registry = self._registry()
        now, deadline = self._mono(), registry.deadline_s
        records = {r.name: r for r in registry.records()}
        return frozenset(
            p.name
            for p in registry.wiring.pods
            if p.nodes and all(health(records[n], now, deadline) is Health.DOWN for n in p.nodes)
        )

    async def run(self) -> None:
        """Mark nodes down when they miss their deadline (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

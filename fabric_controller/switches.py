"""Switch I/O of the controller: observe the OCSes, program batches of cross-connects,
verify them, and program and verify the ToRs' routes over the circuits.

No decisions here: what to program comes from :mod:`fabric_controller.reconcile`
(``converge``, ``steps``, ``check_tables``) and :mod:`fabric_controller.tor_routes`;
this module sequences the driver calls and turns their failures into ``StageError``s
naming the stage, the switch and the batch.

Latency: one ListCrossConnects per OCS observes it (table and failed ports), the
batches of one step go to all OCSes at once, and verification reads the table each
switch returned for its last batch (the switch's own read-back, taken atomically with
the batch) instead of listing it again.

Fencing (controller HA, docs/ha.md): ``fencing(what)`` gives the leader's fencing token
to stamp on every OCS batch (0 without HA: the batch is sent as before, without one) and
raises ``NotLeader`` once this controller no longer leads, before any batch or route
change is sent. The switches refuse a token older than the newest they have seen; ToR
routes go through netlink, which carries no token, so for them this local check is the
fence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from fabric_controller.drivers.electrical import ElectricalDriver
from fabric_controller.drivers.ocs import OcsDriver, PortPair
from fabric_controller.reconcile import Batch, check_tables, converge, ours, steps
from fabric_controller.tor_routes import routed_tors, tor_routes
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Circuit, Wiring
from scheduler.circuits import CircuitPlan

log = get_logger("fabric_controller")


class StageError(errors.FailedPrecondition):
    """A stage of a reconfiguration failed (an OrlError, so every handler sees it)."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"{stage}: {detail}")
        self.stage = stage
        self.detail = detail


def check_drivers(
    wiring: Wiring, ocs: Mapping[str, OcsDriver], electrical: Mapping[str, ElectricalDriver]
) -> None:
    """FailedPrecondition naming every OCS and routed ToR of ``wiring`` without a driver."""
    missing = sorted({o.name for o in wiring.ocses} - set(ocs))
    if missing:
        raise errors.FailedPrecondition(f"no driver for OCS {', '.join(missing)}")
    unrouted = sorted(set(routed_tors(wiring)) - set(electrical))
    if unrouted:
        raise errors.FailedPrecondition(f"no electrical driver for ToR {', '.join(unrouted)}")


class Switches:
    """The OCS drivers (``ocs``, by switch name) and the ToR drivers (``electrical``, by
    ToR name; empty: no routes are programmed) of one wiring. ``fault_hook`` is called
    with ``"program_ocs"`` after every step of OCS batches (crash tests stop there)."""

    def __init__(
        self,
        wiring: Wiring,
        ocs: Mapping[str, OcsDriver],
        electrical: Mapping[str, ElectricalDriver] | None = None,
        *,
        fault_hook: Callable[[str], None] = lambda _stage: None,
        fencing: Callable[[str], int] = lambda _what: 0,
    ) -> None:
        self.ocs = dict(ocs)
        self.electrical = dict(electrical or {})
        check_drivers(wiring, self.ocs, self.electrical)
        self.wiring = wiring
        self._fault = fault_hook
        self._fencing = fencing
        self._interned: dict[str, dict[PortPair, Circuit]] = {}

    def reload(self, wiring: Wiring) -> None:
        """Adopt a new wiring (FailedPrecondition, nothing changed, if a driver is missing)."""
        check_drivers(wiring, self.ocs, self.electrical)
        self.wiring = wiring

    def switching_time(self, plan_steps: list[list[Batch]]) -> float:
        """Optics time of the steps: each waits for its slowest switch."""
        return sum(
            max(self.wiring.ocs(b.ocs).switching_time_s for b in step) for step in plan_steps
        )

    # -- OCS --

    async def observe(self) -> tuple[frozenset[Circuit], frozenset[tuple[str, int]]]:
        """Every switch's circuits and its ports that are down, (ocs, port), read at once."""

        async def one(name: str, drv: OcsDriver) -> tuple[list[Circuit], set[tuple[str, int]]]:
            pairs, down = await drv.snapshot()
            return self._circuits_of(name, pairs), {(name, p) for p in down}

        results = await asyncio.gather(*(one(n, d) for n, d in sorted(self.ocs.items())))
        circuits = frozenset(c for cs, _ in results for c in cs)
        down = frozenset(p for _, ds in results for p in ds)
        return circuits, down

    def _circuits_of(self, ocs: str, pairs: frozenset[PortPair]) -> list[Circuit]:
        """The circuits of a switch's table. Circuits are interned per switch: building
        (and validating) a Circuit costs microseconds, and a large fabric's tables hold
        thousands, mostly the same from one observation to the next."""
        known = self._interned.setdefault(ocs, {})
        if len(known) > 1 << 16:
            known.clear()
        out = []
        for p in pairs:
            c = known.get(p)
            if c is None:
                c = known[p] = Circuit(ocs, *p)
            out.append(c)
        return out

    async def program(
        self, plan_steps: list[list[Batch]], tag: str
    ) -> dict[str, frozenset[PortPair]]:
        """Apply make-before-break steps (``reconcile.steps``) of per-OCS batches: the
        batches of a step go to their switches at once, the next step waits for all.
        Returns each programmed switch's table as it answered its last batch."""
        tables: dict[str, frozenset[PortPair]] = {}
        for i, step in enumerate(plan_steps):
            self._fencing(f"OCS batches {tag}-{i}")  # a deposed leader sends no batch
            results = await asyncio.gather(
                *(self.apply(b, f"{tag}-{i}-{b.ocs}") for b in step), return_exceptions=True
            )
            for batch, result in zip(step, results, strict=True):
                if isinstance(result, BaseException):
                    raise result  # the first failure in switch order; rollback sees all
                tables[batch.ocs] = result
            self._fault("program_ocs")
        return tables

    async def apply(self, batch: Batch, request_id: str) -> frozenset[PortPair]:
        """One batch on its switch; the switch's table after it. A lost answer is
        settled by the switch's table (``landed``); a refusal is a ``StageError``."""
        driver = self.ocs[batch.ocs]
        token = self._fencing(f"OCS {batch.ocs!r} batch {request_id}")
        try:
            if token:
                return await driver.apply(
                    batch.disconnect, batch.connect, request_id=request_id, fencing_token=token
                )
            return await driver.apply(batch.disconnect, batch.connect, request_id=request_id)
        except errors.Unavailable as exc:
            # a timeout leaves the outcome unknown: the switch's own table decides
            table = await landed(driver, batch)
            if table is None:
                raise StageError(
                    "program_ocs",
                    f"OCS {batch.ocs!r} did not confirm the batch (disconnect "
                    f"{list(batch.disconnect) or 'none'}, connect "
                    f"{list(batch.connect) or 'none'}) and its table does not show "
                    f"it: {exc}",
                ) from exc
            log.warning("ocs_answer_lost_batch_applied", ocs=batch.ocs)
            return table
        except errors.OrlError as exc:
            raise StageError(
                "program_ocs",
                f"OCS {batch.ocs!r} refused the batch (disconnect "
                f"{list(batch.disconnect) or 'none'}, connect "
                f"{list(batch.connect) or 'none'}): {exc}",
            ) from exc

    def verify(
        self,
        plan: CircuitPlan,
        observed: frozenset[Circuit],
        tables: Mapping[str, frozenset[PortPair]],
    ) -> None:
        """Check the switches against the plan: a programmed switch by the table it
        returned with its last batch (read by the switch in the same atomic step, so a
        switch that acknowledged without applying shows it), any other by ``observed``."""
        problems = check_tables(plan, tables, observed)
        if problems:
            raise StageError("verify", "switch state differs from the plan: " + "; ".join(problems))

    # -- ToR routes --

    async def program_routes(self, circuits: frozenset[Circuit], stage: str) -> None:
        """Every programmed ToR gets exactly the routes over ``circuits`` (ours pruned)."""
        want = tor_routes(self.wiring, circuits)
        self._fencing(f"ToR routes ({stage})")  # netlink carries no token: fenced here

        async def one(name: str) -> None:
            try:
                await self.electrical[name].ensure(want.get(name, frozenset()), prune=True)
            except errors.OrlError as exc:
                raise StageError(stage, f"ToR {name!r}: {exc}") from exc

        results = await asyncio.gather(*(one(n) for n in sorted(want)), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def verify_routes(self, circuits: frozenset[Circuit]) -> None:
        """Read every programmed ToR back: a ``StageError`` ("verify") names each whose
        routes differ from those over ``circuits``."""
        want = tor_routes(self.wiring, circuits)
        problems = []
        for name in sorted(want):
            try:
                d = await self.electrical[name].verify(want[name], prune=True)
            except errors.OrlError as exc:
                raise StageError("verify", f"reading ToR {name!r} back failed: {exc}") from exc
            if d.add or d.replace or d.remove:
                problems.append(
                    f"ToR {name!r} routes differ (missing {len(d.add)}, different "
                    f"{len(d.replace)}, stale {len(d.remove)})"
                )
        if problems:
            raise StageError("verify", "; ".join(problems))

    # -- both --

    async def converge(
        self, target: frozenset[Circuit], tag: str, observed: frozenset[Circuit] | None = None
    ) -> CircuitPlan:
        """Program the switches from what they hold (``observed``, read now if not given)
        to exactly ``target`` on our ports (and the ToRs to the routes over it), verify."""
        if observed is None:
            observed, _ = await self.observe()
        plan = converge(self.wiring, observed, target)
        if self.electrical:
            await self.program_routes(ours(self.wiring, observed) & target, "drain_routes")
        tables = await self.program(steps(plan), tag) if not plan.empty else {}
        if self.electrical:
            await self.program_routes(target, "program_routes")
        self.verify(plan, observed, tables)
        if self.electrical:
            await self.verify_routes(target)
        return plan


async def landed(driver: OcsDriver, batch: Batch) -> frozenset[PortPair] | None:
    """The switch's table if it shows the batch applied, else None."""
    try:
        table, _ = await driver.snapshot()
    except errors.OrlError:
        return None
    if set(batch.connect) <= table and not set(batch.disconnect) & table:
        return table
    return None

"""The compute-scheduling loop's shell: read the registry, ask, act, remember.

Every ``interval_s`` it reads the latest telemetry of the generation nodes, lets the pure
:mod:`fabric_controller.scheduling` decide (off the event loop: planning a large cluster
takes tens of milliseconds), and sends the plan's commands to the agents: reshards
first (concurrently, one per node), then migrations (concurrently, one per group).

A migration is controller-mediated: ``ExportRequests`` on the source (the requests stop
and are held there), ``ImportRequests`` on the destination (all or none), then
``ResolveExport`` on the source: release when the destination admitted them, restore
when it refused. An import that times out is retried once with the same command id (the
agent answers a repeat with the first result) before the requests are restored, so a
slow destination does not end with the request on both nodes. If the source cannot be
reached to resolve, its hold expires and it restores them itself: nothing is lost.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from fabric_controller import scheduling
from fabric_controller.controller import Controller
from fabric_controller.drivers.agents import AgentClient
from fabric_controller.events import Event
from fabric_controller.registry import Health
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Mode, Role
from orchestrrl.v1 import node_agent_pb2
from scheduler.compute_state import ComputePlan, MoveMethod
from scheduler.perf_model import H800, QWEN25_14B, PerfModel

log = get_logger("fabric_controller.scheduling")

ACTIONS_KEPT = 50


@dataclass(frozen=True)
class ActionRecord:
    timestamp: float
    kind: str  # reshard, migrate, repack (a tail repack's summary: async mode)
    node: str
    command_id: str
    ok: bool
    message: str
    seconds: float
    requests: tuple[str, ...] = ()
    method: str = ""  # migrate: recompute, kv (running requests) or dispatch (queued)


@dataclass(frozen=True)
class ScheduleView:
    """What GetSchedule reports: the latest plan, why, and what was done."""

    enabled: bool
    interval_s: float
    planned_at: float = 0.0
    mode: str = ""
    reason: str = ""
    plan: ComputePlan | None = None
    snapshot: scheduling.Snapshot | None = None
    acted: bool = False
    step: int = 0
    skipped: tuple[str, ...] = ()
    actions: tuple[ActionRecord, ...] = ()
    groups: int = 0  # the length signal: sample groups of the step (Decision.groups)
    groups_with_prior: int = 0
    replan_interval_s: float = 0.0  # proactive re-plans (reshards allowed); 0: not said
    paused: bool = False  # by an operator (PauseSchedule): observes, plans nothing
    # per node, its last reshard's pause as its agent measured it (node, seconds), by node
    reshard_pauses: tuple[tuple[str, float], ...] = ()

    def explanation(self) -> str:
        if not self.enabled:
            return "compute scheduling is off (--compute-scheduling off)"
        head = f"compute scheduling every {self.interval_s:g} s"
        if self.replan_interval_s:
            head += f" (re-plans every {self.replan_interval_s:g} s)"
        if self.paused:
            return f"{head}: paused by an operator (orlctl schedule resume re-plans at once)"
        if self.plan is None:
            return f"{head}: {self.reason or 'no plan yet'}"
        lines = [f"{head}; {self.mode} for step {self.step}:", self.plan.explain()]
        if self.groups:
            lines.append(
                f"  length signal: {self.groups} sample groups, {self.groups_with_prior} "
                "of them met in an earlier step"
            )
        if self.skipped:
            lines.append("  left out: " + "; ".join(self.skipped))
        if self.reshard_pauses:
            lines.append(
                "  measured reshard pauses: "
                + ", ".join(f"{n} {s:.2f} s" for n, s in self.reshard_pauses)
                + " (a reshard there is planned at no less; other nodes: the perf model's "
                "estimate)"
            )
        if not self.acted and not self.plan.empty:
            lines.append("  (not carried out)")
        return "\n".join(lines)


class ComputeScheduler:
    def __init__(
        self,
        controller: Controller,
        clients: Callable[[str, str], AgentClient],
        *,
        config: scheduling.SchedulingConfig | None = None,
        perf: PerfModel | None = None,
        enabled: bool = True,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``clients(node, address)`` gives the agent client of a node."""
        self.c = controller
        self.clients = clients
        self.config = config or scheduling.SchedulingConfig()
        self.perf = perf or PerfModel(QWEN25_14B, H800)
        self.enabled = enabled
        self._wall = wall_clock
        self._tracker = scheduling.StepTracker()
        self._saving: asyncio.Task[None] | None = None
        self._rounds = 0
        self._moved: dict[str, float] = {}  # request id -> when the loop last moved it
        self._actions: collections.deque[ActionRecord] = collections.deque(maxlen=ACTIONS_KEPT)
        # node -> the pause its last reshard took (the agent's stage timings): the planner
        # costs a reshard there at no less than this (before one: the perf model's estimate)
        self._pauses: dict[str, float] = {}
        self._view = ScheduleView(
            enabled, self.config.interval_s, replan_interval_s=self.config.replan.interval_s
        )
        self.paused = False

    def view(self) -> ScheduleView:
        return replace(
            self._view,
            actions=tuple(self._actions),
            paused=self.paused,
            reshard_pauses=tuple(sorted(self._pauses.items())),
        )

    def pause(self, paused: bool) -> None:
        """Pause the loop (its rounds observe the step and decide nothing) or resume it:
        the next round re-plans (layouts and placement) whenever the last plan was."""
        if not self.enabled:
            raise errors.FailedPrecondition(
                "compute scheduling is off (--compute-scheduling off): nothing to pause or resume"
            )
        if self.paused and not paused:
            self._tracker = scheduling.replan_now(self._tracker)
            self._view = replace(
                self._view, mode="resumed", reason="resumed by an operator: the next round re-plans"
            )
        if paused != self.paused:
            log.info("compute_scheduling_" + ("paused" if paused else "resumed"))
        self.paused = paused

    async def run(self) -> None:
        """Plan and act every interval (runs until cancelled), from the memory the store
        holds."""
        await self.restore()
        try:
            while True:
                await asyncio.sleep(self.config.interval_s)
                try:
                    await self.round()
                except errors.OrlError as exc:
                    log.warning("compute_round_failed", error=str(exc))
                except Exception:  # a bug here must not take the fabric controller down
                    log.exception("compute_round_crashed", note="next round in the interval")
        finally:
            if self._saving is not None:
                self._saving.cancel()

    # -- the memory that outlives a step (in the controller's store) --

    async def restore(self) -> None:
        """Start from the saved memory: the forecast's history and the groups remembered
        for their next epoch survive a restart and a failover (a new leader runs this
        when its term begins). An unreadable or invalid memory is logged and left out:
        the loop then learns again, as on a fresh store."""
        try:
            raw = await self.c.store.schedule_memory()
            if raw is None:
                return
            history, remembered = await asyncio.to_thread(scheduling.memory_load, raw)
        except errors.OrlError as exc:
            log.warning("schedule_memory_not_restored", error=str(exc))
            return
        self._tracker = scheduling.restored(history[-self.config.history_steps :], remembered)
        log.info("schedule_memory_restored", steps=len(history), groups=len(remembered))

    def _save_soon(self) -> None:
        """Save the memory in the background (encoding tens of thousands of groups
        takes a while; the round goes on). A save still running is left to finish; the
        save at the next step's end then carries what both steps taught."""
        if self._saving is None or self._saving.done():
            self._saving = asyncio.create_task(self._save(self._tracker))

    async def saved(self) -> None:
        """Wait for the save in flight, if any."""
        if self._saving is not None:
            await asyncio.wait([self._saving])

    async def _save(self, tracker: scheduling.StepTracker) -> None:
        try:
            blob, left_out = await asyncio.to_thread(scheduling.memory_blob, tracker)
            await self.c.store.save_schedule_memory(blob)
        except errors.OrlError as exc:
            log.warning("schedule_memory_not_saved", error=str(exc))
            return
        log.info(
            "schedule_memory_saved",
            steps=len(tracker.history),
            groups=len(tracker.remembered) - left_out,
            groups_left_out=left_out,
            bytes=len(blob),
        )

    # -- one round --

    def _views(self) -> tuple[list[scheduling.NodeView], list[str], dict[str, str]]:
        views: list[scheduling.NodeView] = []
        skipped: list[str] = []
        addresses: dict[str, str] = {}
        for record, health, _age in self.c.nodes():
            node = self.c.wiring.node(record.name)
            if node.role is not Role.GEN:
                continue
            if health is not Health.UP:
                skipped.append(f"{record.name}: {health.value}")
                continue
            got = scheduling.node_view(
                record.name,
                node.gpus,
                record.telemetry,
                kv_import=record.kv_import,
                max_num_seqs=record.max_num_seqs,
            )
            if isinstance(got, str):
                skipped.append(f"{record.name}: {got}")
                continue
            views.append(got)
            addresses[record.name] = record.agent_address
        return views, skipped, addresses

    async def round(self) -> scheduling.Decision:
        """Observe, decide, act once; the decision taken."""
        if not self.enabled:
            return scheduling.Decision("idle", None, "compute scheduling is off")
        views, skipped, addresses = self._views()
        now = self._wall()
        before = self._tracker
        self._tracker = scheduling.observe(
            self._tracker, views, now, self.config.history_steps, self.config.groups_remembered
        )
        if self._tracker.history is not before.history:  # a step ended: what it taught
            self._save_soon()
        if self.paused:
            paused = scheduling.Decision("paused", None, "paused by an operator")
            self._note(now, paused, skipped)
            return paused
        if not views:
            nothing = scheduling.Decision("idle", None, "no generation node reports")
            self._note(now, nothing, skipped)
            return nothing
        snap = scheduling.build_state(views, self._pauses)
        cooled = now - self.config.move_cooldown_s
        self._moved = {r: t for r, t in self._moved.items() if t > cooled}
        decision = await asyncio.to_thread(
            functools.partial(
                scheduling.decide,
                tail=self.c.mode is Mode.ASYNC,
                settled=frozenset(self._moved),
            ),
            self._tracker,
            snap,
            self.perf,
            now,
            self.config,
        )
        self._tracker = scheduling.planned(self._tracker, decision, now)
        if decision.plan is None:
            if self._view.plan is None or decision.mode == "idle":
                self._note(now, decision, skipped)
            return decision
        plan = decision.plan
        hold = plan.cost_hold
        if hold is not None and decision.mode == "replan":
            log.info(
                "compute_reshard_skipped_for_cost",
                layout=hold.label,
                gain_s=round(hold.gain_s, 3),
                measured_pause_s=round(hold.pause_s, 3),
                model_pause_s=round(hold.model_pause_s, 3),
                nodes=list(hold.nodes),
            )
        self._rounds += 1
        tag = f"sched-{int(now)}-{self._rounds}"
        reshards, migrations = scheduling.commands_for(
            plan,
            snap,
            tag,
            self.config.max_migrations,
            frozenset(self._moved),
        )
        for m in migrations:
            self._moved.update(dict.fromkeys(m.request_ids, now))
        self._view = ScheduleView(
            True,
            self.config.interval_s,
            now,
            decision.mode,
            plan.reason,
            plan,
            snap,
            False,
            self._tracker.step or 0,
            tuple(skipped),
            groups=decision.groups,
            groups_with_prior=decision.groups_with_prior,
            replan_interval_s=self.config.replan.interval_s,
        )
        if reshards or migrations:
            records = await self._act(reshards, migrations, addresses)
            if decision.mode == "repack":
                self._record_repack(plan, records, tag)
            self._tracker = scheduling.acted(self._tracker, self._wall())
            self._view = replace(self._view, acted=True)
        return decision

    def _note(self, now: float, decision: scheduling.Decision, skipped: list[str]) -> None:
        self._view = ScheduleView(
            self.enabled,
            self.config.interval_s,
            now,
            decision.mode,
            decision.why,
            None,
            None,
            False,
            self._tracker.step or 0,
            tuple(skipped),
            groups=decision.groups,
            groups_with_prior=decision.groups_with_prior,
            replan_interval_s=self.config.replan.interval_s,
        )

    async def _act(
        self,
        reshards: tuple[scheduling.ReshardCommand, ...],
        migrations: tuple[scheduling.MigrateCommand, ...],
        addresses: Mapping[str, str],
    ) -> list[ActionRecord]:
        """Reshards first (concurrently), then the migrations; their records."""
        results = await asyncio.gather(*(self.reshard(r, addresses[r.node]) for r in reshards))
        failed = {r.node for r, rec in zip(reshards, results, strict=True) if not rec.ok}
        todo = [m for m in migrations if m.source not in failed and m.target not in failed]
        moved = await asyncio.gather(*(self.migrate(m, addresses) for m in todo))
        if moved:  # one event per round (reshards and failures have their own)
            ok = [m for m in moved if m.ok]
            requests = sum(len(m.requests) for m in ok)
            self.c.events.publish(
                Event(
                    "compute_migrated",
                    message=f"{requests} request(s) moved in {len(ok)} of {len(moved)} "
                    f"migration(s); {len(migrations) - len(todo)} skipped (their node's "
                    "reshard failed)",
                )
            )
        return [*results, *moved]

    def _record_repack(self, plan: ComputePlan, records: list[ActionRecord], tag: str) -> None:
        """One ``repack`` action for a tail repack carried out (its reshards and
        migrations have their own records): ok when every part was."""
        ok = all(r.ok for r in records)
        moved = tuple(rid for r in records if r.kind == "migrate" and r.ok for rid in r.requests)
        node_of = {i.id: i.node for i in plan.instances}
        targets = sorted(
            {node_of[m.target] for m in plan.migrations} | {r.node for r in plan.reshards}
        )
        record = self._record(
            ActionRecord(
                self._wall(),
                "repack",
                ",".join(targets),
                f"{tag}-repack",
                ok,
                f"{plan.reason}: {len(moved)} of {len(plan.migrations)} request(s) moved, "
                f"{sum(1 for r in records if r.kind == 'reshard' and r.ok)} of "
                f"{len(plan.reshards)} reshard(s) done",
                sum(r.seconds for r in records),
                moved,
            )
        )
        self.c.events.publish(
            Event(
                "compute_repack" + ("" if record.ok else "_failed"),
                node=record.node,
                message=record.message,
            )
        )

    def _record(self, record: ActionRecord) -> ActionRecord:
        self._actions.append(record)
        level = log.info if record.ok else log.warning
        level(
            "compute action",
            kind=record.kind,
            node=record.node,
            command_id=record.command_id,
            ok=record.ok,
            message=record.message,
            requests=len(record.requests),
        )
        if record.kind == "reshard" or not record.ok:
            self.c.events.publish(
                Event(
                    f"compute_{record.kind}" + ("" if record.ok else "_failed"),
                    node=record.node,
                    message=record.message,
                )
            )
        return record

    async def reshard(self, cmd: scheduling.ReshardCommand, address: str) -> ActionRecord:
        started = time.monotonic()
        before = "+".join(f"TP{t}" for t in cmd.before)
        after = "+".join(f"TP{t}" for t in cmd.layout)
        try:
            reply = await self.clients(cmd.node, address).reshard(cmd.command_id, cmd.layout)
            stages = ", ".join(f"{x.stage} {x.seconds:.3f} s" for x in reply.stages)
            ok, outcome = True, f": {reply.message}" + (f" (stages: {stages})" if stages else "")
            pause = scheduling.measured_pause((x.stage, x.seconds) for x in reply.stages)
            if pause is not None:
                self._pauses[cmd.node] = pause
                log.info("reshard_pause_measured", node=cmd.node, pause_s=round(pause, 3))
        except errors.OrlError as exc:
            ok, outcome = False, f" failed: {exc}"
        return self._record(
            ActionRecord(
                self._wall(),
                "reshard",
                cmd.node,
                cmd.command_id,
                ok,
                f"{before} -> {after}{outcome}",
                time.monotonic() - started,
            )
        )

    async def migrate(
        self, cmd: scheduling.MigrateCommand, addresses: Mapping[str, str]
    ) -> ActionRecord:
        """Export -> import -> resolve (see the module docstring); the outcome."""
        started = time.monotonic()
        route = f"{cmd.source} -> {cmd.target}"
        how = {MoveMethod.DISPATCH: "dispatch (queued, no KV cache)"}.get(
            cmd.method, "recompute" if cmd.recompute else "KV move"
        )
        method = (
            "dispatch"
            if cmd.method is MoveMethod.DISPATCH
            else ("recompute" if cmd.recompute else "kv")
        )
        src = self.clients(cmd.source, addresses[cmd.source])
        dst = self.clients(cmd.target, addresses[cmd.target])
        export_id = f"{cmd.command_id}-export"

        def done(ok: bool, message: str, ids: tuple[str, ...]) -> ActionRecord:
            return self._record(
                ActionRecord(
                    self._wall(),
                    "migrate",
                    route,
                    cmd.command_id,
                    ok,
                    message,
                    time.monotonic() - started,
                    ids,
                    method,
                )
            )

        try:
            exported = await src.export_requests(export_id, cmd.request_ids, self.config.hold_s)
        except errors.OrlError as exc:
            return done(False, f"export from {cmd.source} failed, nothing moved: {exc}", ())
        ids = tuple(r.request_id for r in exported.requests)
        if not ids:
            return done(
                False, f"none of {len(cmd.request_ids)} request(s) is on {cmd.source} any more", ()
            )
        try:
            imported = await self._import(dst, cmd, list(exported.requests))
        except errors.OrlError as exc:
            restored = await self._resolve(src, cmd, export_id, None)
            return done(
                False,
                f"{cmd.target} refused {len(ids)} request(s) on instance {cmd.target_instance} "
                f"({how}): {exc}; {restored}",
                ids,
            )
        released = await self._resolve(src, cmd, export_id, (cmd.target, addresses[cmd.target]))
        if not cmd.recompute and imported.bytes_moved == 0 and imported.recomputed_tokens:
            how = "recompute (a KV move was asked for; the destination engine takes no KV cache)"
            method = "recompute"
        return done(
            True,
            f"{len(imported.admitted)} request(s) to instance {cmd.target_instance} by {how}"
            f" ({imported.bytes_moved} KV bytes, {imported.recomputed_tokens} tokens "
            f"recomputed); {released}",
            ids,
        )

    async def _import(
        self,
        dst: AgentClient,
        cmd: scheduling.MigrateCommand,
        states: list[node_agent_pb2.RequestState],
    ) -> node_agent_pb2.ImportRequestsResponse:
        import_id = f"{cmd.command_id}-import"
        for attempt in (1, 2):
            try:
                return await dst.import_requests(
                    import_id,
                    cmd.source,
                    cmd.target_instance,
                    cmd.recompute,
                    states,
                )
            except errors.Unavailable:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _resolve(
        self,
        src: AgentClient,
        cmd: scheduling.MigrateCommand,
        export_id: str,
        destination: tuple[str, str] | None,
    ) -> str:
        """Release the exported requests to ``destination`` (node, address: the source's
        gateway follows them there), or restore them on the source when it is None."""
        restore = destination is None
        verb = "restore" if restore else "release"
        try:
            r = await src.resolve_export(
                f"{cmd.command_id}-{verb}", export_id, restore, destination=destination
            )
        except errors.OrlError as exc:
            return (
                f"{verb} on {cmd.source} failed ({exc}); its hold of {self.config.hold_s:g} s "
                "restores the requests there when it expires"
            )
        if restore:
            return f"{len(r.restored)} restored on {cmd.source}"
        if r.restored:  # the hold had expired: the source restored them meanwhile
            return f"but {cmd.source} had restored them already: {r.message}"
        return f"{len(r.released)} released by {cmd.source}"

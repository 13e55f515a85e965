"""The node's rollout engine made of real engine instances: :class:`GatewayEngine`.

It implements :class:`node_agent.engine.RolloutEngine` (what telemetry reads and what the
controller's commands change) over one :class:`~node_agent.engines.base.EngineServer` per
entry of the TP layout. Every decision (admission, dispatch, migration, reshard plans,
crash handling) is made by the pure :class:`~node_agent.gateway.core.GatewayCore`; this
module is its shell: it owns the engine servers and the tasks that stream calls, watch
processes, check health, follow requests on other nodes, scrape metrics and reap
orphans, performs the core's actions and feeds their outcomes back.

Every task runs in one :class:`asyncio.TaskGroup`. A task that dies with an unexpected
error fails the gateway loudly: the error is logged, every request in flight fails with
it, its health turns bad (every instance reads ``failed: ...``) and :meth:`wait_failed`
returns, so the agent can exit and its service manager restart it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from node_agent.engine import (
    Destination,
    EngineProgress,
    EngineState,
    EngineStats,
    ImportResult,
    MigratingRequest,
    ReshardResult,
    StageTiming,
)
from node_agent.engines.base import (
    CAP_PAUSE,
    CAP_UPDATE_WEIGHTS,
    Device,
    EngineFailed,
    EngineServer,
    FinishReason,
    Placement,
    Sampling,
    Submission,
)
from node_agent.gateway.core import (
    ORPHAN_GRACE_S,
    RESTART_BACKOFF_S,
    Action,
    CancelCall,
    CancelFollow,
    CheckInstance,
    CoreConfig,
    GatewayCore,
    Instance,
    QueueFull,
    RestartInstance,
    StartCall,
    StartFollow,
    StopInstance,
)
from node_agent.gateway.requests import FINISH, Request, RequestFailed
from orchestrrl import errors
from orchestrrl.logs import get_logger

__all__ = ["FollowChunk", "GatewayConfig", "GatewayEngine", "Peers", "QueueFull", "placements"]

log = get_logger("node_agent.gateway")

CHECK_EVERY_S = 0.25
REAP_EVERY_S = 5.0
CANCEL_WAIT_S = 30.0  # how long an export waits for its calls to end on the engine


class FollowChunk(NamedTuple):
    token_ids: tuple[int, ...]
    weight_version: str
    finish: FinishReason | None
    logprobs: tuple[float, ...] = ()  # one per token when the request reports them


class Peers(Protocol):
    """The other nodes' gateways, for the tokens of requests released to them."""

    def follow(
        self, destination: Destination, request_id: str, start: int
    ) -> AsyncIterator[FollowChunk]:
        """Tokens of ``request_id`` on ``destination`` from output index ``start`` until it
        finishes; errors.NotFound when it does not have it, RequestFailed when it failed
        there, another OrlError when it cannot be reached."""


ServerFactory = Callable[[Placement], EngineServer]
PortPicker = Callable[[Placement], int]


@dataclass(frozen=True)
class GatewayConfig:
    device: Device = "cpu"
    max_queue: int = 65536  # requests waiting at the gateway; more are refused
    weight_version: str = "0"
    load_interval_s: float = 1.0  # how often instances' metrics are scraped
    restart_backoff_s: tuple[float, ...] = RESTART_BACKOFF_S
    orphan_grace_s: float = ORPHAN_GRACE_S
    follow_retries: int = 3  # reconnects to a destination before resuming locally
    hung_after_s: float = 30.0  # an instance unreachable this long while running is restarted

    def core(self) -> CoreConfig:
        return CoreConfig(
            max_queue=self.max_queue,
            weight_version=self.weight_version,
            restart_backoff_s=self.restart_backoff_s,
            orphan_grace_s=self.orphan_grace_s,
            follow_retries=self.follow_retries,
        )


@dataclass(frozen=True)
class WeightUpdate:
    """What :meth:`GatewayEngine.update_weights` did."""

    version: str
    previous: str
    stages: tuple[StageTiming, ...]  # drain (finishing requests), load
    instances: int  # instances that loaded the new weights
    resumed: int  # requests taken off to resume on the new weights
    finished_on_old: int  # requests that finished on the old weights first
    how: str  # "in place", "restart" (or both)
    stale_stopped: int = 0  # requests it left beyond their max_staleness, stopped


def placements(layout: Sequence[int], device: Device, ports: PortPicker) -> list[Placement]:
    """Instance ``k`` of ``layout`` holds the contiguous devices after those of instances
    ``0..k-1`` (the controller's canonical instance order)."""
    out: list[Placement] = []
    first = 0
    for k, tp in enumerate(layout):
        devices = tuple(range(first, first + tp))
        p = Placement(k, tp, devices, device, 0)
        out.append(Placement(k, tp, devices, device, ports(p)))
        first += tp
    return out


class GatewayEngine:
    """Engine instances over ``gpus`` devices in ``tp_layout``; see the module docstring."""

    def __init__(
        self,
        kind: str,
        gpus: int,
        tp_layout: Sequence[int],
        servers: ServerFactory,
        ports: PortPicker,
        *,
        peers: Peers | None = None,
        config: GatewayConfig | None = None,
        node: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or GatewayConfig()
        self.core = GatewayCore(kind, gpus, tp_layout, node=node, config=self.config.core())
        self.kind = kind
        self.node = node
        self._make = servers
        self._ports = ports
        self._peers = peers
        self._clock = clock
        self._servers: dict[int, EngineServer] = {}  # Instance.key -> its server
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._follows: dict[str, asyncio.Task[None]] = {}
        self._group: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._failed = asyncio.Event()
        self._seats_changed = asyncio.Event()  # a call ended
        self._model: str | None = None  # what the instances load (None: as configured)
        self._preparing = ""  # the version an update is preparing

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Start the instances of the initial layout; Unavailable when one does not."""
        insts = [self._instance_for(p) for p in self._placements(self.core.layout)]
        try:
            await self._start_instances(insts)
        except BaseException:
            await self._stop_instances(insts)
            raise
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="gateway")
        await self._ready.wait()
        if self._group is None:  # the task group ended before it started (cannot happen)
            raise errors.Unavailable(f"the gateway did not start: {self.core.crashed}")
        for inst in insts:
            self._watch(inst)
        self._act(self.core.adopt(insts, self.core.layout))
        log.info(
            "gateway_started",
            engine=self.kind,
            device=self.config.device,
            tp_layout=list(self.core.layout),
            instances=[
                {
                    "tp": i.placement.tp,
                    "devices": list(i.placement.devices),
                    "port": i.placement.port,
                }
                for i in insts
            ],
        )

    async def _run(self) -> None:
        """The task group every task of the gateway runs in."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._load_poller(), name="load poller")
                group.create_task(self._orphan_reaper(), name="orphan reaper")
                self._ready.set()
                await asyncio.Future()  # until close() cancels the group
        except asyncio.CancelledError:
            if not self.core.closed:
                raise
        except Exception as exc:  # any task's death fails the gateway
            self._crash(exc)
        finally:
            self._group = None
            self._ready.set()

    def _crash(self, exc: BaseException) -> None:
        first = exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) else exc
        why = f"a gateway task died: {first!r}"[:500]
        log.error("gateway_failed", error=why, exc_info=first)
        self.core.crashed = why
        self.core.fail_all(f"the gateway of node {self.node or '?'} failed ({why})")
        self._failed.set()
        # the engine servers are stopped by close(); no task is left to do it now

    async def wait_failed(self) -> str:
        """Return (the reason) once a task of the gateway has died."""
        await self._failed.wait()
        return self.core.crashed

    async def close(self) -> None:
        """Fail what is still in flight (the agent is stopping) and stop every instance."""
        if self.core.closed:
            return
        self.core.fail_all(f"the node agent of {self.node or 'this node'} stopped")
        self.core.closed = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        await self._stop_instances(self.core.instances)

    # -- RolloutEngine: state and figures --------------------------------------------

    @property
    def gpus(self) -> int:
        return self.core.gpus

    @property
    def state(self) -> EngineState:
        return self.core.engine_state

    @property
    def tp_layout(self) -> tuple[int, ...]:
        return self.core.layout

    @property
    def kv_import(self) -> bool:
        return False  # an imported request is resubmitted: its KV cache is recomputed

    @property
    def max_num_seqs(self) -> int:
        return min((i.max_num_seqs for i in self.core.instances), default=0)

    @property
    def instances(self) -> tuple[Placement, ...]:
        return tuple(i.placement for i in self.core.instances)

    @property
    def failures(self) -> int:
        """Instance crashes seen."""
        return self.core.failures

    @property
    def weight_version(self) -> str:
        return self.core.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """Relabel the weights served now (they were changed outside the gateway); the
        requests it leaves beyond their ``max_staleness`` stop."""
        self._act(self.core.relabel(version))

    @property
    def stale_stopped(self) -> int:
        """Requests stopped beyond their ``max_staleness`` since the gateway started."""
        return self.core.stale_stopped

    def instance_health(self) -> tuple[str, ...]:
        """ "up", "restarting" or "failed: why" per instance (status, tests)."""
        return self.core.instance_health()

    def stats(self) -> EngineStats:
        return self.core.stats(self._clock())

    def progress(self) -> EngineProgress:
        return self.core.progress()

    def request(self, request_id: str) -> Request | None:
        return self.core.requests.get(request_id)

    # -- client side (the HTTP gateway) ------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: Sampling,
        request_id: str | None = None,
        group: str = "",
        *,
        logprobs: bool = False,
        update_policy: str = "",
        max_staleness: int | None = None,
    ) -> Request:
        """Queue a client's request; InvalidArgument / FailedPrecondition (queue full).
        ``group``: its sample group (GRPO: the prompt), see ``check_group``;
        ``logprobs``: report the sampled tokens' logprobs; ``update_policy``: "finish" or
        "resume" at a weight update ("": the update's own, see :meth:`update_weights`);
        ``max_staleness``: it stops with finish reason "stale" once the weights served
        are more versions than this newer than its oldest token (None: no bound)."""
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        req, actions = self.core.submit(
            self._clock(),
            rid,
            prompt,
            max_tokens,
            sampling,
            group,
            logprobs=logprobs,
            update_policy=update_policy,
            max_staleness=max_staleness,
        )
        self._act(actions)
        return req

    def abort(self, request_ids: Sequence[str], why: str = "aborted by the client") -> list[str]:
        """Abort requests by id; the ids this gateway does not have (or that ended)."""
        unknown, actions = self.core.abort(request_ids, why)
        self._act(actions)
        return unknown

    def release(self, req: Request) -> None:
        """The client has read a finished request: forget it."""
        self.core.read(req)

    async def follow(self, request_id: str, start: int) -> AsyncIterator[FollowChunk]:
        """Tokens of a request from ``start`` with their weight version, then its finish
        (another node follows a request it released here); NotFound / RequestFailed."""
        req = self.core.requests.get(request_id)
        if req is None:
            raise errors.NotFound(f"request {request_id!r} is not on node {self.node!r}")
        if start < 0 or start > len(req.output):
            raise errors.field_error("start", start, f"an output index in 0..{len(req.output)}")
        self.core.follower_attached(request_id)
        try:
            pos = start
            async for _ in req.tokens(start):
                while pos < len(req.output):  # split at weight-version changes
                    version, end = _version_run(req.versions, pos, len(req.output))
                    yield FollowChunk(
                        tuple(req.output[pos:end]), version, None, tuple(req.logprobs[pos:end])
                    )
                    pos = end
            yield FollowChunk((), self.core.weight_version, req.finish or "length")
        finally:
            self.core.follower_detached(request_id, self._clock())

    def in_flight(self) -> list[str]:
        """The ids of the requests this gateway holds that have not ended."""
        return [r.id for r in self.core.requests.values() if not r.done]

    @property
    def tokens_generated(self) -> int:
        """Output tokens generated here since the gateway started (a counter)."""
        return self.core.figures.tokens_total

    async def probe(self, timeout_s: float) -> tuple[str, ...]:
        """Generate one token after a one-token prompt on every instance, directly on its
        server (not a request: no seat, no telemetry), as SGLang's ``/health_generate``
        does; per instance, "" when it answered, else why not."""

        async def one(inst: Instance) -> str:
            server = self._servers.get(inst.key)
            if not inst.up or server is None:
                return f"instance {inst.index}: {inst.health}"
            sub = Submission(f"health-{uuid.uuid4().hex}", (0,), 1, Sampling(temperature=0.0))
            try:
                async with asyncio.timeout(timeout_s):
                    async with contextlib.aclosing(server.generate(sub)) as stream:
                        async for chunk in stream:
                            if chunk.token_ids or chunk.finish:
                                return ""
                return f"instance {inst.index}: the stream ended without a token"
            except TimeoutError:
                return f"instance {inst.index}: no token within {timeout_s:g} s"
            except EngineFailed as exc:
                return f"instance {inst.index}: {exc}"

        return tuple(await asyncio.gather(*(one(i) for i in list(self.core.instances))))

    def source_of(self, request_id: str) -> str | None:
        """The node that exported ``request_id`` here ('' when a client of this gateway
        submitted it; None when unknown)."""
        req = self.core.requests.get(request_id)
        return None if req is None else req.source_node

    # -- RolloutEngine: admission ------------------------------------------------------

    async def drain(self) -> None:
        self.core.drain()

    async def resume(self) -> None:
        self._act(self.core.resume())

    async def pause(self) -> None:
        """Stop generating. Instances that can pause in place (vLLM, SGLang) keep their
        calls and KV cache; on the others the calls are aborted and their requests wait at
        the front of the queue with their output so far (KV recomputed at unpause)."""
        in_place, actions = self.core.pause()
        await self._act_and_wait(actions)
        for inst in in_place:
            await self._servers[inst.key].pause()

    async def unpause(self) -> None:
        resumed, actions = self.core.unpause()
        for inst in resumed:
            await self._servers[inst.key].resume()
        self._act(actions)

    # -- RolloutEngine: migration ------------------------------------------------------

    async def export_requests(
        self, request_ids: Sequence[str]
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        exported, missing, actions = self.core.hold(request_ids)
        await self._act_and_wait(actions)
        return tuple(exported), tuple(missing)

    async def restore_requests(self, requests: Sequence[MigratingRequest]) -> tuple[str, ...]:
        restored, actions = self.core.restore([m.request_id for m in requests])
        self._act(actions)
        return tuple(restored)

    async def release_requests(
        self, requests: Sequence[MigratingRequest], destination: Destination | None
    ) -> tuple[str, ...]:
        """The destination admitted the held requests: follow them there (a client or
        another node reads them here). Without a destination they cannot be followed:
        they fail with an error that says so."""
        released, actions = self.core.release(
            [m.request_id for m in requests], destination, self._peers is not None
        )
        self._act(actions)
        return tuple(released)

    async def import_requests(
        self, requests: Sequence[MigratingRequest], instance: int, recompute: bool
    ) -> ImportResult:
        t0 = time.perf_counter()
        result, actions = self.core.admit(self._clock(), requests, instance, recompute)
        await self._act_and_wait(actions)
        return dataclasses.replace(result, stages=(StageTiming("admit", time.perf_counter() - t0),))

    # -- RolloutEngine: reshard ----------------------------------------------------------

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        layout = self.core.check_reshard(new_layout)
        old = self.core.layout
        if layout == old:
            return ReshardResult(old, old, (), 0, f"layout is already {list(old)}; nothing to do")
        marks = [("start", time.perf_counter())]

        def mark(stage: str) -> None:
            marks.append((stage, time.perf_counter()))

        plan = self.core.plan_reshard(layout, self._placements(layout), self._instance_for)
        moved, actions = self.core.begin_reshard(plan)
        dispatched: list[Action] = []
        try:
            await self._act_and_wait(actions)
            mark("export_requests")
            await self._stop_instances(plan.leaving)
            mark("stop_instances")
            fresh = list(plan.fresh.values())
            try:
                await self._start_instances(fresh)
            except errors.OrlError as exc:
                await self._stop_instances(fresh)
                restored = await self._bring_back(old, plan.keep)
                raise errors.FailedPrecondition(
                    f"reshard {list(old)} -> {list(layout)} failed starting the new instances: "
                    f"{exc}; {restored}; {moved} request(s) wait in the queue with their output"
                ) from exc
            mark("start_instances")
            for inst in fresh:
                self._watch(inst)
            dispatched = self.core.end_reshard(plan.instances(), layout)
            self._act(dispatched)
            mark("resubmit_requests")
        finally:
            if self.core.resharding:  # cancelled, or failed before the end
                self.core.resharding = False
                self._act(self.core.adopt(self.core.instances, self.core.layout))
        resumed = sum(1 for a in dispatched if isinstance(a, StartCall))
        stages = tuple(
            StageTiming(stage, t - marks[i][1]) for i, (stage, t) in enumerate(marks[1:])
        )
        return ReshardResult(
            old,
            layout,
            stages,
            0,
            f"{self.kind}: stopped {len(plan.leaving)} instance(s), started {len(fresh)}, kept "
            f"{len(plan.keep)} running; {moved} in-flight request(s) resubmitted with their "
            f"output so far ({resumed} dispatched at once, KV recomputed by the engine); "
            "weights loaded from local storage",
        )

    async def _bring_back(self, old: tuple[int, ...], keep: dict[int, Instance]) -> str:
        """After a failed reshard: the old layout again (kept instances stay)."""
        kept = {id(i) for i in keep.values()}
        insts: list[Instance] = []
        for p in self._placements(old):
            same = [i for i in keep.values() if i.placement.devices == p.devices]
            insts.append(same[0] if same else self._instance_for(p))
        restart = [i for i in insts if id(i) not in kept]
        try:
            await self._start_instances(restart)
        except errors.OrlError as exc:
            for inst in restart:
                if inst.up:
                    self._watch(inst)
            self._act(self.core.end_reshard(insts, old))
            self._act(
                self.core.fail_instances(
                    insts, f"did not start again after the failed reshard: {exc}"
                )
            )
            return f"restarting the old layout {list(old)} failed too ({exc})"
        for inst in restart:
            self._watch(inst)
        self._act(self.core.end_reshard(insts, old))
        return f"the old layout {list(old)} serves again"

    # -- weight updates ------------------------------------------------------------------

    async def update_weights(
        self,
        path: str,
        version: str,
        in_flight: str = FINISH,
        *,
        drain_timeout_s: float | None = None,
    ) -> WeightUpdate:
        """Load the trainer's checkpoint at ``path`` (a Hugging Face directory) as
        ``version`` into every instance. First, while the old weights keep serving, the
        engine's adapter checks it against the model served and turns it into what the
        engine loads (``prepare_model``: for llama.cpp a GGUF); a checkpoint it cannot
        serve is refused then, nothing changed. Then no new call starts; the requests
        whose policy is "resume" (their own, else ``in_flight``) stop and wait, those that
        "finish" complete on the old weights; each instance loads the weights (in place
        where the engine can, else restarted on them) and dispatching goes on, every later
        token tagged ``version``. All or nothing: when an instance cannot load them, those
        that did are brought back to the old weights and FailedPrecondition says which and
        why; the node serves the old version. One update at a time (a second is refused:
        Aborted). ``drain_timeout_s``: how long to wait for the finishing requests
        (DeadlineExceeded after it, nothing changed)."""
        t0 = time.perf_counter()
        previous = self.core.weight_version
        self.core.check_update(version, in_flight)
        if self._preparing:
            raise errors.Aborted(
                f"cannot update weights: weights {self._preparing!r} are being prepared; "
                "retry when the update finishes"
            )
        self._preparing = version
        try:
            engine_path = await self._prepare(path)
        finally:
            self._preparing = ""
        stages = [StageTiming("prepare", time.perf_counter() - t0)]
        t1 = time.perf_counter()
        actions = self.core.begin_update(version, in_flight)
        resumed = sum(1 for a in actions if isinstance(a, CancelCall))
        stale0 = self.core.stale_stopped
        loaded: list[Instance] = []
        try:
            await self._act_and_wait(actions)
            finishing = self.core.seats_taken()
            await self._seats_free(drain_timeout_s, version)
            stages.append(StageTiming("drain", time.perf_counter() - t1))
            t2 = time.perf_counter()
            old = {i.key: self._servers[i.key].model for i in self.core.instances}
            try:
                for inst in list(self.core.instances):
                    await self._load(inst, engine_path, version)
                    loaded.append(inst)
            except (errors.OrlError, EngineFailed, NotImplementedError) as exc:
                failed = self.core.instances[len(loaded)]
                back = await self._roll_back([*loaded, failed], old)
                raise errors.FailedPrecondition(
                    f"weight update to {version!r} from {path}: {self.kind} instance "
                    f"{failed.index} (TP{failed.placement.tp}) could not load it: {exc}; "
                    f"{back}"
                ) from exc
            stages.append(StageTiming("load", time.perf_counter() - t2))
            self._model = engine_path  # instances started later load it too
            self._act(self.core.end_update(ok=True))
        finally:
            if self.core.updating:
                self._act(self.core.end_update(ok=False))
        how = {self._load_mode(i) for i in self.core.instances}
        log.info(
            "weights_updated",
            version=version,
            previous=previous,
            path=path,
            how=sorted(how),
            resumed=resumed,
            finished_on_old=finishing,
            stale_stopped=self.core.stale_stopped - stale0,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return WeightUpdate(
            version,
            previous,
            tuple(stages),
            len(loaded),
            resumed,
            finishing,
            ", ".join(sorted(how)),
            self.core.stale_stopped - stale0,
        )

    def _load_mode(self, inst: Instance) -> str:
        server = self._servers[inst.key]
        return "in place" if CAP_UPDATE_WEIGHTS in server.capabilities else "restart"

    async def _prepare(self, path: str) -> str:
        """What the engines load for the checkpoint at ``path`` (the adapter's check and
        conversion, done once: every instance runs the same engine and model)."""
        servers = [self._servers[i.key] for i in self.core.instances]
        if not servers:
            raise errors.Unavailable(f"node {self.node or '?'} has no engine instance")
        up = [self._servers[i.key] for i in self.core.instances if i.up]
        return await (up or servers)[0].prepare_model(path)

    async def _load(self, inst: Instance, path: str, version: str | None = None) -> None:
        """``inst`` serves the weights at ``path``: loaded in place, or restarted on them
        (an instance that crashed loads them when its own restart comes)."""
        server = self._servers[inst.key]
        if CAP_UPDATE_WEIGHTS in server.capabilities and inst.up:
            await server.update_weights(path, version=version)
            server.use_model(path)  # a later restart loads them too
            return
        server.use_model(path)
        if inst.up or inst.stopping:  # serving, or stopped by an update: (re)start it
            await self._restart_now(inst)

    async def _restart_now(self, inst: Instance) -> None:
        await self._stop_instances([inst], forget=False)
        await self._start_instances([inst])
        self._watch(inst)

    async def _roll_back(self, insts: Sequence[Instance], old: dict[int, str]) -> str:
        """Bring ``insts`` back to their old weights; what happened, in words."""
        failed = []
        for inst in insts:
            try:
                await self._load(inst, old[inst.key])
            except (errors.OrlError, EngineFailed, NotImplementedError) as exc:
                failed.append(f"instance {inst.index}: {exc}")
                log.error("weights_rollback_failed", instance=inst.index, error=str(exc))
        if failed:
            return "rolling back failed too (" + "; ".join(failed) + ")"
        return f"the node serves {self.core.weight_version!r} again"

    async def _seats_free(self, timeout_s: float | None, version: str) -> None:
        """Wait until no call holds a seat (the finishing requests are done)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.core.seats_taken():
                    self._seats_changed.clear()
                    await self._seats_changed.wait()
        except TimeoutError:
            holders = self.core.seat_holders()
            named = ", ".join(holders[:5]) + (", ..." if len(holders) > 5 else "")
            raise errors.DeadlineExceeded(
                f"weight update to {version!r}: {len(holders)} request(s) still "
                f"running on the old weights after {timeout_s:g} s ({named}); "
                "nothing was changed"
            ) from None

    # -- performing the core's actions -------------------------------------------------

    def _act(self, actions: Sequence[Action]) -> list[asyncio.Task[None]]:
        """Perform ``actions``; the tasks of the calls they cancelled (to wait for)."""
        cancelled: list[asyncio.Task[None]] = []
        for a in actions:
            if isinstance(a, StartCall):
                task = self._spawn(self._call(a), f"call {a.call_id}")
                if task is not None:
                    self._calls[a.call_id] = task
                    task.add_done_callback(functools.partial(self._call_done, a.call_id))
            elif isinstance(a, CancelCall):
                task = self._calls.get(a.call_id)
                if task is not None:
                    task.cancel()
                    cancelled.append(task)
            elif isinstance(a, StartFollow):
                task = self._spawn(self._follow(a), f"follow {a.request_id}")
                if task is not None:
                    self._follows[a.request_id] = task
            elif isinstance(a, CancelFollow):
                task = self._follows.pop(a.request_id, None)
                if task is not None and task is not asyncio.current_task():
                    task.cancel()
            elif isinstance(a, CheckInstance):
                self._spawn(self._check(a.instance), f"check instance {a.instance}")
            elif isinstance(a, StopInstance):
                self._spawn(self._servers[a.instance].stop(), f"stop instance {a.instance}")
            elif isinstance(a, RestartInstance):
                self._spawn(self._restart(a), f"restart instance {a.instance}")
        return cancelled

    async def _act_and_wait(self, actions: Sequence[Action]) -> None:
        """Perform ``actions`` and wait until the calls they cancelled have ended on their
        engines (bounded: an engine that does not let go is the health checks' problem)."""
        cancelled = self._act(actions)
        if cancelled:
            await asyncio.wait(cancelled, timeout=CANCEL_WAIT_S)

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None] | None:
        """A task in the gateway's group; None once the group is over or shutting down
        (the gateway is closing or failed: nothing new starts)."""
        group = self._group
        if group is not None:
            with contextlib.suppress(RuntimeError):  # the group is shutting down
                return group.create_task(coro, name=what)
        coro.close()
        return None

    # -- tasks -------------------------------------------------------------------------

    async def _call(self, a: StartCall) -> None:
        server = self._servers[a.instance]
        try:
            async with contextlib.aclosing(server.generate(a.submission)) as stream:
                async for chunk in stream:
                    if not self.core.call_tokens(
                        a.call_id, chunk.token_ids, chunk.finish, chunk.logprobs
                    ):
                        return
            self._act(
                self.core.call_failed(
                    a.call_id,
                    f"instance {a.submission.engine_request_id}: the stream ended early",
                    retry=True,
                    unreachable=False,
                    server_alive=server.alive,
                )
            )
        except EngineFailed as exc:
            self._act(
                self.core.call_failed(
                    a.call_id,
                    str(exc),
                    retry=exc.retry,
                    unreachable=exc.instance,
                    server_alive=server.alive,
                )
            )

    def _call_done(self, call_id: str, task: asyncio.Task[None]) -> None:
        """A call's task is over, however it ended: its seat is free. A done callback,
        not a ``finally`` in :meth:`_call`: a task cancelled before its first step (a call
        dispatched, then held for export or taken off by an update in the same step of the
        loop) runs none of its coroutine, and its seat would stay taken for good."""
        if self._calls.get(call_id) is task:
            del self._calls[call_id]
        try:
            if not self.core.closed:
                self._act(self.core.call_ended(call_id))
        except Exception as exc:  # as a task of the group dying would: the gateway fails
            self._crash(exc)
            if self._runner is not None:
                self._runner.cancel()
        finally:
            self._seats_changed.set()

    def _watch(self, inst: Instance) -> None:
        """Report when the instance's process exits (a crash unless it is stopping)."""
        old = self._watchers.pop(inst.key, None)
        if old is not None:
            old.cancel()
        task = self._spawn(self._watcher(inst), f"watch instance {inst.key}")
        if task is not None:
            self._watchers[inst.key] = task

    async def _watcher(self, inst: Instance) -> None:
        code = await self._servers[inst.key].wait_exit()
        if self._watchers.get(inst.key) is asyncio.current_task():
            del self._watchers[inst.key]
        self._act(self.core.exited(inst.key, code))

    async def _restart(self, a: RestartInstance) -> None:
        await asyncio.sleep(a.delay_s)
        if not self.core.wants_restart(a.instance):
            return
        inst = self.core.instance(a.instance)
        assert inst is not None
        try:
            await self._servers[a.instance].start()
        except errors.OrlError as exc:
            self._act(self.core.restart_failed(a.instance, str(exc)))
            return
        log.info("instance_restarted", instance=inst.index, restarts=inst.restarts)
        self._watch(inst)
        self._started(inst)

    def _started(self, inst: Instance) -> None:
        # what an adapter can do is known once it runs (SGLang's pause in place depends
        # on the version the server reports)
        inst.can_pause = CAP_PAUSE in self._servers[inst.key].capabilities
        self._act(self.core.started(inst))

    async def _check(self, key: int) -> None:
        """Back in service when healthy again; when it stays unreachable while its process
        runs (hung), stop it, and the watcher restarts it. An exit is the watcher's."""
        server = self._servers[key]
        inst = self.core.instance(key)
        for _ in range(round(self.config.hung_after_s / CHECK_EVERY_S)):
            await asyncio.sleep(CHECK_EVERY_S)
            if inst is None or inst.stopping or not server.alive:
                self.core.check_over(key)
                return
            if await server.healthy():
                self._act(self.core.healthy(key))
                return
        log.error("instance_hung", instance=key, after_s=self.config.hung_after_s)
        self._act(self.core.hung(key))

    async def _follow(self, a: StartFollow) -> None:
        assert self._peers is not None
        if a.delay_s:
            await asyncio.sleep(a.delay_s)
        why = "the stream ended before the request finished"
        final = False
        try:
            async for chunk in self._peers.follow(a.destination, a.request_id, a.start):
                if not self.core.follow_tokens(
                    a.request_id,
                    chunk.token_ids,
                    chunk.weight_version,
                    chunk.finish,
                    chunk.logprobs,
                ):
                    return
        except ValueError as exc:  # the destination sent tokens without their logprobs
            why, final = f"{a.destination.node} sent no logprobs: {exc}", True
        except errors.NotFound as exc:
            why, final = str(exc), True
        except RequestFailed as exc:
            why, final = f"it failed there: {exc}", True
        except errors.OrlError as exc:
            why = str(exc)
        finally:
            if self._follows.get(a.request_id) is asyncio.current_task():
                del self._follows[a.request_id]
        self._act(self.core.follow_lost(a.request_id, a.destination, why, final=final))

    async def _load_poller(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            insts = [i for i in self.core.instances if i.up]
            loads = await asyncio.gather(
                *(self._servers[i.key].load() for i in insts), return_exceptions=True
            )
            for inst, load in zip(insts, loads, strict=True):
                if not isinstance(load, BaseException):
                    self.core.set_load(inst.key, load)

    async def _orphan_reaper(self) -> None:
        while True:
            await asyncio.sleep(min(REAP_EVERY_S, self.config.orphan_grace_s / 2))
            self._act(self.core.reap(self._clock()))

    # -- instances -----------------------------------------------------------------------

    def _placements(self, layout: Sequence[int]) -> list[Placement]:
        return placements(layout, self.config.device, self._ports)

    def _instance_for(self, placement: Placement) -> Instance:
        server = self._make(placement)
        if self._model is not None:  # weights loaded by an update since the start
            server.use_model(self._model)
        inst = self.core.new_instance(
            placement, server.max_num_seqs, CAP_PAUSE in server.capabilities
        )
        self._servers[inst.key] = server
        return inst

    async def _start_instances(self, insts: Sequence[Instance]) -> None:
        """Start the instances' servers concurrently; the first failure is raised once every
        start has ended (the ones that did start stay up: the caller stops them)."""
        results = await asyncio.gather(
            *(self._servers[i.key].start() for i in insts), return_exceptions=True
        )
        for inst, result in zip(insts, results, strict=True):
            if result is None:
                self._started(inst)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _stop_instances(self, insts: Sequence[Instance], *, forget: bool = True) -> None:
        self.core.stopping(insts)
        for inst in insts:
            watcher = self._watchers.pop(inst.key, None)
            if watcher is not None:
                watcher.cancel()
        await asyncio.gather(*(self._servers[i.key].stop() for i in insts), return_exceptions=True)
        for inst in insts:  # gone for good (a kept or restarted instance is not stopped)
            if forget and (inst not in self.core.instances or self.core.closed):
                self._servers.pop(inst.key, None)


def _version_run(versions: Sequence[tuple[int, str]], pos: int, end: int) -> tuple[str, int]:
    """The weight version of output index ``pos`` and where its run ends (<= ``end``)."""
    k = bisect.bisect_right([i for i, _ in versions], pos) - 1
    version = versions[k][1] if k >= 0 else ""
    stop = versions[k + 1][0] if k + 1 < len(versions) else end
    return version, min(stop, end)

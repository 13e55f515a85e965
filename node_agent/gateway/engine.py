"""The node's rollout engine made of real engine instances: :class:`GatewayEngine`.

It implements :class:`node_agent.engine.RolloutEngine` (what telemetry reads and what the
controller's commands change) over one :class:`~node_agent.engines.base.EngineServer` per
entry of the TP layout, and keeps every request's state (:mod:`node_agent.gateway.requests`):

- **admission**: client requests queue at the gateway and are dispatched, oldest first,
  to the instance with the most free seats (an instance takes at most its
  ``max_num_seqs``); ``drain`` stops dispatching, ``resume`` starts it again;
- **migration**: ``export_requests`` aborts the requests' calls and holds their state;
  ``import_requests`` (on the destination) submits prompt + output so far, asking for the
  tokens still owed (the destination's engine recomputes the KV cache by prefill; an
  instance without a free seat queues them for the node's next one); when the source
  releases them it *follows* them on the destination
  (``Peers.follow``) and appends what arrives, so the client's stream goes on unbroken;
- **reshard**: the calls on instances that change are aborted and their requests queued
  again (front of the queue, in arrival order), those instances stop, the new layout's
  instances start, and the queue is dispatched again (recompute); instances whose GPUs
  and TP degree stay the same keep running untouched;
- **crashes**: when an instance's process exits, its requests go back to the queue (their
  output so far kept), it is restarted with backoff, and its requests resume on it or on
  another instance; when it cannot be restarted and no instance is left, every waiting
  request fails with an error naming the instance and its exit status.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from node_agent.engine import (
    Destination,
    EngineProgress,
    EngineState,
    EngineStats,
    ImportResult,
    MigratingRequest,
    RequestProgress,
    ReshardResult,
    StageTiming,
    check_group,
    validate_layout,
)
from node_agent.engines.base import (
    CAP_PAUSE,
    Device,
    EngineFailed,
    EngineServer,
    FinishReason,
    InstanceLoad,
    Placement,
    Sampling,
    Submission,
)
from node_agent.gateway.requests import (
    ImportedState,
    Request,
    RequestFailed,
    Where,
    parse_engine_state,
)
from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.gateway")

MAX_CALL_FAILURES = 3  # calls of one request failing while their instance stays up
RESTART_BACKOFF_S = (0.5, 2.0, 5.0)  # an instance that keeps exiting is restarted this often
ORPHAN_GRACE_S = 60.0  # an imported request nobody follows is aborted after this
DONE_KEPT_S = 300.0  # a finished imported request is kept this long for its follower
RATE_WINDOW_S = 2.0
CHECK_EVERY_S = 0.25


class QueueFull(errors.FailedPrecondition):
    """The gateway's queue holds ``max_queue`` requests already."""


class FollowChunk(NamedTuple):
    token_ids: tuple[int, ...]
    weight_version: str
    finish: FinishReason | None


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


@dataclass(eq=False)
class _Slot:
    server: EngineServer
    index: int  # position in the current layout (a kept instance may move)
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    up: bool = False
    stopping: bool = False
    failed: str = ""  # why it is out of service for good
    restarts: int = 0
    watcher: asyncio.Task[None] | None = None
    checker: asyncio.Task[None] | None = None  # an unreachable instance being checked
    paused: bool = False  # paused in place by GatewayEngine.pause
    load: InstanceLoad = field(default_factory=InstanceLoad)

    @property
    def placement(self) -> Placement:
        return self.server.placement

    @property
    def seats(self) -> int:
        return self.server.max_num_seqs - len(self.running) if self.up else 0


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
        self.kind = kind
        self.node = node
        self._gpus = gpus
        self._layout = validate_layout(tp_layout, gpus)
        self._make = servers
        self._ports = ports
        self._peers = peers
        self.config = config or GatewayConfig()
        self._clock = clock
        self._slots: list[_Slot] = []
        self._requests: dict[str, Request] = {}
        self._queue: list[tuple[int, str]] = []  # (seq, request id), sorted
        self._seq = 0
        self._state = EngineState.RUNNING
        self._paused = False
        self._resharding = False
        self._closed = False
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()  # followers, watchers, loops
        self._follows: dict[str, asyncio.Task[None]] = {}
        self._followers: collections.Counter[str] = collections.Counter()
        self._unfollowed: dict[str, float] = {}  # imported request -> when it lost its follower
        self.weight_version = self.config.weight_version
        self._step = 0
        self._completed: list[int] = []
        self._completed_groups: list[str] = []  # parallel to _completed
        self._idle = True
        self._tokens_total = 0
        self._rate_marks: collections.deque[tuple[float, int]] = collections.deque()
        self.failures = 0  # instance crashes seen

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Start the instances of the initial layout; Unavailable when one does not."""
        self._slots = [_Slot(self._make(p), p.index) for p in self._placements(self._layout)]
        try:
            await self._start_slots(self._slots)
        except BaseException:
            await self._stop_slots(self._slots)
            raise
        self._adopt(self._slots, self._layout)
        self._spawn(self._dispatcher(), "dispatcher")
        self._spawn(self._load_poller(), "load poller")
        self._spawn(self._orphan_reaper(), "orphan reaper")
        log.info(
            "gateway_started",
            engine=self.kind,
            device=self.config.device,
            tp_layout=list(self._layout),
            instances=[
                {
                    "tp": s.placement.tp,
                    "devices": list(s.placement.devices),
                    "port": s.placement.port,
                }
                for s in self._slots
            ],
        )

    async def close(self) -> None:
        """Fail what is still in flight (the agent is stopping) and stop every instance."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for slot in self._slots:
            await self._cancel_calls(slot)
        for req in list(self._requests.values()):
            if not req.done:
                req.end(Where.FAILED, error=f"the node agent of {self.node or 'this node'} stopped")
        await self._stop_slots(self._slots)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- RolloutEngine: state and figures --------------------------------------------

    @property
    def gpus(self) -> int:
        return self._gpus

    @property
    def state(self) -> EngineState:
        return EngineState.RESHARDING if self._resharding else self._state

    @property
    def tp_layout(self) -> tuple[int, ...]:
        return self._layout

    @property
    def kv_import(self) -> bool:
        return False  # an imported request is resubmitted: its KV cache is recomputed

    @property
    def max_num_seqs(self) -> int:
        return min((s.server.max_num_seqs for s in self._slots), default=0)

    @property
    def instances(self) -> tuple[Placement, ...]:
        return tuple(s.placement for s in self._slots)

    def instance_health(self) -> tuple[str, ...]:
        """ "up", "restarting" or "failed: why" per instance (status, tests)."""
        return tuple(
            "up" if s.up else (f"failed: {s.failed}" if s.failed else "restarting")
            for s in self._slots
        )

    def stats(self) -> EngineStats:
        queued = running = 0
        for req in self._requests.values():
            if req.where is Where.QUEUED:
                queued += 1
            elif req.where is Where.RUNNING:
                running += 1
        return EngineStats(
            queued_requests=queued,
            running_requests=running,
            tokens_per_s=self._rate(),
            kv_cache_usage=self._kv_usage(),
            step=self._step,
        )

    def progress(self) -> EngineProgress:
        rows = [
            RequestProgress(r.id, r.instance, len(r.prompt), len(r.output), r.max_tokens, r.group)
            for r in self._requests.values()
            if r.where is Where.RUNNING or r.where is Where.QUEUED
        ]
        groups = tuple(self._completed_groups) if any(self._completed_groups) else ()
        return EngineProgress(self._step, tuple(rows), tuple(self._completed), groups)

    def request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def _rate(self) -> float:
        now = self._clock()
        marks = self._rate_marks
        marks.append((now, self._tokens_total))
        while len(marks) > 2 and now - marks[1][0] >= RATE_WINDOW_S:
            marks.popleft()
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _kv_usage(self) -> float:
        """The instances' KV use weighted by their TP degree (their share of the GPUs);
        an engine that does not report it counts its share of seats in use instead."""
        total = used = 0.0
        for s in self._slots:
            t = s.placement.tp
            total += t
            if s.load.kv_usage is not None:
                used += t * s.load.kv_usage
            elif s.server.max_num_seqs:
                used += t * len(s.running) / s.server.max_num_seqs
        return min(1.0, used / total) if total else 0.0

    # -- client side (the HTTP gateway) ------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: Sampling,
        request_id: str | None = None,
        group: str = "",
    ) -> Request:
        """Queue a client's request; InvalidArgument / FailedPrecondition (queue full).
        ``group``: its sample group (GRPO: the prompt), see ``check_group``."""
        self._refuse_closed()
        if not prompt:
            raise errors.field_error("prompt", [], "at least one token id")
        if max_tokens < 1:
            raise errors.field_error("max_tokens", max_tokens, "an integer >= 1")
        sampling.check()
        check_group(group)
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        if rid in self._requests:
            raise errors.field_error("request_id", rid, "an id no request in flight here has")
        queued = sum(1 for r in self._requests.values() if r.where is Where.QUEUED)
        if queued >= self.config.max_queue:
            raise QueueFull(
                f"the gateway queue is full ({queued} requests waiting, "
                f"max_queue {self.config.max_queue}); retry later"
            )
        req = self._new(rid, tuple(prompt), max_tokens, sampling, group=group)
        self._enqueue(req)
        self._dispatch()  # seated now when there is room (the queue counts only waiters)
        return req

    def abort(self, request_ids: Sequence[str], why: str = "aborted by the client") -> list[str]:
        """Abort requests by id; the ids this gateway does not have (or that ended)."""
        unknown = [i for i in request_ids if (r := self._requests.get(i)) is None or r.done]
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None or req.done:
                continue
            self._take_off(req)
            req.end(Where.ABORTED, error=f"request {rid!r} {why}")
            self._forget(req)
            log.info("request_aborted", request=rid, why=why)
        self._maybe_idle()
        return unknown

    def release(self, req: Request) -> None:
        """The client has read a finished request: forget it."""
        if req.done:
            self._forget(req)

    async def follow(self, request_id: str, start: int) -> AsyncIterator[FollowChunk]:
        """Tokens of a request from ``start`` with their weight version, then its finish
        (another node follows a request it released here); NotFound / RequestFailed."""
        req = self._requests.get(request_id)
        if req is None:
            raise errors.NotFound(f"request {request_id!r} is not on node {self.node!r}")
        if start < 0 or start > len(req.output):
            raise errors.field_error("start", start, f"an output index in 0..{len(req.output)}")
        self._followers[request_id] += 1
        self._unfollowed.pop(request_id, None)
        try:
            pos = start
            async for _ in req.tokens(start):
                while pos < len(req.output):  # split at weight-version changes
                    version, end = _version_run(req.versions, pos, len(req.output))
                    yield FollowChunk(tuple(req.output[pos:end]), version, None)
                    pos = end
            yield FollowChunk((), self.weight_version, req.finish or "length")
        finally:
            self._followers[request_id] -= 1
            if self._followers[request_id] <= 0:
                del self._followers[request_id]
                if not req.origin:
                    if req.done:
                        self._forget(req)
                    else:
                        self._unfollowed[request_id] = self._clock()

    def source_of(self, request_id: str) -> str | None:
        """The node that exported ``request_id`` here ('' when a client of this gateway
        submitted it; None when unknown)."""
        req = self._requests.get(request_id)
        return None if req is None else req.source_node

    # -- RolloutEngine: admission ------------------------------------------------------

    async def drain(self) -> None:
        self._refuse_while_resharding("drain")
        self._state = EngineState.DRAINED

    async def resume(self) -> None:
        self._refuse_while_resharding("resume")
        self._state = EngineState.RUNNING
        self._wake.set()

    async def pause(self) -> None:
        """Stop generating. Instances that can pause in place (vLLM, SGLang) keep their
        calls and KV cache; on the others the calls are aborted and their requests wait at
        the front of the queue with their output so far (KV recomputed at unpause)."""
        if self._paused:
            return
        self._paused = True
        for slot in self._slots:
            if slot.up and CAP_PAUSE in slot.server.capabilities:
                await slot.server.pause()
                slot.paused = True
            else:
                await self._cancel_calls(slot)

    async def unpause(self) -> None:
        for slot in self._slots:
            if slot.paused:
                slot.paused = False
                await slot.server.resume()
        self._paused = False
        self._wake.set()

    # -- RolloutEngine: migration ------------------------------------------------------

    async def export_requests(
        self, request_ids: Sequence[str]
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        self._refuse_while_resharding("export requests")
        exported: list[MigratingRequest] = []
        missing: list[str] = []
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None or req.where not in (Where.QUEUED, Where.RUNNING):
                missing.append(rid)
                continue
            instance = req.instance if req.where is Where.RUNNING else -1
            await self._stop_call(req)
            if req.done:  # it finished while its call was being stopped
                missing.append(rid)
                continue
            self._unqueue(req)
            req.where = Where.HELD
            req.instance = -1
            exported.append(
                MigratingRequest(
                    request_id=req.id,
                    prompt_tokens=len(req.prompt),
                    generated_tokens=len(req.output),
                    max_tokens=req.max_tokens,
                    source_instance=instance,
                    kv_bytes=0,
                    prompt_token_ids=req.prompt,
                    output_token_ids=tuple(req.output),
                    engine_state=req.engine_state(),
                    group=req.group,
                )
            )
        self._maybe_idle()
        self._wake.set()
        return tuple(exported), tuple(missing)

    async def restore_requests(self, requests: Sequence[MigratingRequest]) -> tuple[str, ...]:
        restored: list[str] = []
        for m in requests:
            req = self._requests.get(m.request_id)
            if req is None or req.where is not Where.HELD:
                continue
            self._enqueue(req)
            restored.append(req.id)
        return tuple(restored)

    async def release_requests(
        self, requests: Sequence[MigratingRequest], destination: Destination | None
    ) -> tuple[str, ...]:
        """The destination admitted the held requests: follow them there (a client or
        another node reads them here). Without a destination they cannot be followed:
        they fail with an error that says so."""
        released: list[str] = []
        for m in requests:
            req = self._requests.get(m.request_id)
            if req is None or req.where is not Where.HELD:
                continue
            released.append(req.id)
            if destination is None or self._peers is None:
                req.end(
                    Where.FAILED,
                    error=f"request {req.id!r} was migrated off {self.node!r} but the "
                    "controller named no destination to follow it at",
                )
                continue
            req.where = Where.REMOTE
            req.remote = destination.node
            req.hops.append(destination.node)
            self._spawn_follow(req, destination)
        return tuple(released)

    async def import_requests(
        self, requests: Sequence[MigratingRequest], instance: int, recompute: bool
    ) -> ImportResult:
        t0 = time.perf_counter()
        self._refuse_closed()
        self._refuse_while_resharding("import requests")
        if self._state is not EngineState.RUNNING or self._paused:
            raise errors.FailedPrecondition(
                f"cannot import requests: the engine is {self.state.value}, not admitting"
            )
        if not 0 <= instance < len(self._slots):
            raise errors.field_error(
                "instance", instance, f"an index into the layout {list(self._layout)}"
            )
        slot = self._slots[instance]
        states = self._check_imports(requests)
        admitted: list[Request] = []
        for m, parsed in states:
            req = self._requests.get(m.request_id)
            if req is not None:  # coming home, or moving between this node's instances
                self._cancel_follow(req)
                req.remote = ""
            else:
                req = self._new(
                    m.request_id,
                    m.prompt_token_ids,
                    m.max_tokens,
                    parsed.sampling,
                    origin=False,
                    source_node=parsed.hops[-1] if parsed.hops else "",
                    group=m.group,
                )
            req.output[:] = m.output_token_ids
            req.versions[:] = parsed.versions
            here = parsed.hops[-1:] == (self.node,)
            req.hops[:] = parsed.hops if here else [*parsed.hops, self.node]
            if not req.origin and not self._followers[req.id]:
                self._unfollowed[req.id] = self._clock()  # until its source follows it
            admitted.append(req)
        seated = admitted[: slot.seats]
        for req in admitted:
            self._leave_idle()
            if req in seated:
                self._run_on(req, slot)
            else:  # the instance is full (or restarting): next free seat of this node
                self._enqueue(req)
        tokens = sum(len(r.prompt) + len(r.output) for r in admitted)
        waiting = len(admitted) - len(seated)
        return ImportResult(
            tuple(r.id for r in admitted),
            instance,
            0,
            tokens,
            (StageTiming("admit", time.perf_counter() - t0),),
            f"{len(seated)} request(s) on instance {instance} (TP{slot.placement.tp}, "
            f"{self.kind})"
            + (f", {waiting} queued for this node's next free seat" if waiting else "")
            + ": resubmitted with their output so far, the engine recomputes their KV cache"
            + ("" if recompute else f" ({self.kind} cannot receive a KV cache)"),
        )

    def _check_imports(
        self, requests: Sequence[MigratingRequest]
    ) -> list[tuple[MigratingRequest, ImportedState]]:
        if not requests:
            raise errors.field_error("requests", [], "at least one request to import")
        ids = [m.request_id for m in requests]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise errors.field_error("requests", dup, "each request id once per import")
        out = []
        for k, m in enumerate(requests):
            f = f"requests[{k}]"
            if not m.prompt_token_ids:
                raise errors.field_error(
                    f"{f}.prompt_token_ids", [], "the prompt's token ids (a gateway export)"
                )
            if m.max_tokens < 1 or len(m.output_token_ids) > m.max_tokens:
                raise errors.field_error(
                    f"{f}.max_tokens",
                    m.max_tokens,
                    f"an output cap >= 1 and >= the {len(m.output_token_ids)} tokens generated",
                )
            have = self._requests.get(m.request_id)
            # a request this node follows elsewhere comes home; one exported from this
            # node and not resolved yet moves to another of its instances
            if have is not None and not (
                have.where in (Where.REMOTE, Where.HELD)
                and tuple(m.output_token_ids[: len(have.output)]) == tuple(have.output)
                and have.prompt == m.prompt_token_ids
            ):
                raise errors.field_error(
                    f"{f}.request_id",
                    m.request_id,
                    f"a request this node does not have yet (it is {have.where.value} here)",
                )
            out.append((m, parse_engine_state(m.engine_state, len(m.output_token_ids))))
        return out

    # -- RolloutEngine: reshard ----------------------------------------------------------

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        layout = validate_layout(new_layout, self._gpus)
        self._refuse_closed()
        self._refuse_while_resharding("reshard")
        old = self._layout
        if layout == old:
            return ReshardResult(old, old, (), 0, f"layout is already {list(old)}; nothing to do")
        self._resharding = True
        try:
            return await self._reshard(old, layout)
        finally:
            self._resharding = False
            self._wake.set()

    async def _reshard(self, old: tuple[int, ...], layout: tuple[int, ...]) -> ReshardResult:
        marks = [("start", time.perf_counter())]

        def mark(stage: str) -> None:
            marks.append((stage, time.perf_counter()))

        new_places = self._placements(layout)
        keep: dict[int, _Slot] = {}  # new index -> old slot on the same devices and TP
        by_block = {(s.placement.devices, s.placement.tp): s for s in self._slots if s.up}
        for p in new_places:
            slot = by_block.get((p.devices, p.tp))
            if slot is not None:
                keep[p.index] = slot
        leaving = [s for s in self._slots if all(s is not k for k in keep.values())]
        moved = 0
        for slot in leaving:
            moved += await self._cancel_calls(slot)
        mark("export_requests")
        await self._stop_slots(leaving)
        mark("stop_instances")
        fresh = {p.index: _Slot(self._make(p), p.index) for p in new_places if p.index not in keep}
        try:
            await self._start_slots(list(fresh.values()))
        except errors.OrlError as exc:
            await self._stop_slots(list(fresh.values()))
            restored = await self._bring_back(old, keep)
            raise errors.FailedPrecondition(
                f"reshard {list(old)} -> {list(layout)} failed starting the new instances: "
                f"{exc}; {restored}; {moved} request(s) wait in the queue with their output"
            ) from exc
        mark("start_instances")
        slots = [keep[p.index] if p.index in keep else fresh[p.index] for p in new_places]
        self._adopt(slots, layout)
        self._resharding = False
        resumed = self._dispatch()
        mark("resubmit_requests")
        stages = tuple(
            StageTiming(stage, t - marks[i][1]) for i, (stage, t) in enumerate(marks[1:])
        )
        return ReshardResult(
            old,
            layout,
            stages,
            0,
            f"{self.kind}: stopped {len(leaving)} instance(s), started {len(fresh)}, kept "
            f"{len(keep)} running; {moved} in-flight request(s) resubmitted with their output "
            f"so far ({resumed} dispatched at once, KV recomputed by the engine); weights "
            "loaded from local storage",
        )

    async def _bring_back(self, old: tuple[int, ...], keep: dict[int, _Slot]) -> str:
        """After a failed reshard: the old layout again (kept instances stay)."""
        kept = set(map(id, keep.values()))
        places = self._placements(old)
        slots: list[_Slot] = []
        for p in places:
            same = [s for s in keep.values() if s.placement.devices == p.devices]
            slots.append(same[0] if same else _Slot(self._make(p), p.index))
        try:
            await self._start_slots([s for s in slots if id(s) not in kept])
        except errors.OrlError as exc:
            self._adopt(slots, old)
            for s in slots:
                if not s.up and not s.failed:
                    s.failed = f"did not start again after the failed reshard: {exc}"
            self._fail_if_no_instance()
            return f"restarting the old layout {list(old)} failed too ({exc})"
        self._adopt(slots, old)
        self._dispatch()
        return f"the old layout {list(old)} serves again"

    def _adopt(self, slots: list[_Slot], layout: tuple[int, ...]) -> None:
        """Make ``slots`` the instances of ``layout`` (their index is their position)."""
        for k, slot in enumerate(slots):
            slot.index = k
            for rid in slot.running:
                req = self._requests.get(rid)
                if req is not None and req.where is Where.RUNNING:
                    req.instance = k
        self._slots = slots
        self._layout = layout
        for slot in slots:
            if slot.up and slot.watcher is None:
                slot.watcher = self._spawn(self._watch(slot), "watcher")

    # -- internals: requests -----------------------------------------------------------

    def _new(
        self,
        rid: str,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: Sampling,
        *,
        origin: bool = True,
        source_node: str = "",
        group: str = "",
    ) -> Request:
        self._seq += 1
        req = Request(
            rid,
            self._seq,
            prompt,
            max_tokens,
            sampling,
            self._clock(),
            origin=origin,
            source_node=source_node,
            group=group,
            hops=[self.node],
        )
        self._requests[rid] = req
        return req

    def _enqueue(self, req: Request) -> None:
        """Queue in arrival order (a request coming back goes before younger ones)."""
        self._leave_idle()
        req.where = Where.QUEUED
        req.instance = -1
        bisect.insort(self._queue, (req.seq, req.id))
        self._wake.set()

    def _unqueue(self, req: Request) -> None:
        i = bisect.bisect_left(self._queue, (req.seq, req.id))
        if i < len(self._queue) and self._queue[i] == (req.seq, req.id):
            del self._queue[i]

    def _leave_idle(self) -> None:
        """A request arrives: after an idle node, a new generation step starts."""
        if self._idle:
            self._idle = False
            if self._completed:
                self._step += 1
                self._completed = []
                self._completed_groups = []

    def _maybe_idle(self) -> None:
        if not any(r.where in (Where.QUEUED, Where.RUNNING) for r in self._requests.values()):
            self._idle = True

    def _take_off(self, req: Request) -> None:
        """Stop whatever generates ``req`` (without waiting for its call to end)."""
        self._unqueue(req)
        if req.where is Where.RUNNING:
            slot = self._slot_of(req)
            task = slot.running.get(req.id) if slot is not None else None
            if task is not None:
                task.cancel()
        self._cancel_follow(req)

    async def _stop_call(self, req: Request) -> None:
        """Abort ``req``'s call and wait until it has ended (its tokens so far kept)."""
        if req.where is not Where.RUNNING:
            return
        slot = self._slot_of(req)
        task = slot.running.get(req.id) if slot is not None else None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
        if req.where is Where.RUNNING:
            req.where = Where.QUEUED  # the caller decides where it goes next
            req.instance = -1

    def _slot_of(self, req: Request) -> _Slot | None:
        for slot in self._slots:
            if req.id in slot.running:
                return slot
        return None

    def _forget(self, req: Request) -> None:
        if self._requests.get(req.id) is req and req.done:
            del self._requests[req.id]
            self._unfollowed.pop(req.id, None)

    # -- internals: dispatch and calls -----------------------------------------------

    async def _dispatcher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch()

    def _dispatch(self) -> int:
        """Seat queued requests, oldest first, on the instances with most free seats."""
        if self._resharding or self._paused or self._state is not EngineState.RUNNING:
            return 0
        seated = 0
        while self._queue:
            slot = max(self._slots, key=lambda s: s.seats, default=None)
            if slot is None or slot.seats <= 0:
                break
            _, rid = self._queue.pop(0)
            req = self._requests.get(rid)
            if req is None or req.where is not Where.QUEUED:
                continue
            self._run_on(req, slot)
            seated += 1
        return seated

    def _run_on(self, req: Request, slot: _Slot) -> None:
        req.where = Where.RUNNING
        req.instance = slot.index
        task = asyncio.get_running_loop().create_task(self._call(req, slot))
        slot.running[req.id] = task

    async def _call(self, req: Request, slot: _Slot) -> None:
        try:
            if req.remaining <= 0:
                self._finish(req, "length")
                return
            sub = Submission(
                req.next_call_id(), req.prompt + tuple(req.output), req.remaining, req.sampling
            )
            finish: FinishReason | None = None
            async with contextlib.aclosing(slot.server.generate(sub)) as stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        req.append(chunk.token_ids[: req.remaining], self.weight_version)
                        self._tokens_total += len(chunk.token_ids)
                    if chunk.finish is not None or req.remaining <= 0:
                        finish = chunk.finish or "length"
                        break
            if finish is None:
                raise EngineFailed(f"instance {slot.index}: the stream ended early")
            self._finish(req, finish)
        except EngineFailed as exc:
            if exc.instance:
                self._instance_trouble(req, slot, str(exc))
            else:
                self._call_failed(req, slot, str(exc), exc.retry)
        finally:
            if slot.running.get(req.id) is asyncio.current_task():
                del slot.running[req.id]
            self._wake.set()

    def _finish(self, req: Request, finish: FinishReason) -> None:
        req.end(Where.FINISHED, finish)
        self._completed.append(len(req.output))
        self._completed_groups.append(req.group)
        self._maybe_idle()
        if not req.origin and not self._followers[req.id]:
            self._unfollowed.setdefault(req.id, self._clock())

    def _call_failed(self, req: Request, slot: _Slot, why: str, retry: bool) -> None:
        if not slot.server.alive or slot.stopping:
            # the watcher restarts the instance; its requests wait for a seat meanwhile
            slot.up = False
            self._enqueue(req)
            return
        req.failures += 1
        if req.failures >= MAX_CALL_FAILURES or not retry:
            log.warning("request_failed", request=req.id, error=why)
            req.end(
                Where.FAILED,
                error=(
                    f"request {req.id!r} failed {req.failures} times on {self.kind} "
                    f"instance {slot.index}: {why}"
                    if retry
                    else f"{self.kind} refused request {req.id!r}: {why}"
                ),
                refused=not retry,
            )
            self._maybe_idle()
            return
        log.warning("call_failed_retrying", request=req.id, error=why, failures=req.failures)
        self._enqueue(req)

    def _instance_trouble(self, req: Request, slot: _Slot, why: str) -> None:
        """The instance could not be reached: the request waits for a seat (here or on
        another instance) and the instance is checked before it gets more."""
        self._enqueue(req)
        if slot.up and not slot.stopping and slot.checker is None:
            slot.up = False
            log.warning("instance_unreachable", instance=slot.index, error=why)
            slot.checker = self._spawn(self._check(slot), "instance check")

    async def _check(self, slot: _Slot) -> None:
        """Back in service when healthy again; when it stays unreachable while its process
        runs (hung), stop it, and the watcher restarts it. An exit is the watcher's."""
        try:
            for _ in range(round(self.config.hung_after_s / CHECK_EVERY_S)):
                await asyncio.sleep(CHECK_EVERY_S)
                if slot.stopping or not slot.server.alive:
                    return
                if await slot.server.healthy():
                    slot.up = True
                    self._wake.set()
                    return
            log.error("instance_hung", instance=slot.index, after_s=self.config.hung_after_s)
            await slot.server.stop()  # the watcher sees the exit and restarts it
        finally:
            slot.checker = None

    async def _cancel_calls(self, slot: _Slot) -> int:
        """Abort every call on ``slot``; their requests wait at the queue's front."""
        tasks = list(slot.running.items())
        for _, task in tasks:
            task.cancel()
        await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        n = 0
        for rid, _ in tasks:
            req = self._requests.get(rid)
            if req is not None and req.where is Where.RUNNING:
                self._enqueue(req)
                n += 1
        slot.running.clear()
        return n

    # -- internals: instances ----------------------------------------------------------

    def _placements(self, layout: Sequence[int]) -> list[Placement]:
        return placements(layout, self.config.device, self._ports)

    async def _start_slots(self, slots: Sequence[_Slot]) -> None:
        """Start the slots' servers concurrently; the first failure is raised once every
        start has ended (the ones that did start stay up: the caller stops them)."""
        results = await asyncio.gather(*(s.server.start() for s in slots), return_exceptions=True)
        for slot, result in zip(slots, results, strict=True):
            if result is None:
                slot.up = True
                slot.stopping = False
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _stop_slots(self, slots: Sequence[_Slot]) -> None:
        for slot in slots:
            slot.stopping = True
            slot.up = False
            if slot.watcher is not None:
                slot.watcher.cancel()
                slot.watcher = None
        await asyncio.gather(*(s.server.stop() for s in slots), return_exceptions=True)

    async def _watch(self, slot: _Slot) -> None:
        """Restart the instance when its process exits unexpectedly."""
        code = await slot.server.wait_exit()
        if slot.stopping or self._closed:
            return
        slot.up = False
        self.failures += 1
        where = f"{self.kind} instance {slot.index} (TP{slot.placement.tp})"
        log.error("instance_exited", instance=slot.index, exit_status=code)
        await self._cancel_calls(slot)
        slot.watcher = None
        for delay in self.config.restart_backoff_s:
            slot.restarts += 1
            await asyncio.sleep(delay)
            if slot.stopping or self._closed:
                return
            try:
                await slot.server.start()
            except errors.OrlError as exc:
                log.warning("instance_restart_failed", instance=slot.index, error=str(exc))
                continue
            slot.up = True
            log.info("instance_restarted", instance=slot.index, restarts=slot.restarts)
            slot.watcher = self._spawn(self._watch(slot), "watcher")
            self._wake.set()
            return
        slot.failed = f"{where} exited with status {code} and did not restart"
        log.error("instance_failed", instance=slot.index, why=slot.failed)
        self._fail_if_no_instance()

    def _fail_if_no_instance(self) -> None:
        """With no instance up or restarting, nothing can generate the queue: fail it."""
        if any(s.up or not s.failed for s in self._slots):
            return
        why = "; ".join(s.failed for s in self._slots)
        for req in list(self._requests.values()):
            if req.where in (Where.QUEUED, Where.RUNNING):
                self._unqueue(req)
                req.end(Where.FAILED, error=f"request {req.id!r} cannot run: {why}")
        self._queue.clear()

    async def _load_poller(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            slots = [s for s in self._slots if s.up]
            loads = await asyncio.gather(*(s.server.load() for s in slots), return_exceptions=True)
            for slot, load in zip(slots, loads, strict=True):
                if isinstance(load, InstanceLoad):
                    slot.load = load

    async def _orphan_reaper(self) -> None:
        """Imported requests whose follower went away (it gave up, or the client aborted
        on the source) are aborted after a grace period, finished ones forgotten."""
        while True:
            await asyncio.sleep(min(5.0, self.config.orphan_grace_s / 2))
            now = self._clock()
            for rid, since in list(self._unfollowed.items()):
                req = self._requests.get(rid)
                if req is None:
                    self._unfollowed.pop(rid, None)
                    continue
                limit = DONE_KEPT_S if req.done else self.config.orphan_grace_s
                if now - since < limit:
                    continue
                if req.done:
                    self._forget(req)
                elif req.where is not Where.HELD:
                    self.abort([rid], f"lost its follower ({req.source_node}) for {limit:g} s")
                self._unfollowed.pop(rid, None)

    # -- internals: following a released request ---------------------------------------

    def _spawn_follow(self, req: Request, destination: Destination) -> None:
        self._follows[req.id] = self._spawn(self._follow(req, destination), "follow")

    def _cancel_follow(self, req: Request) -> None:
        task = self._follows.pop(req.id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _follow(self, req: Request, destination: Destination) -> None:
        assert self._peers is not None
        tries = 0
        why = ""
        while tries <= self.config.follow_retries:
            try:
                async for chunk in self._peers.follow(destination, req.id, len(req.output)):
                    tries = 0
                    req.append(chunk.token_ids, chunk.weight_version)
                    if chunk.finish is not None:
                        self._follows.pop(req.id, None)
                        req.end(Where.FINISHED, chunk.finish)
                        return
                why = "the stream ended before the request finished"
            except errors.NotFound as exc:
                why = str(exc)
                break
            except RequestFailed as exc:
                why = f"it failed there: {exc}"
                break
            except errors.OrlError as exc:
                why = str(exc)
            tries += 1
            await asyncio.sleep(min(2.0, 0.2 * 2**tries))
        # the destination lost it or cannot be reached: go on here with what we have
        self._follows.pop(req.id, None)
        if req.where is Where.REMOTE:
            log.warning(
                "follow_lost_resuming_here", request=req.id, destination=destination.node, why=why
            )
            req.remote = ""
            req.hops.append(self.node)
            self._enqueue(req)

    # -- helpers -------------------------------------------------------------------------

    def _spawn(self, coro: object, what: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: _log_crash(t, what))
        return task

    def _refuse_while_resharding(self, what: str) -> None:
        if self._resharding:
            raise errors.Aborted(
                f"cannot {what}: a reshard from {list(self._layout)} is in progress; "
                "retry when it finishes"
            )

    def _refuse_closed(self) -> None:
        if self._closed:
            raise errors.Unavailable("the node agent is stopping")


def _version_run(versions: Sequence[tuple[int, str]], pos: int, end: int) -> tuple[str, int]:
    """The weight version of output index ``pos`` and where its run ends (<= ``end``)."""
    k = bisect.bisect_right([i for i, _ in versions], pos) - 1
    version = versions[k][1] if k >= 0 else ""
    stop = versions[k + 1][0] if k + 1 < len(versions) else end
    return version, min(stop, end)


def _log_crash(task: asyncio.Task[None], what: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway_task_crashed", task=what, error=repr(task.exception()))

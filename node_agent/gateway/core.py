"""The gateway's decisions: requests, seats and instances as a state machine.

:class:`GatewayCore` holds every request of the node's gateway (:class:`Request`), the
queue, and what it knows of each engine instance (:class:`Instance`: up, seats, calls);
its methods take events (a client submits, a call streamed tokens, a call failed, an
instance exited, a reshard began, a peer's stream was lost, ``now`` passed) and *return*
the :data:`Action` s that follow (start a call, cancel one, restart an instance after a
delay, follow a request on another node). It does no I/O, owns no task and reads no
clock (``now`` is an argument): the shell, :class:`node_agent.gateway.engine.GatewayEngine`,
performs the actions under one task group and feeds their outcomes back. This is the
shape of vLLM v1's ``Scheduler`` (decides) and ``EngineCore`` (executes).

Calls are named (``{request id}-c{n}``) and every event about a call names it: once the
core has cancelled a call, or the request has moved on, late events of that call change
nothing. A cancelled call keeps its seat on the instance until the shell reports that it
ended, so an engine never holds more calls than its ``max_num_seqs``.

The rules (unchanged from the gateway's first version):

- **admission**: requests queue in arrival order and are dispatched, oldest first, to
  the instance with the most free seats; ``drain`` stops dispatching, ``resume`` starts
  it again, ``pause`` stops it and takes the calls off (instances that can pause in
  place keep theirs);
- **migration**: ``hold`` takes requests off their calls and keeps their state;
  ``admit`` (on the destination) resubmits prompt + output so far; ``release`` follows
  them on the destination, ``restore`` queues them again;
- **reshard**: calls on instances that change are cancelled and their requests queued
  again (front of the queue, in arrival order); instances whose devices and TP degree
  stay keep running untouched;
- **staleness**: when new weights land (an update ends, the weights are relabelled, or a
  request is imported), every request here (queued, running, held, resumed) with a
  ``max_staleness`` that the version now served exceeds, counted from its oldest token's
  version, stops with finish reason ``stale`` and its output so far (a request with no
  token yet never is: its first token comes from the new weights); versions are compared
  as the trainer's counts (``"3"``), other labels are never judged stale;
- **crashes**: an instance that exits is restarted with backoff, its requests queued;
  one that cannot be reached is checked before it gets more; when none is left, every
  waiting request fails naming the instances and why.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node_agent.engine import (
    Destination,
    EngineProgress,
    EngineState,
    EngineStats,
    ImportResult,
    MigratingRequest,
    RequestProgress,
    check_group,
    validate_layout,
)
from node_agent.engines.base import (
    FinishReason,
    InstanceLoad,
    Placement,
    Sampling,
    Submission,
)
from node_agent.gateway.figures import StepFigures, kv_usage
from node_agent.gateway.handoff import Followers, check_imports, exported, import_result
from node_agent.gateway.requests import (
    MAX_STALENESS,
    RESUME,
    STALE,
    UPDATE_POLICIES,
    Request,
    Where,
    staleness,
)
from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.gateway")

MAX_CALL_FAILURES = 3  # calls of one request failing while their instance stays up
RESTART_BACKOFF_S = (0.5, 2.0, 5.0)  # an instance that keeps exiting is restarted this often
ORPHAN_GRACE_S = 60.0  # an imported request nobody follows is aborted after this


class QueueFull(errors.FailedPrecondition):
    """The gateway's queue holds ``max_queue`` requests already."""


# -- actions: what the shell performs ---------------------------------------------------


@dataclass(frozen=True)
class StartCall:
    """Stream ``submission`` from the instance ``instance`` (an :attr:`Instance.key`) and
    report its chunks and its end under ``call_id``."""

    call_id: str
    request_id: str
    instance: int
    submission: Submission


@dataclass(frozen=True)
class CancelCall:
    """Stop the call (the engine aborts it); report its end as usual."""

    call_id: str


@dataclass(frozen=True)
class CheckInstance:
    """The instance could not be reached: poll its health; report healthy, or hung
    when it stays unreachable while its process runs."""

    instance: int


@dataclass(frozen=True)
class StopInstance:
    """Stop the instance's process (a hung instance: its exit restarts it)."""

    instance: int


@dataclass(frozen=True)
class RestartInstance:
    """After ``delay_s``, start the instance's process again (if the core still wants
    it: :meth:`GatewayCore.wants_restart`) and report the outcome."""

    instance: int
    delay_s: float


@dataclass(frozen=True)
class StartFollow:
    """After ``delay_s``, follow ``request_id`` on ``destination`` from output index
    ``start``: report its tokens, its finish, or that it was lost."""

    request_id: str
    destination: Destination
    start: int
    delay_s: float = 0.0


@dataclass(frozen=True)
class CancelFollow:
    request_id: str


Action = (
    StartCall
    | CancelCall
    | CheckInstance
    | StopInstance
    | RestartInstance
    | StartFollow
    | CancelFollow
)


# -- instances and calls -------------------------------------------------------------------


@dataclass(eq=False)
class Instance:
    """One engine instance as the core sees it. ``key`` names it for the shell for as long
    as it exists (its ``index`` in the layout may change when a reshard keeps it)."""

    key: int
    placement: Placement
    max_num_seqs: int
    can_pause: bool = False
    index: int = 0
    up: bool = False
    stopping: bool = False  # being stopped on purpose: its exit is not a crash
    failed: str = ""  # why it is out of service for good
    restarts: int = 0  # restart attempts
    attempt: int = -1  # position in the restart backoff (-1: not restarting)
    exit_status: int = 0
    checking: bool = False  # unreachable, its health being checked
    paused: bool = False  # paused in place
    version: str = ""  # the weights it serves
    calls: set[str] = field(default_factory=set)  # calls holding a seat here
    load: InstanceLoad = field(default_factory=InstanceLoad)

    @property
    def seats(self) -> int:
        return self.max_num_seqs - len(self.calls) if self.up else 0

    @property
    def health(self) -> str:
        return "up" if self.up else (f"failed: {self.failed}" if self.failed else "restarting")

    def next_restart(self, backoff: Sequence[float], kind: str) -> float | None:
        """The delay before the next restart attempt; None (and ``failed`` says why) when
        the backoff is used up."""
        self.attempt += 1
        if self.attempt < len(backoff):
            self.restarts += 1
            return backoff[self.attempt]
        self.attempt = -1
        where = f"{kind} instance {self.index} (TP{self.placement.tp})"
        self.failed = f"{where} exited with status {self.exit_status} and did not restart"
        return None


@dataclass(eq=False)
class _Call:
    id: str
    request: str
    instance: Instance
    live: bool = True  # False once cancelled or finished: its events change nothing


@dataclass(frozen=True)
class ReshardPlan:
    """A reshard of the instances: ``keep`` maps a new layout index to the instance that
    stays (same devices and TP degree, up); ``leaving`` stop; ``fresh`` start."""

    old_layout: tuple[int, ...]
    layout: tuple[int, ...]
    placements: tuple[Placement, ...]
    keep: dict[int, Instance]
    leaving: tuple[Instance, ...]
    fresh: dict[int, Instance]

    def instances(self) -> list[Instance]:
        return [self.keep.get(p.index) or self.fresh[p.index] for p in self.placements]


@dataclass(frozen=True)
class CoreConfig:
    max_queue: int = 65536
    weight_version: str = "0"
    restart_backoff_s: tuple[float, ...] = RESTART_BACKOFF_S
    orphan_grace_s: float = ORPHAN_GRACE_S
    follow_retries: int = 3  # reconnects to a destination before resuming locally


class GatewayCore:
    """The gateway's state and rules; see the module docstring."""

    def __init__(
        self,
        kind: str,
        gpus: int,
        layout: Sequence[int],
        *,
        node: str = "",
        config: CoreConfig | None = None,
    ) -> None:
        self.kind = kind
        self.node = node
        self.gpus = gpus
        self.layout = validate_layout(layout, gpus)
        self.config = config or CoreConfig()
        self.instances: list[Instance] = []
        self.requests: dict[str, Request] = {}
        self.weight_version = self.config.weight_version
        self.failures = 0  # instance exits seen
        self.state = EngineState.RUNNING
        self.paused = False
        self.resharding = False
        self.closed = False
        self.crashed = ""  # why the gateway stopped working (a task of its shell died)
        self.updating = ""  # the weight version being loaded ("": no update)
        self.stale_stopped = 0  # requests stopped beyond their max_staleness
        self._queue: list[tuple[int, str]] = []  # (seq, request id), sorted
        self._seq = 0
        self._keys = 0
        self._calls: dict[str, _Call] = {}
        self._live: dict[str, str] = {}  # request id -> its live call
        self._followers = Followers(self.config.orphan_grace_s, self.config.follow_retries)
        self.figures = StepFigures()

    # -- instances ------------------------------------------------------------------------

    def new_instance(self, placement: Placement, max_num_seqs: int, can_pause: bool) -> Instance:
        """An instance for ``placement`` (not in the layout until adopted)."""
        self._keys += 1
        return Instance(
            self._keys,
            placement,
            max_num_seqs,
            can_pause,
            placement.index,
            version=self.weight_version,
        )

    def instance(self, key: int) -> Instance | None:
        return next((i for i in self.instances if i.key == key), None)

    def adopt(self, instances: list[Instance], layout: tuple[int, ...]) -> list[Action]:
        """Make ``instances`` those of ``layout`` (their index is their position)."""
        for k, inst in enumerate(instances):
            inst.index = k
            for cid in inst.calls:
                req = self.requests.get(self._calls[cid].request)
                if req is not None and self._live.get(req.id) == cid:
                    req.instance = k
        self.instances = instances
        self.layout = layout
        return self._dispatch()

    def started(self, inst: Instance) -> list[Action]:
        """``inst``'s process started and is healthy (first start, reshard or restart)."""
        inst.up = True
        inst.stopping = False
        inst.attempt = -1
        return self._dispatch()

    def stopping(self, instances: Sequence[Instance]) -> None:
        """The shell stops these on purpose: their exits are not crashes."""
        for inst in instances:
            inst.stopping = True
            inst.up = False

    def exited(self, key: int, status: int) -> list[Action]:
        """An instance's process exited: take its calls off (their requests wait for a
        seat) and restart it after the first backoff delay."""
        inst = self.instance(key)
        if inst is None or inst.stopping or self.closed:
            return []
        inst.up = False
        inst.exit_status = status
        self.failures += 1
        log.error("instance_exited", instance=inst.index, exit_status=status)
        actions = self._take_calls_off(inst)
        return actions + self._next_restart(inst) + self._dispatch()

    def wants_restart(self, key: int) -> bool:
        inst = self.instance(key)
        return inst is not None and not inst.stopping and not self.closed and inst.attempt >= 0

    def restart_failed(self, key: int, why: str) -> list[Action]:
        inst = self.instance(key)
        if inst is None or inst.stopping or self.closed:
            return []
        log.warning("instance_restart_failed", instance=inst.index, error=why)
        return self._next_restart(inst)

    def _next_restart(self, inst: Instance) -> list[Action]:
        delay = inst.next_restart(self.config.restart_backoff_s, self.kind)
        if delay is not None:
            return [RestartInstance(inst.key, delay)]
        log.error("instance_failed", instance=inst.index, why=inst.failed)
        return self._fail_if_no_instance()

    def healthy(self, key: int) -> list[Action]:
        """An unreachable instance answers its health check again."""
        inst = self.instance(key)
        if inst is None:
            return []
        inst.checking = False
        if inst.stopping or inst.failed:
            return []
        inst.up = True
        return self._dispatch()

    def hung(self, key: int) -> list[Action]:
        """It stayed unreachable while its process ran: stop it (its exit restarts it)."""
        inst = self.instance(key)
        if inst is None:
            return []
        inst.checking = False
        if inst.stopping:
            return []
        return [StopInstance(key)]

    def check_over(self, key: int) -> None:
        """The health check ended without a verdict (the instance exited or is stopping)."""
        inst = self.instance(key)
        if inst is not None:
            inst.checking = False

    def set_load(self, key: int, load: InstanceLoad) -> None:
        inst = self.instance(key)
        if inst is not None:
            inst.load = load

    def _fail_if_no_instance(self) -> list[Action]:
        """With no instance up or restarting, nothing can generate the queue: fail it."""
        if any(i.up or not i.failed for i in self.instances):
            return []
        why = "; ".join(i.failed for i in self.instances)
        actions: list[Action] = []
        for req in list(self.requests.values()):
            if req.where in (Where.QUEUED, Where.RUNNING):
                self._unqueue(req)
                actions += self._detach(req)
                req.end(Where.FAILED, error=f"request {req.id!r} cannot run: {why}")
        self._queue.clear()
        self._maybe_idle()
        return actions

    def fail_all(self, why: str) -> list[Action]:
        """The gateway cannot go on (its agent stops, or a task of its shell died): every
        request in flight fails with ``why``; their calls and follows are cancelled."""
        actions: list[Action] = []
        for req in list(self.requests.values()):
            if req.done:
                continue
            actions += self._stop_generating(req)
            req.end(Where.FAILED, error=why)
        self._queue.clear()
        return actions

    # -- reshard ----------------------------------------------------------------------------

    def check_reshard(self, new_layout: Sequence[int]) -> tuple[int, ...]:
        """``new_layout`` validated; refused while closed, resharding or updating weights."""
        layout = validate_layout(new_layout, self.gpus)
        self._refuse_closed()
        self._refuse_while_resharding("reshard")
        self._refuse_while_updating("reshard")
        return layout

    # -- weight updates ---------------------------------------------------------------------

    def begin_update(self, version: str, in_flight: str) -> list[Action]:
        """Load weights ``version``: stop dispatching; the calls of requests that resume
        on the new weights (their own policy, else ``in_flight``) are taken off and wait at
        the queue's front; the others finish on the old weights. The shell waits until no
        call holds a seat, loads the weights, then calls :meth:`end_update`."""
        self.check_update(version, in_flight)
        self.updating = version
        actions: list[Action] = []
        for rid in sorted(self._live, key=lambda r: self.requests[r].seq):
            req = self.requests[rid]
            if (req.update_policy or in_flight) == RESUME:
                actions += self._detach(req)
                self._enqueue(req)
        return actions

    def check_update(self, version: str, in_flight: str) -> None:
        """InvalidArgument / Aborted / Unavailable when an update cannot begin now."""
        self._refuse_closed()
        if not version or len(version) > 128:
            raise errors.field_error("version", version, "a label of 1-128 characters")
        if in_flight not in UPDATE_POLICIES:
            raise errors.field_error("in_flight", in_flight, " or ".join(UPDATE_POLICIES))
        self._refuse_while_resharding("update weights")
        self._refuse_while_updating("update weights")

    def seats_taken(self) -> int:
        """Calls holding a seat on any instance (live or ending)."""
        return sum(len(i.calls) for i in self.instances)

    def seat_holders(self) -> list[str]:
        """Who holds the seats taken, in words (for an update that waited too long)."""
        return [
            f"{c.request!r} on instance {c.instance.index}"
            + ("" if c.live else " (cancelled, not yet ended)")
            for inst in self.instances
            for c in (self._calls[cid] for cid in sorted(inst.calls) if cid in self._calls)
        ]

    def end_update(self, ok: bool) -> list[Action]:
        """The update is over: every instance serves the new version (``ok``) or the old
        one; dispatching goes on."""
        actions: list[Action] = []
        if ok:
            self.weight_version = self.updating
            for inst in self.instances:
                inst.version = self.updating
            actions = self._stop_stale(list(self.requests.values()))
        self.updating = ""
        return actions + self._dispatch()

    def relabel(self, version: str) -> list[Action]:
        """The weights served now are ``version`` (changed outside the gateway): later
        tokens carry it, and the requests it leaves beyond their bound stop."""
        self.weight_version = version
        for inst in self.instances:
            inst.version = version
        return self._stop_stale(list(self.requests.values()))

    def plan_reshard(
        self,
        layout: tuple[int, ...],
        placements: Sequence[Placement],
        make: Callable[[Placement], Instance],
    ) -> ReshardPlan:
        """Which instances stay (same devices and TP degree, up), leave and start."""
        by_block = {(i.placement.devices, i.placement.tp): i for i in self.instances if i.up}
        keep: dict[int, Instance] = {}
        for p in placements:
            inst = by_block.get((p.devices, p.tp))
            if inst is not None:
                keep[p.index] = inst
        kept = {id(i) for i in keep.values()}
        leaving = tuple(i for i in self.instances if id(i) not in kept)
        fresh = {p.index: make(p) for p in placements if p.index not in keep}
        return ReshardPlan(self.layout, layout, tuple(placements), keep, leaving, fresh)

    def begin_reshard(self, plan: ReshardPlan) -> tuple[int, list[Action]]:
        """Stop admitting; take the calls off the leaving instances (their requests wait at
        the front of the queue). Returns how many requests were moved."""
        self.resharding = True
        actions: list[Action] = []
        moved = 0
        for inst in plan.leaving:
            moved += sum(1 for cid in inst.calls if self._calls[cid].live)
            actions += self._take_calls_off(inst)
        self.stopping(plan.leaving)
        return moved, actions

    def end_reshard(self, instances: list[Instance], layout: tuple[int, ...]) -> list[Action]:
        """The instances of ``layout`` serve (the new ones, or the old ones brought back)."""
        self.resharding = False
        return self.adopt(instances, layout)

    def fail_instances(self, instances: Sequence[Instance], why: str) -> list[Action]:
        for inst in instances:
            if not inst.up and not inst.failed:
                inst.failed = why
        return self._fail_if_no_instance()

    # -- client requests ----------------------------------------------------------------------

    def submit(
        self,
        now: float,
        rid: str,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: Sampling,
        group: str = "",
        *,
        logprobs: bool = False,
        update_policy: str = "",
        max_staleness: int | None = None,
    ) -> tuple[Request, list[Action]]:
        """Queue a client's request; InvalidArgument / FailedPrecondition (queue full).
        ``logprobs``: report the sampled tokens' logprobs; ``update_policy``: what it does
        at a weight update (FINISH, RESUME; "": the update's policy); ``max_staleness``:
        it stops (finish reason ``stale``) once the weights served are more versions than
        this newer than its oldest token (None: never)."""
        self._refuse_closed()
        if not prompt:
            raise errors.field_error("prompt", [], "at least one token id")
        if max_tokens < 1:
            raise errors.field_error("max_tokens", max_tokens, "an integer >= 1")
        sampling.check()
        check_group(group)
        if update_policy and update_policy not in UPDATE_POLICIES:
            raise errors.field_error("update_policy", update_policy, " or ".join(UPDATE_POLICIES))
        if max_staleness is not None and (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, int)
            or not 0 <= max_staleness <= MAX_STALENESS
        ):
            raise errors.field_error(
                "max_staleness", max_staleness, f"an integer in 0..{MAX_STALENESS}, or null"
            )
        if rid in self.requests:
            raise errors.field_error("request_id", rid, "an id no request in flight here has")
        queued = len(self._queue)
        if queued >= self.config.max_queue:
            raise QueueFull(
                f"the gateway queue is full ({queued} requests waiting, "
                f"max_queue {self.config.max_queue}); retry later"
            )
        req = self._new(now, rid, tuple(prompt), max_tokens, sampling, group=group)
        req.want_logprobs = logprobs
        req.update_policy = update_policy
        req.max_staleness = max_staleness
        self._enqueue(req)
        return req, self._dispatch()

    def abort(self, request_ids: Sequence[str], why: str) -> tuple[list[str], list[Action]]:
        """Abort requests by id; the ids this gateway does not have (or that ended)."""
        unknown = [i for i in request_ids if (r := self.requests.get(i)) is None or r.done]
        actions: list[Action] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.done:
                continue
            actions += self._stop_generating(req)
            req.end(Where.ABORTED, error=f"request {rid!r} {why}")
            self._forget(req)
            log.info("request_aborted", request=rid, why=why)
        self._maybe_idle()
        return unknown, actions + self._dispatch()

    def read(self, req: Request) -> None:
        """The client has read a finished request: forget it."""
        if req.done:
            self._forget(req)

    # -- calls ------------------------------------------------------------------------------

    def call_tokens(
        self,
        call_id: str,
        tokens: tuple[int, ...],
        finish: FinishReason | None,
        logprobs: tuple[float, ...] = (),
    ) -> bool:
        """A call streamed ``tokens`` (and ``finish`` on its last chunk), with their
        logprobs when asked. False when the call is over for the core (cancelled, its
        request moved on, failed, or it just finished): the shell stops reading it."""
        call = self._calls.get(call_id)
        if call is None or not call.live:
            return False
        req = self.requests[call.request]
        if tokens:
            keep = req.remaining
            try:
                req.append(tokens[:keep], call.instance.version, logprobs[:keep])
            except ValueError as exc:  # the engine cannot give what the client asked for
                self._detach(req)
                log.warning("request_failed", request=req.id, error=str(exc))
                req.end(
                    Where.FAILED,
                    error=f"{self.kind} instance {call.instance.index}: {exc}",
                    refused=True,
                )
                self._maybe_idle()
                return False
            self.figures.tokens_total += len(tokens)
        if finish is None and req.remaining > 0:
            return True
        call.live = False
        self._live.pop(req.id, None)
        self._finish(req, finish or "length")
        return False

    def call_failed(
        self, call_id: str, why: str, *, retry: bool, unreachable: bool, server_alive: bool
    ) -> list[Action]:
        """A call failed (the engine answered with an error, the stream ended early, or
        the instance could not be reached: ``unreachable``)."""
        call = self._calls.get(call_id)
        if call is None or not call.live:
            return []
        inst = call.instance
        req = self.requests[call.request]
        self._detach(req)
        if unreachable:
            # the instance's trouble, not the request's: it waits for a seat, and the
            # instance is checked before it gets more
            self._enqueue(req)
            if inst.up and not inst.stopping and not inst.checking:
                inst.up = False
                inst.checking = True
                log.warning("instance_unreachable", instance=inst.index, error=why)
                return [CheckInstance(inst.key)]
            return []
        if not server_alive or inst.stopping:
            # its exit restarts the instance; the request waits for a seat meanwhile
            inst.up = False
            self._enqueue(req)
            return []
        req.failures += 1
        if req.failures >= MAX_CALL_FAILURES or not retry:
            log.warning("request_failed", request=req.id, error=why)
            req.end(
                Where.FAILED,
                error=(
                    f"request {req.id!r} failed {req.failures} times on {self.kind} "
                    f"instance {inst.index}: {why}"
                    if retry
                    else f"{self.kind} refused request {req.id!r}: {why}"
                ),
                refused=not retry,
            )
            self._maybe_idle()
            return []
        log.warning("call_failed_retrying", request=req.id, error=why, failures=req.failures)
        self._enqueue(req)
        return []

    def call_ended(self, call_id: str) -> list[Action]:
        """The shell's task of the call is over: its seat is free."""
        call = self._calls.pop(call_id, None)
        if call is None:
            return []
        call.instance.calls.discard(call_id)
        if call.live:  # ended without a chunk, a failure or a cancel (cannot happen)
            req = self.requests.get(call.request)
            if req is not None and self._live.get(req.id) == call_id:
                self._detach(req)
                self._enqueue(req)
        return self._dispatch()

    def has_live_call(self, request_id: str) -> bool:
        return request_id in self._live

    def calls_of(self, inst: Instance) -> list[str]:
        return sorted(inst.calls)

    # -- admission ----------------------------------------------------------------------------

    def drain(self) -> None:
        self._refuse_while_resharding("drain")
        self.state = EngineState.DRAINED

    def resume(self) -> list[Action]:
        self._refuse_while_resharding("resume")
        self.state = EngineState.RUNNING
        return self._dispatch()

    def pause(self) -> tuple[list[Instance], list[Action]]:
        """Stop generating: the instances to pause in place (returned), and calls taken
        off the others (their requests wait at the queue's front)."""
        if self.paused:
            return [], []
        self.paused = True
        in_place: list[Instance] = []
        actions: list[Action] = []
        for inst in self.instances:
            if inst.up and inst.can_pause:
                inst.paused = True
                in_place.append(inst)
            else:
                actions += self._take_calls_off(inst)
        return in_place, actions

    def unpause(self) -> tuple[list[Instance], list[Action]]:
        """Generate again: the instances to resume in place, and what to dispatch."""
        resumed = [i for i in self.instances if i.paused]
        for inst in resumed:
            inst.paused = False
        self.paused = False
        return resumed, self._dispatch()

    # -- migration ----------------------------------------------------------------------------

    def hold(
        self, request_ids: Sequence[str]
    ) -> tuple[list[MigratingRequest], list[str], list[Action]]:
        """Take requests off their calls and the queue, keep them HELD, and return their
        state for export, the ids not held (unknown, ended or not here), and the calls to
        cancel."""
        self._refuse_while_resharding("export requests")
        held: list[MigratingRequest] = []
        missing: list[str] = []
        actions: list[Action] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.where not in (Where.QUEUED, Where.RUNNING):
                missing.append(rid)
                continue
            held.append(exported(req, req.instance if req.where is Where.RUNNING else -1))
            actions += self._stop_generating(req)
            req.where = Where.HELD
            req.instance = -1
        self._maybe_idle()
        return held, missing, actions + self._dispatch()

    def restore(self, request_ids: Sequence[str]) -> tuple[list[str], list[Action]]:
        """Held requests the destination did not admit: queued here again."""
        restored: list[str] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.where is not Where.HELD:
                continue
            self._enqueue(req)
            restored.append(req.id)
        return restored, self._dispatch()

    def release(
        self, request_ids: Sequence[str], destination: Destination | None, can_follow: bool
    ) -> tuple[list[str], list[Action]]:
        """The destination admitted the held requests: follow them there. Without a
        destination (or a way to reach peers) they fail with an error that says so."""
        released: list[str] = []
        actions: list[Action] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.where is not Where.HELD:
                continue
            released.append(req.id)
            if destination is None or not can_follow:
                req.end(
                    Where.FAILED,
                    error=f"request {req.id!r} was migrated off {self.node!r} but the "
                    "controller named no destination to follow it at",
                )
                continue
            req.where = Where.REMOTE
            req.remote = destination.node
            req.hop(destination.node)
            self._followers.start_following(req.id)
            actions.append(StartFollow(req.id, destination, len(req.output)))
        return released, actions

    def admit(
        self,
        now: float,
        requests: Sequence[MigratingRequest],
        instance: int,
        recompute: bool,
    ) -> tuple[ImportResult, list[Action]]:
        """Admit migrating requests on ``instance`` (all or none): resubmitted with their
        output so far; those beyond its free seats wait for this node's next one."""
        self._refuse_closed()
        self._refuse_while_resharding("import requests")
        if self.state is not EngineState.RUNNING or self.paused:
            raise errors.FailedPrecondition(
                f"cannot import requests: the engine is {self.engine_state.value}, not admitting"
            )
        if not 0 <= instance < len(self.instances):
            raise errors.field_error(
                "instance", instance, f"an index into the layout {list(self.layout)}"
            )
        inst = self.instances[instance]
        states = check_imports(requests, self.requests)
        admitted: list[Request] = []
        actions: list[Action] = []
        for m, parsed in states:
            req = self.requests.get(m.request_id)
            if req is not None:  # coming home, or moving between this node's instances
                actions += self._stop_generating(req)
                req.remote = ""
            else:
                req = self._new(
                    now,
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
            req.want_logprobs = parsed.logprobs is not None
            req.logprobs[:] = parsed.logprobs or ()
            req.update_policy = parsed.update_policy
            req.max_staleness = parsed.max_staleness
            here = parsed.hops[-1:] == (self.node,)
            req.hops[:] = parsed.hops
            req.hop_starts[:] = parsed.hop_starts or [0] * len(parsed.hops)
            if not here:
                req.hop(self.node)
            if not req.origin and not self._followers.followed(req.id):
                self._followers.orphaned(req.id, now)  # until its source follows it
            admitted.append(req)
        actions += self._stop_stale(admitted, admitted=True)  # made on weights too old here
        live = [r for r in admitted if not r.done]  # a stopped one answers its follower
        seated = live[: inst.seats] if not self.updating else []
        for req in live:
            self.figures.arrive()
            if req in seated:
                actions.append(self._run_on(req, inst))
            else:  # the instance is full (or restarting): next free seat of this node
                self._enqueue(req)
        result = import_result(
            [r.id for r in admitted],
            sum(len(r.prompt) + len(r.output) for r in admitted),
            len(seated),
            instance,
            f"TP{inst.placement.tp}, {self.kind}",
            "" if recompute else f"{self.kind} cannot receive a KV cache",
        )
        return result, actions + self._dispatch()

    # -- following a request released to another node --------------------------------------

    def follow_tokens(
        self,
        request_id: str,
        tokens: tuple[int, ...],
        version: str,
        finish: FinishReason | None,
        logprobs: tuple[float, ...] = (),
    ) -> bool:
        """Tokens of a request followed on another node; False once it is no longer
        followed (the shell stops reading)."""
        req = self.requests.get(request_id)
        if req is None or req.where is not Where.REMOTE:
            return False
        self._followers.progressed(request_id)
        req.append(tokens, version, logprobs)
        if finish is None:
            return True
        self._followers.stop_following(request_id)
        req.end(Where.FINISHED, finish)
        return False

    def follow_lost(
        self, request_id: str, destination: Destination, why: str, *, final: bool
    ) -> list[Action]:
        """Following failed: try again with backoff, or (``final``: the destination lost
        it or failed it; or too many tries) go on here with what we have."""
        req = self.requests.get(request_id)
        if req is None or req.where is not Where.REMOTE:
            self._followers.stop_following(request_id)
            return []
        tries = self._followers.retry(request_id, final)
        if tries is not None:
            return [StartFollow(req.id, destination, len(req.output), min(2.0, 0.2 * 2**tries))]
        log.warning(
            "follow_lost_resuming_here", request=req.id, destination=destination.node, why=why
        )
        req.remote = ""
        req.hop(self.node)
        self._enqueue(req)
        return self._dispatch()

    # -- serving a request that another node follows here ------------------------------------

    def follower_attached(self, request_id: str) -> None:
        self._followers.attached(request_id)

    def follower_detached(self, request_id: str, now: float) -> None:
        if not self._followers.detached(request_id):
            return
        req = self.requests.get(request_id)
        if req is None or req.origin:
            return
        if req.done:
            self._forget(req)
        else:
            self._followers.orphaned(request_id, now)

    def reap(self, now: float) -> list[Action]:
        """Imported requests whose follower went away (it gave up, or the client aborted
        on the source) are aborted after a grace period, finished ones forgotten. A copy
        the request moved on from (released to another node: it migrated on, or back to
        where it came from) is dropped the same way: the request goes on there."""
        actions: list[Action] = []
        grace = self.config.orphan_grace_s
        for req in self._followers.due(now, self.requests):
            if req.done:
                self._forget(req)
            elif req.where is Where.REMOTE:
                actions += self._drop_copy(req, grace)
            elif req.where is not Where.HELD:
                why = (
                    f"is no longer followed from {req.source_node} (for {grace:g} s): its "
                    "client went away there, or its source resumed it itself"
                )
                actions += self.abort([req.id], why)[1]
        return actions

    def _drop_copy(self, req: Request, grace: float) -> list[Action]:
        """Forget this node's copy of a request that moved on to ``req.remote`` and that
        no node follows here any more (nothing is lost: it is generated there)."""
        moved_to = req.remote
        actions = self._stop_generating(req)  # its follow of the node it moved on to
        req.end(
            Where.ABORTED,
            error=f"request {req.id!r} moved on from {self.node!r} to {moved_to!r}; "
            "this node's copy was dropped",
        )
        self._forget(req)
        log.info(
            "request_copy_dropped",
            request=req.id,
            moved_to=moved_to,
            source=req.source_node,
            why=f"the request moved on to {moved_to} and {req.source_node} has not followed "
            f"it here for {grace:g} s; it goes on at {moved_to}, nothing is lost",
        )
        self._maybe_idle()
        return actions

    # -- figures ---------------------------------------------------------------------------------

    @property
    def engine_state(self) -> EngineState:
        return EngineState.RESHARDING if self.resharding else self.state

    def instance_health(self) -> tuple[str, ...]:
        """ "up", "restarting" or "failed: why" per instance."""
        if self.crashed:
            return tuple(f"failed: {self.crashed}" for _ in self.instances)
        return tuple(i.health for i in self.instances)

    def stats(self, now: float) -> EngineStats:
        queued = running = 0
        for req in self.requests.values():
            if req.where is Where.QUEUED:
                queued += 1
            elif req.where is Where.RUNNING:
                running += 1
        return EngineStats(
            queued_requests=queued,
            running_requests=running,
            tokens_per_s=self.figures.rate(now),
            kv_cache_usage=kv_usage(
                (i.placement.tp, i.load, len(i.calls), i.max_num_seqs) for i in self.instances
            ),
            step=self.figures.step,
        )

    def progress(self) -> EngineProgress:
        rows = [
            RequestProgress(r.id, r.instance, len(r.prompt), len(r.output), r.max_tokens, r.group)
            for r in self.requests.values()
            if r.where is Where.RUNNING or r.where is Where.QUEUED
        ]
        f = self.figures
        return EngineProgress(f.step, tuple(rows), tuple(f.completed), f.groups())

    # -- internals ---------------------------------------------------------------------------------

    def _dispatch(self) -> list[Action]:
        """Seat queued requests, oldest first, on the instances with most free seats."""
        if self.resharding or self.paused or self.state is not EngineState.RUNNING:
            return []
        if self.closed or self.crashed or self.updating:
            return []
        actions: list[Action] = []
        while self._queue:
            inst = max(self.instances, key=lambda i: i.seats, default=None)
            if inst is None or inst.seats <= 0:
                break
            _, rid = self._queue.pop(0)
            req = self.requests.get(rid)
            if req is None or req.where is not Where.QUEUED:
                continue
            if req.remaining <= 0:  # nothing owed (an import at its cap)
                self._finish(req, "length")
                continue
            actions.append(self._run_on(req, inst))
        return actions

    def _run_on(self, req: Request, inst: Instance) -> StartCall:
        cid = req.next_call_id()
        self._calls[cid] = _Call(cid, req.id, inst)
        self._live[req.id] = cid
        inst.calls.add(cid)
        req.where = Where.RUNNING
        req.instance = inst.index
        sub = Submission(
            cid, req.prompt + tuple(req.output), req.remaining, req.sampling, req.want_logprobs
        )
        return StartCall(cid, req.id, inst.key, sub)

    def _detach(self, req: Request) -> list[Action]:
        """End ``req``'s live call for the core (its seat stays taken until it ended)."""
        cid = self._live.pop(req.id, None)
        if cid is None:
            return []
        call = self._calls.get(cid)
        if call is not None:
            call.live = False
        return [CancelCall(cid)]

    def _take_calls_off(self, inst: Instance) -> list[Action]:
        """Cancel every call on ``inst``; their requests wait at the queue's front."""
        actions: list[Action] = []
        for cid in sorted(inst.calls):
            call = self._calls[cid]
            if not call.live:
                continue
            req = self.requests.get(call.request)
            if req is None:
                continue
            actions += self._detach(req)
            self._enqueue(req)
        return actions

    def _stop_generating(self, req: Request) -> list[Action]:
        """Whatever generates ``req`` stops: its queue place, its call, its follow."""
        self._unqueue(req)
        actions = self._detach(req)
        if req.where is Where.REMOTE or self._followers.following(req.id):
            self._followers.stop_following(req.id)
            actions.append(CancelFollow(req.id))
        return actions

    def _stop_stale(self, requests: Sequence[Request], *, admitted: bool = False) -> list[Action]:
        """Stop those of ``requests`` still to be generated here (queued, running or held;
        ``admitted``: any not ended) whose oldest token is more than their
        ``max_staleness`` versions older than the weights served: they end with finish
        reason ``stale`` and their output so far."""
        actions: list[Action] = []
        version = self.weight_version
        here = (Where.QUEUED, Where.RUNNING, Where.HELD)
        for req in sorted(requests, key=lambda r: r.seq):
            if req.max_staleness is None or req.done or (req.where not in here and not admitted):
                continue
            lag = staleness(req.versions, len(req.output), version)
            if lag is None or lag <= req.max_staleness:
                continue
            was = req.where
            actions += self._stop_generating(req)
            req.end(Where.FINISHED, STALE)
            self.stale_stopped += 1
            if not req.origin and not self._followers.followed(req.id):
                self._followers.orphaned(req.id, None)  # timed from the next reap
            log.info(
                "request_stale_stopped",
                request=req.id,
                was=was.value,
                version=version,
                lag=lag,
                max_staleness=req.max_staleness,
                tokens=len(req.output),
            )
        self._maybe_idle()
        return actions

    def _finish(self, req: Request, finish: FinishReason) -> None:
        req.end(Where.FINISHED, finish)
        self.figures.complete(len(req.output), req.group)
        self._maybe_idle()
        if not req.origin and not self._followers.followed(req.id):
            self._followers.orphaned(req.id, None)  # timed from the next reap

    def _new(
        self,
        now: float,
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
            now,
            origin=origin,
            source_node=source_node,
            group=group,
            hops=[self.node],
            hop_starts=[0],
        )
        self.requests[rid] = req
        return req

    def _enqueue(self, req: Request) -> None:
        """Queue in arrival order (a request coming back goes before younger ones)."""
        self.figures.arrive()
        req.where = Where.QUEUED
        req.instance = -1
        i = bisect.bisect_left(self._queue, (req.seq, req.id))
        if i == len(self._queue) or self._queue[i] != (req.seq, req.id):
            self._queue.insert(i, (req.seq, req.id))

    def _unqueue(self, req: Request) -> None:
        i = bisect.bisect_left(self._queue, (req.seq, req.id))
        if i < len(self._queue) and self._queue[i] == (req.seq, req.id):
            del self._queue[i]

    def _forget(self, req: Request) -> None:
        if self.requests.get(req.id) is req and req.done:
            del self.requests[req.id]
            self._followers.forget(req.id)

    def _maybe_idle(self) -> None:
        if not any(r.where in (Where.QUEUED, Where.RUNNING) for r in self.requests.values()):
            self.figures.idle = True

    def _refuse_while_resharding(self, what: str) -> None:
        if self.resharding:
            raise errors.Aborted(
                f"cannot {what}: a reshard from {list(self.layout)} is in progress; "
                "retry when it finishes"
            )

    def _refuse_while_updating(self, what: str) -> None:
        if self.updating:
            raise errors.Aborted(
                f"cannot {what}: weights {self.updating!r} are being loaded; "
                "retry when the update finishes"
            )

    def _refuse_closed(self) -> None:
        if self.closed:
            raise errors.Unavailable("the node agent is stopping")
        if self.crashed:
            raise errors.Unavailable(f"the gateway failed: {self.crashed}")

    def queued_ids(self) -> list[str]:
        """The queue, in dispatch order (tests, invariants)."""
        return [rid for _, rid in self._queue]

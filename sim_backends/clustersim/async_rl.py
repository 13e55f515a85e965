"""Asynchronous RL in the simulator: the trainer and the rollout engines run at once.

``rollout.mode = "async"`` (:mod:`scheduler.async_rollout` holds the rules). One event
loop runs both sides across weight versions:

- **Engines** are :class:`.generation.GenerationSim` instances that never stop between
  steps; each carries a weight version, and every token a request generates on it is
  tagged with that version (a request's tokens are attributed when it leaves an engine:
  it finishes, is aborted, preempted or moved). Requests reach the engines from one
  pending line, each to the engine with the most free seats, an engine holding at most
  its seats' worth (verl's rollouter keeps 16 prompts of 16 samples per server in
  flight: 256 sequences, vLLM's ``max_num_seqs``).
- **Admission**: a group (``samples_per_prompt`` requests) starts only while
  :func:`scheduler.async_rollout.admission_limit` allows (AReaL's bound, or verl's
  fractional ``staleness_threshold``).
- **The trainer** trains version ``v`` in ``local_updates`` updates, each on the next
  ``N / local_updates`` complete groups in completion order (``take_batch``; over-stale
  groups dropped when ``max_lag`` is set), timed on the fabric by
  :class:`.pipeline.StepTimer`; it waits while too few groups are complete.
- **Weights**, at the end of version ``v``: ``global`` (verl): every engine pauses for
  the sync (the fabric's weight-sync schedule), its running requests aborted and resumed
  after it with their KV cache recomputed, and the trainer waits for the sync too.
  ``relay`` (Laminar): the trainer pushes the weights once to one relay per rollout pod
  (the first rollout node of the pod, over the fabric: a lease of ``lease_s`` on
  RFabric), which streams them down a chain of the pod's nodes (host memory, pipelined
  in 256 MiB chunks); the trainer waits only for its push. Each engine then loads the
  version from its node's relay copy (host-to-device, ``Hardware.h2d_bandwidth``) as
  :func:`~scheduler.async_rollout.update_action` says: at once when idle, after
  aborting its requests (``pull = abort``), or once its batch drains (``pull = drain``,
  admitting nothing meanwhile; its queued requests go back to the pending line).
- **Repack** (``repack``): at each relay arrival and every ``repack_interval_s``, the
  draining engines' tails are consolidated by :func:`scheduler.repack.plan_repack`
  (KV moved at :meth:`~scheduler.perf_model.PerfModel.kv_move_time` or recomputed,
  whichever is cheaper, the target stalled that long); the emptied engines load the new
  version and take fresh prompts. With ``reshard`` the targets are whole nodes resharded
  to one engine of the node's width (:meth:`~scheduler.perf_model.PerfModel.reshard_time`)
  that keeps the old version until it drains, then returns to the base layout.
- **The split** (``plan_split``): every ``plan_every`` versions
  :func:`scheduler.async_plan.plan_async_split` may move whole nodes between the pools:
  a node leaving the rollout pool aborts its requests (back to the pending line), the
  trainer pauses for :func:`scheduler.step_plan.split_switch_s` plus, on an optical
  fabric, the re-pointing of the node's aggregation-layer circuits (OCS switching and
  the ToR side's settling; host-facing ports never move), and the fabric's standing
  circuits are re-planned for the new pools.

A version's step is the trainer's own time, ``wait + training + its blocking sync``
(:func:`scheduler.rollout.step_seconds`), plus any split move before it; verl logs
``timing_s/step`` without the sync (its ``param_sync`` is logged apart): both are
reported. Results are a pure function of the scenario and seed.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrrl import errors
from scheduler.async_plan import PeriodMeasure, plan_async_split
from scheduler.async_rollout import (
    Action,
    AsyncPolicy,
    BatchTake,
    CompleteGroup,
    WeightUpdate,
    admission_limit,
    leased_transfer_s,
    take_batch,
    update_action,
)
from scheduler.compute_state import Instance, canonical_instances
from scheduler.forecast import LengthForecast, build_forecast
from scheduler.gate import DEFAULT_SETTLING_MARGIN_S
from scheduler.perf_model import PerfModel
from scheduler.repack import RepackPlan, TailEngine, plan_repack, reshard_pays
from scheduler.rollout import RolloutMode, RolloutRule, StepPhases, step_seconds
from scheduler.step_plan import split_switch_s
from sim_backends.clustersim.fabrics import Fabric, FabricKind, Transfer
from sim_backends.clustersim.generation import GenerationSim, _Inst, _Req, uniform_pattern
from sim_backends.clustersim.pipeline import (
    SIM_PLANNER,
    StepTimer,
    cluster_spec,
    make_fabric,
    perf_model,
    pools,
    train_shape,
    with_split,
)
from sim_backends.clustersim.scenario import Scenario
from sim_backends.clustersim.workload import group_draws, group_requests

RELAY_CHUNK_BYTES = 256 * 2**20  # the relay chain's pipelining unit (scheduler.weight_sync's)


@dataclass(frozen=True)
class VersionRecord:
    """One weight version: the trainer's timeline and what it trained."""

    version: int  # the weights trained on (the update makes version + 1)
    start_s: float
    end_s: float
    wait_s: float  # waiting for complete groups
    train_s: float  # its local updates
    sync_s: float  # blocked on the weight sync (global) or its push (relay)
    switch_s: float  # a split move before it
    step_s: float
    train_gpus: int
    gen_gpus: int
    groups: int
    responses: int
    tokens: int  # prompt and response tokens trained
    response_tokens: int
    dropped_groups: int
    dropped_responses: int
    lags: tuple[int, ...]  # per trained group
    tokens_by_lag: tuple[tuple[int, int], ...]  # response tokens by version lag

    @property
    def logged_step_s(self) -> float:
        """The step as verl's ``timing_s/step`` counts it: waiting and updating, not the
        parameter sync (logged apart) nor a split move."""
        return self.wait_s + self.train_s


@dataclass(frozen=True)
class AsyncRun:
    """A run end to end; means over the versions after ``warmup``."""

    name: str
    label: str
    rule: RolloutRule
    policy: AsyncPolicy
    static_tp: int
    versions: tuple[VersionRecord, ...]
    warmup: int
    propagation_s: tuple[float, ...]  # per pushed version: trainer end -> last engine on it
    stalls_s: tuple[float, ...]  # per engine update: its weight-load pause
    split_timeline: tuple[tuple[float, int, int], ...]  # (time, train GPUs, gen GPUs)
    plans: tuple[str, ...]
    repacks: int = 0
    repack_moves: int = 0
    reshards: int = 0
    aborted: int = 0
    trainer_idle: float = 0.0
    rollout_idle: float = 0.0
    extra: Mapping[str, object] = field(default_factory=dict)

    @property
    def steady(self) -> tuple[VersionRecord, ...]:
        return self.versions[min(self.warmup, len(self.versions) - 1) :]

    def _time(self) -> float:
        return sum(v.step_s for v in self.steady)

    @property
    def mean_step_s(self) -> float:
        return self._time() / len(self.steady)

    @property
    def mean_logged_step_s(self) -> float:
        return sum(v.logged_step_s for v in self.steady) / len(self.steady)

    @property
    def samples_per_s(self) -> float:
        return sum(v.responses for v in self.steady) / self._time()

    @property
    def tokens_per_s(self) -> float:
        return sum(v.response_tokens for v in self.steady) / self._time()

    def lag_quantile(self, q: float) -> float:
        """The ``q`` quantile of the trained trajectories' version lag (steady versions)."""
        lags = sorted(x for v in self.steady for x in v.lags)
        if not lags:
            return 0.0
        return float(lags[min(len(lags) - 1, max(0, math.ceil(q * len(lags)) - 1))])

    @property
    def offpolicy_token_share(self) -> float:
        total = sum(t for v in self.steady for _, t in v.tokens_by_lag)
        old = sum(t for v in self.steady for lag, t in v.tokens_by_lag if lag > 0)
        return old / total if total else 0.0

    @property
    def dropped_share(self) -> float:
        dropped = sum(v.dropped_responses for v in self.steady)
        return dropped / (dropped + sum(v.responses for v in self.steady) or 1)

    def summary(self) -> dict[str, Any]:
        st = self.steady
        n = len(st)
        props = sorted(self.propagation_s)
        return {
            "label": self.label,
            "mode": self.rule.mode.value,
            "admission_bound": self.rule.admission_bound,
            "weight_update": self.policy.weight_update.value,
            "pull": self.policy.pull.value,
            "repack": self.policy.repack,
            "reshard": self.policy.reshard,
            "plan_split": self.policy.plan_split,
            "lease_s": self.policy.lease_s,
            "static_tp": self.static_tp,
            "versions": len(self.versions),
            "warmup": self.warmup,
            "mean_step_s": self.mean_step_s,
            "mean_logged_step_s": self.mean_logged_step_s,
            "mean_wait_s": sum(v.wait_s for v in st) / n,
            "mean_train_s": sum(v.train_s for v in st) / n,
            "mean_sync_s": sum(v.sync_s for v in st) / n,
            "switch_s": sum(v.switch_s for v in self.versions),
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "lag_p50": self.lag_quantile(0.5),
            "lag_p99": self.lag_quantile(0.99),
            "lag_max": self.lag_quantile(1.0),
            "offpolicy_token_share": self.offpolicy_token_share,
            "dropped_share": self.dropped_share,
            "trainer_idle": self.trainer_idle,
            "rollout_idle": self.rollout_idle,
            "propagation_s": {
                "mean": sum(props) / len(props) if props else 0.0,
                "max": props[-1] if props else 0.0,
            },
            "stall_s": {
                "mean": sum(self.stalls_s) / len(self.stalls_s) if self.stalls_s else 0.0,
                "max": max(self.stalls_s, default=0.0),
            },
            "repacks": self.repacks,
            "repack_moves": self.repack_moves,
            "reshards": self.reshards,
            "aborted": self.aborted,
            "splits": [f"{v.gen_gpus}/{v.train_gpus}" for v in self.versions],
            "split_timeline": [list(x) for x in self.split_timeline],
            "lags": [list(v.lags) for v in self.versions],
            "plans": list(self.plans),
            "steps": [
                {
                    "version": v.version,
                    "start_s": v.start_s,
                    "step_s": v.step_s,
                    "wait_s": v.wait_s,
                    "train_s": v.train_s,
                    "sync_s": v.sync_s,
                    "switch_s": v.switch_s,
                    "responses": v.responses,
                    "dropped_responses": v.dropped_responses,
                }
                for v in self.versions
            ],
            **self.extra,
        }


@dataclass
class _Group:
    name: str
    size: int
    prompt_tokens: int
    rids: tuple[str, ...]
    done: int = 0


@dataclass
class _Acc:
    """Accumulators of the version in training."""

    start: float
    wait: float = 0.0
    train: float = 0.0
    switch: float = 0.0
    groups: int = 0
    responses: int = 0
    tokens: int = 0
    response_tokens: int = 0
    dropped_groups: int = 0
    dropped_responses: int = 0
    lags: list[int] = field(default_factory=list)
    by_lag: dict[int, int] = field(default_factory=dict)


def node_name(index: int) -> str:
    """A cluster node by its fabric index (stable when it changes pool)."""
    return f"n{index:04d}"


class AsyncSim(GenerationSim):
    """One asynchronous run (mutable state private to :func:`run_async`)."""

    def __init__(
        self, s: Scenario, perf: PerfModel, rule: RolloutRule, policy: AsyncPolicy, tp: int
    ) -> None:
        # attributes the base constructor's _add_instance needs
        self.now = 0.0  # the time of the event being handled
        self.last_version: dict[str, int] = {}
        self.ver: dict[str, int] = {}
        self.idle_since: dict[str, float] = {}
        self.idle_gpu_s = 0.0
        self.base = s
        self.s = s
        self.rule = rule
        self.pol = policy
        self.tp = tp
        g = s.cluster.gpus_per_node
        self.g = g
        _, gen = pools(s)
        layout = {node_name(i): uniform_pattern(g, tp) for i in gen}
        config = replace(SIM_PLANNER, max_num_seqs=s.generation.max_num_seqs)
        super().__init__(perf, g, layout, "static", 5.0, config, s.workload.max_response_tokens, ())
        self.recorded: dict[str, int] = {}
        self.pieces: dict[str, list[tuple[int, int]]] = {}
        self.new_done: list[str] = []
        self.group_of: dict[str, str] = {}
        self.groups: dict[str, _Group] = {}
        self.pending: deque[_Req] = deque()
        self.draining: set[str] = set()
        self.pinned: set[str] = set()  # resharded tail holders (back to base when drained)
        self.relay_ver: dict[str, int] = dict.fromkeys(self.nodes, 0)
        self.queue: list[CompleteGroup] = []
        self.dq: list[tuple[float, int, str, Any]] = []
        self.dseq = 0
        self.started = 0
        self.consumed = 0
        self.tv = 0  # the trainer's weights
        self.local = 0
        self.trainer_busy = True  # until the first try
        self.t_free = 0.0
        self.wait_since: float | None = None
        self.acc = _Acc(0.0)
        self.records: list[VersionRecord] = []
        self.propagation: list[float] = []
        self.unpropagated: dict[int, float] = {}  # version -> its trainer end
        self.stalls: list[float] = []
        self.split_plans: list[str] = []
        self.timeline: list[tuple[float, int, int]] = [(0.0, s.split.train_gpus, s.split.gen_gpus)]
        self.repacks = 0
        self.repack_moves = 0
        self.aborted = 0
        self.idle_at_end: list[float] = []
        self.done = False
        self.n = s.workload.samples_per_prompt
        self.batch = s.workload.prompts_per_step
        self.weight_bytes = train_shape(s, perf).weight_bytes
        self.fabrics: dict[tuple[int, int], Fabric] = {}
        self.timer = StepTimer(s, perf, self._fabric(s), RolloutMode.ASYNC)
        self.last_compute_s = 0.0
        self.forecast: LengthForecast | None = None
        self.forecast_at = -1
        self.period = self._period_start(0.0)

    # -- bookkeeping of instances and tokens --

    def _add_instance(self, inst: Instance, now: float) -> _Inst:
        s = super()._add_instance(inst, now)
        s.version = self.last_version.get(inst.id, -1) + 1  # stale events never match
        self.ver[inst.id] = self.ver.get(inst.id, 0)
        self.idle_since[inst.id] = now
        return s

    def _retire(self, s: _Inst, now: float) -> None:
        self._close_idle(s, now)
        self.idle_since.pop(s.id, None)
        self.last_version[s.id] = s.version + 1
        super()._retire(s, now)

    def _stop(self, s: _Inst, r: _Req) -> None:
        super()._stop(s, r)
        got = r.generated - self.recorded.get(r.id, 0)
        if got > 0:
            self.pieces.setdefault(r.id, []).append((self.ver[s.id], got))
            self.recorded[r.id] = r.generated

    def _finish_segment(self, s: _Inst, now: float) -> None:
        n = len(self.finished)
        super()._finish_segment(s, now)
        if len(self.finished) > n:
            self.new_done += self.finished[n:]

    def _schedule(self, s: _Inst) -> None:
        super()._schedule(s)
        working = s.running or s.queue or s.busy_until > max(s.clock, self.now)
        if working:
            self._close_idle(s, self.now)
        elif s.id not in self.idle_since:
            self.idle_since[s.id] = max(s.clock, self.now)

    def _close_idle(self, s: _Inst, now: float) -> None:
        since = self.idle_since.pop(s.id, None)
        if since is not None and now > since:
            self.idle_gpu_s += (now - since) * s.tp

    def _idle_total(self, now: float) -> float:
        return self.idle_gpu_s + sum(
            max(0.0, now - t) * self.insts[i].tp
            for i, t in self.idle_since.items()
            if i in self.insts
        )

    def _wake(self, s: _Inst, now: float) -> None:
        """Bring ``s`` to ``now`` and let it admit (a segment in flight ends at its last
        whole iteration)."""
        if s.seg is not None:
            self._sync(s, now)
        elif s.busy_until <= now:
            s.clock = max(s.clock, now)
        self._schedule(s)

    def _fabric(self, s: Scenario) -> Fabric:
        key = (s.split.train_gpus, s.split.gen_gpus)
        if key not in self.fabrics:
            self.fabrics[key] = make_fabric(s, self.perf)
        return self.fabrics[key]

    def _push(self, t: float, kind: str, data: Any = None) -> None:
        self.dseq += 1
        heapq.heappush(self.dq, (t, self.dseq, kind, data))

    # -- admission and dispatch --

    def _admit_groups(self, now: float) -> None:
        limit = admission_limit(self.rule.admission_bound, self.consumed, self.batch)
        cfg = self.s.workload
        while self.started < limit:
            idx = self.started
            chunk, index = divmod(idx, self.batch)
            draw = group_draws(cfg, self.s.seed, chunk)[index]
            name = f"g{idx}"
            reqs = group_requests(cfg, draw, self.tv, group=name)
            grp = _Group(name, len(reqs), draw.prompt_tokens, tuple(r.id for r in reqs))
            self.groups[name] = grp
            for rr in reqs:
                r = _Req(rr)
                self.reqs[r.id] = r
                self.lengths[r.id] = r.length
                self.group_of[r.id] = name
                self.pending.append(r)
                self.unfinished += 1
            self.started += 1
        self._dispatch(now)

    def _accepting(self, s: _Inst) -> bool:
        """Fresh work goes only to engines on the newest version (a version the trainer
        has produced is on its way: fresh prompts wait the push and the load for it)."""
        return s.id not in self.draining and self.ver[s.id] >= self.tv

    def _dispatch(self, now: float, only: _Inst | None = None) -> None:
        """Pending requests to the engines with the most free seats (``only``: that
        engine, from its own event), each engine taking at most an even share of the
        pending line over the engines that take fresh work now or once their load ends
        (so the first engines on a new version do not take it all)."""
        if not self.pending:
            return
        eligible = sum(1 for x in self.insts.values() if x.id not in self.draining)
        share = -(-len(self.pending) // max(1, eligible))
        cands = [only] if only is not None else list(self.insts.values())
        heap: list[tuple[float, str]] = []
        room: dict[str, int] = {}
        for s in cands:
            if not self._accepting(s):
                continue
            free = self._seq_cap(s.tp) - len(s.running) - len(s.queue)
            room[s.id] = min(free, share)
            if room[s.id] > 0:
                heap.append((-free / self._seq_cap(s.tp), s.id))
        heapq.heapify(heap)
        touched: set[str] = set()
        while self.pending and heap:
            _, iid = heapq.heappop(heap)
            s = self.insts[iid]
            r = self.pending.popleft()
            r.inst = s
            s.queue.append(r)
            touched.add(iid)
            room[iid] -= 1
            if room[iid] > 0:
                free = self._seq_cap(s.tp) - len(s.running) - len(s.queue)
                heapq.heappush(heap, (-free / self._seq_cap(s.tp), iid))
        if only is None:
            for iid in sorted(touched):
                self._wake(self.insts[iid], now)

    # -- completions and the trainer --

    def _on_done(self, now: float) -> None:
        done, self.new_done = self.new_done, []
        for rid in done:
            grp = self.groups[self.group_of[rid]]
            grp.done += 1
            if grp.done == grp.size:
                first = min(v for r in grp.rids for v, t in self.pieces.get(r, ()) if t > 0)
                tokens = sum(grp.prompt_tokens + self.reqs[r].length for r in grp.rids)
                self.queue.append(CompleteGroup(grp.name, first, tokens, grp.size))
        self._trainer_try(now)

    def _sub_batch(self) -> int:
        per = self.batch // self.pol.local_updates
        if self.local == self.pol.local_updates - 1:
            return self.batch - per * (self.pol.local_updates - 1)
        return per

    def _trainer_try(self, now: float) -> None:
        if self.done or (self.trainer_busy and now < self.t_free):
            return
        self.trainer_busy = False
        take = take_batch(self.queue, self.tv, self._sub_batch(), self.pol.lag_limit)
        if take is None:
            if self.wait_since is None:
                self.wait_since = max(now, self.t_free)
            return
        if self.wait_since is not None:
            self.acc.wait += max(0.0, now - self.wait_since)
            self.wait_since = None
        self.queue = list(take.rest)
        timing = self.timer.train(take.tokens)
        self.last_compute_s = timing.compute_s / max(1, self.s.training.mini_batches)
        self.trainer_busy = True
        self.t_free = now + timing.train_s
        self._push(self.t_free, "trained", (take, timing.train_s))

    def _on_trained(self, now: float, take: BatchTake, train_s: float) -> None:
        a = self.acc
        a.train += train_s
        a.groups += len(take.trained)
        a.dropped_groups += len(take.dropped)
        a.dropped_responses += sum(g.responses for g in take.dropped)
        for g, lag in zip(take.trained, take.lags, strict=True):
            grp = self.groups[g.name]
            a.responses += g.responses
            a.tokens += g.tokens
            a.lags.append(lag)
            for rid in grp.rids:
                for v, t in self.pieces.get(rid, ()):
                    a.response_tokens += t
                    a.by_lag[self.tv - v] = a.by_lag.get(self.tv - v, 0) + t
        for g in (*take.trained, *take.dropped):
            self._forget(g.name)
        self.local += 1
        if self.local < self.pol.local_updates:
            self.trainer_busy = False
            self._trainer_try(now)
            return
        self._end_version(now)

    def _forget(self, name: str) -> None:
        grp = self.groups.pop(name)
        for rid in grp.rids:
            self.pieces.pop(rid, None)
            self.recorded.pop(rid, None)
            self.group_of.pop(rid, None)
            self.reqs.pop(rid, None)
            self.lengths.pop(rid, None)

    def _end_version(self, now: float) -> None:
        self.local = 0
        self.tv += 1
        self.consumed += self.batch
        if self.pol.weight_update is WeightUpdate.GLOBAL:
            sync = self._global_sync(now)
        else:
            sync = self._relay_push(now)
        a = self.acc
        phases = StepPhases(0.0, a.train, sync, wait_s=a.wait)
        step = step_seconds(RolloutMode.ASYNC, phases) + a.switch
        self.records.append(
            VersionRecord(
                version=self.tv - 1,
                start_s=a.start,
                end_s=now + sync,
                wait_s=a.wait,
                train_s=a.train,
                sync_s=sync,
                switch_s=a.switch,
                step_s=step,
                train_gpus=self.s.split.train_gpus,
                gen_gpus=self.s.split.gen_gpus,
                groups=a.groups,
                responses=a.responses,
                tokens=a.tokens,
                response_tokens=a.response_tokens,
                dropped_groups=a.dropped_groups,
                dropped_responses=a.dropped_responses,
                lags=tuple(a.lags),
                tokens_by_lag=tuple(sorted(a.by_lag.items())),
            )
        )
        self.t_free = now + sync
        self.trainer_busy = True
        self.acc = _Acc(now + sync)
        self.idle_at_end.append(self._idle_total(now + sync))
        if len(self.records) >= self.s.asynchronous.versions:
            self.done = True
            return
        if self.pol.plan_split and self.tv % self.pol.plan_every == 0:
            self._plan_split(now + sync)
        self._admit_groups(now)
        self._push(self.t_free, "free")

    # -- weights --

    def _global_sync(self, now: float) -> float:
        """verl: every engine paused for one sync; running requests aborted, resumed after
        it with their KV cache recomputed."""
        res = self.timer.fabric.run_phase(
            "weight-sync", self.timer.sync_transfers, idle_window_s=self.last_compute_s
        )
        sync = res.seconds
        end = now + sync
        for s in list(self.insts.values()):
            self._abort(s, now)
            self.ver[s.id] = self.tv
            s.busy_until = max(s.busy_until, s.clock, now) + sync
            self.stalls.append(sync)
            self._schedule(s)
        for n in self.relay_ver:
            self.relay_ver[n] = self.tv
        self.propagation.append(sync)
        self._push(end, "dispatch")
        return sync

    def _relay_targets(self) -> list[tuple[int, list[int]]]:
        """(head, the pod's other rollout nodes in chain order) per rollout pod."""
        c = cluster_spec(self.s)
        by_pod: dict[int, list[int]] = {}
        for n in sorted(int(x[1:]) for x in self.nodes):
            by_pod.setdefault(c.pod_of(n), []).append(n)
        return [(nodes[0], nodes[1:]) for _, nodes in sorted(by_pod.items())]

    def _relay_push(self, now: float) -> float:
        """Laminar: the trainer's nodes push their shards to each rollout pod's relay head
        (leased circuits on RFabric), which chain the version through the pod."""
        train, _ = pools(self.s)
        heads = self._relay_targets()
        shard = self.weight_bytes / len(train)
        push = [Transfer(t, h, shard, "relay push") for h, _ in heads for t in train]
        push_s = self.wave_seconds(push, self.pol.lease_s, "weight-sync")
        c = cluster_spec(self.s)
        node_bw = c.node_bytes_per_s
        full = self.perf.network_transfer_time(self.weight_bytes, bandwidth=node_bw)
        hop = self.perf.network_transfer_time(
            min(RELAY_CHUNK_BYTES, self.weight_bytes), bandwidth=node_bw
        )
        self.unpropagated[self.tv] = now
        for head, chain in heads:
            self._push(now + push_s, "relay", (node_name(head), self.tv))
            for k, n in enumerate(chain):
                self._push(now + push_s + full + k * hop, "relay", (node_name(n), self.tv))
        return push_s

    def wave_seconds(self, transfers: Sequence[Transfer], lease_s: float, phase: str) -> float:
        """A bulk transfer on the fabric: on the standing circuits, or (RFabric with a
        lease) on circuits leased for ``lease_s``, the rest of it on the standing ones."""
        fabric = self.timer.fabric
        if not transfers:
            return 0.0
        try:
            standing = fabric.transfer_seconds(transfers)
        except errors.FailedPrecondition:
            standing = math.inf
        leasing = fabric.kind is FabricKind.RFABRIC and fabric.options.reconfigure
        if leasing and (lease_s > 0 or math.isinf(standing)):
            res = fabric.run_phase(phase, transfers, idle_window_s=self.last_compute_s)
            if lease_s <= 0 or math.isinf(standing):
                return res.seconds
            return leased_transfer_s(res.seconds, standing, lease_s)
        if math.isinf(standing):
            raise errors.FailedPrecondition(f"{fabric.kind.value}: no path for {phase} transfers")
        return standing

    def _on_relay(self, now: float, node: str, version: int) -> None:
        if node not in self.relay_ver:
            return  # the node left the rollout pool meanwhile
        self.relay_ver[node] = max(self.relay_ver[node], version)
        for s in [x for x in self.insts.values() if x.node == node]:
            act = update_action(
                self.ver[s.id], version, len(s.running), self.pol.pull, pinned=s.id in self.pinned
            )
            if act is Action.LOAD:
                self._load(s, now)
            elif act is Action.ABORT:
                self._abort(s, now)
                self._load(s, now)
            elif act is Action.DRAIN and s.id not in self.draining:
                self.draining.add(s.id)
                back = list(s.queue)
                s.queue.clear()
                for r in reversed(back):
                    r.inst = None
                    self.pending.appendleft(r)
        if self.pol.repack:
            self._repack(now)
        self._dispatch(now)

    def _abort(self, s: _Inst, now: float) -> None:
        """Partial rollout's abort: the running requests leave with their tokens and wait
        first in line on ``s`` (their KV cache is recomputed when admitted again)."""
        if s.seg is not None:
            self._sync(s, now)
        running = sorted(s.running.values(), key=lambda r: (r.it0, r.id))
        for r in running:
            self._stop(s, r)
        for r in reversed(running):
            s.queue.appendleft(r)
        self.aborted += len(running)

    def _load_s(self, tp: int) -> float:
        bw = self.perf.hardware.h2d_bandwidth
        return self.perf.weight_bytes_per_shard(tp) / bw if bw > 0 else 0.0

    def _load(self, s: _Inst, now: float) -> None:
        """``s`` loads its node's relay version (host to device), back to the node's base
        layout first if it held a resharded tail."""
        version = self.relay_ver[s.node]
        self.draining.discard(s.id)
        if s.id in self.pinned:
            self._unreshard(s, now, version)
            return
        pause = self._load_s(s.tp)
        if s.seg is not None:
            self._sync(s, now)
        self.ver[s.id] = version
        s.busy_until = max(s.busy_until, s.clock, now) + pause
        self.stalls.append(pause)
        self._check_propagation(now + pause)
        self._dispatch(now, only=s)
        self._schedule(s)

    def _check_propagation(self, at: float) -> None:
        if not self.unpropagated or not self.insts:
            return
        low = min(self.ver[i] for i in self.insts)
        for v in sorted(self.unpropagated):
            if v <= low:
                self.propagation.append(at - self.unpropagated.pop(v))

    # -- repack and reshard --

    def _repack(self, now: float) -> None:
        engines: list[TailEngine] = []
        for s in self.insts.values():
            if s.id not in self.draining or not s.running:
                continue
            if s.seg is not None:
                self._sync(s, now)
            reqs = tuple(
                (r.id, r.prompt + r.generated + (s.it - r.it0)) for r in s.running.values()
            )
            engines.append(
                TailEngine(s.id, s.node, s.tp, self.ver[s.id], self._seq_cap(s.tp), s.cap, reqs)
            )
        plan = plan_repack(engines, tail_fraction=self.pol.tail_fraction, by_node=self.pol.reshard)
        if not plan.empty:
            self._apply_repack(plan, now)
        for x in list(self.insts.values()):
            if x.id in self.draining:
                self._schedule(x)  # synced above: resume

    def _apply_repack(self, plan: RepackPlan, now: float) -> None:
        if plan.moves:
            self.repacks += 1
            self.repack_moves += len(plan.moves)
            self.reasons.append(f"t={now:.1f}s: {plan.reason}")
        wide: dict[str, _Inst] = {}
        for node, _ in plan.reshard_nodes:
            if self._wide_pays(node, plan, now):
                wide[node] = self._reshard_node(node, self.g, now)
        cross = [
            m
            for m in plan.moves
            if self._pod(self.insts[m.source].node) != self._pod(self._target_node(m.target))
        ]
        bulk = 0.0
        if cross:
            ts = [
                Transfer(
                    int(self.insts[m.source].node[1:]),
                    int(self._target_node(m.target)[1:]),
                    m.tokens * self.perf.kv_bytes_per_token(),
                    "repack",
                )
                for m in cross
            ]
            bulk = self.wave_seconds(ts, self.pol.repack_lease_s, "generation")
        for m in plan.moves:
            src = self.insts[m.source]
            r = src.running[m.request]
            self._stop(src, r)
            dst = self._move_target(m.target, m.tokens, wide)
            same = src.node == dst.node
            cost = min(
                self.perf.kv_move_time(m.tokens, same_node=same, src_tp=src.tp, dst_tp=dst.tp),
                self.perf.recompute_time(dst.tp, m.tokens),
            )
            if not same and self._pod(src.node) != self._pod(dst.node):
                cost = max(cost, bulk)
            if dst.seg is not None:
                self._sync(dst, now)
            dst.busy_until = max(dst.busy_until, dst.clock, now) + cost
            r.inst = dst
            fits = len(dst.running) < self._seq_cap(dst.tp) and (
                dst.ctx_sum + m.tokens <= dst.cap or not dst.running
            )
            if fits:
                self._start(dst, r)
            else:
                dst.queue.appendleft(r)
            self.migrations += 1
        for iid in plan.freed:
            freed = self.insts.get(iid)
            if freed is not None and not freed.running and not freed.queue:
                self._load(freed, now)

    def _move_target(self, target: str, tokens: int, wide: Mapping[str, _Inst]) -> _Inst:
        """The engine a repack move lands on: the named engine, or on a node target its
        wide engine (resharded) or the node's engine with the most room."""
        if not target.startswith("node:"):
            return self.insts[target]
        node = target[5:]
        if node in wide:
            return wide[node]
        on = [x for x in self.insts.values() if x.node == node]
        return max(
            on,
            key=lambda x: (
                self._seq_cap(x.tp) - len(x.running) - len(x.queue),
                x.cap - x.ctx_sum - tokens,
                x.id,
            ),
        )

    def _wide_pays(self, node: str, plan: RepackPlan, now: float) -> bool:
        """Whether the node's tail (after the plan's moves) frees the node sooner on one
        engine of the node's width (:func:`scheduler.repack.reshard_pays`)."""
        on = [x for x in self.insts.values() if x.node == node]
        if not on or max(x.tp for x in on) >= self.g:
            return False
        leaving = {m.request for m in plan.moves}
        gens = [
            r.generated + (x.it - r.it0)
            for x in on
            for r in x.running.values()
            if r.id not in leaving
        ]
        moved = [m.tokens for m in plan.moves if m.target == f"node:{node}"]
        batch = len(gens) + len(moved)
        if batch == 0 or batch > self._seq_cap(self.g):
            return False
        ctxs = [g + self.s.workload.prompt_tokens for g in gens] + moved
        forecast = self._forecast()
        longest = max(forecast.remaining_mean(g) for g in gens) if gens else forecast.mean_length()
        before = [x.tp for x in on for _ in x.gpus]
        return reshard_pays(
            base_tp=min(before),
            wide_tp=self.g,
            batch=batch,
            context_tokens=sum(ctxs) / len(ctxs),
            remaining_tokens=longest,
            iteration_s=self.perf.decode_iteration_time,
            pause_s=self.perf.reshard_time(before, [self.g] * self.g),
        )

    def _forecast(self) -> LengthForecast:
        """The length forecast of the tail decisions: the responses completed in the
        last two versions' worth (rebuilt once a version)."""
        if self.forecast_at != self.tv or self.forecast is None:
            recent = self.completed[-2 * self.batch * self.n :] or [1]
            self.forecast = build_forecast(
                [], recent, [], max_tokens=self.s.workload.max_response_tokens
            )
            self.forecast_at = self.tv
        return self.forecast

    def _target_node(self, target: str) -> str:
        return target[5:] if target.startswith("node:") else self.insts[target].node

    def _pod(self, node: str) -> int:
        return cluster_spec(self.s).pod_of(int(node[1:]))

    def _reshard_node(self, node: str, tp: int, now: float) -> _Inst:
        """The node's engines (a draining tail of one version) merge into one engine of
        ``tp`` GPUs, their requests on it; it keeps their version, pinned until drained."""
        olds = [s for s in self.insts.values() if s.node == node]
        version = self.ver[olds[0].id]
        before = [s.tp for s in olds for _ in s.gpus]
        held: list[_Req] = []
        for s in olds:
            if s.seg is not None:
                self._sync(s, now)
            for r in sorted(s.running.values(), key=lambda r: (r.it0, r.id)):
                self._stop(s, r)
                held.append(r)
            held += list(s.queue)
            s.queue.clear()
            self.draining.discard(s.id)
            self._retire(s, now)
        pause = self.perf.reshard_time(before, [tp] * self.g)
        (inst,) = canonical_instances(node, self.node_gpus[node], (tp,))
        new = self._add_instance(inst, now)
        self.ver[new.id] = version
        new.busy_until = now + pause
        self.draining.add(new.id)
        self.pinned.add(new.id)
        for r in held:
            r.inst = new
            if len(new.running) < self._seq_cap(tp):
                self._start(new, r)
            else:
                new.queue.append(r)
        self.reshards += 1
        self.pause_s += pause
        return new

    def _unreshard(self, s: _Inst, now: float, version: int) -> None:
        """A drained tail holder returns to the node's base layout on the new version."""
        self.pinned.discard(s.id)
        node = s.node
        base = uniform_pattern(self.g, self.tp)
        per_gpu = [t for t in base for _ in range(t)]
        pause = max(self._load_s(self.tp), self.perf.reshard_time([s.tp] * self.g, per_gpu))
        queued = list(s.queue)
        s.queue.clear()
        self._retire(s, now)
        for inst in canonical_instances(node, self.node_gpus[node], base):
            new = self._add_instance(inst, now)
            self.ver[new.id] = version
            new.busy_until = now + pause
            self.stalls.append(pause)
        for r in reversed(queued):
            r.inst = None
            self.pending.appendleft(r)
        self.reshards += 1
        self.pause_s += pause
        self._check_propagation(now + pause)
        self._dispatch(now)
        for x in self.insts.values():
            if x.node == node:
                self._schedule(x)

    # -- the split --

    def _period_start(self, now: float) -> dict[str, float]:
        return {
            "t": now,
            "wait": sum(v.wait_s for v in self.records),
            "busy": sum(v.train_s + v.sync_s for v in self.records),
            "tokens": float(sum(v.tokens for v in self.records)),
            "generated": float(self.tokens),
            "idle": self._idle_total(now),
        }

    def _plan_split(self, now: float) -> None:
        p0, p1 = self.period, self._period_start(now)
        self.period = p1
        m = PeriodMeasure(
            train_gpus=self.s.split.train_gpus,
            gen_gpus=self.s.split.gen_gpus,
            wall_s=p1["t"] - p0["t"],
            trainer_wait_s=p1["wait"] - p0["wait"],
            train_busy_s=p1["busy"] - p0["busy"],
            trained_tokens=p1["tokens"] - p0["tokens"],
            generated_tokens=p1["generated"] - p0["generated"],
            rollout_idle_gpu_s=p1["idle"] - p0["idle"],
        )
        cfg = self.s.workload
        running = [
            r.generated + (r.inst.it - r.it0) if r.running and r.inst is not None else r.generated
            for r in self.reqs.values()
            if r.done_at < 0
        ]
        forecast = build_forecast(
            [],
            self.completed[-8 * self.batch * self.n :],
            running,
            max_tokens=cfg.max_response_tokens,
        )
        mean = forecast.mean_length()
        gen_tokens = self.n * mean
        train_tokens = self.n * (cfg.prompt_tokens + mean)
        g = self.g
        c = self.s.cluster
        node_gbps = c.nics_per_node * c.nic_gbps
        optical = self.timer.fabric.kind in (FabricKind.RFABRIC, FabricKind.STATIC_OPTICAL)

        def switch(a: int, b: int) -> float:
            moved = abs(b - a) // g
            to_train, to_gen = (moved, 0) if b > a else (0, moved)
            pause = split_switch_s(self.perf, to_train, to_gen, node_gbps)
            if optical and moved:
                pause += self.base.fabric.ocs_switching_s + DEFAULT_SETTLING_MARGIN_S
            return pause

        period_s = sum(v.step_s for v in self.records[-self.pol.plan_every :])
        d = plan_async_split(
            m,
            unit=g,
            min_train_gpus=self.pol.min_train_gpus,
            max_train_gpus=self.pol.max_train_gpus,
            train_tokens_per_group=train_tokens,
            gen_tokens_per_group=gen_tokens,
            period_s=period_s,
            switch_s=switch,
        )
        self.split_plans.append(f"version {self.tv}: {d.reason}")
        if d.changed:
            self._move_split(now, d.train_gpus, d.switch_s)

    def _move_split(self, now: float, train_gpus: int, pause: float) -> None:
        """Whole nodes change pool at ``now``: leavers abort their requests, joiners start
        the base layout on the newest version after ``pause``; the trainer waits ``pause``."""
        total = self.s.split.total_gpus
        new_s = with_split(self.base, train_gpus, total - train_gpus)
        _, gen_old = pools(self.s)
        _, gen_new = pools(new_s)
        leaving = sorted(set(gen_old) - set(gen_new))
        joining = sorted(set(gen_new) - set(gen_old))
        for n in leaving:
            name = node_name(n)
            for s in [x for x in self.insts.values() if x.node == name]:
                self._abort(s, now)
                back = list(s.queue)
                s.queue.clear()
                for r in reversed(back):
                    r.inst = None
                    self.pending.appendleft(r)
                self.draining.discard(s.id)
                self.pinned.discard(s.id)
                self._retire(s, now)
            self.relay_ver.pop(name, None)
            self.node_gpus.pop(name, None)
        keep = [x for x in self.nodes if int(x[1:]) not in leaving]
        for n in joining:
            name = node_name(n)
            keep.append(name)
            self.node_gpus[name] = tuple(range(self.g))
            self.relay_ver[name] = self.tv
            for inst in canonical_instances(
                name, self.node_gpus[name], uniform_pattern(self.g, self.tp)
            ):
                new = self._add_instance(inst, now)
                self.ver[new.id] = self.tv
                new.busy_until = now + pause
                self._schedule(new)
        self.nodes = tuple(sorted(keep))
        self.s = new_s
        self.timer.use(new_s, self._fabric(new_s))
        self.acc.switch += pause
        self.t_free = max(self.t_free, now) + pause
        self.timeline.append((now, train_gpus, total - train_gpus))
        self._dispatch(now)

    # -- the loop --

    def simulate(self) -> None:
        self._admit_groups(0.0)
        self.trainer_busy = False
        self._trainer_try(0.0)
        if self.pol.repack:
            self._push(self.pol.repack_interval_s, "repack")
        while not self.done:
            te = self.events[0][0] if self.events else math.inf
            td = self.dq[0][0] if self.dq else math.inf
            if math.isinf(te) and math.isinf(td):
                raise errors.FailedPrecondition(
                    f"async run stalled at version {self.tv}: {len(self.queue)} group(s) "
                    f"complete, {len(self.pending)} request(s) pending, nothing running"
                )
            if td <= te:
                t, _, kind, data = heapq.heappop(self.dq)
                self.now = t
                self._driver(t, kind, data)
                continue
            t, _, iid, version = heapq.heappop(self.events)
            live = self.insts.get(iid)
            if live is None or live.version != version:
                continue
            self.now = t
            self._finish_segment(live, t)
            if live.id in self.draining and not live.running and not live.queue:
                self._load(live, t)
            else:
                self._dispatch(t, only=live)
                self._schedule(live)
            if self.new_done:
                self._on_done(t)

    def _driver(self, t: float, kind: str, data: Any) -> None:
        if kind == "trained":
            take, train_s = data
            self._on_trained(t, take, train_s)
        elif kind == "free":
            self._trainer_try(t)
        elif kind == "relay":
            node, version = data
            self._on_relay(t, node, version)
        elif kind == "dispatch":
            self._dispatch(t)
        elif kind == "repack":
            self._repack(t)
            if not self.done:
                self._push(t + self.pol.repack_interval_s, "repack")

    def result(self, label: str) -> AsyncRun:
        w = min(len(self.records) - 1, self.s.asynchronous.warmup)
        steady = self.records[w:]
        wall = max(1e-9, sum(v.step_s for v in steady))
        wait = sum(v.wait_s for v in steady)
        idle0 = self.idle_at_end[w - 1] if w > 0 else 0.0
        gen_gpu_s = sum(v.step_s * v.gen_gpus for v in steady)
        return AsyncRun(
            name=self.base.name,
            label=label,
            rule=self.rule,
            policy=self.pol,
            static_tp=self.tp,
            versions=tuple(self.records),
            warmup=self.s.asynchronous.warmup,
            propagation_s=tuple(self.propagation),
            stalls_s=tuple(self.stalls),
            split_timeline=tuple(self.timeline),
            plans=tuple(self.split_plans),
            repacks=self.repacks,
            repack_moves=self.repack_moves,
            reshards=self.reshards,
            aborted=self.aborted,
            trainer_idle=wait / wall,
            rollout_idle=(self.idle_at_end[-1] - idle0) / max(1e-9, gen_gpu_s),
        )


def run_async(
    s: Scenario,
    perf: PerfModel | None = None,
    *,
    policy: AsyncPolicy | None = None,
    rule: RolloutRule | None = None,
    tp: int = 0,
    label: str = "",
) -> AsyncRun:
    """One asynchronous run of ``s`` (its ``[rollout]`` rule and ``[async]`` policy
    unless given), engines at a uniform TP ``tp`` (0: ``generation.static_tp``, else 4
    or the largest that fits)."""
    perf = perf or perf_model(s)
    rule = rule or s.rollout.rule
    if not rule.asynchronous:
        raise errors.field_error("rollout.mode", rule.mode.value, "async for an asynchronous run")
    if policy is None:
        built, problems = s.asynchronous.built(s.split.total_gpus, s.cluster.gpus_per_node)
        if built is None:
            raise errors.InvalidArgument("; ".join(problems))
        policy = built
    if s.split.unit_gpus:
        raise errors.field_error(
            "split.unit_gpus", s.split.unit_gpus, '0 with rollout.mode = "async" (whole nodes)'
        )
    tp = tp or s.generation.static_tp or _default_tp(s, perf)
    sim = AsyncSim(s, perf, rule, policy, tp)
    sim.simulate()
    return sim.result(label or policy.label or policy.weight_update.value)


def _default_tp(s: Scenario, perf: PerfModel) -> int:
    from sim_backends.clustersim.pipeline import candidate_tps

    tps = candidate_tps(s, perf)
    return 4 if 4 in tps else max(tps)


__all__ = ["AsyncRun", "AsyncSim", "VersionRecord", "node_name", "run_async"]

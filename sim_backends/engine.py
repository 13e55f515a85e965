"""A simulated continuous-batching rollout engine (implements node_agent.engine.RolloutEngine).

The simulation is advanced lazily by elapsed time (read from an injectable clock) in
fixed steps, so a fake clock makes it fully deterministic for a given seed:

- requests arrive as a Poisson process and wait in a queue;
- each TP instance admits queued requests while it is RUNNING and its KV cache has room
  (DRAINED admits nothing; running requests still decode to completion);
- every running request gains one token per decode iteration of its instance; the
  iteration time is a coarse bandwidth-bound estimate (weights plus the batch's KV
  cache read once per iteration, split over the TP degree) - enough to make the load
  respond to the layout, not the project's performance model (that lives in scheduler);
- when the KV cache overflows, the newest request is preempted back to the queue.

Generation steps (``EngineProgress.step``): with ``requests_per_step`` 0 (the default)
requests arrive continuously and the whole run is step 0; the completed lengths kept
are then the last ``max_completed_lengths``. With ``requests_per_step`` N > 0 the engine
behaves like a rollout step of RL: N requests arrive at once, and when the last of them
has finished the step counter advances, the completed lengths start afresh and the
next N arrive. With ``samples_per_prompt`` S > 1 a step's requests come in groups of S
samples of one prompt, tagged with the prompt's group (``RequestProgress.group``): a
prompt's difficulty, log-normal with sd ``prompt_sigma``, scales all its samples'
lengths (GRPO's siblings), and a prompt keeps it at its next occurrence (the groups
repeat every ``prompts_per_epoch`` prompts). :meth:`SimulatedEngine.pause` (the reshard's
pause stage) stops admissions and decoding until :meth:`SimulatedEngine.unpause`;
arrivals still queue.

Resharding changes the layout and redistributes in-flight requests; it moves no weights
and says so (``bytes_moved=0``).

Weights (:meth:`SimulatedEngine.update_weights`): the engine serves a weight version (its
label, reported in telemetry). An update pauses decoding, reads the new checkpoint's
tensor table (so a path that is not a whole checkpoint fails the update, and the old
version stays), switches the version for every instance at once, and resumes; the
requests in flight finish on the old weights or resume on the new ones as asked (the
simulation counts them; it has no per-token versions).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    check_import_ids,
    validate_layout,
)
from node_agent.gateway.engine import WeightUpdate
from orchestrrl import checkpoint, errors

GIB = 2**30


@dataclass(frozen=True)
class SimEngineConfig:
    """Parameters of the simulation. Model numbers are Qwen2.5-14B in BF16 on H800."""

    step_s: float = 0.05
    arrival_rate_per_gpu: float = 1.0  # requests/s arriving per GPU of the node
    prompt_tokens: int = 512
    output_median_tokens: float = 1024.0  # response lengths are log-normal (long-tailed)
    output_sigma: float = 1.0
    max_output_tokens: int = 16384
    max_batch_per_instance: int = 256
    max_queue: int = 4096  # arrivals beyond this are turned away
    weight_bytes: float = 14.8e9 * 2  # 14.8 B parameters, 2 bytes each
    kv_bytes_per_token: float = 2 * 48 * 8 * 128 * 2  # K and V, 48 layers, 8 KV heads x 128
    hbm_bytes_per_gpu: float = 80 * GIB
    memory_fraction: float = 0.9  # share of HBM the engine reserves (vLLM's default)
    hbm_bandwidth: float = 3.35e12  # bytes/s
    bandwidth_efficiency: float = 0.7
    iteration_overhead_s: float = 0.003
    allreduce_s_per_doubling: float = 0.0005
    max_catch_up_s: float = 60.0  # longer gaps are skipped rather than simulated step by step
    requests_per_step: int = 0  # 0: continuous Poisson arrivals; N: RL steps of N requests
    samples_per_prompt: int = 1  # step mode: requests come in groups of this many samples
    prompt_sigma: float = 0.0  # sd of a prompt's log difficulty (shared by its samples)
    prompts_per_epoch: int = 0  # prompts before the groups repeat (0: never)
    max_completed_lengths: int = 4096  # completed lengths kept in continuous mode

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise errors.field_error("samples_per_prompt", self.samples_per_prompt, ">= 1")
        if not 0.0 <= self.prompt_sigma <= 5.0:
            raise errors.field_error("prompt_sigma", self.prompt_sigma, "in [0, 5]")
        if self.prompts_per_epoch < 0:
            raise errors.field_error("prompts_per_epoch", self.prompts_per_epoch, ">= 0")


@dataclass(slots=True)  # slots: the decode loop touches every request at every step
class _Request:
    output_tokens: int
    generated: float = 0.0
    id: str = ""
    prompt_tokens: int = 0
    group: str = ""


@dataclass
class _Instance:
    tp: int
    kv_capacity_tokens: float
    running: list[_Request] = field(default_factory=list)
    kv_used_tokens: float = 0.0  # prompt plus generated tokens of the running requests


class SimulatedEngine:
    """Simulated rollout instances over ``gpus`` GPUs with tensor-parallel ``tp_layout``."""

    def __init__(
        self,
        gpus: int,
        tp_layout: Sequence[int],
        seed: int = 0,
        *,
        config: SimEngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        relayout_delay_s: float = 0.0,
        request_prefix: str | None = None,
        weight_version: str = "0",
        relayout_hold: asyncio.Event | None = None,
    ) -> None:
        """``request_prefix`` starts every request id (default: random, so ids are unique
        across nodes and requests can migrate between them). ``relayout_hold``: while it
        is not set, a reshard stays in its relayout stage (a test observes it there)."""
        if gpus < 1:
            raise errors.field_error("gpus", gpus, "a node has at least one GPU")
        self._gpus = gpus
        self._config = config or SimEngineConfig()
        self._clock = clock
        self._relayout_delay_s = relayout_delay_s
        self.relayout_hold = relayout_hold
        self._rng = random.Random(seed)
        self._state = EngineState.RUNNING
        self._instances = self._build(validate_layout(tp_layout, gpus))
        self._queue: collections.deque[_Request] = collections.deque()
        self._last = clock()
        self._carry = 0.0
        self._sim_time = 0.0
        self._next_arrival = self._draw_interarrival()
        self._prefix = request_prefix if request_prefix is not None else os.urandom(4).hex()
        self._serial = 0
        self._paused = False
        self._step_index = 0
        self._step_issued = False  # the current step's requests have arrived (step mode)
        cfg = self._config
        # (length, group) of the requests completed in the step
        self._completed: collections.deque[tuple[int, str]] = collections.deque(
            maxlen=None if cfg.requests_per_step > 0 else cfg.max_completed_lengths
        )
        self._next_prompt = 0
        self._difficulty: dict[int, float] = {}  # prompt -> its log difficulty
        # CPU seconds (this thread's) spent stepping the simulation: the work a real engine
        # does in its own processes; the agent reports it apart (bench/agent_overhead.py).
        self.simulation_cpu_s = 0.0
        self.weight_version = weight_version

    # -- RolloutEngine ------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        return self._gpus

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def tp_layout(self) -> tuple[int, ...]:
        return self._layout

    @property
    def kv_import(self) -> bool:
        return True  # it takes a moved KV cache (at no simulated cost)

    @property
    def max_num_seqs(self) -> int:
        return self._config.max_batch_per_instance

    def stats(self) -> EngineStats:
        self._advance()
        # one pass over the instances (read at every telemetry sample); the sums are taken
        # in the same order as before, so the figures are the same to the last bit
        used = capacity = tokens_per_s = 0.0
        running = 0
        decoding = self._state is not EngineState.RESHARDING and not self._paused
        for i in self._instances:
            used += i.kv_used_tokens
            capacity += i.kv_capacity_tokens
            if i.running:
                running += len(i.running)
                if decoding:
                    tokens_per_s += len(i.running) / self._iteration_s(i)
        return EngineStats(
            queued_requests=len(self._queue),
            running_requests=running,
            tokens_per_s=tokens_per_s,
            kv_cache_usage=min(1.0, used / capacity) if capacity > 0 else 0.0,
            step=self._step_index,
        )

    def progress(self) -> EngineProgress:
        self._advance()
        cap = self._config.max_output_tokens
        requests = [
            RequestProgress(r.id, k, r.prompt_tokens, int(r.generated), cap, r.group)
            for k, instance in enumerate(self._instances)
            for r in instance.running
        ]
        requests += [
            RequestProgress(r.id, -1, r.prompt_tokens, int(r.generated), cap, r.group)
            for r in self._queue
        ]
        lengths = tuple(length for length, _ in self._completed)
        groups = tuple(g for _, g in self._completed)
        if not any(groups):
            groups = ()
        return EngineProgress(self._step_index, tuple(requests), lengths, groups)

    async def pause(self) -> None:
        self._advance()  # up to now at the old pace; from here on nothing decodes
        self._paused = True

    async def unpause(self) -> None:
        self._advance()  # the paused interval passes without decoding
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    async def update_weights(
        self,
        path: str,
        version: str,
        in_flight: str = "finish",
        *,
        drain_timeout_s: float | None = None,
    ) -> WeightUpdate:
        """Serve ``version`` from the checkpoint directory at ``path`` (see the module
        docstring); FailedPrecondition, the old version kept, when it cannot be read."""
        if in_flight not in ("finish", "resume"):
            raise errors.field_error("in_flight", in_flight, '"finish" or "resume"')
        t0 = time.perf_counter()
        was_paused = self._paused
        await self.pause()
        try:
            table = await asyncio.to_thread(
                checkpoint.read_tensor_table, Path(path) / checkpoint.WEIGHTS
            )
        except (OSError, ValueError) as exc:
            raise errors.FailedPrecondition(
                f"simulated engine: cannot load {path}: {exc}; it keeps version "
                f"{self.weight_version!r}"
            ) from None
        finally:
            if not was_paused:
                await self.unpause()
        running = sum(len(i.running) for i in self._instances)
        previous, self.weight_version = self.weight_version, version
        return WeightUpdate(
            version,
            previous,
            (StageTiming("load", time.perf_counter() - t0),),
            len(self._instances),
            running if in_flight == "resume" else 0,
            running if in_flight == "finish" else 0,
            f"sim ({len(table)} tensors)",
        )

    async def drain(self) -> None:
        self._advance()
        self._refuse_while_resharding("drain")
        self._state = EngineState.DRAINED

    async def resume(self) -> None:
        self._advance()
        self._refuse_while_resharding("resume")
        self._state = EngineState.RUNNING

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        layout = validate_layout(new_layout, self._gpus)
        self._advance()
        self._refuse_while_resharding("reshard")
        old = self.tp_layout
        if layout == old:
            return ReshardResult(old, old, (), 0, f"layout is already {list(old)}; nothing to do")
        prior = self._state
        # the stages on the engine's clock (a test's manual clock measures a long pause)
        t0 = self._clock()
        self._state = EngineState.RESHARDING  # pause: no admissions, no decoding
        t1 = self._clock()
        try:
            if self._relayout_delay_s > 0:
                await asyncio.sleep(self._relayout_delay_s)
            if self.relayout_hold is not None:
                await self.relayout_hold.wait()
            self._advance()  # the pause is simulated as time without decoding
            self._relayout(layout)
        finally:
            t2 = self._clock()
            self._state = prior  # resume to the state before the reshard (also if cancelled)
        t3 = self._clock()
        stages = (
            StageTiming("pause", t1 - t0),
            StageTiming("relayout", t2 - t1),
            StageTiming("resume", t3 - t2),
        )
        return ReshardResult(
            old, layout, stages, 0, "simulated engine: layout changed, no weights moved"
        )

    async def export_requests(
        self, request_ids: Sequence[str]
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        self._advance()
        self._refuse_while_resharding("export requests")
        wanted = set(request_ids)
        found: dict[str, MigratingRequest] = {}
        kv_bytes = self._config.kv_bytes_per_token
        for k, inst in enumerate(self._instances):
            for r in [r for r in inst.running if r.id in wanted]:
                inst.running.remove(r)
                inst.kv_used_tokens -= self._footprint(r)
                found[r.id] = self._migrating(r, k, int(self._footprint(r) * kv_bytes))
        for r in [r for r in self._queue if r.id in wanted]:
            self._queue.remove(r)
            found[r.id] = self._migrating(r, -1, 0)
        exported = tuple(found[i] for i in request_ids if i in found)
        return exported, tuple(i for i in request_ids if i not in found)

    async def import_requests(
        self, requests: Sequence[MigratingRequest], instance: int, recompute: bool
    ) -> ImportResult:
        t0 = time.perf_counter()
        self._advance()
        if self._state is not EngineState.RUNNING:
            raise errors.FailedPrecondition(
                f"cannot import requests: the engine is {self._state.value}, not admitting"
            )
        if not 0 <= instance < len(self._instances):
            raise errors.field_error(
                "instance", instance, f"an index into the layout {list(self.tp_layout)}"
            )
        check_import_ids(requests)
        present = {r.id for i in self._instances for r in i.running} | {r.id for r in self._queue}
        dup = sorted(m.request_id for m in requests if m.request_id in present)
        if dup:
            raise errors.field_error("requests", dup, "requests this engine does not have yet")
        incoming = [self._from_migrating(m) for m in requests]
        target = self._instances[instance]
        need = sum(self._footprint(r) for r in incoming)
        room = target.kv_capacity_tokens - target.kv_used_tokens
        seats = self._config.max_batch_per_instance - len(target.running)
        if need > room or len(incoming) > seats:
            raise errors.FailedPrecondition(
                f"instance {instance} (TP{target.tp}) has room for {room:.0f} KV tokens and "
                f"{seats} sequences; the {len(incoming)} request(s) need {need:.0f} tokens"
            )
        for r in incoming:
            self._place(target, r)
        moved = 0 if recompute else sum(m.kv_bytes for m in requests)
        prefilled = sum(int(self._footprint(r)) for r in incoming) if recompute else 0
        stage = StageTiming("recompute_kv" if recompute else "receive_kv", time.perf_counter() - t0)
        return ImportResult(
            tuple(m.request_id for m in requests),
            instance,
            moved,
            prefilled,
            (stage,),
            "simulated engine: requests admitted with their progress; the KV cache is "
            + ("recomputed" if recompute else "taken as moved")
            + " at no simulated cost",
        )

    async def restore_requests(self, requests: Sequence[MigratingRequest]) -> tuple[str, ...]:
        self._advance()
        for m in requests:
            r = self._from_migrating(m)
            home = (
                self._instances[m.source_instance]
                if 0 <= m.source_instance < len(self._instances)
                else None
            )
            need = self._footprint(r)
            if home is not None and home.kv_used_tokens + need <= home.kv_capacity_tokens:
                self._place(home, r)
            elif m.source_instance >= 0 and (other := self._least_loaded(r)) is not None:
                self._place(other, r)
            else:
                self._queue.appendleft(r)  # admitted again (KV recomputed) when there is room
        return tuple(m.request_id for m in requests)

    async def release_requests(
        self, requests: Sequence[MigratingRequest], destination: Destination | None
    ) -> tuple[str, ...]:
        """Nothing reads a simulated request's tokens: released requests are forgotten."""
        return tuple(m.request_id for m in requests)

    # -- simulation ---------------------------------------------------------------------

    def _new_request(self, output_tokens: int, group: str = "") -> _Request:
        self._serial += 1
        return _Request(
            output_tokens,
            id=f"{self._prefix}-{self._serial}",
            prompt_tokens=self._config.prompt_tokens,
            group=group,
        )

    def _migrating(self, r: _Request, instance: int, kv_bytes: int) -> MigratingRequest:
        return MigratingRequest(
            request_id=r.id,
            prompt_tokens=r.prompt_tokens,
            generated_tokens=int(r.generated),
            max_tokens=self._config.max_output_tokens,
            source_instance=instance,
            kv_bytes=kv_bytes,
            engine_state=json.dumps({"output_tokens": r.output_tokens}).encode(),
            group=r.group,
        )

    def _from_migrating(self, m: MigratingRequest) -> _Request:
        """The simulated request of a migrating one; without the simulator's own state (a
        request from another engine kind) its length is drawn as for an arrival."""
        output = 0
        if m.engine_state:
            try:
                output = int(json.loads(m.engine_state.decode())["output_tokens"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                raise errors.field_error(
                    "engine_state", m.engine_state[:60], "the simulated engine's JSON state"
                ) from None
        if output <= 0:
            output = self._draw_output_tokens()
        cap = m.max_tokens or self._config.max_output_tokens
        return _Request(
            max(min(output, cap), m.generated_tokens + 1),
            float(m.generated_tokens),
            m.request_id,
            m.prompt_tokens,
            m.group,
        )

    def _refuse_while_resharding(self, what: str) -> None:
        if self._state is EngineState.RESHARDING:
            raise errors.Aborted(
                f"cannot {what}: a reshard to {list(self.tp_layout)} is in progress; "
                "retry when it finishes"
            )

    def _build(self, layout: Sequence[int]) -> list[_Instance]:
        """The instances of ``layout`` (empty); also sets :attr:`tp_layout` (read at every
        telemetry sample, so kept rather than rebuilt)."""
        cfg = self._config
        instances = []
        for tp in layout:
            pool = tp * cfg.hbm_bytes_per_gpu * cfg.memory_fraction - cfg.weight_bytes
            instances.append(_Instance(tp, max(0.0, pool / cfg.kv_bytes_per_token)))
        self._layout = tuple(i.tp for i in instances)
        return instances

    def _relayout(self, layout: Sequence[int]) -> None:
        """Replace the instances; in-flight requests keep their progress (the simulated
        KV cache is recomputed for free) and those that do not fit go back to the queue."""
        in_flight = [r for i in self._instances for r in i.running]
        self._instances = self._build(layout)
        for request in in_flight:
            target = self._least_loaded(request)
            if target is None:
                self._queue.appendleft(request)
            else:
                self._place(target, request)

    def _draw_interarrival(self) -> float:
        rate = self._config.arrival_rate_per_gpu * self._gpus
        return self._rng.expovariate(rate) if rate > 0 else math.inf

    def _draw_output_tokens(self, log_scale: float = 0.0) -> int:
        cfg = self._config
        mu = math.log(cfg.output_median_tokens) + log_scale
        length = self._rng.lognormvariate(mu, cfg.output_sigma)
        return max(1, min(cfg.max_output_tokens, round(length)))

    def _footprint(self, request: _Request) -> float:
        return request.prompt_tokens + request.generated

    def _place(self, instance: _Instance, request: _Request) -> None:
        instance.running.append(request)
        instance.kv_used_tokens += self._footprint(request)

    def _iteration_s(self, instance: _Instance) -> float:
        cfg = self._config
        read = cfg.weight_bytes + instance.kv_used_tokens * cfg.kv_bytes_per_token
        memory_s = read / instance.tp / (cfg.hbm_bandwidth * cfg.bandwidth_efficiency)
        allreduce_s = cfg.allreduce_s_per_doubling * math.log2(instance.tp)
        return cfg.iteration_overhead_s + memory_s + allreduce_s

    def _least_loaded(self, request: _Request) -> _Instance | None:
        need = self._footprint(request)
        fits = [
            i
            for i in self._instances
            if len(i.running) < self._config.max_batch_per_instance
            and i.kv_used_tokens + need <= i.kv_capacity_tokens
        ]
        return min(fits, key=lambda i: i.kv_used_tokens / i.kv_capacity_tokens, default=None)

    def _advance(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last) + self._carry
        self._last = now
        if elapsed > self._config.max_catch_up_s:
            self._sim_time += elapsed - self._config.max_catch_up_s
            self._next_arrival = max(self._next_arrival, self._sim_time)
            elapsed = self._config.max_catch_up_s
        step = self._config.step_s
        steps = int(elapsed / step)
        self._carry = elapsed - steps * step
        if steps:
            started = time.thread_time()
            for _ in range(steps):
                self._step(step)
            self.simulation_cpu_s += time.thread_time() - started

    def _step(self, dt: float) -> None:
        self._sim_time += dt
        if self._config.requests_per_step > 0:
            if not self._step_issued or not (
                self._queue or any(i.running for i in self._instances)
            ):
                self._begin_step()
        else:
            while self._next_arrival <= self._sim_time:
                if len(self._queue) < self._config.max_queue:
                    self._queue.append(self._new_request(self._draw_output_tokens()))
                self._next_arrival += self._draw_interarrival()
        if self._state is EngineState.RESHARDING or self._paused:
            return
        if self._state is EngineState.RUNNING:
            self._admit()
        for instance in self._instances:
            self._decode(instance, dt)

    def _begin_step(self) -> None:
        """Step mode: the next step's requests arrive together (the first at step 0)."""
        if self._step_issued:
            self._step_index += 1
            self._completed.clear()
        self._step_issued = True
        cfg = self._config
        if cfg.samples_per_prompt <= 1:
            for _ in range(cfg.requests_per_step):
                self._queue.append(self._new_request(self._draw_output_tokens()))
            return
        prompt, scale = 0, 0.0
        for i in range(cfg.requests_per_step):
            if i % cfg.samples_per_prompt == 0:
                prompt = self._next_prompt
                self._next_prompt += 1
                if cfg.prompts_per_epoch:
                    prompt %= cfg.prompts_per_epoch
                if prompt not in self._difficulty:
                    self._difficulty[prompt] = self._rng.gauss(0.0, cfg.prompt_sigma)
                scale = self._difficulty[prompt]
            group = f"{self._prefix}-p{prompt}"
            self._queue.append(self._new_request(self._draw_output_tokens(scale), group))

    def _admit(self) -> None:
        while self._queue:
            target = self._least_loaded(self._queue[0])
            if target is None:
                return
            self._place(target, self._queue.popleft())

    def _decode(self, instance: _Instance, dt: float) -> None:
        if not instance.running:
            return
        tokens = dt / self._iteration_s(instance)
        still: list[_Request] = []
        keep = still.append
        used = 0.0
        for request in instance.running:
            generated = request.generated + tokens
            request.generated = generated
            if generated < request.output_tokens:
                keep(request)
                used += request.prompt_tokens + generated
            else:
                self._completed.append((request.output_tokens, request.group))
        instance.running = still
        instance.kv_used_tokens = used
        while instance.running and instance.kv_used_tokens > instance.kv_capacity_tokens:
            preempted = instance.running.pop()  # the newest; its KV is recomputed later
            instance.kv_used_tokens -= self._footprint(preempted)
            self._queue.appendleft(preempted)

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

Resharding changes the layout and redistributes in-flight requests; it moves no weights
and says so (``bytes_moved=0``).
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node_agent.engine import (
    EngineState,
    EngineStats,
    ReshardResult,
    StageTiming,
    validate_layout,
)
from orchestrrl import errors

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


@dataclass
class _Request:
    output_tokens: int
    generated: float = 0.0


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
    ) -> None:
        if gpus < 1:
            raise errors.field_error("gpus", gpus, "a node has at least one GPU")
        self._gpus = gpus
        self._config = config or SimEngineConfig()
        self._clock = clock
        self._relayout_delay_s = relayout_delay_s
        self._rng = random.Random(seed)
        self._state = EngineState.RUNNING
        self._instances = self._build(validate_layout(tp_layout, gpus))
        self._queue: collections.deque[_Request] = collections.deque()
        self._last = clock()
        self._carry = 0.0
        self._sim_time = 0.0
        self._next_arrival = self._draw_interarrival()

    # -- RolloutEngine ------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        return self._gpus

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def tp_layout(self) -> tuple[int, ...]:
        return tuple(i.tp for i in self._instances)

    def stats(self) -> EngineStats:
        self._advance()
        used = sum(i.kv_used_tokens for i in self._instances)
        capacity = sum(i.kv_capacity_tokens for i in self._instances)
        tokens_per_s = 0.0
        if self._state is not EngineState.RESHARDING:
            tokens_per_s = sum(
                (len(i.running) / self._iteration_s(i) for i in self._instances if i.running), 0.0
            )
        return EngineStats(
            queued_requests=len(self._queue),
            running_requests=sum(len(i.running) for i in self._instances),
            tokens_per_s=tokens_per_s,
            kv_cache_usage=min(1.0, used / capacity) if capacity > 0 else 0.0,
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
        t0 = time.perf_counter()
        self._state = EngineState.RESHARDING  # pause: no admissions, no decoding
        t1 = time.perf_counter()
        try:
            if self._relayout_delay_s > 0:
                await asyncio.sleep(self._relayout_delay_s)
            self._advance()  # the pause is simulated as time without decoding
            self._relayout(layout)
        finally:
            t2 = time.perf_counter()
            self._state = prior  # resume to the state before the reshard (also if cancelled)
        t3 = time.perf_counter()
        stages = (
            StageTiming("pause", t1 - t0),
            StageTiming("relayout", t2 - t1),
            StageTiming("resume", t3 - t2),
        )
        return ReshardResult(
            old, layout, stages, 0, "simulated engine: layout changed, no weights moved"
        )

    # -- simulation ---------------------------------------------------------------------

    def _refuse_while_resharding(self, what: str) -> None:
        if self._state is EngineState.RESHARDING:
            raise errors.Aborted(
                f"cannot {what}: a reshard to {list(self.tp_layout)} is in progress; "
                "retry when it finishes"
            )

    def _build(self, layout: Sequence[int]) -> list[_Instance]:
        cfg = self._config
        instances = []
        for tp in layout:
            pool = tp * cfg.hbm_bytes_per_gpu * cfg.memory_fraction - cfg.weight_bytes
            instances.append(_Instance(tp, max(0.0, pool / cfg.kv_bytes_per_token)))
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

    def _draw_output_tokens(self) -> int:
        cfg = self._config
        length = self._rng.lognormvariate(math.log(cfg.output_median_tokens), cfg.output_sigma)
        return max(1, min(cfg.max_output_tokens, round(length)))

    def _footprint(self, request: _Request) -> float:
        return self._config.prompt_tokens + request.generated

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
        for _ in range(steps):
            self._step(step)

    def _step(self, dt: float) -> None:
        self._sim_time += dt
        while self._next_arrival <= self._sim_time:
            if len(self._queue) < self._config.max_queue:
                self._queue.append(_Request(self._draw_output_tokens()))
            self._next_arrival += self._draw_interarrival()
        if self._state is EngineState.RESHARDING:
            return
        if self._state is EngineState.RUNNING:
            self._admit()
        for instance in self._instances:
            self._decode(instance, dt)

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
        for request in instance.running:
            request.generated += tokens
        instance.running = [r for r in instance.running if r.generated < r.output_tokens]
        instance.kv_used_tokens = sum(self._footprint(r) for r in instance.running)
        while instance.running and instance.kv_used_tokens > instance.kv_capacity_tokens:
            preempted = instance.running.pop()  # the newest; its KV is recomputed later
            instance.kv_used_tokens -= self._footprint(preempted)
            self._queue.appendleft(preempted)

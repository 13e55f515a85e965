"""Plausibility bounds on an agent's telemetry sample, checked before the controller
stores it (and so before the compute planner sees it).

An agent may report only for its own node, but what it reports is not otherwise
trusted: a sample with absurd figures (a tokens/s rate no GPU reaches, more running
requests than its engine has seats for, more tokens generated than the request's cap,
negative, NaN or infinite values) is rejected whole, counted and logged; the node keeps
its last plausible sample. Bounds come from the wiring and the registration (the node's
GPUs, its engine's ``max_num_seqs``) where possible, and otherwise from the constants
below, each with its source and a generous slack: they are there to catch a broken or
hostile agent, never to second-guess a real one.

Checked are the figures the controller uses: the time, the engine's figures and every
request's progress (the compute planner), the GPUs' utilization and memory and the TP
layout (``orlctl nodes``). NIC, RDMA and the other GPU figures are passed on as reported.
This runs for the newest sample of every upload (2,048 agents: 2,048 a second), so it
reads each field once: about 0.5 us per request on the benchmark machine.

Pure: no clock (``now`` is an argument), no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

from orchestrrl.v1 import node_agent_pb2
from scheduler.perf_model import H800

# Every generated (or prefilled) token costs at least 2 FLOPs per active parameter. The
# smallest models post-trained with RL are ~0.5 B parameters (Qwen2.5-0.5B); an H800
# does 989 TFLOP/s dense BF16 (2x that in FP8). With 4x slack on top (FP8, MoE models
# with fewer active parameters, speculative decoding), no GPU exceeds about 4 million
# tokens/s: a node's rate is bounded by this times its GPUs.
SMALLEST_MODEL_PARAMS = 0.5e9
TOKENS_PER_S_SLACK = 4.0
MAX_TOKENS_PER_S_PER_GPU = TOKENS_PER_S_SLACK * H800.peak_flops / (2 * SMALLEST_MODEL_PARAMS)

# The longest context any open model advertises is 10 M tokens (Llama 4 Scout); a
# request's prompt plus output, and its max_tokens cap, stay below 2**24 (16.8 M).
MAX_SEQUENCE_TOKENS = 1 << 24

# Seats of one instance when the engine did not register its max_num_seqs, and the most
# a registration is believed (vLLM's default is 256 to 1024, SGLang sizes it from
# memory: a few thousand at most).
MAX_SEATS_PER_INSTANCE = 1 << 14

# Requests waiting on one node, and completed lengths of one step on it: a DAPO-like
# step is 512 prompts x 16 samples = 8,192 requests for the whole cluster; 16 times that
# on a single node is not a real queue.
MAX_QUEUED_PER_NODE = 1 << 17

# A generation-step counter that counted a step every second for a hundred years.
MAX_STEP = 1 << 32

# GPUs of one node (HGX: 8; GB200 NVL72: 4 per compute tray), with slack.
MAX_GPUS_PER_NODE = 128

# A GPU's memory (H800: 80 GB; the largest today: 288 GB), with slack.
MAX_GPU_MEMORY_BYTES = 4 << 40

# A sample stamped further ahead of the controller's clock than this is refused (older
# samples are normal: an agent uploads its backlog after an outage).
MAX_CLOCK_AHEAD_S = 3600.0


@dataclass(frozen=True)
class TelemetryBounds:
    """The bounds of one node's samples."""

    gpus: int  # the node's GPUs in the wiring
    max_num_seqs: int = 0  # its engine's seats per instance, as registered (0: unknown)

    @property
    def max_tokens_per_s(self) -> float:
        return MAX_TOKENS_PER_S_PER_GPU * max(1, self.gpus)

    @property
    def max_running(self) -> int:
        """Requests the node's engines can run at once: at most one instance per GPU,
        each with its seats (a TP layout changes how many instances, not this bound)."""
        seats = min(self.max_num_seqs or MAX_SEATS_PER_INSTANCE, MAX_SEATS_PER_INSTANCE)
        return max(1, self.gpus) * seats


@dataclass(frozen=True)
class Implausible:
    """Why a sample was rejected: the field (a fixed name, e.g. ``engine.tokens_per_s``),
    the value and the bound it breaks."""

    field: str
    value: object
    bound: str

    def __str__(self) -> str:
        return f"{self.field} = {_short(self.value)}: {self.bound}"


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 64 else text[:64] + "..."


def _range(field: str, value: float, low: float, high: float) -> Implausible | None:
    """``value`` finite and in [low, high] (a NaN fails every comparison: refused)."""
    if low <= value <= high:
        return None
    return Implausible(field, value, f"expected a finite number in [{low:g}, {high:g}]")


_GPU = attrgetter("utilization", "memory_used_bytes", "memory_total_bytes")


def check_sample(
    sample: node_agent_pb2.TelemetrySample, bounds: TelemetryBounds, now: float | None
) -> Implausible | None:
    """The first implausible figure of ``sample``, or None when every figure is within
    ``bounds`` (``now``: the controller's wall clock, seconds since the Unix epoch; None:
    the timestamp is only checked to be finite and not negative)."""
    latest = math.inf if now is None else now + MAX_CLOCK_AHEAD_S
    if not 0.0 <= sample.timestamp <= latest or math.isinf(sample.timestamp):
        return Implausible(
            "timestamp",
            sample.timestamp,
            f"seconds since the Unix epoch, at most {MAX_CLOCK_AHEAD_S:g} s ahead of the "
            f"controller's clock ({now or 0:.0f})",
        )
    return _engine(sample.engine, bounds) or _hardware(sample)


def _engine(e: node_agent_pb2.EngineSample, bounds: TelemetryBounds) -> Implausible | None:
    running_cap = bounds.max_running
    bad = _range("engine.tokens_per_s", e.tokens_per_s, 0.0, bounds.max_tokens_per_s) or _range(
        "engine.kv_cache_usage", e.kv_cache_usage, 0.0, 1.0
    )
    if bad is not None:
        return bad
    if e.running_requests > running_cap:
        return Implausible(
            "engine.running_requests", e.running_requests, f"at most {_seats(bounds)}"
        )
    if e.queued_requests > MAX_QUEUED_PER_NODE:
        return Implausible(
            "engine.queued_requests", e.queued_requests, f"at most {MAX_QUEUED_PER_NODE}"
        )
    if e.step > MAX_STEP:
        return Implausible("engine.step", e.step, f"at most {MAX_STEP}")
    completed = e.completed_lengths
    if len(completed) > MAX_QUEUED_PER_NODE:
        return Implausible(
            "engine.completed_lengths",
            f"{len(completed)} lengths",
            f"at most {MAX_QUEUED_PER_NODE}",
        )
    if completed and max(completed) > MAX_SEQUENCE_TOKENS:
        return Implausible(
            "engine.completed_lengths", max(completed), f"tokens, at most {MAX_SEQUENCE_TOKENS}"
        )
    requests = e.requests
    if len(requests) > running_cap + MAX_QUEUED_PER_NODE:
        return Implausible(
            "engine.requests",
            f"{len(requests)} requests",
            f"at most {running_cap + MAX_QUEUED_PER_NODE} ({_seats(bounds)} running, "
            f"{MAX_QUEUED_PER_NODE} queued)",
        )
    running = 0
    for r in requests:  # each field read once: this loop is the cost of the whole check
        cap, generated, prompt = r.max_tokens, r.generated_tokens, r.prompt_tokens
        if r.instance >= 0:
            running += 1
        if cap > MAX_SEQUENCE_TOKENS:
            return _request(r, "max_tokens", cap, f"at most {MAX_SEQUENCE_TOKENS}")
        if cap and generated > cap:
            return _request(r, "generated_tokens", generated, f"at most its max_tokens ({cap})")
        if prompt + generated > MAX_SEQUENCE_TOKENS:
            return _request(
                r, "prompt_tokens+generated_tokens", prompt + generated,
                f"at most {MAX_SEQUENCE_TOKENS}",
            )  # fmt: skip
    if running > running_cap:
        return Implausible(
            "engine.requests", f"{running} running (instance >= 0)", f"at most {_seats(bounds)}"
        )
    queued = len(requests) - running
    if queued > MAX_QUEUED_PER_NODE:
        return Implausible(
            "engine.requests", f"{queued} queued (instance -1)", f"at most {MAX_QUEUED_PER_NODE}"
        )
    return None


def _seats(bounds: TelemetryBounds) -> str:
    gpus = max(1, bounds.gpus)
    if 0 < bounds.max_num_seqs <= MAX_SEATS_PER_INSTANCE:
        return f"{gpus} GPUs x {bounds.max_num_seqs} seats per instance"
    why = "not registered" if not bounds.max_num_seqs else f"{bounds.max_num_seqs} registered"
    return f"{gpus} GPUs x {MAX_SEATS_PER_INSTANCE} seats (max_num_seqs {why})"


def _request(r: node_agent_pb2.RequestProgress, field: str, value: int, bound: str) -> Implausible:
    return Implausible(
        f"engine.requests.{field}", value, f"{bound} (request {_short(repr(r.request_id))})"
    )


def _hardware(sample: node_agent_pb2.TelemetrySample) -> Implausible | None:
    gpus = sample.gpus
    if len(gpus) > MAX_GPUS_PER_NODE:
        return Implausible("gpus", f"{len(gpus)} GPUs", f"at most {MAX_GPUS_PER_NODE}")
    for util, used, total in map(_GPU, gpus):
        bad = (
            _range("gpus.utilization", util, 0.0, 1.0)
            or _range("gpus.memory_total_bytes", total, 0, MAX_GPU_MEMORY_BYTES)
            or _range("gpus.memory_used_bytes", used, 0, total)
        )
        if bad is not None:
            return bad
    layout = sample.tp_layout
    if len(layout) > MAX_GPUS_PER_NODE or (layout and max(layout) > MAX_GPUS_PER_NODE):
        return Implausible("tp_layout", list(layout[:16]), f"at most {MAX_GPUS_PER_NODE} GPUs")
    return None

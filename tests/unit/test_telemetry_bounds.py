"""Plausibility bounds on telemetry samples (fabric_controller.telemetry_bounds)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_controller import telemetry_bounds as tb
from fabric_controller.telemetry_bounds import TelemetryBounds, check_sample
from orchestrrl.v1 import node_agent_pb2 as pb

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
BOUNDS = TelemetryBounds(gpus=8, max_num_seqs=256)


def agent_like(requests: int = 64) -> pb.TelemetrySample:
    """What a busy generation node's agent sends (every field an agent fills)."""
    s = pb.TelemetrySample(node="gen0-n0", timestamp=NOW - 0.5, tp_layout=[2, 2, 2, 2])
    s.engine_state = pb.ENGINE_STATE_RUNNING
    for i in range(8):
        s.gpus.add(
            index=i, utilization=0.8, memory_used_bytes=77 << 30, memory_total_bytes=80 << 30,
            power_watts=450.0, temperature_c=60.0, sm_clock_mhz=1860.0,
            pcie_tx_bytes_per_s=1.4e8, pcie_rx_bytes_per_s=3.6e8, nvlink_tx_bytes_per_s=8.6e9,
            nvlink_rx_bytes_per_s=8.6e9, ecc_corrected=0, xid_errors=0,
        )  # fmt: skip
        s.nics.add(name=f"eth{i}", rx_bytes=10**12, tx_bytes=10**12, rx_gbps=12.5, tx_gbps=380.0)
        s.rdma.add(device=f"mlx5_{i}", port=1, tx_bytes=10**12, tx_bytes_per_s=4.9e10,
                   rx_bytes_per_s=4.9e10, cnp_sent_per_s=1e4)  # fmt: skip
    e = s.engine
    e.queued_requests, e.running_requests, e.step, e.has_progress = 3, requests, 7, True
    e.tokens_per_s, e.kv_cache_usage = 9000.0, 0.6
    for r in range(requests):
        e.requests.add(request_id=f"r{r}", instance=r % 4, prompt_tokens=512,
                       generated_tokens=(r * 37) % 4000, max_tokens=16384)  # fmt: skip
    e.requests.add(request_id="queued", instance=-1, prompt_tokens=512, max_tokens=0)
    e.completed_lengths.extend((r * 131) % 8000 + 1 for r in range(requests))
    return s


def test_an_agents_sample_is_plausible() -> None:
    assert check_sample(agent_like(), BOUNDS, NOW) is None
    assert check_sample(pb.TelemetrySample(node="n"), TelemetryBounds(gpus=1), NOW) is None
    # full seats on every GPU, a deep queue, a long request at its cap: still real
    s = agent_like(0)
    for r in range(8 * 256):
        s.engine.requests.add(request_id=f"x{r}", instance=r % 8, prompt_tokens=1000,
                              generated_tokens=32768, max_tokens=32768)  # fmt: skip
    s.engine.requests.add(request_id="long", instance=-1, prompt_tokens=1_000_000, max_tokens=0)
    s.engine.running_requests, s.engine.queued_requests = 8 * 256, 100_000
    assert check_sample(s, BOUNDS, NOW) is None


def _set(path: str, value: object) -> Callable[[pb.TelemetrySample], None]:
    def mutate(s: pb.TelemetrySample) -> None:
        *parents, leaf = path.split(".")
        target: object = s
        for p in parents:
            target = getattr(target, p)[0] if p in ("gpus", "nics", "rdma", "requests") else (
                getattr(target, p)
            )  # fmt: skip
        setattr(target, leaf, value)

    return mutate


def _add_requests(n: int, instance: int) -> Callable[[pb.TelemetrySample], None]:
    def mutate(s: pb.TelemetrySample) -> None:
        for r in range(n):
            s.engine.requests.add(request_id=f"spoof{r}", instance=instance, prompt_tokens=1)

    return mutate


NAN, INF = math.nan, math.inf
CASES: dict[str, tuple[Callable[[pb.TelemetrySample], None], str]] = {
    "tokens/s NaN": (_set("engine.tokens_per_s", NAN), "engine.tokens_per_s = nan"),
    "tokens/s inf": (_set("engine.tokens_per_s", INF), "engine.tokens_per_s = inf"),
    "tokens/s negative": (_set("engine.tokens_per_s", -1.0), "engine.tokens_per_s = -1.0"),
    "tokens/s beyond the GPUs": (
        _set("engine.tokens_per_s", 8 * tb.MAX_TOKENS_PER_S_PER_GPU * 1.01),
        "engine.tokens_per_s",
    ),
    "KV use above 1": (_set("engine.kv_cache_usage", 1.5), "engine.kv_cache_usage = 1.5"),
    "running beyond the seats": (
        _set("engine.running_requests", 8 * 256 + 1),
        "engine.running_requests = 2049: at most 8 GPUs x 256 seats per instance",
    ),
    "queue": (_set("engine.queued_requests", tb.MAX_QUEUED_PER_NODE + 1), "engine.queued_requests"),
    "step": (_set("engine.step", 1 << 40), "engine.step = 1099511627776"),
    "generated beyond the cap": (
        _set("engine.requests.generated_tokens", 16385),
        "engine.requests.generated_tokens = 16385: at most its max_tokens (16384) (request 'r0')",
    ),
    "cap beyond any context": (
        _set("engine.requests.max_tokens", 4_000_000_000),
        "engine.requests.max_tokens = 4000000000",
    ),
    "sequence beyond any context": (
        _set("engine.requests.prompt_tokens", tb.MAX_SEQUENCE_TOKENS + 1),
        "engine.requests.prompt_tokens+generated_tokens",
    ),
    "requests running beyond the seats": (
        _add_requests(8 * 256 - 64 + 1, 0),
        "engine.requests = 2049 running (instance >= 0): at most 8 GPUs x 256",
    ),
    "requests queued beyond any queue": (
        _add_requests(tb.MAX_QUEUED_PER_NODE, -1),
        "engine.requests = 131073 queued (instance -1)",
    ),
    "completed length": (
        lambda s: s.engine.completed_lengths.append(tb.MAX_SEQUENCE_TOKENS + 1),
        "engine.completed_lengths = 16777217",
    ),
    "GPU utilization": (_set("gpus.utilization", 80.0), "gpus.utilization = 80.0"),
    "GPU utilization NaN": (_set("gpus.utilization", NAN), "gpus.utilization = nan"),
    "GPU memory used beyond total": (
        _set("gpus.memory_used_bytes", 81 << 30),
        "gpus.memory_used_bytes = 86973087744",
    ),
    "timestamp NaN": (_set("timestamp", NAN), "timestamp = nan"),
    "timestamp in the future": (_set("timestamp", NOW + 7200), "timestamp = 1800007200.0"),
    "timestamp negative": (_set("timestamp", -1.0), "timestamp = -1.0"),
    "TP layout": (lambda s: s.tp_layout.append(1 << 20), "tp_layout"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_absurd_figure_is_named(case: str) -> None:
    mutate, expected = CASES[case]
    s = agent_like()
    mutate(s)
    why = check_sample(s, BOUNDS, NOW)
    assert why is not None and str(why).startswith(expected), why
    assert why.field == expected.split(" ")[0]  # a fixed name (no values in it)


def test_bounds_come_from_the_wiring_and_the_registration() -> None:
    s = agent_like(0)
    s.engine.running_requests = 4 * 256 + 1
    assert check_sample(s, TelemetryBounds(gpus=8, max_num_seqs=256), NOW) is None
    assert check_sample(s, TelemetryBounds(gpus=4, max_num_seqs=256), NOW) is not None
    # without a registered max_num_seqs the seats are a generous constant
    s.engine.running_requests = 8 * tb.MAX_SEATS_PER_INSTANCE
    assert check_sample(s, TelemetryBounds(gpus=8), NOW) is None
    s.engine.running_requests += 1
    why = check_sample(s, TelemetryBounds(gpus=8), NOW)
    assert why is not None and "max_num_seqs not registered" in str(why)
    # nor can a registration claim more seats than that
    why = check_sample(s, TelemetryBounds(gpus=8, max_num_seqs=1 << 30), NOW)
    assert why is not None and "max_num_seqs 1073741824 registered" in str(why)
    s = agent_like()
    s.engine.tokens_per_s = 2 * tb.MAX_TOKENS_PER_S_PER_GPU
    assert check_sample(s, TelemetryBounds(gpus=1), NOW) is not None
    assert check_sample(s, TelemetryBounds(gpus=2), NOW) is None
    # the ceiling: an H800 decoding the smallest RL model, with slack (about 4 M tokens/s)
    assert 3e6 < tb.MAX_TOKENS_PER_S_PER_GPU < 5e6


def test_without_a_clock_only_the_timestamps_sign_and_finiteness_are_checked() -> None:
    s = agent_like()
    s.timestamp = NOW * 10
    assert check_sample(s, BOUNDS, None) is None
    s.timestamp = math.inf
    assert check_sample(s, BOUNDS, None) is not None


def test_a_long_request_id_is_shown_bounded() -> None:
    s = agent_like()
    s.engine.requests[0].request_id = "x" * 10_000
    s.engine.requests[0].generated_tokens = 20_000
    why = check_sample(s, BOUNDS, NOW)
    assert why is not None and len(str(why)) < 300


@given(
    tokens_per_s=st.floats(0.0, 8 * tb.MAX_TOKENS_PER_S_PER_GPU),
    kv=st.floats(0.0, 1.0),
    util=st.floats(0.0, 1.0),
    running=st.integers(0, 8 * 256),
    rows=st.lists(
        st.tuples(
            st.integers(-1, 3),
            st.integers(0, 1 << 20),
            st.integers(0, 1 << 20),
            st.integers(0, 1 << 20),
        ),
        max_size=20,
    ),
)
def test_every_sample_within_the_bounds_is_plausible(
    tokens_per_s: float, kv: float, util: float, running: int, rows: list[tuple[int, ...]]
) -> None:
    s = agent_like(0)
    s.engine.tokens_per_s, s.engine.kv_cache_usage = tokens_per_s, kv
    s.engine.running_requests = running
    s.gpus[0].utilization = util
    for k, (instance, prompt, generated, cap) in enumerate(rows):
        generated = min(generated, cap) if cap else generated
        s.engine.requests.add(request_id=f"h{k}", instance=instance, prompt_tokens=prompt,
                              generated_tokens=generated, max_tokens=cap)  # fmt: skip
    assert check_sample(s, BOUNDS, NOW) is None

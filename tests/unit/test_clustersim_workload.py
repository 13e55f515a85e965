"""GRPO workload: deterministic per seed, capped, drifting longer across steps."""

from __future__ import annotations

import statistics

import pytest

from sim_backends.clustersim.scenario import WorkloadConfig
from sim_backends.clustersim.workload import median_at, step_workload, workload

pytestmark = pytest.mark.unit

CFG = WorkloadConfig(prompts_per_step=64, samples_per_prompt=8, max_response_tokens=8192)


def test_same_seed_same_requests_and_steps_independent_of_count() -> None:
    a = workload(CFG, 3, 4)
    b = workload(CFG, 3, 2)
    assert a[:2] == b
    assert step_workload(CFG, 3, 3) == a[3]
    assert workload(CFG, 4, 1) != a[:1]


def test_shape_cap_and_groups() -> None:
    wl = step_workload(CFG, 1, 0)
    assert len(wl.requests) == 64 * 8
    assert len({r.id for r in wl.requests}) == len(wl.requests)
    assert all(1 <= r.response_tokens <= 8192 for r in wl.requests)
    assert any(r.response_tokens == 8192 for r in wl.requests)  # the long tail hits the cap
    by_prompt: dict[int, set[int]] = {}
    for r in wl.requests:
        by_prompt.setdefault(r.prompt, set()).add(r.prompt_tokens)
    assert all(len(v) == 1 for v in by_prompt.values())  # samples share their prompt
    assert wl.total_tokens == wl.response_tokens + sum(r.prompt_tokens for r in wl.requests)


def test_long_tail_and_drift() -> None:
    steps = workload(CFG, 2, 6)
    medians = [statistics.median(r.response_tokens for r in s.requests) for s in steps]
    assert medians[-1] > medians[0] * 1.1
    assert median_at(CFG, 5) == pytest.approx(1500 * 1.05**5)
    lengths = sorted(r.response_tokens for r in steps[0].requests)
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 > 5 * p50  # long-tailed: the slowest responses dominate a step


def test_no_drift_keeps_the_distribution() -> None:
    cfg = WorkloadConfig(prompts_per_step=32, drift_per_step=0.0)
    a = [r.response_tokens for r in step_workload(cfg, 9, 0).requests]
    b = [r.response_tokens for r in step_workload(cfg, 9, 7).requests]
    assert abs(statistics.median(a) - statistics.median(b)) < 0.3 * statistics.median(a)

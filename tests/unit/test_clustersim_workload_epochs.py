"""A finite dataset walked over epochs: persistent prompts, shuffled order, history."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from orchestrrl import errors
from sim_backends.clustersim.scenario import WorkloadConfig, parse_scenario
from sim_backends.clustersim.workload import (
    median_at,
    previous_occurrence,
    step_workload,
    steps_per_epoch,
    workload,
)

pytestmark = pytest.mark.unit

# 10 prompts a step, 6 steps an epoch (65 prompts: 5 dropped per epoch by drop_last)
CFG = WorkloadConfig(
    prompts_per_step=10, samples_per_prompt=8, dataset_prompts=65, max_response_tokens=8192
)


def _prompts(cfg: WorkloadConfig, seed: int, step: int) -> list[int]:
    reqs = step_workload(cfg, seed, step).requests
    ids = [r.dataset_prompt for r in reqs[:: cfg.samples_per_prompt]]
    assert all(i is not None for i in ids)
    return [i for i in ids if i is not None]


def test_fresh_prompts_are_the_default_and_carry_no_history() -> None:
    wl = step_workload(WorkloadConfig(prompts_per_step=8), 1, 3)
    assert all(r.dataset_prompt is None and r.previous is None for r in wl.requests)


def test_each_epoch_is_a_seeded_shuffle_of_distinct_prompts() -> None:
    assert steps_per_epoch(CFG) == 6
    epoch0 = [p for k in range(6) for p in _prompts(CFG, 1, k)]
    epoch1 = [p for k in range(6, 12) for p in _prompts(CFG, 1, k)]
    assert len(set(epoch0)) == 60 and len(set(epoch1)) == 60  # no prompt twice per epoch
    assert set(epoch0) <= set(range(65))
    assert epoch0 != epoch1  # reshuffled
    assert epoch0 != sorted(epoch0)  # shuffled at all
    assert [p for k in range(6) for p in _prompts(CFG, 2, k)] != epoch0  # per seed
    # deterministic: the same run gives the same steps
    assert workload(CFG, 1, 3) == workload(CFG, 1, 3)


def test_a_prompt_keeps_its_prompt_tokens_across_epochs() -> None:
    tokens: dict[int, set[int]] = {}
    for k in range(18):
        for r in step_workload(CFG, 4, k).requests:
            assert r.dataset_prompt is not None
            tokens.setdefault(r.dataset_prompt, set()).add(r.prompt_tokens)
    assert all(len(v) == 1 for v in tokens.values())
    assert len(set().union(*tokens.values())) > 10  # but prompts differ


def test_history_is_the_previous_occurrence_exactly() -> None:
    first_epoch = {}
    for k in range(6):
        wl = step_workload(CFG, 3, k)
        assert all(r.previous is None for r in wl.requests)  # nothing seen before
        logs = [math.log(r.response_tokens) for r in wl.requests]
        for i in range(CFG.prompts_per_step):
            group = wl.requests[i * 8 : (i + 1) * 8]
            first_epoch[group[0].dataset_prompt] = (
                k,
                tuple(r.response_tokens for r in group),
                sum(logs) / len(logs),
            )
    for k in range(6, 12):
        for r in step_workload(CFG, 3, k).requests:
            then = first_epoch.get(r.dataset_prompt)
            if then is None:  # dropped by drop_last in epoch 0
                assert r.previous is None
                continue
            assert r.previous is not None
            assert r.previous.lengths == then[1]
            assert r.previous.step_log_mean == pytest.approx(then[2])
            assert r.previous.steps_ago == k - then[0]


def test_start_step_starts_in_a_later_epoch_at_the_stated_median() -> None:
    late = replace(CFG, start_step=8, drift_per_step=0.1)
    wl = step_workload(late, 5, 0)
    assert wl.step == 0 and {r.id.split("-")[0] for r in wl.requests} == {"s0"}
    # run step 8 is step 2 of epoch 1: the run's own steps 0-1 and 8 must agree
    same = step_workload(replace(late, start_step=0), 5, 8)
    assert [r.dataset_prompt for r in wl.requests] == [r.dataset_prompt for r in same.requests]
    assert sum(r.previous is not None for r in wl.requests) >= 8 * 9  # most seen before
    assert median_at(late, 0) == late.median_response_tokens
    # the previous epoch's lengths are those of its own (earlier, shorter) step
    seen = [r for r in wl.requests if r.previous is not None]
    assert all(r.previous is not None and r.previous.steps_ago >= 1 for r in seen)
    past = statistics.median(x for r in seen if r.previous for x in r.previous.lengths)
    now = statistics.median(r.response_tokens for r in seen)
    assert past < now


def test_prompt_history_off_passes_nothing() -> None:
    off = replace(CFG, start_step=6, prompt_history=False)
    on = replace(CFG, start_step=6)
    a, b = step_workload(off, 1, 0).requests, step_workload(on, 1, 0).requests
    assert all(r.previous is None for r in a)
    assert any(r.previous is not None for r in b)
    assert [r.response_tokens for r in a] == [r.response_tokens for r in b]


def _difficulty_correlation(cfg: WorkloadConfig) -> float:
    """Correlation between a prompt's log-mean length in epoch 1 and its previous one."""
    now, then = [], []
    for k in range(steps_per_epoch(cfg)):
        reqs = step_workload(cfg, 7, k).requests
        for i in range(cfg.prompts_per_step):
            group = reqs[i * cfg.samples_per_prompt : (i + 1) * cfg.samples_per_prompt]
            prev = group[0].previous
            if prev is None:
                continue
            now.append(statistics.fmean(math.log(r.response_tokens) for r in group))
            then.append(statistics.fmean(math.log(x) for x in prev.lengths))
    return float(np.corrcoef(now, then)[0, 1])


def test_difficulty_persists_and_its_drift_weakens_it() -> None:
    base = WorkloadConfig(
        prompts_per_step=50,
        samples_per_prompt=16,
        dataset_prompts=500,
        drift_per_step=0.0,
        start_step=10,
    )
    steady = _difficulty_correlation(replace(base, difficulty_drift_sigma=0.0))
    drifting = _difficulty_correlation(replace(base, difficulty_drift_sigma=0.6))
    assert steady > 0.8  # the prompt term dominates the 16-sample mean
    assert drifting < steady - 0.1


def test_previous_occurrence_of_a_prompt_never_met_is_none() -> None:
    assert previous_occurrence(CFG, 1, 0, 3) is None  # still in epoch 0


def _error(workload_table: dict[str, Any]) -> str:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_scenario({"cluster": {"nodes": 8}, "workload": workload_table})
    return str(info.value)


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"dataset_prompts": 10, "prompts_per_step": 64}, "workload.dataset_prompts=10"),
        ({"dataset_prompts": -1}, "workload.dataset_prompts=-1"),
        ({"start_step": 3}, "workload.start_step=3 is not valid: 0 unless"),
        ({"dataset_prompts": 640, "start_step": -2}, "workload.start_step=-2"),
        ({"difficulty_drift_sigma": -0.1}, "workload.difficulty_drift_sigma=-0.1"),
        ({"prompt_history": 1}, "workload.prompt_history=1"),
    ],
)
def test_bad_dataset_keys_name_field_value_and_what_is_allowed(
    table: dict[str, Any], needle: str
) -> None:
    assert needle in _error(table)


def test_dataset_keys_parse() -> None:
    s = parse_scenario(
        {
            "cluster": {"nodes": 8},
            "workload": {"dataset_prompts": 640, "start_step": 10, "prompt_history": False},
        }
    )
    assert s.workload.dataset_prompts == 640 and s.workload.start_step == 10
    assert s.workload.prompt_history is False
    assert s.workload.difficulty_drift_sigma == 0.3  # the stated default

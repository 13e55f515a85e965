"""Choosing the generation/training split: the pure rule, the candidates, the shell."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim_backends.clustersim.pipeline import (
    SplitOutcome,
    StepTiming,
    choose_split,
    end_to_end,
    make_fabric,
    perf_model,
    pipeline_bound,
    resolve_split,
    run_best_static,
    run_generation,
    run_pipeline,
    step_bounds,
    sweep_split,
    with_split,
)
from sim_backends.clustersim.scenario import Scenario, SplitConfig, parse_scenario

pytestmark = pytest.mark.unit


def _outcome(train: int, gen: int, step: float, bound: str = "generation") -> SplitOutcome:
    return SplitOutcome(train, gen, 8, step - 0.1, 1.0, 0.1, step, bound)


def test_choose_split_takes_the_shortest_step() -> None:
    outcomes = [_outcome(8, 56, 30.0, "training"), _outcome(16, 48, 20.0), _outcome(24, 40, 22.0)]
    assert choose_split(outcomes) == outcomes[1]
    assert choose_split(list(reversed(outcomes))) == outcomes[1]  # order does not matter


def test_choose_split_breaks_ties_toward_more_generation_gpus() -> None:
    a, b = _outcome(24, 40, 20.0), _outcome(16, 48, 20.0)
    assert choose_split([a, b]) == b
    assert choose_split([b, a]) == b


def test_choose_split_refuses_an_empty_sweep() -> None:
    with pytest.raises(ValueError, match="no split"):
        choose_split([])


def _timing(gen: float, train: float) -> StepTiming:
    step = max(gen, train) + 0.1
    return StepTiming(1, 0.0, gen, train, train, 0.0, 0.1, step, 0.0, 0.0, 0.0, False, "")


def test_pipeline_bound_names_the_side_that_set_every_step() -> None:
    assert pipeline_bound([_timing(10, 5), _timing(10, 10)]) == "generation"  # ties: gen
    assert pipeline_bound([_timing(4, 5), _timing(1, 9)]) == "training"
    assert pipeline_bound([_timing(10, 5), _timing(4, 5)]) == "mixed"


def test_candidates_keep_the_pool_total() -> None:
    auto = SplitConfig(16, 48, choose="auto")
    assert [(c.train_gpus, c.gen_gpus) for c in auto.candidates(8)] == [
        (t, 64 - t) for t in (8, 16, 24, 32, 40, 48, 56)
    ]
    listed = SplitConfig(16, 48, choose="auto", sweep_train_gpus=(24, 8))
    assert [(c.train_gpus, c.gen_gpus) for c in listed.candidates(8)] == [(8, 56), (24, 40)]
    fixed = SplitConfig(16, 48)
    assert fixed.candidates(8) == (fixed,)


def _scenario(**split: object) -> Scenario:
    return parse_scenario(
        {
            "name": "t",
            "seed": 3,
            "steps": 2,
            "cluster": {"nodes": 4, "nodes_per_pod": 2},
            "split": {"train_gpus": 8, "gen_gpus": 24, **split},
            "workload": {
                "prompts_per_step": 8,
                "samples_per_prompt": 4,
                "max_response_tokens": 2048,
            },
            "generation": {"policy": "static"},
            "fabric": {"kind": "fat-tree"},
        }
    )


def test_resolve_split_runs_the_chosen_split_of_the_sweep() -> None:
    s = _scenario(choose="auto")
    resolved, sweep = resolve_split(s)
    assert [(o.train_gpus, o.gen_gpus) for o in sweep] == [(8, 24), (16, 16), (24, 8)]
    best = choose_split(sweep)
    assert (resolved.split.train_gpus, resolved.split.gen_gpus) == (best.train_gpus, best.gen_gpus)
    assert resolved.split.choose == "fixed" and resolve_split(resolved) == (resolved, ())
    # each sweep row is the best static pipeline of that split, run on its own
    direct = run_best_static(with_split(s, 16, 16), perf_model(s))
    assert sweep[1].step_s == direct.mean_step_s and sweep[1].bound == direct.bound
    # more training GPUs: shorter training, fewer generation GPUs: longer generation
    assert sweep[0].train_s > sweep[1].train_s > sweep[2].train_s
    assert sweep[0].gen_s < sweep[2].gen_s


def test_fixed_split_is_not_swept() -> None:
    s = _scenario()
    assert resolve_split(s) == (s, ())
    assert len(sweep_split(s, perf_model(s))) == 1


def test_end_to_end_speedups_come_from_step_times() -> None:
    s = replace(_scenario(), steps=3)
    perf = perf_model(s)
    static = run_best_static(s, perf)
    gens = run_generation(s, perf, "adaptive", static.static_tp)
    adaptive = run_pipeline(
        s, perf, gens, make_fabric(s, perf), policy="adaptive", static_tp=static.static_tp
    )
    bounds = step_bounds(s, perf)
    e = end_to_end(static, adaptive, static, bounds)
    assert (e["train_gpus"], e["gen_gpus"]) == (8, 24)
    assert e["adaptive_e2e_speedup"] == pytest.approx(static.mean_step_s / adaptive.mean_step_s)
    assert e["oracle_e2e_speedup"] == 1.0
    assert e["pipeline_bound"] == {
        "static": static.bound,
        "adaptive": adaptive.bound,
        "oracle": static.bound,
    }
    assert e["train_s"] == static.mean_train_s and e["sync_s"] == static.mean_sync_s
    steady = static.steady
    expected = sum(max(bounds[x.step], x.train_s) + x.sync_s for x in steady) / len(steady)
    assert e["bound_step_s"] == pytest.approx(expected)
    assert expected <= static.mean_step_s  # generation's fluid bound: a ceiling

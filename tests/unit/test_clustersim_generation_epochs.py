"""The simulator passes a prompt's previous-epoch lengths to the planner's forecast."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.compute_problem import DEFAULT_CONFIG
from scheduler.forecast import PriorLengths, prior_log_scales
from scheduler.perf_model import default_model
from sim_backends.clustersim.generation import GenerationSim, simulate_step
from sim_backends.clustersim.scenario import WorkloadConfig
from sim_backends.clustersim.workload import step_workload

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B")
# epoch 1 of a 24-prompt dataset, 8 prompts x 4 samples a step, short responses
CFG = WorkloadConfig(
    prompts_per_step=8,
    samples_per_prompt=4,
    dataset_prompts=24,
    start_step=3,
    median_response_tokens=200.0,
    max_response_tokens=2048,
    drift_per_step=0.0,
)


def test_the_step_prior_is_built_from_every_group_history() -> None:
    reqs = step_workload(CFG, 1, 0).requests
    assert all(r.previous is not None for r in reqs)
    expected = prior_log_scales(
        {
            f"p{r.prompt}": PriorLengths(r.previous.lengths, r.previous.step_log_mean)
            for r in reqs
            if r.previous is not None
        }
    )
    assert expected  # the previous epoch says something about the groups
    sim = GenerationSim(PERF, 8, {"gen000": (4, 4)}, "adaptive", 5.0, DEFAULT_CONFIG, 2048, ())
    sim.run(reqs)
    assert sim.group_prior == expected


def test_history_reaches_the_planner_and_changes_nothing_else() -> None:
    on = step_workload(CFG, 2, 0).requests
    off = step_workload(replace(CFG, prompt_history=False), 2, 0).requests
    layout = {"gen000": (4, 4)}
    a = simulate_step(PERF, on, layout, policy="adaptive", max_response_tokens=2048)
    b = simulate_step(PERF, off, layout, policy="adaptive", max_response_tokens=2048)
    assert a.response_tokens == b.response_tokens and sorted(a.lengths) == sorted(b.lengths)
    # the first plan is made before anything has finished: only the prior tells groups apart
    assert a.predicted[0] != b.predicted[0]
    # without a history the simulation is the one of requests carrying none
    bare = [replace(r, dataset_prompt=None) for r in off]
    c = simulate_step(PERF, bare, layout, policy="adaptive", max_response_tokens=2048)
    assert c == b


def test_the_prompt_oracle_is_told_each_prompts_lengths_of_this_very_step() -> None:
    """``prompt-oracle``: the adaptive policy with a perfect epoch prior (this step's own
    lengths per prompt, no drift), whatever the requests carry; first epoch or not."""
    from sim_backends.clustersim.generation import perfect_priors

    fresh = step_workload(replace(CFG, dataset_prompts=0, samples_per_prompt=8), 1, 0).requests
    assert all(r.previous is None for r in fresh)  # nothing to learn from in the workload
    priors = perfect_priors(fresh)
    assert sorted(priors) == sorted({f"p{r.prompt}" for r in fresh})
    for g, prior in priors.items():
        assert sorted(prior.lengths) == sorted(
            r.response_tokens for r in fresh if f"p{r.prompt}" == g
        )
    sim = GenerationSim(PERF, 8, {"gen000": (4, 4)}, "prompt-oracle", 5.0, DEFAULT_CONFIG, 2048, ())
    sim.run(fresh)
    assert sim.group_prior == prior_log_scales(priors) and sim.group_prior
    # the long prompts are told apart from the start: their prior scale is the largest
    mean_len = {g: sum(p.lengths) / len(p.lengths) for g, p in priors.items()}
    assert max(sim.group_prior, key=sim.group_prior.__getitem__) == max(
        mean_len, key=mean_len.__getitem__
    )
    blind = GenerationSim(PERF, 8, {"gen000": (4, 4)}, "adaptive", 5.0, DEFAULT_CONFIG, 2048, ())
    blind.run(fresh)
    assert blind.group_prior == {}

"""RL steps under a rollout rule in the simulator: full rollout through the driver is the
pipeline's own simulation; partial rollout ends steps by its rule, carries, drops and
tags tokens as scheduler.rollout decides; the step planner moves the split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.compute_problem import PlannerConfig
from scheduler.rollout import FULL, RolloutMode, RolloutRule, StepEnd
from sim_backends.clustersim.generation import StepStop, simulate_step, uniform_layout
from sim_backends.clustersim.pipeline import (
    make_fabric,
    perf_model,
    run_generation,
    run_pipeline,
)
from sim_backends.clustersim.rollout import run_rl
from sim_backends.clustersim.scenario import Scenario, parse_scenario
from sim_backends.clustersim.workload import group_draws, group_requests, step_workload

pytestmark = pytest.mark.unit

PARTIAL = RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS)


def _scenario(**split: int) -> Scenario:
    return parse_scenario(
        {
            "name": "tiny",
            "seed": 3,
            "steps": 4,
            "cluster": {"nodes": 4},
            "split": {"train_gpus": split.get("train", 8), "gen_gpus": split.get("gen", 24)},
            "workload": {
                "prompts_per_step": 16,
                "samples_per_prompt": 8,
                "max_response_tokens": 8192,
            },
            "fabric": {"kind": "fat-tree"},
        }
    )


S = _scenario()
PERF = perf_model(S)


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_full_rollout_through_the_driver_is_the_pipeline(policy: str) -> None:
    old = run_pipeline(
        S,
        PERF,
        run_generation(S, PERF, policy, 8),
        make_fabric(S, PERF),
        policy=policy,
        static_tp=8,
    )
    new = run_rl(S, PERF, policy, 8, FULL)
    assert new.run.steps == old.steps
    assert [g.seconds for g in new.run.gens] == [g.seconds for g in old.gens]
    assert all(x.carried_out == x.dropped_responses == 0 for x in new.rollout)
    assert new.offpolicy_token_share == 0.0 and new.dropped_share == 0.0
    # every step trains the batch of the step before: 16 groups of 8
    assert [x.consumed_responses for x in new.rollout] == [0, 128, 128, 128]
    assert new.samples_per_s == pytest.approx(128 / new.mean_step_s)


def test_the_prompt_stream_is_full_rollouts_steps_at_the_step_that_starts_them() -> None:
    cfg = S.workload
    for k in range(3):
        again = [r for d in group_draws(cfg, S.seed, k) for r in group_requests(cfg, d, k)]
        assert tuple(again) == step_workload(cfg, S.seed, k).requests
    late = group_requests(cfg, group_draws(cfg, S.seed, 0)[0], 3, group="s0-p0")
    early = group_requests(cfg, group_draws(cfg, S.seed, 0)[0], 0)
    assert all(a.response_tokens >= b.response_tokens for a, b in zip(late, early, strict=True))
    assert {r.group for r in late} == {"s0-p0"}


def test_partial_rollout_conserves_responses_and_bounds_staleness() -> None:
    r = run_rl(S, PERF, "static", 8, PARTIAL)
    again = run_rl(S, PERF, "static", 8, PARTIAL)
    assert r.summary() == again.summary()  # deterministic per seed
    started = sum(x.started_groups for x in r.rollout)
    assert r.rollout[0].started_groups == 20  # 16 x 1.25 in flight
    trained = sum(x.trained_groups for x in r.rollout)
    dropped = sum(x.dropped_groups for x in r.rollout)
    last = r.rollout[-1]
    # every group started is trained, dropped, waiting or still carried at the end
    assert trained + dropped + last.waiting_groups <= started
    assert trained + dropped + last.waiting_groups + last.carried_out >= started - 20
    assert any(x.carried_out > 0 for x in r.rollout)
    for x, st in zip(r.rollout[1:], r.run.steps[1:], strict=True):
        assert st.gen_s >= st.train_s - 1e-9  # a partial step never ends before training
        assert x.trained_groups == 16  # the trainer's batch, exactly
        assert x.carried_in >= 0 and x.consumed_responses == 128
    assert 0.0 < r.offpolicy_token_share < 1.0
    assert r.offpolicy_token_share == pytest.approx(
        sum(x.consumed_offpolicy for x in r.steady) / sum(x.consumed_tokens for x in r.steady)
    )
    # full rollout on the same prompts waits for its tail: partial ends sooner
    full = run_rl(S, PERF, "static", 8, FULL)
    assert r.mean_gen_s < full.mean_gen_s


def test_no_staleness_drops_what_a_step_leaves_unfinished() -> None:
    strict = run_rl(S, PERF, "static", 8, replace(PARTIAL, max_staleness=0))
    assert sum(x.dropped_responses for x in strict.rollout) > 0
    assert strict.offpolicy_token_share == 0.0
    assert all(x.carried_in == 0 for x in strict.rollout)
    assert strict.dropped_share > 0.0


def test_the_step_stop_ends_generation_by_the_rule_and_reports_what_is_unfinished() -> None:
    reqs = [
        r for d in group_draws(S.workload, S.seed, 0)[:5] for r in group_requests(S.workload, d, 0)
    ]
    layout = uniform_layout(["gen000"], 8, 8)
    need = {f"p{i}": 8 for i in range(5)}
    full = simulate_step(PERF, reqs, layout)
    stop = StepStop(PARTIAL, 4, 0.0, need)
    part = simulate_step(PERF, reqs, layout, stop=stop)
    assert part.ready_s == part.seconds < full.seconds
    done = set(part.finished)
    groups_done = sum(all(f"s0-p{i}-r{j}" in done for j in range(8)) for i in range(5))
    assert groups_done == 4
    assert {rid for rid, _ in part.unfinished} == {r.id for r in reqs} - done
    by_id = {r.id: r for r in reqs}
    assert all(0 <= g < by_id[rid].response_tokens for rid, g in part.unfinished)
    late = simulate_step(PERF, reqs, layout, stop=replace(stop, min_end_s=full.seconds + 5.0))
    assert late.seconds == full.seconds + 5.0 and late.unfinished == ()  # all done, it waited
    timed = RolloutRule(RolloutMode.PARTIAL, 1.0, 1, StepEnd.TIME, time_budget_s=7.0)
    t = simulate_step(PERF, reqs, layout, stop=StepStop(timed, 4, 0.0, need))
    assert t.seconds == 7.0 and len(t.unfinished) > 0
    tokens = RolloutRule(RolloutMode.PARTIAL, 1.0, 1, StepEnd.TOKENS, token_budget=5000)
    tk = simulate_step(PERF, reqs, layout, stop=StepStop(tokens, 4, 0.0, need))
    generated = sum(by_id[i].response_tokens for i in tk.finished) + sum(
        g for _, g in tk.unfinished
    )
    assert generated >= 5000 and tk.seconds < full.seconds


def test_carried_requests_resume_from_their_prefix() -> None:
    reqs = [
        r for d in group_draws(S.workload, S.seed, 0)[:2] for r in group_requests(S.workload, d, 0)
    ]
    layout = uniform_layout(["gen000"], 8, 8)
    fresh = simulate_step(PERF, reqs, layout)
    ahead = [replace(r, generated=r.response_tokens // 2) for r in reqs]
    resumed = simulate_step(PERF, ahead, layout)
    assert resumed.seconds < fresh.seconds  # half of every response was already there


def test_the_step_planner_moves_nodes_to_the_side_that_bounds_the_step() -> None:
    s = replace(_scenario(train=16, gen=16), steps=4)
    r = run_rl(s, PERF, "static", 8, PARTIAL, plan_split=True)
    splits = [(x.gen_gpus, x.train_gpus) for x in r.run.steps]
    assert splits[:2] == [(16, 16), (16, 16)]  # the planner needs a measured step first
    assert len(r.plans) == 2 and all(p.startswith("step ") for p in r.plans)
    # 16 generation GPUs bound the step (training 128 responses on 16 GPUs takes ~5 s)
    assert r.run.steps[1].gen_s > 4 * r.run.steps[1].train_s
    assert r.plans[0].startswith("step 2: split 16/16 -> 24/8")
    assert splits[2:] == [(24, 8), (24, 8)] and "kept" in r.plans[1]
    assert r.run.steps[2].switch_s > 0 and r.run.steps[3].switch_s == 0.0
    assert r.run.steps[2].step_s >= r.run.steps[2].switch_s + r.run.steps[2].gen_s
    summary = r.summary()
    assert summary["splits"] == [f"{g}/{t}" for g, t in splits]
    assert {"mean_step_s", "samples_per_s", "offpolicy_token_share", "dropped_share"} <= set(
        summary
    )


@pytest.mark.parametrize("pattern", [8, 4, 2])
def test_an_adaptive_partial_step_that_keeps_its_layout_is_the_static_step(pattern: int) -> None:
    """Under partial rollout the planner dispatches a fresh batch in arrival order in turn
    (as static dispatch does) and its re-plans cost the instances nothing: a step whose
    layout it keeps (the trainer holds the step past every layout's end: no layout gains)
    is the static step, request for request. (Before, every re-plan set each instance's
    clock to the plan's time, dropping the decode iteration in progress: 0.1 % of a step
    at a 5 s interval.)"""
    reqs = [
        r
        for d in group_draws(S.workload, S.seed, 0)
        for r in group_requests(S.workload, d, 0, group=f"s0-p{d.index}")
    ]
    layout = uniform_layout(["gen000", "gen001", "gen002"], 8, pattern)
    need = {f"s0-p{i}": 8 for i in range(16)}
    history = [[r.response_tokens for r in step_workload(S.workload, S.seed, 1).requests]]
    stop = StepStop(PARTIAL, 12, 1e4, need)
    static = simulate_step(PERF, reqs, layout, stop=stop, history=history)
    adaptive = simulate_step(
        PERF,
        reqs,
        layout,
        policy="adaptive",
        stop=stop,
        history=history,
        replan_interval_s=2.0,
        config=PlannerConfig(carry_tail=True),
    )
    assert adaptive.plans > 10 and adaptive.reshards == 0
    # the same events (a re-plan splits a decode segment in two: rounding differs)
    assert adaptive.completions == pytest.approx(static.completions, rel=1e-12)
    assert adaptive.finished == static.finished
    assert adaptive.unfinished == static.unfinished

"""A split by GPU units (pools sharing a node) and Seer's divided rollout in the simulator;
the step planner's move of a few GPUs and the trainer's known batch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from orchestrrl import errors
from scheduler.forecast import build_forecast
from scheduler.perf_model import default_model
from scheduler.rollout import RolloutMode, RolloutRule, StepEnd
from scheduler.step_plan import StepLoad, TrainingRate, plan_step, split_switch_s
from sim_backends.clustersim.generation import simulate_step, static_turns, uniform_pattern
from sim_backends.clustersim.pipeline import (
    gen_layout,
    perf_model,
    pools,
    train_compute_s,
    training_step,
)
from sim_backends.clustersim.rollout import run_rl
from sim_backends.clustersim.scenario import Scenario, parse_scenario
from sim_backends.clustersim.workload import RolloutRequest, step_workload

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B")
PARTIAL = RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS)


def _scenario(split: dict[str, Any], **generation: Any) -> Scenario:
    return parse_scenario(
        {
            "name": "units",
            "seed": 3,
            "steps": 5,
            "cluster": {"nodes": 4},
            "split": split,
            "workload": {
                "prompts_per_step": 16,
                "samples_per_prompt": 8,
                "max_response_tokens": 8192,
            },
            "generation": generation,
            "fabric": {"kind": "fat-tree"},
        }
    )


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(errors.InvalidArgument) as e:
        parse_scenario({"cluster": {"nodes": 4}, **data})
    return str(e.value)


# -- the scenario keys --


def test_a_split_by_units_shares_one_node_between_the_pools() -> None:
    s = _scenario({"train_gpus": 10, "gen_gpus": 22, "unit_gpus": 2})
    assert (s.train_nodes, s.gen_nodes, s.shared_gen_gpus) == (2, 2, 6)
    # the shared node's network is the training pool's: nodes 0-1 train, 2-3 generate
    assert pools(s) == ((0, 1), (2, 3))
    # generation: two whole nodes and the shared node's 6 GPUs, at TP 4 or what divides
    assert gen_layout(s, 4) == {"gen000": (4, 4), "gen001": (4, 4), "gen002": (2, 2, 2)}
    assert gen_layout(s, 1)["gen002"] == (1,) * 6
    # training compute on its 10 GPUs exactly, its collectives on its 2 nodes
    perf = perf_model(s)
    whole = replace(s, split=replace(s.split, train_gpus=16, gen_gpus=16))
    tokens = 10**7
    part = training_step(s, perf, tokens)
    full = training_step(whole, perf, tokens)
    assert part.update_compute_s == pytest.approx(full.update_compute_s * 16 / 10)
    assert train_compute_s(s, perf, tokens) == pytest.approx(
        train_compute_s(whole, perf, tokens) * 1.6
    )


@pytest.mark.parametrize(
    ("split", "needle"),
    [
        (
            {"train_gpus": 10, "gen_gpus": 22},
            "split.train_gpus=10 is not valid: a positive multiple of 8",
        ),
        (
            {"train_gpus": 16, "gen_gpus": 16, "unit_gpus": 3},
            "split.unit_gpus=3 is not valid: 0 (whole nodes) or a divisor",
        ),
        (
            {"train_gpus": 10, "gen_gpus": 20, "unit_gpus": 2},
            "split.gen_gpus=20 is not valid: with split.unit_gpus = 2",
        ),
        ({"train_gpus": 16, "gen_gpus": 16, "unit_gpus": -2}, "split.unit_gpus=-2"),
        (
            {"train_gpus": 9, "gen_gpus": 23, "unit_gpus": 2},
            "split.train_gpus=9 is not valid: a positive multiple of 2",
        ),
    ],
)
def test_bad_split_units_name_the_key_the_value_and_what_is_allowed(
    split: dict[str, Any], needle: str
) -> None:
    assert needle in _error({"split": split})


def test_a_unit_must_own_whole_nics() -> None:
    msg = _error(
        {
            "cluster": {"nodes": 4, "nics_per_node": 2},
            "split": {"train_gpus": 16, "gen_gpus": 16, "unit_gpus": 2},
        }
    )
    assert "split.unit_gpus=2" in msg and "whole NICs" in msg
    ok = parse_scenario(
        {
            "cluster": {"nodes": 4, "nics_per_node": 2},
            "split": {"train_gpus": 12, "gen_gpus": 20, "unit_gpus": 4},
        }
    )
    assert ok.shared_gen_gpus == 4


def test_bad_chunk_tokens_name_the_key() -> None:
    msg = _error({"generation": {"chunk_tokens": 100}})
    assert "generation.chunk_tokens=100 is not valid: 0 (off) or at least 256" in msg
    assert "generation.chunk_tokens=-1" in _error({"generation": {"chunk_tokens": -1}})


@pytest.mark.parametrize(
    ("gpus", "tp", "pattern"),
    [(8, 4, (4, 4)), (6, 4, (2, 2, 2)), (2, 8, (2,)), (3, 2, (1, 1, 1)), (4, 4, (4,))],
)
def test_a_shared_nodes_pattern(gpus: int, tp: int, pattern: tuple[int, ...]) -> None:
    assert uniform_pattern(gpus, tp) == pattern


# -- static dispatch on mixed instances --


def test_static_dispatch_follows_instance_size_on_a_mixed_layout() -> None:
    """A TP4 and a TP2 instance: the TP4 one gets two requests for each of the TP2's, in
    smooth turns (nginx's weighted round robin); alike instances keep plain turns."""

    class Inst:  # what static_turns reads of an instance
        def __init__(self, name: str, tp: int) -> None:
            self.id, self.tp = name, tp

    big, small = Inst("a", 4), Inst("b", 2)
    turns = [x.id for x in static_turns([big, small], 12)]  # type: ignore[list-item]
    assert turns == ["a", "b", "a"] * 4
    alike = [Inst(n, 4) for n in "abc"]
    assert [x.id for x in static_turns(alike, 7)] == list("abcabca")  # type: ignore[arg-type]
    # a whole step on the mixed node: both instances end close together
    reqs = [RolloutRequest(f"r{i}", i, 200, 400) for i in range(12)]
    mixed = simulate_step(PERF, reqs, {"gen000": (4, 2)})
    ends = sorted(seg.busy_end for seg in mixed.segments if seg.kind == "run")
    assert len(ends) == 2 and ends[-1] - ends[0] < 0.5 * ends[-1]


# -- divided rollout --


def _step_requests(n: int = 64) -> list[RolloutRequest]:
    wl = step_workload(_scenario({"train_gpus": 8, "gen_gpus": 24}).workload, 3, 0)
    return list(wl.requests[:n])


def test_divided_rollout_moves_long_requests_and_loses_no_token() -> None:
    reqs = _step_requests()
    layout = {"gen000": (4, 4), "gen001": (4, 4)}
    plain = simulate_step(PERF, reqs, layout)
    divided = simulate_step(PERF, reqs, layout, chunk_tokens=512)
    assert divided.chunk_moves > 0 and plain.chunk_moves == 0
    # every response finishes with its own length (a chunk boundary is no completion)
    assert sorted(divided.lengths) == sorted(r.response_tokens for r in reqs)
    assert len(divided.completions) == len(reqs)
    # a chunk as long as the longest response never ends one: the same step
    none = simulate_step(PERF, reqs, layout, chunk_tokens=max(r.response_tokens for r in reqs))
    assert none.chunk_moves == 0 and none.completions == plain.completions


def test_divided_rollout_under_partial_rollout_reports_every_prefix() -> None:
    s = _scenario({"train_gpus": 8, "gen_gpus": 24}, chunk_tokens=512, policy="static")
    run = run_rl(s, perf_model(s), "static", 8, PARTIAL, warmup=2)
    assert any(g.chunk_moves for g in run.run.gens)
    for st in run.rollout:
        assert st.trained_groups + st.waiting_groups <= 20 * (st.step + 1)
    assert run.samples_per_s > 0


# -- the step planner --


FORECAST = build_forecast([[1500] * 256 + [6000] * 64], max_tokens=20480)


def test_the_planner_times_training_on_the_batch_it_trains() -> None:
    """One step asynchronous: the batch trained during a step is the one the last step
    collected, known when the step is planned."""
    rate = TrainingRate(1e-4)
    known = StepLoad(1024, 512.0, FORECAST, train_tokens=3e6)
    guess = StepLoad(1024, 512.0, FORECAST)
    assert known.training_tokens == 3e6
    assert guess.training_tokens == pytest.approx(1024 * (512.0 + FORECAST.mean_length()))
    plans = [
        plan_step(
            PERF,
            [(16, 48)],
            (16, 48),
            rule=PARTIAL,
            load=load,
            training=rate,
            sync_s=0.1,
            gpus_per_node=8,
            tps=(2, 4, 8),
            max_num_seqs=256,
            node_gbps=3200.0,
        )
        for load in (known, guess)
    ]
    assert plans[0].chosen.train_s == pytest.approx(1e-4 * 3e6 / 16)
    assert plans[1].chosen.train_s == pytest.approx(rate.seconds(guess.training_tokens, 16))


def test_moving_a_few_gpus_costs_their_own_nics() -> None:
    """A move of 2 GPUs pays the weights and the setup over their 2 NICs; a whole node's
    move is priced as before."""
    rate = TrainingRate(2e-4)  # training bounds the step: more GPUs train, the better
    load = StepLoad(1024, 512.0, FORECAST, train_tokens=3e7)
    splits = [(16, 48), (18, 46), (20, 44), (22, 42)]
    plan = plan_step(
        PERF,
        splits,
        (16, 48),
        rule=PARTIAL,
        load=load,
        training=rate,
        sync_s=0.1,
        gpus_per_node=8,
        tps=(2, 4, 8),
        max_num_seqs=256,
        node_gbps=3200.0,
    )
    moved = plan.chosen.train_gpus - 16
    assert plan.changes_split and moved == 6, plan.reason
    assert plan.switch_s == pytest.approx(split_switch_s(PERF, 1, 0, 3200.0 * moved / 8))
    assert f"moving {moved} GPU(s)" in plan.reason
    assert split_switch_s(PERF, 1, 0, 800.0) > split_switch_s(PERF, 1, 0, 3200.0)

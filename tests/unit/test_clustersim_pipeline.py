"""One-step-async pipeline: composition of generation, training and weight sync."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim_backends.clustersim.pipeline import (
    best_static,
    make_fabric,
    perf_model,
    pools,
    run_generation,
    run_pipeline,
    run_scenario,
    train_compute_s,
    with_max_num_seqs,
)
from sim_backends.clustersim.scenario import Scenario, parse_scenario

pytestmark = pytest.mark.unit


def _scenario(**over: object) -> Scenario:
    data: dict[str, object] = {
        "name": "t",
        "seed": 3,
        "steps": 3,
        "cluster": {"nodes": 6, "nodes_per_pod": 2},
        "model": {"name": "Qwen2.5-14B"},
        "split": {"train_gpus": 16, "gen_gpus": 24},
        "workload": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_response_tokens": 4096},
        "generation": {"policy": "static", "static_tp": 4},
        "fabric": {"kind": "rfabric"},
    }
    data.update(over)
    return parse_scenario(data)


def test_step_is_max_of_generation_and_training_plus_sync() -> None:
    s = _scenario()
    perf = perf_model(s)
    gens = run_generation(s, perf, "static", 4)
    res = run_pipeline(s, perf, gens, make_fabric(s, perf), policy="static", static_tp=4)
    first, *rest = res.steps
    assert first.train_s == 0.0 and first.step_s == pytest.approx(first.gen_s + first.sync_s)
    t = 0.0
    for prev, st in zip(res.steps, res.steps[1:], strict=False):
        g = gens[prev.step]
        tokens = g.response_tokens + g.prompt_tokens
        assert st.train_compute_s == pytest.approx(train_compute_s(s, perf, tokens))
        assert st.train_comm_s > 0  # two training nodes: a ring all-reduce per mini-batch
        assert st.train_s == pytest.approx(st.train_compute_s + st.train_comm_s)
        assert st.step_s == pytest.approx(max(st.gen_s, st.train_s) + st.sync_s)
    for st in res.steps:
        assert st.start_s == pytest.approx(t)
        t += st.step_s
    assert res.mean_step_s == pytest.approx(sum(x.step_s for x in rest) / len(rest))
    assert res.tokens_per_s > 0 and res.cost.total > 0
    assert set(res.link_utilisation) == {"training", "weight-sync"}


def test_training_flops_are_eight_params_per_token_at_the_mfu() -> None:
    s = _scenario()
    perf = perf_model(s)
    h, e = perf.hardware, perf.efficiency
    expected = 8 * perf.model.params * 1e6 / (16 * h.peak_flops * e.training_mfu)
    assert train_compute_s(s, perf, 1_000_000) == pytest.approx(expected)
    with_ref = replace(s, training=replace(s.training, reference_model=True))
    assert train_compute_s(with_ref, perf, 1_000_000) == pytest.approx(expected * 10 / 8)


def test_pools_put_training_first() -> None:
    assert pools(_scenario()) == ((0, 1), (2, 3, 4))


def test_rfabric_without_reconfiguration_equals_the_static_optical_run() -> None:
    s = _scenario()
    perf = perf_model(s)
    gens = run_generation(s, perf, "static", 4)
    frozen = make_fabric(s, perf, "rfabric", reconfigure=False)
    static = make_fabric(s, perf, "static-optical")
    a = run_pipeline(s, perf, gens, frozen, policy="static", static_tp=4)
    b = run_pipeline(s, perf, gens, static, policy="static", static_tp=4)
    assert [x.step_s for x in a.steps] == [x.step_s for x in b.steps]
    assert not any(x.sync_reconfigured for x in a.steps)
    assert a.cost == b.cost


def test_slack_gate_keeps_topology_when_switching_exceeds_the_idle_window() -> None:
    s = _scenario()
    perf = perf_model(s)
    gens = run_generation(s, perf, "static", 4)
    slow = make_fabric(s, perf, "rfabric", ocs_switching_s=1e5)
    res = run_pipeline(s, perf, gens, slow, policy="static", static_tp=4)
    assert all(x.sync_reconfig_s == 0.0 and x.train_reconfig_s == 0.0 for x in res.steps)
    assert not any(x.sync_reconfigured for x in res.steps)


def test_best_static_picks_the_fastest_uniform_layout() -> None:
    s = _scenario()
    tp, gens, totals = best_static(s, perf_model(s))
    assert set(totals) == {1, 2, 4, 8}
    assert totals[tp] == min(totals.values())
    assert sum(g.seconds for g in gens) == totals[tp]


@pytest.mark.parametrize("cap", [1, 16, 256, 1024])
def test_the_scenarios_max_num_seqs_caps_every_tp_of_the_performance_model(cap: int) -> None:
    """``generation.max_num_seqs`` is the engines' cap at every TP (also above the
    model's default of 256), and the simulated instances never run more."""
    s = with_max_num_seqs(_scenario(), cap)
    perf = perf_model(s)
    assert {t: perf.max_num_seqs(t) for t in (1, 2, 4, 8)} == dict.fromkeys((1, 2, 4, 8), cap)
    assert perf.model == perf_model(_scenario()).model
    gens = run_generation(s, perf, "static", 8)
    assert all(g.seconds > 0 for g in gens)


def test_run_scenario_is_deterministic_for_a_seed() -> None:
    s = _scenario(generation={"policy": "adaptive", "replan_interval_s": 3.0})
    a, b = run_scenario(s), run_scenario(s)
    assert a == b
    c = run_scenario(replace(s, seed=4))
    assert [x.step_s for x in c.steps] != [x.step_s for x in a.steps]

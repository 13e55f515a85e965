"""Scenario files: defaults, and every kind of bad input rejected before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrrl import errors
from sim_backends.clustersim.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.unit

EXAMPLES = sorted(Path(__file__).resolve().parents[2].joinpath("examples", "sim").glob("*.toml"))


def test_minimal_scenario_gets_documented_defaults() -> None:
    s = parse_scenario({"cluster": {"nodes": 8}})
    assert s.cluster.gpus == 64
    assert (s.split.train_gpus, s.split.gen_gpus) == (16, 48)  # a quarter of the nodes train
    assert s.workload.max_response_tokens == 20480
    assert s.generation.policy == "adaptive"
    assert s.fabric.kind == "rfabric" and s.fabric.ocs_switching_s == 0.010


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_scenarios_are_valid(path: Path) -> None:
    s = load_scenario(path)
    assert s.source == str(path)
    assert s.split.train_gpus + s.split.gen_gpus <= s.cluster.gpus


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_scenario(data)
    return str(info.value)


def test_unknown_keys_are_named_with_what_is_allowed() -> None:
    msg = _error({"cluster": {"nodes": 8, "gpu": 8}, "workload": {"prompts": 3}, "extra": 1})
    assert "cluster.gpu=8 is not valid: unknown key; allowed: gpus_per_node, hardware" in msg
    assert "workload.prompts=3" in msg and "prompts_per_step" in msg
    assert "extra=1" in msg and "unknown key" in msg


def test_impossible_split_names_both_fields_and_the_cluster_size() -> None:
    msg = _error({"cluster": {"nodes": 4}, "split": {"train_gpus": 16, "gen_gpus": 24}})
    assert "split.train_gpus + split.gen_gpus = 16 + 24 = 40" in msg
    assert "the cluster has 32 GPUs" in msg


def test_split_must_be_whole_nodes() -> None:
    msg = _error({"cluster": {"nodes": 4}, "split": {"train_gpus": 4, "gen_gpus": 8}})
    assert "split.train_gpus=4" in msg and "multiple of 8" in msg


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"cluster": {"nodes": -2}}, "cluster.nodes=-2"),
        (
            {"cluster": {"nodes": 8}, "workload": {"prompts_per_step": 0}},
            "workload.prompts_per_step=0",
        ),
        (
            {"cluster": {"nodes": 8}, "workload": {"max_response_tokens": -5}},
            "max_response_tokens=-5",
        ),
        (
            {"cluster": {"nodes": 8}, "fabric": {"ocs_switching_s": -0.1}},
            "fabric.ocs_switching_s=-0.1",
        ),
        ({"cluster": {"nodes": 8}, "steps": 0}, "steps=0"),
        ({"cluster": {"nodes": 8.5}}, "cluster.nodes=8.5"),
        ({"cluster": {"nodes": True}}, "cluster.nodes=True"),
        ({"cluster": {"nodes": 8}, "model": {"name": "GPT-9"}}, "model.name='GPT-9'"),
        ({"cluster": {"nodes": 8}, "generation": {"policy": "magic"}}, "generation.policy='magic'"),
        ({"cluster": {"nodes": 8}, "generation": {"static_tp": 3}}, "generation.static_tp=3"),
        ({"cluster": {"nodes": 8}, "fabric": {"kind": "torus"}}, "fabric.kind='torus'"),
        ({"cluster": {"nodes": 8}, "fabric": {"oversubscription": 0.5}}, "oversubscription=0.5"),
        ({"cluster": {"nodes": 8}, "workload": "big"}, "workload='big'"),
        ({}, "cluster is missing"),
        ({"cluster": {}}, "cluster.nodes is missing"),
    ],
)
def test_bad_values_name_field_and_value(data: dict[str, Any], needle: str) -> None:
    assert needle in _error(data)


def test_72b_does_not_fit_tp1() -> None:
    msg = _error(
        {"cluster": {"nodes": 8}, "model": {"name": "Qwen2.5-72B"}, "generation": {"static_tp": 1}}
    )
    assert "generation.static_tp=1" in msg and "fits one GPU" in msg


def test_every_problem_reported_at_once() -> None:
    msg = _error({"cluster": {"nodes": 8, "nic_gbps": -1}, "workload": {"sample_sigma": -1}})
    assert "cluster.nic_gbps=-1" in msg and "workload.sample_sigma=-1" in msg


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster\nnodes = 1")
    with pytest.raises(errors.InvalidArgument, match="not valid TOML"):
        load_scenario(bad)
    with pytest.raises(errors.InvalidArgument, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    unknown = tmp_path / "u.toml"
    unknown.write_text("[cluster]\nnodes = 2\n[workload]\nprompt = 3\n")
    with pytest.raises(errors.InvalidArgument, match=r"u\.toml: invalid scenario"):
        load_scenario(unknown)


def test_split_choose_auto_keeps_the_pool_and_an_optional_sweep() -> None:
    s = parse_scenario({"cluster": {"nodes": 8}, "split": {"choose": "auto"}})
    assert (s.split.choose, s.split.train_gpus, s.split.gen_gpus) == ("auto", 16, 48)
    assert s.split.sweep_train_gpus == ()
    listed = parse_scenario(
        {
            "cluster": {"nodes": 8},
            "split": {
                "train_gpus": 16,
                "gen_gpus": 32,
                "choose": "auto",
                "sweep_train_gpus": [8, 24],
            },
        }
    )
    assert listed.split.sweep_train_gpus == (8, 24)
    assert [c.gen_gpus for c in listed.split.candidates(8)] == [40, 24]  # total 48 kept


@pytest.mark.parametrize(
    ("split", "needle"),
    [
        ({"choose": "best"}, "split.choose='best' is not valid: one of fixed, auto"),
        ({"choose": 1}, "split.choose=1 is not valid: a str"),
        (
            {"sweep_train_gpus": [8]},
            'split.sweep_train_gpus=[8] is not valid: only with split.choose = "auto"',
        ),
        (
            {"choose": "auto", "sweep_train_gpus": 8},
            "split.sweep_train_gpus=8 is not valid: a list of integers",
        ),
        ({"choose": "auto", "sweep_train_gpus": [8, True]}, "a list of integers"),
        (
            {"choose": "auto", "sweep_train_gpus": [4]},
            "split.sweep_train_gpus=[4] is not valid: distinct",
        ),
        (
            {"choose": "auto", "sweep_train_gpus": [64]},
            "below the pool total train_gpus + gen_gpus = 64",
        ),
        ({"choose": "auto", "sweep_train_gpus": [0]}, "a positive multiple of 8 GPUs"),
        (
            {"choose": "auto", "sweep_train_gpus": [8, 8]},
            "split.sweep_train_gpus=[8, 8] is not valid: distinct",
        ),
    ],
)
def test_bad_split_choice_names_field_value_and_what_is_allowed(
    split: dict[str, Any], needle: str
) -> None:
    assert needle in _error({"cluster": {"nodes": 8}, "split": split})


def test_rollout_defaults_to_full_and_partial_keys_build_the_rule() -> None:
    s = parse_scenario({"cluster": {"nodes": 8}})
    assert s.rollout.mode == "full" and s.rollout.rule.partial is False
    p = parse_scenario(
        {
            "cluster": {"nodes": 8},
            "split": {"choose": "plan"},
            "rollout": {"mode": "partial", "over_provision": 2, "max_staleness": 2},
        }
    )
    rule = p.rollout.rule
    assert rule.partial and rule.over_provision == 2.0 and rule.max_staleness == 2
    assert rule.end.value == "groups" and p.split.choose == "plan"


@pytest.mark.parametrize(
    ("rollout", "needle"),
    [
        ({"mode": "eager"}, "rollout.mode='eager' is not valid: one of full, partial, async"),
        (
            {"mode": "partial", "over_provision": 2.5},
            "rollout.over_provision=2.5 is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"mode": "partial", "over_provision": -1},
            "rollout.over_provision=-1.0 is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"mode": "partial", "over_provision": "lots"},
            "rollout.over_provision='lots' is not valid: a number from 1.0 to 2.0",
        ),
        (
            {"over_provision": 1.5},
            'rollout.over_provision=1.5 is not valid: 1.0 unless rollout.mode = "partial"',
        ),
        (
            {"mode": "partial", "max_staleness": 1.5},
            "rollout.max_staleness=1.5 is not valid: an integer from 0 to 16",
        ),
        (
            {"mode": "partial", "max_staleness": -2},
            "rollout.max_staleness=-2 is not valid: an integer from 0 to 16",
        ),
        ({"mode": "partial", "end": "never"}, "rollout.end='never' is not valid: one of all"),
        (
            {"mode": "partial", "end": "time"},
            'rollout.time_budget_s=0.0 is not valid: a number > 0 with rollout.end = "time"',
        ),
        ({"mode": "partial", "budget": 3}, "rollout.budget=3 is not valid: unknown key"),
    ],
)
def test_bad_rollout_values_name_the_key_the_value_and_the_range(
    rollout: dict[str, Any], needle: str
) -> None:
    assert needle in _error({"cluster": {"nodes": 8}, "rollout": rollout})


# -- the asynchronous mode ([rollout] mode = "async" and the [async] table) --


def test_an_asynchronous_scenario_parses_with_either_staleness_form() -> None:
    p = parse_scenario(
        {
            "cluster": {"nodes": 4},
            "rollout": {"mode": "async", "staleness_threshold": 0.5},
            "async": {"weight_update": "relay", "repack": True, "reshard": True, "lease_s": 2},
        }
    )
    assert p.rollout.rule.asynchronous and p.rollout.rule.admission_bound == 0.5
    policy, problems = p.asynchronous.built(p.split.total_gpus, 8)
    assert problems == [] and policy is not None
    assert policy.repack and policy.reshard and policy.lease_s == 2.0
    areal = parse_scenario(
        {"cluster": {"nodes": 4}, "rollout": {"mode": "async", "max_staleness": 2}}
    )
    assert areal.rollout.rule.admission_bound == 2.0


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (
            {"weight_update": "broadcast"},
            "async.weight_update='broadcast' is not valid: one of global, relay",
        ),
        ({"pull": "later"}, "async.pull='later' is not valid: one of drain, abort"),
        ({"local_updates": 0}, "async.local_updates=0 is not valid: an integer from 1 to 64"),
        (
            {"max_lag": -2},
            "async.max_lag=-2 is not valid: -1 (no limit) or an integer from 0 to 64",
        ),
        (
            {"max_lag": 65},
            "async.max_lag=65 is not valid: -1 (no limit) or an integer from 0 to 64",
        ),
        ({"tail_fraction": 1.5}, "async.tail_fraction=1.5 is not valid: a number in (0, 1]"),
        ({"tail_fraction": 0}, "async.tail_fraction=0.0 is not valid: a number in (0, 1]"),
        (
            {"repack_interval_s": 0.01},
            "async.repack_interval_s=0.01 is not valid: a number from 0.1 to 3600 seconds",
        ),
        ({"reshard": True}, "async.reshard=True is not valid: false unless async.repack = true"),
        ({"plan_every": 0}, "async.plan_every=0 is not valid: an integer from 1 to 1000"),
        ({"lease_s": -1}, "async.lease_s=-1.0 is not valid: a number from 0 (no lease) to 600"),
        ({"lease_s": 601}, "async.lease_s=601.0 is not valid: a number from 0 (no lease) to 600"),
        (
            {"repack_lease_s": "long"},
            "async.repack_lease_s='long' is not valid: a number from 0 (no lease) to 600",
        ),
        (
            {"min_train_gpus": 12},
            "async.min_train_gpus=12 is not valid: 0 (no bound) or a multiple of 8 GPUs "
            "from 8 to 24",
        ),
        (
            {"max_train_gpus": 32},
            "async.max_train_gpus=32 is not valid: 0 (no bound) or a multiple of 8 GPUs "
            "from 8 to 24",
        ),
        (
            {"min_train_gpus": 24, "max_train_gpus": 16},
            "async.min_train_gpus=24 is not valid: at most async.max_train_gpus (16)",
        ),
        ({"versions": 1}, "async.versions=1 is not valid: an integer from 2 to 1000"),
        (
            {"versions": 4, "warmup": 4},
            "async.warmup=4 is not valid: an integer from 0 to versions - 1",
        ),
        ({"lag": 3}, "async.lag=3 is not valid: unknown key"),
    ],
)
def test_bad_async_values_name_the_key_the_value_and_the_range(
    table: dict[str, Any], needle: str
) -> None:
    data = {"cluster": {"nodes": 4}, "rollout": {"mode": "async"}, "async": table}
    assert needle in _error(data)


@pytest.mark.parametrize(
    ("rollout", "needle"),
    [
        (
            {"mode": "async", "staleness_threshold": 17},
            "rollout.staleness_threshold=17.0 is not valid: a number from 0 to 16",
        ),
        (
            {"mode": "async", "staleness_threshold": -0.5},
            "rollout.staleness_threshold=-0.5 is not valid: a number from 0 to 16",
        ),
        (
            {"mode": "full", "staleness_threshold": 0.5},
            'rollout.staleness_threshold=0.5 is not valid: 0 unless rollout.mode = "async"',
        ),
    ],
)
def test_bad_staleness_thresholds_are_refused(rollout: dict[str, Any], needle: str) -> None:
    assert needle in _error({"cluster": {"nodes": 4}, "rollout": rollout})


def test_an_async_table_needs_the_asynchronous_mode() -> None:
    err = _error({"cluster": {"nodes": 4}, "async": {"repack": True}})
    assert "rollout.mode='full' is not valid: async when the scenario has an [async] table" in err


def test_bad_optical_oversubscription_is_refused() -> None:
    err = _error({"cluster": {"nodes": 4}, "fabric": {"optical_oversubscription": 0.5}})
    assert "fabric.optical_oversubscription=0.5 is not valid: >= 1" in err


def test_verls_replay_scenarios_are_valid() -> None:
    from sim_backends.clustersim.replay import PUBLISHED, VERL_DIR

    for pub in PUBLISHED:
        s = load_scenario(VERL_DIR / pub.scenario)
        assert s.cluster.hardware == "H20" and s.rollout.rule.admission_bound == 0.5
        assert s.split.total_gpus == pub.gpus
        assert s.asynchronous.built(s.split.total_gpus, 8)[0] is not None

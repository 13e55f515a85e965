"""Scenario keys of the training traffic regimes: [parallelism], training.model and
split.placement, with the same clear errors as every other key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrrl import errors
from sim_backends.clustersim.pipeline import make_fabric, perf_model, pools, run_pipeline
from sim_backends.clustersim.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _scenario(**sections: Any) -> dict[str, Any]:
    return {
        "cluster": {"nodes": 8, "nodes_per_pod": 2},
        "split": {"train_gpus": 32, "gen_gpus": 32},
        **sections,
    }


def test_new_keys_parse_with_defaults() -> None:
    s = parse_scenario(_scenario())
    assert s.parallelism.strategy == "megatron" and s.parallelism.algorithm == "ring"
    assert s.parallelism.overlap == 0.0 and s.split.placement == "contiguous"
    assert s.training.model == ""
    s = parse_scenario(
        _scenario(
            parallelism={"strategy": "ep", "ep": 16, "overlap": 0.5, "algorithm": "auto"},
            training={"model": "Qwen3-30B-A3B"},
            split={"train_gpus": 32, "gen_gpus": 32, "placement": "scattered"},
        )
    )
    assert s.parallelism.ep == 16 and s.training.model == "Qwen3-30B-A3B"
    assert pools(s) == ((0, 2, 4, 6), (1, 3, 5, 7))


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        (
            {"parallelism": {"strategy": "zero"}},
            "parallelism.strategy='zero' is not valid: one of megatron, fsdp, ep",
        ),
        (
            {"parallelism": {"overlap": 1.5}},
            "parallelism.overlap=1.5 is not valid: a number in [0, 1]",
        ),
        ({"parallelism": {"overlap": -1}}, "parallelism.overlap=-1 is not valid: a number >= 0"),
        (
            {"parallelism": {"timing": "exact"}},
            "parallelism.timing='exact' is not valid: one of flow, bottleneck",
        ),
        ({"parallelism": {"strategy": "ep"}}, "a dense strategy: Qwen2.5-14B has no experts"),
        (
            {"parallelism": {"pp": 3}},
            "parallelism.pp=3 is not valid: a divisor of the training nodes (4)",
        ),
        ({"parallelism": {"speed": 1}}, "parallelism.speed=1 is not valid: unknown key"),
        ({"training": {"model": "GPT-5"}}, "training.model='GPT-5' is not valid: empty or one of"),
        (
            {"split": {"train_gpus": 32, "gen_gpus": 32, "placement": "random"}},
            "split.placement='random' is not valid: one of contiguous, scattered",
        ),
    ],
)
def test_bad_values_name_field_value_and_what_is_allowed(
    sections: dict[str, Any], needle: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        parse_scenario(_scenario(**sections))
    assert needle in str(exc.value)


def test_example_network_scenario_runs_fsdp_scattered_on_the_flow_model() -> None:
    s = load_scenario(ROOT / "examples/sim/network-fsdp-scattered.toml")
    assert s.parallelism.strategy == "fsdp" and s.split.placement == "scattered"
    perf = perf_model(s)
    from sim_backends.clustersim.pipeline import run_generation

    gens = run_generation(s, perf, "static", 4)
    res = run_pipeline(s, perf, gens, make_fabric(s, perf), policy="static", static_tp=4)
    st = res.steps[1]
    assert st.train_comm_s > 0 and st.train_s == pytest.approx(st.train_compute_s + st.train_comm_s)
    assert set(res.algorithms) == {"fsdp all-gather", "fsdp reduce-scatter"}
    assert set(res.algorithms.values()) <= {"ring", "hierarchical"}

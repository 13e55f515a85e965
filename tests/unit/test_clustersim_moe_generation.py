"""MoE generation in the simulator: the regime map's generation schedule and timing
against hand computations, instance placement over pods, the fabric's bandwidth for the
expert all-to-all, and a scenario running generation with Qwen3-235B-A22B."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from scheduler.perf_model import default_model
from sim_backends.clustersim import pipeline, regimes
from sim_backends.clustersim.fabrics import ClusterSpec, FabricKind, FabricOptions, build_fabric
from sim_backends.clustersim.regimes import (
    GenSchedule,
    gen_instances,
    gen_schedule,
    run_one,
    time_generation,
)
from sim_backends.clustersim.scenario import WorkloadConfig, parse_scenario
from sim_backends.clustersim.workload import RolloutRequest

pytestmark = pytest.mark.unit

MOE = default_model("Qwen3-235B-A22B")
SMALL = ClusterSpec(16, nodes_per_pod=4)


def _req(i: int, prompt: int, length: int) -> RolloutRequest:
    return RolloutRequest(f"r{i}", i, prompt, length)


def test_schedule_is_first_come_first_served_continuous_batching() -> None:
    reqs = [_req(0, 10, 3), _req(1, 20, 5), _req(2, 30, 2)]
    s = gen_schedule(reqs, 1, 32, cap=2)
    # r0 and r1 run 3 iterations (mean context 15); r0 ends, r2 joins r1 (at 23 + 30)
    assert s.segments == (((2, 3, 15.0), (2, 2, 26.5)),)
    assert s.prompt_tokens == (60,) and s.tokens == 60 + 10
    # round-robin over two instances
    two = gen_schedule(reqs, 2, 32, cap=8)
    assert two.segments == (((2, 2, 20.0), (1, 1, 12.0)), ((1, 5, 20.0),))
    assert two.prompt_tokens == (40, 20)
    with pytest.raises(errors.InvalidArgument, match="cap"):
        gen_schedule(reqs, 1, 32, cap=0)


def test_generation_time_is_prefill_then_the_decode_iterations() -> None:
    sched = GenSchedule(32, 4, (((4, 3, 1000.0), (1, 2, 2000.0)),), (2048,), 0)
    bw = 50e9 / 3

    def it(b: int, ctx: float) -> float:
        return MOE.moe_decode_breakdown(32, b, ctx, bw).total_s

    # memory-bound at these batches: the trapezoid is exact, i.e. iteration by iteration
    decode = it(4, 1000) + it(4, 1001) + it(4, 1002) + it(1, 2000) + it(1, 2001)
    expected = MOE.moe_prefill_time(32, 2048, 0, bw) + decode
    t = time_generation(MOE, sched, bw)
    assert t.seconds == pytest.approx(expected, rel=1e-12)
    net = 94 * (
        3 * MOE.moe_a2a_time(32, 4, bw)
        + 2 * MOE.moe_a2a_time(32, 1, bw)
        + MOE.moe_a2a_time(32, 8192, bw) * 2048 / 8192
    )
    assert t.network_s == pytest.approx(net)
    # the fabric's bandwidth changes only the network part
    fast = time_generation(MOE, sched, 50e9)
    assert t.seconds - fast.seconds == pytest.approx(t.network_s - fast.network_s, rel=1e-9)
    assert t.network_s > fast.network_s > 0


def test_instances_contiguous_stay_in_a_pod_and_scattered_cross_pods() -> None:
    gen = list(range(16))
    assert gen_instances(gen, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen_instances(gen, 4, "scattered") == [
        [0, 4, 8, 12],
        [1, 5, 9, 13],
        [2, 6, 10, 14],
        [3, 7, 11, 15],
    ]
    assert gen_instances(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(errors.InvalidArgument, match="placement"):
        gen_instances(gen, 4, "packed")


def test_fabric_bandwidth_for_the_generation_all_to_all() -> None:
    nic = MOE.hardware.nic_bandwidth
    bps = SMALL.node_bytes_per_s
    gen = list(range(16))
    for kind in (FabricKind.FAT_TREE, FabricKind.OVERSUBSCRIBED):
        fabric = build_fabric(kind, SMALL, FabricOptions(oversubscription=3.0), (), gen)
        inside = regimes._gen_bandwidth(fabric, gen_instances(gen, 4), MOE, bps)
        assert inside == pytest.approx(nic)  # one pod per instance: the NICs bound it
    over = build_fabric(FabricKind.OVERSUBSCRIBED, SMALL, FabricOptions(), (), gen)
    # scattered: every node sends 3/4 of its bytes out of its pod, 4 nodes per pod over
    # uplinks of 4/3 of a node: 3 U / (4/3 node) against 3/4 U / node = 3x slower
    crossing = regimes._gen_bandwidth(over, gen_instances(gen, 4, "scattered"), MOE, bps)
    assert crossing == pytest.approx(nic / 3)
    assert regimes._gen_bandwidth(over, [[0], [1]], MOE, bps) is None


def test_moe_row_step_is_max_of_generation_and_training_plus_sync() -> None:
    wl = WorkloadConfig(prompts_per_step=8, samples_per_prompt=4, max_response_tokens=2048)
    perf = default_model("Qwen2.5-72B")
    tokens = regimes.batch_tokens(16 * 8, wl, 1)
    moe = regimes.WORKLOADS[2]
    row = run_one(moe, 16, "contiguous", "fat-tree", tokens, perf, wl, 1)
    assert row["gen_s"] > 0 and row["gen_instances"] == 2 and row["gen_ep_gpus"] == 32
    assert row["step_s"] == pytest.approx(max(row["gen_s"], row["train_s"]) + row["sync_s"])
    exposed = row["gen_net_s"] if row["bound"] == "generation" else row["exposed_s"]
    assert row["exposed_s"] == pytest.approx(exposed)
    assert row == run_one(moe, 16, "contiguous", "fat-tree", tokens, perf, wl, 1)
    dense = run_one(regimes.WORKLOADS[0], 16, "contiguous", "fat-tree", tokens, perf, wl, 1)
    assert dense["gen_s"] is None and dense["bound"] == "training"
    assert dense["step_s"] == pytest.approx(dense["train_s"] + dense["sync_s"])


def test_a_moe_scenario_runs_generation_on_one_node_instances() -> None:
    doc = {
        "cluster": {"nodes": 4},
        "model": {"name": "Qwen3-235B-A22B"},
        "steps": 2,
        "split": {"train_gpus": 16, "gen_gpus": 16},
        "parallelism": {"strategy": "ep", "ep": 16},
        "workload": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_response_tokens": 1024},
        "generation": {"policy": "static"},
    }
    r = pipeline.run_scenario(parse_scenario(doc))
    assert r.static_tp == 8  # 470 GB of weights fit only a whole node
    assert all(g.seconds > 0 for g in r.gens)
    assert r.mean_step_s == pytest.approx(max(r.mean_gen_s, r.mean_train_s) + r.mean_sync_s)
    with pytest.raises(errors.InvalidArgument, match=r"generation\.static_tp=4.*Qwen3-235B"):
        parse_scenario({**doc, "generation": {"static_tp": 4}})


def test_scattered_instances_pay_the_oversubscribed_core_in_generation() -> None:
    wl = WorkloadConfig(prompts_per_step=8, samples_per_prompt=4, max_response_tokens=2048)
    perf = default_model("Qwen2.5-72B")
    tokens = regimes.batch_tokens(128 * 8, wl, 1)
    moe = regimes.WORKLOADS[2]

    def gen(placement: str, kind: str) -> dict[str, object]:
        return run_one(moe, 128, placement, kind, tokens, perf, wl, 1)

    # 128 nodes = four pods of 32, half of each generating when scattered: contiguous
    # instances stay in a pod, scattered ones have a node in each pod, and 16 nodes per pod
    # sending 3/4 of their all-to-all out exceed the pod's 32/3 nodes' worth of uplinks
    # (1.5x slower than the NICs; training's concurrent traffic is not counted)
    inside, crossing = gen("contiguous", "fat-tree-oversub"), gen("scattered", "fat-tree-oversub")
    assert inside["gen_gbps_per_gpu"] == pytest.approx(400.0)
    assert crossing["gen_gbps_per_gpu"] == pytest.approx(400.0 / 1.5)
    assert crossing["gen_net_s"] > inside["gen_net_s"]  # type: ignore[operator]
    assert crossing["gen_s"] - inside["gen_s"] == pytest.approx(  # type: ignore[operator]
        crossing["gen_net_s"] - inside["gen_net_s"]  # type: ignore[operator]
    )
    # the non-blocking fat-tree does not care where the instances are
    assert gen("scattered", "fat-tree")["gen_s"] == gen("contiguous", "fat-tree")["gen_s"]

"""Version propagation on a 4:1 core: relays, leases, the engines' load
(sim_backends.clustersim.propagation)."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from sim_backends.clustersim.pipeline import make_fabric, perf_model
from sim_backends.clustersim.propagation import (
    propagation,
    propagation_figure,
    propagation_scenario,
)

pytestmark = pytest.mark.unit


def test_the_figure_compares_leases_with_the_same_static_core() -> None:
    fig = propagation_figure()
    rows = {(r["fabric"], r["schedule"], r["lease"]): r for r in fig["rows"]}
    assert fig["rollout_gpus"] == 64 and fig["oversubscription"] == 4.0
    assert fig["weight_bytes"] == pytest.approx(65.5e9, rel=0.01)  # Qwen2.5-32B in BF16
    static = rows["static-optical", "relay", "none"]
    leased = rows["rfabric", "relay", "hidden"]
    assert fig["ratio"] == pytest.approx(static["propagation_s"] / leased["propagation_s"])
    assert leased["propagation_s"] < static["propagation_s"]
    # a lease set up in the trainer's idle window costs the wave nothing; without one the
    # OCS switching and the ToR side's settling are charged
    assert leased["reconfig_s"] == 0.0
    assert rows["rfabric", "relay", "charged"]["reconfig_s"] == pytest.approx(0.010 + 0.005)
    # relays: the model crosses the core once per rollout pod, not once per rollout node
    for core in ("fat-tree-oversub", "static-optical"):
        assert rows[core, "relay", "none"]["push_s"] < rows[core, "p2p", "none"]["push_s"]
    for r in fig["rows"]:
        assert r["propagation_s"] == pytest.approx(r["push_s"] + r["chain_s"] + r["load_s"])
        assert r["stall_s"] == r["load_s"]


def test_an_engine_stalls_only_for_its_load_from_host_memory() -> None:
    s = propagation_scenario()
    perf = perf_model(s)
    row = propagation(s, make_fabric(s, perf, "fat-tree-oversub"), tp=4)
    assert row.stall_s == pytest.approx(perf.weight_bytes_per_shard(4) / 35e9)
    assert row.chain_s > 0  # three more nodes down each rollout pod's chain


def test_bad_choices_are_refused() -> None:
    s = propagation_scenario()
    fabric = make_fabric(s, perf_model(s), "fat-tree-oversub")
    with pytest.raises(errors.InvalidArgument, match="schedule"):
        propagation(s, fabric, schedule="gossip")
    with pytest.raises(errors.InvalidArgument, match="lease"):
        propagation(s, fabric, lease="forever")

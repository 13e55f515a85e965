"""Network cost counts checked by hand on small fabrics."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from sim_backends.clustersim.cost import (
    CostBreakdown,
    Prices,
    clos_tiers,
    fat_tree_cost,
    optical_cost,
)
from sim_backends.clustersim.fabrics import ClusterSpec, FabricKind, FabricOptions, build_fabric

pytestmark = pytest.mark.unit

# 4 nodes x 2 NICs = 8 endpoints, 2 pods of 2 nodes, 4-port switches, one 8-port OCS
SMALL = ClusterSpec(nodes=4, gpus_per_node=8, nics_per_node=2, nic_gbps=400.0, nodes_per_pod=2)
OPTS = FabricOptions(switch_radix=4, ocs_ports=8, oversubscription=2.0)
UNIT = Prices(switch_port=1.0, transceiver=10.0, ocs_port=100.0, fibre=1000.0)


def _fabric(kind: FabricKind) -> CostBreakdown:
    return build_fabric(kind, SMALL, OPTS, [0, 1], [2, 3]).cost(UNIT)


def _counts(cost: CostBreakdown) -> tuple[float, float, float, float]:
    """(switch ports, transceivers, OCS ports, fibres)."""
    ports = sum(n for k, (n, _) in cost.items.items() if "port" in k and "OCS" not in k)
    trx = sum(n for k, (n, _) in cost.items.items() if k.startswith("transceiver"))
    fibre = sum(n for k, (n, _) in cost.items.items() if k.startswith("fibre"))
    return ports, trx, cost.count("OCS port"), fibre


def test_clos_tiers() -> None:
    assert clos_tiers(4, 4) == 1  # one 4-port switch
    assert clos_tiers(8, 4) == 2  # 4 leaves (2 down, 2 up) + 2 spines
    assert clos_tiers(9, 4) == 3
    assert clos_tiers(2048, 64) == 2  # 64 leaves of 32 + 32 spines of 64
    assert clos_tiers(2049, 64) == 3
    with pytest.raises(errors.InvalidArgument, match="switch_radix"):
        clos_tiers(8, 5)


def test_non_blocking_fat_tree_by_hand() -> None:
    # 4 leaves x 4 ports + 2 spines x 4 ports = 24 ports; links: 8 host + 8 leaf-spine,
    # 2 transceivers and 1 fibre each
    cost = _fabric(FabricKind.FAT_TREE)
    assert _counts(cost) == (24, 32, 0, 16)
    assert cost.total == pytest.approx(24 * 1 + 32 * 10 + 16 * 1000)
    # above the hosts: the 8 leaf-spine links (16 ports, 16 transceivers, 8 fibres)
    assert _counts(cost.above_hosts()) == (16, 16, 0, 8)


def test_oversubscribed_fat_tree_by_hand() -> None:
    # 2:1 leaves: 8 host ports + 4 uplinks; spine ports 4; links 8 host + 4 leaf-spine
    cost = _fabric(FabricKind.OVERSUBSCRIBED)
    assert _counts(cost) == (16, 24, 0, 12)


def test_rail_optimised_by_hand() -> None:
    # 2 rails, each one 4-port switch for the 4 nodes' NIC of that rail: 8 ports, 8 links
    cost = _fabric(FabricKind.RAIL)
    assert _counts(cost) == (8, 16, 0, 8)


@pytest.mark.parametrize("kind", [FabricKind.STATIC_OPTICAL, FabricKind.RFABRIC])
def test_optical_fabrics_by_hand(kind: FabricKind) -> None:
    # leaves: 8 host ports + 8 uplinks (1:1); every uplink one transceiver and one fibre
    # to the OCS; 2 pods x 4 uplinks fill the one 8-port OCS; no electrical spine
    cost = _fabric(kind)
    assert _counts(cost) == (16, 24, 8, 16)
    assert cost.total == pytest.approx(16 * 1 + 24 * 10 + 8 * 100 + 16 * 1000)


def test_ocs_count_rounds_up_and_counts_installed_ports() -> None:
    # 2 pods x 4 uplinks over 6-port OCSes: 3 ports per pod per OCS -> 2 OCSes, 12 ports
    opts = FabricOptions(switch_radix=4, ocs_ports=6)
    cost = build_fabric(FabricKind.RFABRIC, SMALL, opts, [0, 1], [2, 3]).cost(UNIT)
    assert cost.count("OCS port") == 12
    direct = optical_cost(8, 8, 2, 6, UNIT)
    assert direct == cost


def test_default_prices_2048_gpus_fat_tree_vs_rfabric() -> None:
    big = ClusterSpec(nodes=256)
    tree = build_fabric(FabricKind.FAT_TREE, big).cost()
    optical = build_fabric(FabricKind.RFABRIC, big, FabricOptions(), range(128), range(128, 256))
    # 2048 endpoints: a 2-tier Clos of 64-port switches, 3 ports per endpoint
    assert tree.count("leaf port (host-facing)") + tree.count("switch port (inter-switch)") == 6144
    # 8 pods x 256 uplinks, 40 ports per pod per 320-port OCS -> 7 OCSes
    assert optical.cost().count("OCS port") == 7 * 320
    assert optical.cost().total < tree.total


def test_a_single_pod_needs_nothing_above_its_leaves() -> None:
    one = ClusterSpec(nodes=2, nics_per_node=2, nodes_per_pod=2)  # 4 endpoints
    for kind in FabricKind:
        cost = build_fabric(kind, one, OPTS, [0], [1]).cost(UNIT)
        assert _counts(cost) == (4, 8, 0, 4), kind


def test_bad_prices() -> None:
    with pytest.raises(errors.InvalidArgument, match=r"prices\.fibre"):
        Prices(fibre=-1.0)
    with pytest.raises(errors.InvalidArgument, match="oversubscription"):
        fat_tree_cost(8, 4, 0.5)

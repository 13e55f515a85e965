"""Synthetic wirings of any size, for benchmarks and the simulator.

``synthetic_wiring(nodes=2048)`` builds pods of ``nodes_per_pod`` nodes (half the
pods training, half generation), one ToR per pod with ``uplinks_per_pod`` uplinks
spread evenly over OCSes of at most ``max_ocs_ports`` ports each.
"""

from __future__ import annotations

from typing import Any

from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Wiring


def synthetic_wiring(
    nodes: int,
    *,
    nodes_per_pod: int = 8,
    uplinks_per_pod: int = 16,
    max_ocs_ports: int = 1024,
    gpus_per_node: int = 8,
    nics_per_node: int = 8,
    nic_gbps: float = 400.0,
    switching_time_ms: float = 10.0,
    train_fraction: float = 0.5,
) -> Wiring:
    if nodes < 2 or nodes % nodes_per_pod:
        raise ValueError(f"nodes={nodes} must be a multiple of nodes_per_pod={nodes_per_pod}")
    pods = nodes // nodes_per_pod
    if pods < 2:
        raise ValueError("need at least two pods")
    total_ports = pods * uplinks_per_pod
    n_ocs = max(1, -(-total_ports // max_ocs_ports))
    while uplinks_per_pod % n_ocs:
        n_ocs += 1
    per_ocs = uplinks_per_pod // n_ocs
    ports_per_ocs = pods * per_ocs
    n_train = max(1, min(pods - 1, round(pods * train_fraction)))
    doc: dict[str, Any] = {
        "cluster": {"name": f"synthetic-{nodes}", "controller": "127.0.0.1:0"},
        "ocs": [
            {"name": f"ocs{i}", "address": "127.0.0.1:0", "ports": max(2, ports_per_ocs),
             "switching_time_ms": switching_time_ms}
            for i in range(n_ocs)
        ],
        "pod": [], "tor": [], "node": [],
    }  # fmt: skip
    for p in range(pods):
        name = f"pod{p}"
        role = "train" if p < n_train else "gen"
        doc["pod"].append({"name": name})
        doc["tor"].append(
            {
                "name": f"tor{p}",
                "pod": name,
                "uplinks": [
                    {"port": f"up{o}-{k}", "ocs": f"ocs{o}", "ocs_port": p * per_ocs + k + 1}
                    for o in range(n_ocs)
                    for k in range(per_ocs)
                ],
            }
        )
        for n in range(nodes_per_pod):
            doc["node"].append(
                {
                    "name": f"{name}-n{n}", "pod": name, "role": role,
                    "agent": "127.0.0.1:0", "gpus": gpus_per_node,
                    "nics": [
                        {"name": f"eth{k}", "tor": f"tor{p}", "tor_port": f"n{n}-{k}",
                         "gbps": nic_gbps}
                        for k in range(nics_per_node)
                    ],
                }
            )  # fmt: skip
    return wiring_mod.validate(doc, f"synthetic-{nodes}")

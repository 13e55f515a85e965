"""`orlctl local up` serves Prometheus /metrics on every daemon that has them (the
controller and each agent; the simulated OCS has none), on ephemeral loopback ports
that `orlctl local status` lists (issue 14). A two-node cluster of real daemons."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrrl import wiring as wiring_mod
from sim_backends.synthetic import synthetic_wiring

pytestmark = pytest.mark.component


ORLCTL = [sys.executable, "-m", "fabric_controller.cli"]


def orlctl(*args: str) -> str:
    r = subprocess.run([*ORLCTL, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"orlctl {' '.join(args)} exited {r.returncode}:\n{r.stderr}"
    return r.stdout


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[dict[str, Any], Path]]:
    w = synthetic_wiring(
        2, nodes_per_pod=1, uplinks_per_pod=2, max_ocs_ports=8, gpus_per_node=2, nics_per_node=1
    )
    path = tmp_path / "wiring.toml"
    path.write_text(wiring_mod.to_toml(w))
    run_dir = tmp_path / "run"
    args = ["local", "up", "--wiring", str(path), "--run-dir", str(run_dir), "--ephemeral-ports"]
    up = json.loads(orlctl("--json", *args))
    try:
        yield up, run_dir
    finally:
        orlctl("local", "down", "--run-dir", str(run_dir))


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text: str = r.read().decode()
    return text


def test_every_daemon_serves_metrics_listed_by_local_status(
    cluster: tuple[dict[str, Any], Path],
) -> None:
    up, run_dir = cluster
    roles = {p["name"]: (p["role"], p["metrics"]) for p in up["procs"]}
    assert roles["ocs0"] == ("ocs", "")  # orl-sim-ocs has no metrics
    for name, (role, metrics) in roles.items():
        if role == "ocs":
            continue
        assert metrics.startswith("127.0.0.1:") and not metrics.endswith(":0"), (name, metrics)
        text = scrape(metrics)
        assert ("orl_epoch " if role == "controller" else "orl_agent_registered ") in text, name

    status = json.loads(orlctl("--json", "local", "status", "--run-dir", str(run_dir)))
    assert {r["name"]: r["metrics"] for r in status["procs"]} == {
        n: m for n, (_, m) in roles.items()
    }
    text = orlctl("local", "status", "--run-dir", str(run_dir))
    assert f"metrics http://{roles['controller'][1]}/metrics" in text, text

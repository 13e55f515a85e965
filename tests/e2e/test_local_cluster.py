"""The real daemons as subprocesses, driven through orlctl, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrrl import wiring as wiring_mod
from orchestrrl.v1 import optical_switch_pb2, optical_switch_pb2_grpc

pytestmark = pytest.mark.e2e

ORLCTL = [sys.executable, "-m", "fabric_controller.cli"]


def orlctl(*args: str, check: bool = True, env: dict[str, str] | None = None) -> Any:
    r = subprocess.run([*ORLCTL, *args], capture_output=True, text=True, timeout=120, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"orlctl {' '.join(args)} exited {r.returncode}:\n{r.stderr}")
    return r


def orljson(*args: str, env: dict[str, str] | None = None) -> Any:
    return json.loads(orlctl("--json", *args, env=env).stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("run")
    up = orljson("local", "up", "--run-dir", str(run_dir), "--ephemeral-ports")
    try:
        yield {**up, "run_dir_path": run_dir}
    finally:
        down = orljson("local", "down", "--run-dir", str(run_dir))
        assert all("stopped" in line for line in down["stopped"]), down
        for proc in up["procs"]:
            assert not Path(f"/proc/{proc['pid']}").exists() or _zombie(proc["pid"]), proc


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def ocs_table(address: str) -> set[tuple[str, int, int]]:
    with grpc.insecure_channel(address) as ch:
        r = optical_switch_pb2_grpc.OpticalSwitchStub(ch).ListCrossConnects(
            optical_switch_pb2.ListCrossConnectsRequest(), timeout=5
        )
    return {("ocs0", x.a, x.b) for x in r.cross_connects}


def test_local_cluster_walks_phases_through_orlctl(cluster: dict[str, Any]) -> None:
    ctl = ["--controller", cluster["controller"]]
    ocs = next(p for p in cluster["procs"] if p["role"] == "ocs")

    nodes = orljson(*ctl, "nodes")
    assert len(nodes) == 8
    assert all(n["health"] == "up" for n in nodes), nodes
    assert all(n["gpu_backend"] == "sim" for n in nodes)

    r = orljson(*ctl, "phase", "set", "weight-sync")
    assert r["phase"] == "weight-sync" and r["changed"] and r["epoch"] >= 1
    assert len(r["circuits"]) == 16
    got = orljson(*ctl, "phase", "get")
    assert (got["epoch"], got["phase"]) == (r["epoch"], "weight-sync")
    want = {(c["ocs"], c["a"], c["b"]) for c in r["circuits"]}
    assert {(c["ocs"], c["a"], c["b"]) for c in got["circuits"]} == want
    assert ocs_table(ocs["address"]) == want

    # ORL_CONTROLLER selects the controller too; options may follow the sub-command
    env = {**os.environ, "ORL_CONTROLLER": cluster["controller"]}
    plan = json.loads(orlctl("phase", "plan", "training", "--json", env=env).stdout)
    assert len(plan["added"]) == 8 and len(plan["removed"]) == 16
    assert ocs_table(ocs["address"]) == want  # planning changed nothing

    t = orlctl(*ctl, "topology", "show").stdout
    assert "cluster local-8node: 4 pods, 8 nodes" in t and "gen0 <-> train0: 4 circuit(s)" in t
    text = orlctl(*ctl, "nodes").stdout
    assert text.count(" up ") == 8


def test_bad_input_gives_one_clear_error_and_changes_nothing(cluster: dict[str, Any]) -> None:
    ctl = ["--controller", cluster["controller"]]
    before = orljson(*ctl, "phase", "get")
    r = orlctl(*ctl, "phase", "set", "warmup", check=False)
    assert r.returncode == 2
    assert "invalid choice: 'warmup'" in r.stderr and "weight-sync" in r.stderr
    assert orljson(*ctl, "phase", "get") == before


def test_local_status_and_double_up(cluster: dict[str, Any]) -> None:
    run_dir = str(cluster["run_dir_path"])
    st = orljson("local", "status", "--run-dir", run_dir)
    assert st["running"] and all(p["alive"] for p in st["procs"])
    assert sorted({p["role"] for p in st["procs"]}) == ["agent", "controller", "ocs"]
    again = orlctl("local", "up", "--run-dir", run_dir, "--ephemeral-ports", check=False)
    assert again.returncode == 1 and "already running" in again.stderr


def test_unreachable_controller_is_a_clear_error(tmp_path: Path) -> None:
    r = orlctl("--controller", "127.0.0.1:1", "--timeout", "2", "phase", "get", check=False)
    assert r.returncode == 1
    assert "controller 127.0.0.1:1: GetPhase" in r.stderr and "UNAVAILABLE" in r.stderr


def test_config_check(tmp_path: Path) -> None:
    ok = orlctl("config", "check", str(wiring_mod.default_wiring_path()))
    assert "valid wiring for cluster 'local-8node'" in ok.stdout
    data = orljson("config", "check", str(wiring_mod.default_wiring_path()))
    assert len(data["node"]) == 8
    bad = tmp_path / "bad.toml"
    bad.write_text(
        wiring_mod.default_wiring_path().read_text().replace("ocs_port = 2 ", "ocs_port = 1 ", 1)
    )
    r = orlctl("config", "check", str(bad), check=False)
    assert r.returncode == 2
    assert "port 1 of OCS 'ocs0' is already cabled to tor 'tor-train0'.uplinks[0]" in r.stderr
    j = orlctl("--json", "config", "check", str(bad), check=False)
    assert json.loads(j.stdout)["error"]["kind"] == "WiringError"


def test_python_client_phase_context_manager(cluster: dict[str, Any]) -> None:
    from orchestrrl.client import Client

    with Client(cluster["controller"], timeout_s=10) as orl:
        orl.set_phase("generation")
        with orl.phase("weight-sync") as change:
            assert change.phase == "weight-sync"
            assert orl.get_phase().phase == "weight-sync"
        assert orl.get_phase().phase == "generation"
        with pytest.raises(RuntimeError, match="sync failed"), orl.phase("weight-sync"):
            raise RuntimeError("sync failed")
        assert orl.get_phase().phase == "generation"


def test_events_and_plan_commands(cluster: dict[str, Any]) -> None:
    ctl = ["--controller", cluster["controller"]]
    orlctl(*ctl, "phase", "set", "training")
    lines = orlctl(*ctl, "--json", "events", "--recent", "50").stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert {"node_registered", "epoch_committed"} <= {e["kind"] for e in events}
    # (not only the newest few: the compute-scheduling loop records events of its own,
    # reshards of the generation nodes, at any time)
    text = orlctl(*ctl, "events", "--recent", "50").stdout
    assert "epoch_committed" in text
    plan = orljson(*ctl, "plan", "phase", "weight-sync")
    assert len(plan["added"]) == 16 and len(plan["removed"]) == 8


def test_weight_sync_moves_a_checkpoint_to_every_generation_node(cluster: dict[str, Any]) -> None:
    """A trainer publishes a checkpoint into its agent's directory; `phase set weight-sync
    --checkpoint --from` commits the circuits, every generation agent fetches and loads it,
    and `orlctl nodes` shows the version."""
    import time

    from fabric_controller.local import checkpoint_dir
    from sim_backends.tiny_models import TinyShape, write_checkpoint

    ctl = ["--controller", cluster["controller"]]
    shape = TinyShape(layers=1, hidden=64, head_dim=32, intermediate=128, vocab=128)
    published = write_checkpoint(checkpoint_dir(cluster["run_dir_path"], "train0-n0"), "7", shape)
    r = orljson(*ctl, "phase", "set", "weight-sync", "--checkpoint", "7", "--from", "train0-n0")
    ws = r["weight_sync"]
    assert r["phase"] == "weight-sync" and ws["complete"], ws
    assert ws["checksum"][:16] == published.name.split("-")[1]
    assert {n["node"] for n in ws["nodes"]} == {"gen0-n0", "gen0-n1", "gen1-n0", "gen1-n1"}
    assert all(n["ok"] and n["version"] == "7" and n["bytes_fetched"] > 0 for n in ws["nodes"])
    for n in ws["nodes"]:  # each generation agent holds it, verified
        assert (checkpoint_dir(cluster["run_dir_path"], n["node"]) / published.name).is_dir()
    text = orlctl(*ctl, "phase", "set", "weight-sync", "--checkpoint", "7", "--from", "train0-n0")
    assert "every generation node runs it" in text.stdout and "(had it)" in text.stdout
    # a version nobody has: refused before any circuit moves, exit status 1
    bad = orlctl(*ctl, "phase", "set", "weight-sync", "--checkpoint", "8", "--from", "train0-n0",
                 check=False)  # fmt: skip
    assert bad.returncode == 1 and "no checkpoint 8" in bad.stderr
    half = orlctl(*ctl, "phase", "set", "training", "--checkpoint", "7", check=False)
    assert half.returncode == 2 and "--from" in half.stderr
    deadline = time.monotonic() + 30
    while True:  # the agents report the version with their next telemetry upload
        nodes = {n["node"]: n for n in orljson(*ctl, "nodes")}
        if all(nodes[g]["weight_version"] == "7" for g in ws_nodes(ws)):
            break
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)
    assert " 7 " in orlctl(*ctl, "nodes").stdout


def ws_nodes(ws: dict[str, Any]) -> list[str]:
    return [n["node"] for n in ws["nodes"]]

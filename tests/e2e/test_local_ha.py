"""`orlctl local up --ha`: a 3-member etcd cluster and two controllers as subprocesses,
driven through orlctl as a user would; the leader is killed and the standby takes over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sim_backends.etcd_cluster import INSTALL, etcd_binary
from tests.e2e.test_local_cluster import orlctl, orljson

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(etcd_binary() is None, reason=f"etcd is not installed: {INSTALL}"),
]


def etcd_members(run_dir: Path) -> list[int]:
    """The etcd processes whose data lives in ``run_dir``."""
    pattern = f"etcd --name .*--data-dir {run_dir.resolve()}/"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("run")
    up = orljson("local", "up", "--run-dir", str(run_dir), "--ephemeral-ports", "--ha")
    assert len(etcd_members(run_dir)) == 3
    try:
        yield {**up, "run_dir_path": run_dir}
    finally:
        down = orljson("local", "down", "--run-dir", str(run_dir))
        assert all("stopped" in line for line in down["stopped"]), down
        assert etcd_members(run_dir) == []  # the members went with their supervisor


def roles(run_dir: Path) -> dict[str, str]:
    r = orlctl("--json", "local", "status", "--run-dir", str(run_dir), check=False)
    return {p["name"]: p["ha_role"] for p in json.loads(r.stdout)["procs"] if "ha_role" in p}


def roles_once(run_dir: Path, settled: Callable[[dict[str, str]], bool]) -> dict[str, str]:
    """The controllers' roles once ``settled`` holds: a standby learns who leads from a
    watch, and a controller asked on a busy machine may not answer within `local status`'s
    2 s (it then shows "not answering")."""
    deadline = time.monotonic() + 60
    while not settled(seen := roles(run_dir)):
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    return seen


def led_by_one(controllers: dict[str, str]) -> Callable[[dict[str, str]], bool]:
    """One controller leads and every other names it."""

    def check(seen: dict[str, str]) -> bool:
        leaders = [name for name, role in seen.items() if role == "leader"]
        return len(leaders) == 1 and all(
            role == f"standby (leader {controllers[leaders[0]]})"
            for name, role in seen.items()
            if name != leaders[0]
        )

    return check


def test_one_controller_leads_and_the_other_names_it(ha: dict[str, Any]) -> None:
    controllers = {p["name"]: p["address"] for p in ha["procs"] if p["role"] == "controller"}
    assert len(controllers) == 2 and ha["controller"] == ",".join(controllers.values())
    assert [p["role"] for p in ha["procs"]].count("etcd") == 1
    seen = roles_once(ha["run_dir_path"], led_by_one(controllers))
    assert sorted(seen.values()).count("leader") == 1 and set(seen) == set(controllers)


def test_the_standby_takes_over_when_the_leader_is_killed(ha: dict[str, Any]) -> None:
    env = {**os.environ, "ORL_CONTROLLER": ha["controller"]}
    controllers = {p["name"]: p["address"] for p in ha["procs"] if p["role"] == "controller"}
    first = orljson("phase", "set", "generation", "--request-id", "ha-e2e-1", env=env)
    seen = roles_once(ha["run_dir_path"], led_by_one(controllers))
    leader = next(name for name, role in seen.items() if role == "leader")
    pid = next(p["pid"] for p in ha["procs"] if p["name"] == leader)
    os.kill(pid, signal.SIGKILL)
    # the client follows the list of controllers: this waits out the 2 s lease
    second = orljson("--timeout", "20", "phase", "set", "training", env=env)
    assert second["epoch"] == first["epoch"] + 1
    # a retried request id gets its first outcome from the new leader
    again = orljson("phase", "set", "generation", "--request-id", "ha-e2e-1", env=env)
    assert again["epoch"] == first["epoch"]
    (new,) = set(controllers) - {leader}
    seen = roles_once(ha["run_dir_path"], lambda seen: seen[new] == "leader")
    assert seen[leader].startswith("not answering"), seen

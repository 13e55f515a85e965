"""`orl-testbed` refusing bad input without creating anything, and `down` removing a
testbed whose `up` was killed with SIGKILL half-way."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrrl import wiring as wiring_mod
from sim_backends import netns
from sim_backends.synthetic import synthetic_wiring
from sim_backends.testbed.resources import PROCESS_MB, read_machine
from sim_backends.testbed.state import marked_pids

pytestmark = pytest.mark.netns

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-8node.toml"


def cli(*args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
    prefix = []
    if user is not None:
        prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    return subprocess.run(
        [*prefix, sys.executable, "-m", "sim_backends.testbed.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


def nothing_of(tid: str, run_dir: Path) -> None:
    assert not netns.namespaces_with_prefix(f"{tid}-")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{tid}-" not in links
    assert not marked_pids(tid)
    assert not run_dir.exists()


def base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


_ids = iter("abcdefghijklmnopqrstuvwxyz")


@pytest.fixture
def tid(netns_ready: None) -> Iterator[str]:
    """``zl<pid in base 36><letter>``: fresh per test, recognisable once its process is
    dead (the testbeds of a killed earlier run are removed first); always removed."""
    for name in netns.namespaces_with_prefix("zl"):
        old = name.split("-", 1)[0]
        with contextlib.suppress(ValueError):
            if not Path(f"/proc/{int(old[2:-1], 36)}").exists():
                cli("down", "--id", old)
    testbed = f"zl{base36(os.getpid())}{next(_ids)}"
    try:
        yield testbed
    finally:
        cli("down", "--id", testbed)


def test_a_wiring_too_large_for_the_machine_is_refused_first(tid: str, tmp_path: Path) -> None:
    machine = read_machine()  # 1.5 times what this machine's memory can hold
    nodes = 64 * max(2, math.ceil(machine.mem_available_mb / PROCESS_MB * 1.5 / 64))
    big = tmp_path / "big.toml"
    big.write_text(wiring_mod.to_toml(synthetic_wiring(nodes, nodes_per_pod=64)))
    run_dir = tmp_path / "run"
    result = cli("up", "--wiring", str(big), "--id", tid, "--run-dir", str(run_dir))
    assert result.returncode == 1, result.stderr
    assert "is too large for this machine" in result.stderr
    found = re.search(r"memory: (\d+) daemons \(64 MB each\)", result.stderr)
    assert found and int(found.group(1)) > nodes  # agents, the controller, the OCSes
    assert "use a wiring with fewer nodes" in result.stderr
    assert "nothing was created" in result.stderr
    nothing_of(tid, run_dir)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_without_root_it_says_so_and_creates_nothing(tid: str, tmp_path: Path) -> None:
    probe = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", "import sim_backends"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if probe.returncode:
        pytest.skip(
            "this checkout is not readable by an unprivileged user (uid 65534), so the "
            f"testbed cannot be started as one: {probe.stderr.strip().splitlines()[-1]}"
        )
    run_dir = tmp_path / "run"
    result = cli("up", "--wiring", str(EXAMPLE), "--id", tid, "--run-dir", str(run_dir), user=65534)
    assert result.returncode == 1
    assert "the testbed needs root" in result.stderr and "uid 65534" in result.stderr
    nothing_of(tid, run_dir)


def test_a_wiring_the_testbed_cannot_model_is_invalid_input(tid: str, tmp_path: Path) -> None:
    odd = tmp_path / "two-tors.toml"
    # a valid wiring (the second ToR cabled to a second OCS) that the testbed cannot model
    odd.write_text(
        EXAMPLE.read_text()
        + '\n[[ocs]]\nname = "ocs1"\naddress = "127.0.0.1:50062"\nports = 2\n'
        + '\n[[tor]]\nname = "tor-gen0b"\npod = "gen0"\n'
        + 'uplinks = [{ port = "up0", ocs = "ocs1", ocs_port = 1 }]\n'
    )
    run_dir = tmp_path / "run"
    result = cli("up", "--wiring", str(odd), "--id", tid, "--run-dir", str(run_dir))
    assert result.returncode == 2, result.stderr
    assert "pod 'gen0' has 2 ToRs: the testbed models exactly one ToR per pod" in result.stderr
    nothing_of(tid, run_dir)


def test_a_bad_id_is_invalid_input(tmp_path: Path, netns_ready: None) -> None:
    result = cli("up", "--wiring", str(EXAMPLE), "--id", "Orl-1", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    assert "--id='Orl-1' is not valid: 1-8 characters" in result.stderr


def test_down_removes_everything_after_up_was_killed_half_way(tid: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "sim_backends.testbed.cli", "up", "--wiring", str(EXAMPLE),
         "--id", tid, "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "ready" / "ocs-ocs0.addr").exists():  # a daemon is running
            assert up.poll() is None and time.monotonic() < deadline, "up ended or stalled"
            time.sleep(0.02)
    finally:
        up.send_signal(signal.SIGKILL)
        up.wait()
    assert netns.namespaces_with_prefix(f"{tid}-") and marked_pids(tid)  # orphans remain
    status = cli("status", "--id", tid, "--run-dir", str(run_dir))
    assert "namespaces (13)" in status.stdout
    down = cli("down", "--id", tid, "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert "deleted 13 namespace(s)" in down.stdout
    nothing_of(tid, run_dir)
    again = cli("down", "--id", tid)
    assert again.returncode == 0 and "nothing to remove" in again.stdout

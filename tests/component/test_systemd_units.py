"""The shipped systemd units: systemd-analyze accepts them, and every flag they pass
exists in the daemon they start."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fabric_controller.main import build_parser as controller_parser
from node_agent.config import build_parser as agent_parser
from sim_backends.ocs_server import _parser as ocs_parser

pytestmark = pytest.mark.component

UNITS = Path(__file__).parents[2] / "systemd"
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "orl-fabric-controller.service": controller_parser,
    "orl-fabric-controller-ha.service": controller_parser,
    "orl-node-agent.service": agent_parser,
    "orl-sim-ocs.service": ocs_parser,
}


def exec_start(unit: str) -> list[str]:
    text = (UNITS / unit).read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split()


@pytest.mark.parametrize("unit", sorted(PARSERS))
def test_unit_flags_exist_in_the_daemon(unit: str) -> None:
    known = {o for a in PARSERS[unit]()._actions for o in a.option_strings}
    flags = [w for w in exec_start(unit)[1:] if w.startswith("--")]
    assert flags, unit
    assert set(flags) <= known, set(flags) - known


@pytest.mark.parametrize("unit", sorted(PARSERS))
def test_systemd_analyze_verify_accepts_the_unit(unit: str, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    venv_bin = str(Path(sys.executable).parent) + "/"
    text = (UNITS / unit).read_text().replace("/opt/orchestrrl/.venv/bin/", venv_bin)
    copy = tmp_path / unit
    copy.write_text(text)
    r = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line for line in (r.stdout + r.stderr).splitlines()
        if line.strip() and not re.search(r"Failed to (connect|prepare filename)", line)
    ]  # fmt: skip
    assert r.returncode == 0 and not problems, problems


# `systemd-analyze security` exposure (0 best, 10 worst) of each unit as shipped: a change
# that loosens the sandbox fails here. Lower a limit when a unit gets tighter; raise one
# only with the reason in the unit's comments. Issue 16's targets: agent <= 4.5, OCS <= 2.5.
EXPOSURE_LIMITS = {
    "orl-fabric-controller.service": 3.8,
    "orl-fabric-controller-ha.service": 3.8,
    "orl-node-agent.service": 2.4,
    "orl-sim-ocs.service": 1.1,
}
EXPOSURE_RE = re.compile(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)")


def _systemd_analyze_offline() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    r = subprocess.run(["systemd-analyze", "--help"], capture_output=True, text=True, timeout=60)
    if "--offline" not in r.stdout:
        pytest.skip("systemd-analyze lacks --offline (systemd >= 250 has it)")


def test_every_unit_has_an_exposure_limit() -> None:
    assert (
        sorted(EXPOSURE_LIMITS)
        == sorted(PARSERS)
        == sorted(p.name for p in UNITS.glob("*.service"))
    )


@pytest.mark.parametrize("unit", sorted(EXPOSURE_LIMITS))
def test_systemd_analyze_security_exposure_does_not_regress(unit: str) -> None:
    _systemd_analyze_offline()
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(UNITS / unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = EXPOSURE_RE.search(r.stdout)
    assert match, f"no exposure level in the output of systemd-analyze:\n{r.stdout}{r.stderr}"
    exposure = float(match.group(1))
    failing = "\n".join(line for line in r.stdout.splitlines() if line.startswith("✗"))
    assert exposure <= EXPOSURE_LIMITS[unit], (
        f"{unit} scores {exposure}, above its limit {EXPOSURE_LIMITS[unit]}: a sandbox "
        f"setting was loosened. Open ones:\n{failing}"
    )

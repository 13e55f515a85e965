"""Files that are not wirings, at the CLI, at the controller's start and on its SIGHUP
reload: an endless device, binary bytes, 5,000 nested arrays, 20,000 problems. Each is
refused by one bounded message naming the file (and the position), never a traceback,
and a reload keeps the last good wiring."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from tests.e2e.test_controller_crash import start_controller

pytestmark = pytest.mark.e2e

GOOD = wiring_mod.default_wiring_path().read_text()
# what each bad file's message must say
EXPECTED = {
    "endless": "larger than 16,777,216 bytes",
    "binary": "not UTF-8 text at line 3, column 15 (byte 35: 0xff)",
    "deep": "nested more than 64 deep (at line 1, column 69)",
    "many": "20000 problem(s) in the wiring:",
}


def write_bad(path: Path, kind: str) -> None:
    """Make ``path`` the bad file ``kind`` (replacing what is there in one step)."""
    tmp = path.with_suffix(".new")
    tmp.unlink(missing_ok=True)
    if kind == "endless":
        tmp.symlink_to("/dev/zero")
    elif kind == "binary":
        tmp.write_bytes(b'[cluster]\nname = "x"\ncontroller = "\xff\xfe"\n' + GOOD.encode())
    elif kind == "deep":
        tmp.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n" + GOOD)
    else:
        tmp.write_text("".join(f"unknown{i} = {i}\n" for i in range(20_000)) + GOOD)
    tmp.replace(path)


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_cli_and_controller_start_refuse_a_bad_wiring(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.toml"
    write_bad(path, kind)
    r = run("fabric_controller.cli", "config", "check", str(path))
    assert r.returncode == 2 and r.stdout == "", r.stderr[-3000:]
    prefix = "orlctl: error: "
    assert r.stderr.startswith(f"{prefix}{path}: ") and EXPECTED[kind] in r.stderr, r.stderr
    assert len(r.stderr.encode()) <= len(prefix) + errors.MAX_MESSAGE_BYTES + 1
    j = run("fabric_controller.cli", "--json", "config", "check", str(path))
    error = json.loads(j.stdout)["error"]
    assert j.returncode == 2 and error["kind"] == "WiringError"
    assert len(error["message"].encode()) <= errors.MAX_MESSAGE_BYTES
    # the controller's --wiring: the same message, no traceback
    c = run(
        "fabric_controller.main", "--wiring", str(path), "--state", str(tmp_path / "s.db"),
        "--listen", "127.0.0.1:0", "--plaintext", "--log-format", "json",
    )  # fmt: skip
    assert c.returncode == 2 and EXPECTED[kind] in c.stderr, c.stderr[-3000:]
    assert "Traceback" not in c.stderr and len(c.stderr.encode()) < 4 * 1024


async def test_sighup_rejects_each_bad_wiring_and_keeps_the_last_good(tmp_path: Path) -> None:
    wiring = tmp_path / "wiring.toml"
    wiring.write_text(GOOD)
    ctl = await start_controller(tmp_path, "127.0.0.1:1", wiring=wiring)
    log_path = tmp_path / "controller.log"

    def rejections() -> list[tuple[str, dict[str, object]]]:
        lines = log_path.read_text().splitlines()
        return [(line, json.loads(line)) for line in lines if "wiring_reload_rejected" in line]

    try:
        async with AsyncClient(ctl.address, timeout_s=10) as c:
            for i, kind in enumerate(sorted(EXPECTED)):
                write_bad(wiring, kind)
                ctl.proc.send_signal(signal.SIGHUP)
                async with asyncio.timeout(30):
                    while len(rejections()) <= i:  # noqa: ASYNC110 - another process logs
                        await asyncio.sleep(0.05)
                line, entry = rejections()[i]
                error = str(entry["error"])
                assert error.startswith(f"{wiring}: ") and EXPECTED[kind] in error, error
                assert len(error.encode()) <= errors.MAX_MESSAGE_BYTES
                assert len(line.encode()) < 3 * 1024
                assert len(await c.nodes()) == 8  # the last good wiring serves on
            # and a good file is still adopted afterwards
            wiring.unlink()
            wiring.write_text(GOOD[: GOOD.rindex("[[node]]")])
            ctl.proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(30):
                while len(await c.nodes()) != 7:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        assert await ctl.stop() == 0
    log = log_path.read_text()
    assert "Traceback" not in log and "Exception in callback" not in log

"""kill -9 of the controller at every stage of a reconfiguration: a restart ends on a
known epoch (old or new by the recovery rule) with the switch state equal to it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.model import Circuit
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs

pytestmark = pytest.mark.e2e


class ControllerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc = proc
        self.address = address

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 15)


async def start_controller(
    tmp: Path,
    ocs_address: str,
    crash_at: str = "",
    wiring: Path | None = None,
    extra: list[str] | None = None,
    *,
    name: str = "controller",
    state: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ControllerProcess:
    """The controller daemon as a subprocess, once it serves. ``name``: its ready and log
    files (``tmp/NAME.addr``, ``tmp/NAME.log``); ``state``: the state flags (default
    ``--state tmp/state.db``); ``env``: more environment (fault injection)."""
    ready = tmp / f"{name}.addr"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "ORL_FAULT_CRASH_AT": crash_at, **(env or {})}
    log_path = tmp / f"{name}.log"
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    state = ["--state", str(tmp / "state.db")] if state is None else state
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fabric_controller.main",
        "--wiring", str(wiring or wiring_mod.default_wiring_path()),
        *state, "--listen", "127.0.0.1:0",
        "--ocs-address", f"ocs0={ocs_address}", "--ready-file", str(ready),
        "--log-format", "json", "--plaintext", *(extra or []),
        stdout=asyncio.subprocess.DEVNULL, stderr=log_fd, env=env,
    )  # fmt: skip
    os.close(log_fd)
    async with asyncio.timeout(30):
        while not ready.exists():
            assert proc.returncode is None, log_path.read_text()[-2000:]
            await asyncio.sleep(0.02)
    return ControllerProcess(proc, ready.read_text().strip())


@pytest.fixture
async def ocs() -> AsyncIterator[tuple[str, SimulatedOcs]]:
    server, sim = await serve_ocs("127.0.0.1:0", port_count=32, switching_time_s=0.0)
    try:
        yield server.address, sim
    finally:
        await server.stop(0.1)


def table(sim: SimulatedOcs) -> set[Circuit]:
    return {Circuit("ocs0", a, b) for a, b in sim.cross_connects()}


@pytest.mark.parametrize(
    ("stage", "expected_epoch"),
    [
        ("planned", 1),  # nothing acknowledged yet: roll back
        # training -> weight-sync is one batch (every new circuit reuses a port of a removed
        # one): the switch holds the whole planned epoch though the journal says planned,
        # so recovery rolls forward instead of switching the optics back
        ("program_ocs", 2),
        ("ocs_programmed", 2),  # every batch acknowledged: roll forward
        ("verified", 2),
        ("committed", 2),
    ],
)
async def test_restart_after_kill_converges(
    tmp_path: Path, ocs: tuple[str, SimulatedOcs], stage: str, expected_epoch: int
) -> None:
    address, sim = ocs
    first = await start_controller(tmp_path, address)
    async with AsyncClient(first.address, timeout_s=10) as c:
        training = await c.set_phase("training")
    assert await first.stop() == 0
    assert training.epoch == 1

    doomed = await start_controller(tmp_path, address, crash_at=stage)
    async with AsyncClient(doomed.address, timeout_s=10) as c:
        with pytest.raises(errors.Unavailable):
            await c.set_phase("weight-sync")
    assert await asyncio.wait_for(doomed.proc.wait(), 10) == -signal.SIGKILL

    survivor = await start_controller(tmp_path, address)
    try:
        async with AsyncClient(survivor.address, timeout_s=10) as c:
            got = await c.get_phase()
            assert got.epoch == expected_epoch
            assert got.phase == ("training" if expected_epoch == 1 else "weight-sync")
            assert table(sim) == {Circuit(x.ocs, x.a, x.b) for x in got.circuits}
            # and it keeps working
            nxt = await c.set_phase("generation")
            assert nxt.epoch == expected_epoch + 1 and table(sim) == set()
    finally:
        assert await survivor.stop() == 0


async def test_ocs_that_forgets_its_state_is_repaired(
    tmp_path: Path, ocs: tuple[str, SimulatedOcs]
) -> None:
    address, sim = ocs
    ctl = await start_controller(tmp_path, address)
    try:
        async with AsyncClient(ctl.address, timeout_s=10) as c:
            r = await c.set_phase("weight-sync")
            want = {Circuit(x.ocs, x.a, x.b) for x in r.circuits}
            # the switch reboots and forgets every circuit
            sim.apply(sim.cross_connects(), ())
            assert table(sim) == set()
            # the controller's drift check (or the next change) restores the epoch
            again = await c.set_phase("weight-sync")
            assert again.epoch == r.epoch
            assert table(sim) == want
    finally:
        assert await ctl.stop() == 0

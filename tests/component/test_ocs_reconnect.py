"""After an OCS outage, the first call once the switch listens again succeeds (issue 14).

gRPC keeps a channel whose connection failed in reconnect backoff (1 s, then 1.6x per
attempt, up to 120 s) and fails every call at once meanwhile ("Connection refused"), so
after a 20 s / 60 s outage phase changes were refused for seconds after the switch was
back. The OCS driver now tries a fresh channel before it gives up. A real simulated OCS
is stopped and restarted on the same port after longer than the initial backoff.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from fabric_controller.controller import Controller
from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.store import Store
from orchestrrl import errors
from orchestrrl.model import Phase, Wiring
from sim_backends.ocs_server import serve as serve_ocs

pytestmark = pytest.mark.component

OUTAGE_S = 1.6  # longer than gRPC's initial reconnect backoff (1 s +- 20 %)


async def outage(driver: GrpcOcsDriver, calls: int = 4) -> None:
    """Calls while the switch is down: each fails, and the old channel backs off."""
    started = time.monotonic()
    for _ in range(calls):
        with pytest.raises(errors.Unavailable, match=r"OCS 'ocs0' at .*UNAVAILABLE"):
            await driver.cross_connects()
        await asyncio.sleep(max(0.0, started + OUTAGE_S * (_ + 1) / calls - time.monotonic()))


async def test_the_first_call_after_the_switch_is_back_succeeds() -> None:
    server, _ = await serve_ocs("127.0.0.1:0", switching_time_s=0.0)
    address = server.address
    driver = GrpcOcsDriver("ocs0", address, timeout_s=5.0)
    try:
        await driver.apply([], [(1, 2)], request_id="a1")
        await server.stop(0)
        await outage(driver)
        server, sim = await serve_ocs(address, switching_time_s=0.0)  # the same port
        assert await driver.cross_connects() == frozenset()  # it rebooted: empty table
        assert await driver.apply([], [(3, 4)], request_id="a2") == {(3, 4)}
        assert sim.cross_connects() == {(3, 4)}
        # the fresh channel is used from then on: no new channel per call
        reconnects = driver.reconnects
        await driver.cross_connects()
        assert driver.reconnects == reconnects
    finally:
        await driver.close()
        await server.stop(0)


async def test_a_call_refused_for_another_reason_is_not_retried() -> None:
    server, _ = await serve_ocs("127.0.0.1:0", switching_time_s=0.0)
    driver = GrpcOcsDriver("ocs0", server.address, timeout_s=5.0)
    try:
        with pytest.raises(errors.InvalidArgument):
            await driver.apply([], [(1, 1)], request_id="bad")
        assert driver.reconnects == 0
    finally:
        await driver.close()
        await server.stop(0)


async def test_the_first_phase_change_after_the_switch_is_back_succeeds(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    ocs = example_wiring.ocses[0]
    server, _ = await serve_ocs("127.0.0.1:0", name=ocs.name, port_count=ocs.ports,
                                switching_time_s=0.0)  # fmt: skip
    address = server.address
    driver = GrpcOcsDriver(ocs.name, address, timeout_s=5.0)
    controller = Controller(example_wiring, Store(tmp_path / "s.db"), {ocs.name: driver})
    await controller.start()
    try:
        assert (await controller.set_phase(Phase.WEIGHT_SYNC)).changed
        await server.stop(0)
        started = time.monotonic()
        while time.monotonic() - started < OUTAGE_S:  # phase changes fail meanwhile
            with pytest.raises(errors.OrlError, match="UNAVAILABLE"):
                await controller.set_phase(Phase.TRAINING)
            await asyncio.sleep(0.4)
        server, sim = await serve_ocs(address, name=ocs.name, port_count=ocs.ports,
                                      switching_time_s=0.0)  # fmt: skip
        result = await controller.set_phase(Phase.TRAINING)  # the first one after
        assert result.record.phase is Phase.TRAINING
        assert sim.cross_connects() == {(c.a, c.b) for c in result.record.circuits}
    finally:
        await driver.close()
        await server.stop(0)
        controller.store.close()

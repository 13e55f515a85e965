"""Controller operations as a daemon: SIGHUP reload, /metrics, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from tests.e2e.test_controller_crash import start_controller

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    # /metrics is plain HTTP from prometheus_client, which cannot report a bound port 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _scrape(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            body: bytes = r.read()
            return body.decode()

    return await asyncio.to_thread(get)


async def test_sighup_reload_and_metrics(tmp_path: Path) -> None:
    wiring = tmp_path / "wiring.toml"
    text = wiring_mod.default_wiring_path().read_text()
    wiring.write_text(text)
    port = _free_port()
    ctl = await start_controller(
        tmp_path, "127.0.0.1:1", wiring=wiring, extra=["--metrics-listen", f"127.0.0.1:{port}"]
    )
    try:
        async with AsyncClient(ctl.address, timeout_s=10) as c:
            assert len(await c.nodes()) == 8
            # a broken file is rejected; the last good wiring stays
            wiring.write_text(text.replace('role = "gen"', 'role = "rollout"', 1))
            ctl.proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            assert len(await c.nodes()) == 8
            # a valid change is adopted: drop the last node
            cut = text.rindex("[[node]]")
            wiring.write_text(text[:cut])
            ctl.proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(10):
                while len(await c.nodes()) != 7:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        metrics = await _scrape(f"http://127.0.0.1:{port}/metrics")
        assert "orl_epoch 0.0" in metrics and 'orl_nodes{health="unknown"}' in metrics
    finally:
        assert await ctl.stop() == 0
    log = (tmp_path / "controller.log").read_text()
    assert "wiring reload rejected; keeping the last good wiring" in log
    assert "role = 'rollout'" in log

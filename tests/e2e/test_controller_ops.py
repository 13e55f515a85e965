"""Controller operations as a daemon: SIGHUP reload, /metrics, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
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
            log = tmp_path / "controller.log"
            async with asyncio.timeout(30):  # handled (a second SIGHUP must not merge with it)
                while "wiring_reload_rejected" not in log.read_text():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert len(await c.nodes()) == 8
            # a valid change is adopted: drop the last node
            cut = text.rindex("[[node]]")
            wiring.write_text(text[:cut])
            ctl.proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(30):
                while len(await c.nodes()) != 7:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        # the node gauges are set by the liveness loop (every half heartbeat interval)
        async with asyncio.timeout(30):
            while 'orl_nodes{health="unknown"}' not in (  # noqa: ASYNC110 - another process
                metrics := await _scrape(f"http://127.0.0.1:{port}/metrics")
            ):
                await asyncio.sleep(0.05)
        assert "orl_epoch 0.0" in metrics
    finally:
        assert await ctl.stop() == 0
    logged = (tmp_path / "controller.log").read_text()
    assert "role = 'rollout'" in logged
    assert "node 'gen1-n1' removed" in logged  # the reload says what changed


async def test_mutual_tls_daemon_and_orlctl(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    made = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fabric_controller.cli", "certs", "dev", "--out", str(pki),
        "orl-fabric-controller", "alice", "mallory",
    )  # fmt: skip
    assert await made.wait() == 0
    ready = tmp_path / "ready"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fabric_controller.main", "--state", str(tmp_path / "s.db"),
        "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--ocs-address",
        "ocs0=127.0.0.1:1", "--operator", "alice", "--log-format", "json",
        "--tls-cert", str(pki / "orl-fabric-controller.pem"),
        "--tls-key", str(pki / "orl-fabric-controller.key"), "--tls-ca", str(pki / "ca.pem"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            while not ready.exists():  # noqa: ASYNC110 - written by the other process
                await asyncio.sleep(0.05)
        address = ready.read_text().strip()

        async def orlctl(who: str | None) -> tuple[int, str]:
            env = {**os.environ}
            if who:
                env |= {
                    "ORL_TLS_CERT": str(pki / f"{who}.pem"),
                    "ORL_TLS_KEY": str(pki / f"{who}.key"),
                    "ORL_TLS_CA": str(pki / "ca.pem"),
                }
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fabric_controller.cli", "--controller", address,
                "--timeout", "5", "phase", "get", env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await p.communicate()
            return p.returncode or 0, (out + err).decode()

        code, out = await orlctl("alice")
        assert code == 0 and "epoch 0: no phase set yet" in out, out
        code, out = await orlctl("mallory")
        assert code == 1 and "PermissionDenied" not in out and "is not an operator" in out
        code, out = await orlctl(None)
        assert code == 1 and "UNAVAILABLE" in out
    finally:
        proc.terminate()
        assert await proc.wait() == 0

"""The local cluster with its OCS behind a real NETCONF server (`orlctl local up --ocs
netconf`: netconfd behind a private sshd, the NETCONF driver), and a controller killed
between a batch's confirmed commit and its confirmation. After every change a separate
NETCONF client (ncclient) reads the switch: it holds exactly the committed circuits."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from sim_backends.netconf_server import NetconfServer, unavailable
from tests.e2e.test_controller_crash import start_controller
from tests.e2e.test_local_cluster import orljson
from tests.netconf_fixtures import Observer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = unavailable()
    if why:
        pytest.skip(f"a NETCONF OCS needs netconfd behind sshd: {why}")
    run_dir = tmp_path_factory.mktemp("run")
    small = run_dir / "wiring.toml"  # the example's 4 pods, one node each: quicker to start
    w = wiring_mod.load(wiring_mod.default_wiring_path())
    nodes = tuple(n for n in w.nodes if n.name.endswith("-n0"))
    pods = tuple(replace(p, nodes=tuple(n for n in p.nodes if n.endswith("-n0"))) for p in w.pods)
    small.write_text(wiring_mod.to_toml(replace(w, nodes=nodes, pods=pods)))
    up = orljson(
        "local", "up", "--ocs", "netconf", "--wiring", str(small), "--run-dir", str(run_dir),
        "--ephemeral-ports",
    )  # fmt: skip
    try:
        yield {**up, "run_dir_path": run_dir}
    finally:
        down = orljson("local", "down", "--run-dir", str(run_dir))
        assert all("stopped" in line for line in down["stopped"]), down


async def test_phase_cycles_leave_the_netconf_switch_holding_the_committed_circuits(
    cluster: dict[str, Any],
) -> None:
    ocs = next(p for p in cluster["procs"] if p["role"] == "ocs")
    run_dir = Path(cluster["run_dir_path"])
    netconf = wiring_mod.load(run_dir / "wiring-netconf.toml").ocs("ocs0").netconf
    assert netconf is not None and netconf.host_key_check and netconf.known_hosts
    observer = Observer(ocs["address"], netconf.username, netconf.key_file)
    try:
        # the first change through orlctl, as a user would; the cycles through the client
        r = orljson("--controller", cluster["controller"], "phase", "set", "training")
        assert (r["epoch"], r["changed"]) == (1, True)
        assert observer.circuits() == {(c["a"], c["b"]) for c in r["circuits"]}
        async with AsyncClient(cluster["controller"], timeout_s=30) as client:
            for i in range(2):
                for phase in ("generation", "weight-sync", "training"):
                    set_ = await client.set_phase(phase, request_id=f"cycle-{i}-{phase}")
                    got = await client.get_phase()
                    want = {(c.a, c.b) for c in got.circuits}
                    assert (got.epoch, got.phase) == (set_.epoch, phase)
                    assert observer.circuits() == want
                    assert observer.pairs() == {p for a, b in want for p in ((a, b), (b, a))}
                    assert observer.controller()["last-batch"].startswith(f"epoch-{got.epoch}-")
        assert got.epoch == 7
    finally:
        observer.close()


def _netconf_wiring(server: NetconfServer, path: Path) -> Path:
    w = wiring_mod.load(wiring_mod.default_wiring_path())
    o = replace(w.ocses[0], address=server.address, driver="netconf",
                netconf=server.settings(confirm_timeout_s=60))  # fmt: skip
    path.write_text(wiring_mod.to_toml(replace(w, ocses=(o,))))
    return path


async def test_a_controller_killed_before_confirming_leaves_nothing_for_recovery_to_trust(
    netconf: NetconfServer, tmp_path: Path
) -> None:
    wiring = _netconf_wiring(netconf, tmp_path / "wiring.toml")
    doomed = await start_controller(tmp_path, netconf.address, "netconf_confirmed", wiring=wiring)
    async with AsyncClient(doomed.address, timeout_s=20) as c:
        with pytest.raises(errors.Unavailable):
            await c.set_phase("training")
    assert await asyncio.wait_for(doomed.proc.wait(), 20) == -signal.SIGKILL
    observer = Observer(netconf)
    try:
        held = observer.circuits()  # epoch 1's batch: committed, never confirmed
        assert len(held) == 8

        survivor = await start_controller(tmp_path, netconf.address, wiring=wiring)
        try:
            async with AsyncClient(survivor.address, timeout_s=20) as c:
                got = await c.get_phase()
                # its first NETCONF session cancelled the orphaned commit, so recovery saw
                # the switch empty and rolled the journal back, instead of committing
                # epoch 1 over a batch the switch would undo when its confirm timeout ran
                assert (got.epoch, got.circuits) == (0, [])
                assert observer.circuits() == set()
                log = (tmp_path / "controller.log").read_text().splitlines()
                events = [json.loads(line)["event"] for line in log if line.startswith("{")]
                assert "ocs_unconfirmed_commit_cancelled" in events
                again = await c.set_phase("training")  # and the fabric moves on
                assert again.epoch == 1
                assert observer.circuits() == {(x.a, x.b) for x in again.circuits} == held
        finally:
            assert await survivor.stop() == 0
    finally:
        observer.close()

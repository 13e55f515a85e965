"""`orlctl --json` speaks one dialect across commands (issue 14): `phase get` and
`topology show` name the committed state's fields alike and spell the phase as `phase
set` takes it (`weight-sync`, not `PHASE_WEIGHT_SYNC`), with numbers as numbers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fabric_controller import cli
from orchestrrl.model import Wiring
from sim_backends.harness import start_fabric

pytestmark = pytest.mark.component


async def orlctl_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    capsys.readouterr()  # (the in-process controller logs to stdout too)
    assert await asyncio.to_thread(cli.main, ["--json", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])


async def test_phase_get_and_topology_show_agree(
    example_wiring: Wiring, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = await start_fabric(example_wiring, tmp_path / "s.db", switching_time_s=0.0)
    ctl = ("--controller", f.address)
    try:
        # before any phase: no phase (null) and epoch 0, in both (not left out)
        got = await orlctl_json(capsys, *ctl, "phase", "get")
        topo = await orlctl_json(capsys, *ctl, "topology", "show")
        assert (got["epoch"], got["phase"]) == (topo["epoch"], topo["phase"]) == (0, None)

        await orlctl_json(capsys, *ctl, "phase", "set", "weight-sync")
        got = await orlctl_json(capsys, *ctl, "phase", "get")
        topo = await orlctl_json(capsys, *ctl, "topology", "show")
        assert got["phase"] == topo["phase"] == "weight-sync"
        assert got["epoch"] == topo["epoch"] == 1 and isinstance(topo["epoch"], int)
        assert topo["circuits"] == got["circuits"] and len(got["circuits"]) == 16
        assert set(got["circuits"][0]) == {"ocs", "a", "b", "pod_a", "pod_b"}
        shared = set(got) & set(topo)
        assert {"epoch", "phase", "circuits"} <= shared
        # the wiring keeps the proto's field names, every field present
        assert topo["cluster"] == example_wiring.cluster
        assert topo["ocses"][0] == {
            "name": "ocs0",
            "address": example_wiring.ocses[0].address,
            "port_count": example_wiring.ocses[0].ports,
            "switching_time_s": example_wiring.ocses[0].switching_time_s,
        }
        assert {n["name"] for n in topo["nodes"]} == {n.name for n in example_wiring.nodes}
    finally:
        await f.stop()

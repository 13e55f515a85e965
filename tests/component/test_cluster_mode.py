"""The cluster's mode (phased or async) over the controller's real gRPC API, in process,
against simulated OCSes: async mode commits one standing topology (the training mesh and
every training pod to every generation pod), refuses the training and generation phases,
keeps its circuits for weight-sync, survives a restart, and is left for a phase."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fabric_controller import cli
from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.model import Circuit, Wiring
from orchestrrl.v1 import common_pb2
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from sim_backends.harness import Fabric

pytestmark = pytest.mark.component


def table(fabric: Fabric) -> set[Circuit]:
    return {Circuit(name, a, b) for name, o in fabric.ocs.items() for a, b in o.cross_connects()}


def pod_pairs(wiring: Wiring, circuits: set[Circuit]) -> set[tuple[str, str]]:
    out = set()
    for c in circuits:
        a, b = wiring.port_owner(c.ocs, c.a), wiring.port_owner(c.ocs, c.b)
        assert a is not None and b is not None
        out.add((min(a, b), max(a, b)))
    return out


async def test_async_mode_holds_one_standing_topology(fabric: Fabric, client: AsyncClient) -> None:
    m = await client.get_mode()
    assert (m.mode, m.epoch, m.phase) == ("phased", 0, None)
    m = await client.set_mode("async", request_id="enter")
    assert (m.mode, m.epoch, m.phase, m.changed) == ("async", 1, "async", True)
    standing = table(fabric)
    assert m.circuits == len(standing) > 0
    # both roles at once: the training mesh and trainer -> every rollout pod
    assert pod_pairs(fabric.wiring, standing) == {
        ("train0", "train1"),
        ("gen0", "train0"),
        ("gen0", "train1"),
        ("gen1", "train0"),
        ("gen1", "train1"),
    }
    assert (await client.get_phase()).phase == "async"
    for phase in ("training", "generation"):
        with pytest.raises(errors.FailedPrecondition, match=f"cannot set phase {phase}: the "
                           "cluster is in async mode"):  # fmt: skip
            await client.set_phase(phase)
    assert table(fabric) == standing and (await client.get_mode()).epoch == 1
    # weight-sync keeps the standing circuits: they already join trainer and rollout
    ws = await client.set_phase("weight-sync")
    assert (ws.epoch, ws.phase, ws.changed) == (1, "async", False)
    assert table(fabric) == standing
    # the same mode again changes nothing
    again = await client.set_mode("async")
    assert (again.epoch, again.changed) == (1, False)

    await fabric.restart_controller()  # the mode is the committed epoch's: it persists
    async with AsyncClient(fabric.address, timeout_s=10) as c2:
        assert (await c2.get_mode()).mode == "async"
        left = await c2.set_mode("phased", phase="training")
        assert (left.mode, left.epoch, left.phase, left.changed) == ("phased", 2, "training", True)
        assert pod_pairs(fabric.wiring, table(fabric)) == {("train0", "train1")}
        stay = await c2.set_mode("phased")
        assert (stay.epoch, stay.changed) == (2, False) and "phased mode already" in stay.message
        assert (await c2.set_phase("generation")).epoch == 3


async def test_bad_mode_requests_are_invalid_argument(fabric: Fabric) -> None:
    async with grpc.aio.insecure_channel(fabric.address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        bad = [
            (pb.SetModeRequest(mode="sideways"), "mode='sideways' is not valid: phased or async"),
            (pb.SetModeRequest(mode=""), "mode='' is not valid: phased or async"),
            (
                pb.SetModeRequest(mode="async", phase=common_pb2.PHASE_TRAINING),
                "phase='training' is not valid: unspecified when entering async mode",
            ),
            (
                pb.SetModeRequest(mode="phased", phase=common_pb2.PHASE_ASYNC),
                "phase='async' is not valid",
            ),
            (pb.SetModeRequest(mode="phased", phase=42), "phase=42 is not valid"),
        ]
        for request, message in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetMode(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SetPhase(pb.SetPhaseRequest(phase=common_pb2.PHASE_ASYNC), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "phase='async' is not valid" in info.value.details()
        assert "orlctl mode set async" in info.value.details()
        got = await stub.GetMode(pb.GetModeRequest(), timeout=5)
        assert (got.mode, got.epoch) == ("phased", 0)
    assert table(fabric) == set()


async def test_orlctl_mode_shows_and_sets_it(
    fabric: Fabric, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--controller", fabric.address]
    assert await asyncio.to_thread(cli.main, [*base, "mode", "set", "async"]) == 0
    # (the in-process controller logs to stdout too: the lines are looked for)
    out = capsys.readouterr().out
    assert "\nmode async: epoch 1, phase async, 12 circuit(s); trainer and rollout" in out
    assert await asyncio.to_thread(cli.main, [*base, "mode"]) == 0
    assert "mode async: epoch 1, phase async" in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, [*base, "phase", "get"]) == 0
    assert "phase async (mode async)" in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, [*base, "phase", "set", "training"]) == 1
    assert "the cluster is in async mode" in capsys.readouterr().err
    assert await asyncio.to_thread(cli.main, [*base, "mode", "set", "nope"]) == 2
    assert "mode='nope' is not valid: phased or async" in capsys.readouterr().err
    assert await asyncio.to_thread(cli.main, [*base, "--json", "mode", "set", "phased"]) == 0
    assert '"mode": "phased"' in capsys.readouterr().out

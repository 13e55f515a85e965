"""Mutual TLS on the controller and the OCS: who may call what."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fabric_controller.controller import Controller
from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import Store
from orchestrrl import errors, grpcutil
from orchestrrl.client import AsyncClient
from orchestrrl.devcerts import CertFiles, make_dev_pki
from orchestrrl.model import Wiring
from orchestrrl.tls import Authorizer, from_args
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from sim_backends.ocs_server import serve as serve_ocs
from tests.helpers import tls

pytestmark = pytest.mark.component


@dataclass
class Secured:
    address: str
    pki: dict[str, CertFiles]
    rogue: CertFiles


@pytest.fixture
async def secured(example_wiring: Wiring, tmp_path: Path) -> AsyncIterator[Secured]:
    pki = make_dev_pki(tmp_path / "pki", ["orl-fabric-controller", "alice", "gen0-n0"])
    rogue = make_dev_pki(tmp_path / "rogue", ["alice"])["alice"]  # another CA
    me = tls(pki["orl-fabric-controller"])
    ocs_server, _ = await serve_ocs("127.0.0.1:0", switching_time_s=0.0, tls=me)
    driver = GrpcOcsDriver("ocs0", ocs_server.address, tls=me)
    controller = Controller(example_wiring, Store(tmp_path / "s.db"), {"ocs0": driver})
    await controller.start()
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller, Authorizer(me, frozenset({"alice"}))), s
        ),
        ["orchestrrl.v1.FabricController"],
        tls=me,
    )
    try:
        yield Secured(server.address, pki, rogue)
    finally:
        await server.stop(0.1)
        await driver.close()
        await ocs_server.stop(0.1)
        controller.store.close()


async def test_operator_certificate_may_change_phases(secured: Secured) -> None:
    async with AsyncClient(secured.address, 10, tls(secured.pki["alice"])) as c:
        r = await c.set_phase("weight-sync")  # the controller programs the OCS over mTLS too
        assert r.changed and len(r.circuits) == 16


async def test_agent_certificate_is_limited_to_its_own_node(secured: Secured) -> None:
    agent = tls(secured.pki["gen0-n0"])
    async with grpcutil.channel(secured.address, agent) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        ok = await stub.Register(
            pb.RegisterRequest(node="gen0-n0", agent_address="127.0.0.1:1"), timeout=5
        )
        assert ok.session_id
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Register(
                pb.RegisterRequest(node="gen1-n0", agent_address="127.0.0.1:1"), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may not act for node 'gen1-n0'" in info.value.details()
    async with AsyncClient(secured.address, 10, agent) as c:
        with pytest.raises(errors.PermissionDenied, match="is not an operator; operators: alice"):
            await c.set_phase("training")


async def test_untrusted_or_missing_certificates_are_refused(secured: Secured) -> None:
    async with AsyncClient(secured.address, 3, tls(secured.rogue)) as c:
        with pytest.raises(errors.Unavailable):
            await c.get_phase()
    async with AsyncClient(secured.address, 3) as plain:
        with pytest.raises(errors.Unavailable):
            await plain.get_phase()


def test_tls_flags_are_all_or_nothing(tmp_path: Path) -> None:
    ns = argparse.Namespace(tls_cert=tmp_path / "c.pem", tls_key=None, tls_ca=None, plaintext=False)
    with pytest.raises(errors.InvalidArgument, match="--tls-key, --tls-ca as well"):
        from_args(ns)
    none = argparse.Namespace(tls_cert=None, tls_key=None, tls_ca=None, plaintext=False)
    with pytest.raises(errors.InvalidArgument, match="or --plaintext for local development"):
        from_args(none)
    assert from_args(none, required=False) is None
    missing = argparse.Namespace(
        tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k", tls_ca=tmp_path / "ca", plaintext=False
    )
    with pytest.raises(errors.InvalidArgument, match="--tls-cert="):
        from_args(missing)


async def test_agent_accepts_commands_only_from_the_controller(tmp_path: Path) -> None:
    from node_agent.commands import CommandLog
    from node_agent.nics import SysfsNics
    from node_agent.servicer import SERVICE_NAME, NodeAgentService
    from node_agent.telemetry import Collector
    from orchestrrl.v1 import node_agent_pb2, node_agent_pb2_grpc
    from sim_backends.engine import SimulatedEngine
    from sim_backends.gpus import SimulatedGpus

    pki = make_dev_pki(tmp_path / "pki", ["orl-fabric-controller", "gen0-n0", "alice"])
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1)
    collector = Collector("gen0-n0", SimulatedGpus(8, seed=1), SysfsNics([]), engine)
    await collector.open()
    commands = CommandLog()
    me = tls(pki["gen0-n0"])
    servicer = NodeAgentService(
        collector, engine, commands, 0.05, auth=Authorizer(me),
        controllers=frozenset({"orl-fabric-controller"}),
    )  # fmt: skip
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
        tls=me,
    )
    try:
        for who, allowed in (("orl-fabric-controller", True), ("alice", False)):
            async with grpcutil.channel(server.address, tls(pki[who])) as ch:
                stub = node_agent_pb2_grpc.NodeAgentStub(ch)
                status = await stub.GetStatus(node_agent_pb2.GetStatusRequest(), timeout=5)
                assert status.node == "gen0-n0"  # any trusted peer may read
                call = stub.Drain(node_agent_pb2.DrainRequest(command_id=f"d-{who}"), timeout=5)
                if allowed:
                    await call
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "allowed: orl-fabric-controller" in info.value.details()
    finally:
        await server.stop(0.1)
        await commands.close()

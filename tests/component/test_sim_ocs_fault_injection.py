"""The simulated switch's fault injection: not served unless asked for, and then (with
mutual TLS) only to operators."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrrl import grpcutil
from orchestrrl.devcerts import CertFiles, make_dev_pki
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import FAULTS_SERVICE_NAME, main, serve
from tests.helpers import tls

pytestmark = pytest.mark.component

TIMEOUT = 5.0


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return make_dev_pki(tmp_path / "pki", ["orl-sim-ocs", "orl-fabric-controller", "alice",
                                           "gen0-n0"])  # fmt: skip


async def inject(address: str, caller: TlsConfig | None) -> grpc.StatusCode:
    """Try to mark port 3 down; the status of the call."""
    async with grpcutil.channel(address, caller) as ch:
        try:
            await pb_grpc.OcsFaultInjectionStub(ch).SetPortHealth(
                pb.SetPortHealthRequest(port=3, up=False), timeout=TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def armed(pki: dict[str, CertFiles]) -> AsyncIterator[tuple[str, SimulatedOcs]]:
    running, ocs = await serve(
        "127.0.0.1:0",
        switching_time_s=0.0,
        tls=tls(pki["orl-sim-ocs"]),
        fault_injection=True,
        operators=frozenset({"alice"}),
    )
    try:
        yield running.address, ocs
    finally:
        await running.stop(0.1)


async def test_only_an_operator_certificate_may_inject_faults(
    armed: tuple[str, SimulatedOcs], pki: dict[str, CertFiles]
) -> None:
    address, ocs = armed
    for refused in ("gen0-n0", "orl-fabric-controller"):
        assert await inject(address, tls(pki[refused])) == grpc.StatusCode.PERMISSION_DENIED
        async with grpcutil.channel(address, tls(pki[refused])) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.OcsFaultInjectionStub(ch).FailNextApply(
                    pb.FailNextApplyRequest(message="x"), timeout=TIMEOUT
                )
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused in (info.value.details() or "")
            assert "is not an operator; operators: alice" in (info.value.details() or "")
    assert ocs.down_ports() == frozenset()
    ocs.apply([], [(1, 2)])  # no fault was armed by the refused callers
    assert await inject(address, tls(pki["alice"])) == grpc.StatusCode.OK
    assert ocs.down_ports() == {3}


@pytest.mark.parametrize("secure", [True, False])
async def test_without_the_flag_the_service_is_not_served(
    pki: dict[str, CertFiles], secure: bool
) -> None:
    running, ocs = await serve(
        "127.0.0.1:0",
        switching_time_s=0.0,
        tls=tls(pki["orl-sim-ocs"]) if secure else None,
        operators=frozenset({"alice"}),
    )
    try:
        caller = tls(pki["alice"]) if secure else None
        assert await inject(running.address, caller) == grpc.StatusCode.UNIMPLEMENTED
        assert ocs.down_ports() == frozenset()
        async with grpcutil.channel(running.address, caller) as ch:
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                timeout=TIMEOUT
            )
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await call.done_writing()
            reply = await call.read()
        assert FAULTS_SERVICE_NAME not in {s.name for s in reply.list_services_response.service}
    finally:
        await running.stop(0.1)


async def test_in_plaintext_with_the_flag_anyone_may_inject(tmp_path: Path) -> None:
    running, ocs = await serve("127.0.0.1:0", switching_time_s=0.0, fault_injection=True)
    try:
        assert await inject(running.address, None) == grpc.StatusCode.OK
        assert ocs.down_ports() == {3}
    finally:
        await running.stop(0.1)


def test_flags_say_who_may_inject(
    pki: dict[str, CertFiles], capsys: pytest.CaptureFixture[str]
) -> None:
    me = pki["orl-sim-ocs"]
    files = ["--tls-cert", str(me.cert), "--tls-key", str(me.key), "--tls-ca", str(me.ca)]
    assert main(["--listen", "127.0.0.1:0", "--operator", "alice", "--plaintext"]) == 2
    assert "--operator='alice' is not valid: only with --fault-injection" in capsys.readouterr().err
    assert main(["--listen", "127.0.0.1:0", "--fault-injection", *files]) == 2
    assert "at least one identity allowed to inject faults (--operator NAME)" in (
        capsys.readouterr().err
    )

"""orl-sim-ocs: the simulated optical circuit switch as a gRPC daemon.

The servicer only translates between protobuf and ``SimulatedOcs`` and adds the one
thing the pure model leaves out: the time the optics take to switch.

With ``--netns NS`` the switch is the testbed's: every accepted batch is also programmed
as tc redirects between the port devices of namespace NS (``sim_backends.tc_ocs``),
atomically from the caller's view, and a port's health is its veth's link state.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from orchestrrl import add_version_flag, errors, limits
from orchestrrl.grpcutil import (
    RunningServer,
    domain_errors_to_status,
    parse_address,
    run,
    shutdown_signal,
    start_server,
    write_ready_file,
)
from orchestrrl.logs import get_logger, setup_logging
from orchestrrl.netlink import check_netns
from orchestrrl.tls import Authorizer, TlsConfig, add_tls_arguments
from orchestrrl.tls import from_args as tls_from_args
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc
from sim_backends.ocs import MAX_PORTS, ApplyResult, Pair, SimulatedOcs
from sim_backends.tc_ocs import DEFAULT_DEVICE_PREFIX, NetnsOcs, TcCircuits

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OpticalSwitch"].full_name
FAULTS_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OcsFaultInjection"].full_name

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class OpticalSwitchServicer(pb_grpc.OpticalSwitchServicer):
    def __init__(
        self,
        ocs: SimulatedOcs,
        auth: Authorizer | None = None,
        controllers: frozenset[str] = frozenset(),
        dataplane: NetnsOcs | None = None,
    ) -> None:
        self._ocs = ocs
        self._auth = auth or Authorizer(None)
        self._controllers = controllers
        self._dataplane = dataplane
        self._apply_lock = asyncio.Lock()  # batches never interleave, switching included
        self._log = get_logger("sim_backends.ocs", ocs=ocs.name)

    @domain_errors_to_status
    async def GetInfo(self, request: pb.GetInfoRequest, context: Context) -> pb.SwitchInfo:
        ocs = self._ocs
        return pb.SwitchInfo(
            name=ocs.name,
            port_count=ocs.port_count,
            switching_time_s=ocs.switching_time_s,
            backend="simulated" if self._dataplane is None else "netns",
        )

    @domain_errors_to_status
    async def ListPorts(
        self, request: pb.ListPortsRequest, context: Context
    ) -> pb.ListPortsResponse:
        if self._dataplane is not None:
            await self._dataplane.refresh_health()
        return pb.ListPortsResponse(
            ports=[
                pb.Port(
                    port=s.port,
                    state=pb.PORT_STATE_UP if s.up else pb.PORT_STATE_DOWN,
                    peer=s.peer or 0,
                )
                for s in self._ocs.port_states()
            ]
        )

    @domain_errors_to_status
    async def ListCrossConnects(
        self, request: pb.ListCrossConnectsRequest, context: Context
    ) -> pb.ListCrossConnectsResponse:
        if self._dataplane is not None:
            await self._dataplane.refresh_health()
        r = pb.ListCrossConnectsResponse(down_ports=sorted(self._ocs.down_ports()))
        _put_table(r, self._ocs.cross_connects(), request.packed)
        return r

    @domain_errors_to_status
    async def ApplyCrossConnects(
        self, request: pb.ApplyCrossConnectsRequest, context: Context
    ) -> pb.ApplyCrossConnectsResponse:
        self._auth.peer(context, self._controllers)
        async with self._apply_lock:
            result = await self._apply(request)
            # The optics only move when the table changes (not for replays or no-op batches).
            switching_time_s = self._ocs.switching_time_s if result.changed else 0.0
            await asyncio.sleep(switching_time_s)
        self._log.info(
            "ocs.applied",
            added=len(result.added),
            removed=len(result.removed),
            cross_connects=len(result.cross_connects),
            switching_time_s=switching_time_s,
            replayed=result.replayed,
            request_id=request.request_id,
        )
        r = pb.ApplyCrossConnectsResponse(
            switching_time_s=switching_time_s, replayed=result.replayed
        )
        _put_table(r, result.cross_connects, request.packed)
        return r

    async def _apply(self, request: pb.ApplyCrossConnectsRequest) -> ApplyResult:
        # refuse an oversized batch before building it (each pair: a message or two ports)
        self._ocs.check_batch_size(
            len(request.disconnect) + len(request.disconnect_pairs) // 2,
            len(request.connect) + len(request.connect_pairs) // 2,
        )
        disconnect = _pairs(request.disconnect, request.disconnect_pairs, "disconnect_pairs")
        connect = _pairs(request.connect, request.connect_pairs, "connect_pairs")
        if self._dataplane is not None:
            return await self._dataplane.apply(
                disconnect,
                connect,
                request_id=request.request_id,
                fencing_token=request.fencing_token,
            )
        return self._ocs.apply(
            disconnect,
            connect,
            request_id=request.request_id,
            fencing_token=request.fencing_token,
        )


def _pairs(messages: Iterable[pb.CrossConnect], packed: Sequence[int], field: str) -> list[Pair]:
    """The pairs of a request: its CrossConnect messages, then its packed pairs."""
    if len(packed) % 2:
        raise errors.field_error(
            field, f"{len(packed)} ports", "an even number of ports: pairs a0, b0, a1, b1, ..."
        )
    return [(m.a, m.b) for m in messages] + list(zip(packed[0::2], packed[1::2], strict=True))


def _put_table(
    r: pb.ListCrossConnectsResponse | pb.ApplyCrossConnectsResponse,
    table: Iterable[Pair],
    packed: bool,
) -> None:
    """The table, sorted, as one packed list of ports or one message per pair (built in
    place with ``add``: about three times faster than a list of messages)."""
    if packed:
        r.pairs.extend(chain.from_iterable(sorted(table)))
        return
    add = r.cross_connects.add
    for a, b in sorted(table):
        add(a=a, b=b)


class FaultInjectionServicer(pb_grpc.OcsFaultInjectionServicer):
    """Lets tests and demos break a simulated switch from outside its process. Served
    only when asked for (``orl-sim-ocs --fault-injection``); with mutual TLS only the
    operators' certificates may call it (``auth``: an Authorizer with the operators)."""

    def __init__(
        self, ocs: SimulatedOcs, auth: Authorizer, dataplane: NetnsOcs | None = None
    ) -> None:
        self._ocs = ocs
        self._auth = auth
        self._dataplane = dataplane  # with one, a port's health is its veth's link state
        self._log = get_logger("sim_backends.ocs", ocs=ocs.name)

    @domain_errors_to_status
    async def SetPortHealth(
        self, request: pb.SetPortHealthRequest, context: Context
    ) -> pb.SetPortHealthResponse:
        self._auth.operator(context)
        if self._dataplane is not None:
            await self._dataplane.set_port_health(request.port, request.up)
        else:
            self._ocs.set_port_health(request.port, request.up)
        self._log.warning("ocs_port_health", port=request.port, up=request.up)
        return pb.SetPortHealthResponse()

    @domain_errors_to_status
    async def FailNextApply(
        self, request: pb.FailNextApplyRequest, context: Context
    ) -> pb.FailNextApplyResponse:
        self._auth.operator(context)
        self._ocs.fail_next_apply(request.message or "simulated switching failure")
        self._log.warning("ocs_fail_next_apply", message=request.message)
        return pb.FailNextApplyResponse()


async def serve(
    listen: str,
    *,
    name: str = "ocs0",
    port_count: int = 32,
    switching_time_s: float = 0.01,
    tls: TlsConfig | None = None,
    controllers: frozenset[str] = frozenset({"orl-fabric-controller"}),
    dataplane: NetnsOcs | None = None,
    fault_injection: bool = False,
    operators: frozenset[str] = frozenset(),
) -> tuple[RunningServer, SimulatedOcs]:
    """Start a simulated OCS on ``listen`` (port 0: any free port; see ``.address``).
    With ``tls``, only the ``controllers`` identities may change cross-connects. With
    an (opened) ``dataplane``, its switch is served and every batch is programmed in it.
    ``fault_injection`` also serves OcsFaultInjection (off by default: a caller could
    mark ports down and fail batches), to the ``operators`` identities only with ``tls``
    (to anyone in plaintext)."""
    ocs = (
        dataplane.ocs if dataplane is not None else SimulatedOcs(name, port_count, switching_time_s)
    )
    servicer = OpticalSwitchServicer(ocs, Authorizer(tls), controllers, dataplane)
    faults = FaultInjectionServicer(ocs, Authorizer(tls, operators), dataplane)
    services = [SERVICE_NAME]
    if fault_injection:
        services.append(FAULTS_SERVICE_NAME)
        get_logger("sim_backends.ocs", ocs=ocs.name).warning(
            "ocs.fault_injection_on",
            allowed=", ".join(sorted(operators)) if tls is not None else "any caller (plaintext)",
            hint="callers allowed can mark ports down and fail batches; for tests and demos",
        )

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_OpticalSwitchServicer_to_server(servicer, server)
        if fault_injection:
            pb_grpc.add_OcsFaultInjectionServicer_to_server(faults, server)

    running = await start_server(
        listen,
        register,
        services,
        tls=tls,
        max_receive_bytes=limits.OCS_MAX_RECEIVE_BYTES,
    )
    return running, ocs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orl-sim-ocs", description="A simulated optical circuit switch."
    )
    add_version_flag(p)
    p.add_argument("--name", default="ocs0", help="switch name (default: %(default)s)")
    p.add_argument(
        "--ports", type=int, default=32, help=f"port count, 1..{MAX_PORTS} (default: %(default)s)"
    )
    p.add_argument(
        "--switching-time-ms",
        type=float,
        default=10.0,
        help="time a batch of circuits takes to switch (default: %(default)s)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:50061", help="HOST:PORT, port 0 = any (default: %(default)s)"
    )
    p.add_argument("--ready-file", type=Path, help="write the bound address here once serving")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    p.add_argument(
        "--controller-identity",
        action="append",
        default=[],
        metavar="NAME",
        help="with mutual TLS, certificate identities allowed to program the switch "
        "(default: orl-fabric-controller)",
    )
    p.add_argument(
        "--fault-injection",
        action="store_true",
        help="also serve the OcsFaultInjection service (mark ports down, fail the next "
        "batch) for tests and demos; with mutual TLS only --operator identities may call "
        "it (default: off, not served)",
    )
    p.add_argument(
        "--operator",
        action="append",
        default=[],
        metavar="NAME",
        help="with --fault-injection and mutual TLS, a certificate identity (CN or DNS SAN) "
        "allowed to inject faults; repeatable",
    )
    p.add_argument(
        "--netns",
        metavar="NS",
        help="testbed mode: also program every circuit as tc redirects between the port "
        "devices of this network namespace, and report their link state as port health "
        "(needs root)",
    )
    p.add_argument(
        "--port-device-prefix",
        default=DEFAULT_DEVICE_PREFIX,
        metavar="PREFIX",
        help="with --netns, port N is the device PREFIX<N> (default: %(default)s)",
    )
    add_tls_arguments(p)
    return p


def _check(args: argparse.Namespace) -> None:
    if not args.name:
        raise errors.field_error("--name", args.name, "must be a non-empty name, e.g. ocs0")
    if not 1 <= args.ports <= MAX_PORTS:
        raise errors.field_error("--ports", args.ports, f"must be 1..{MAX_PORTS}")
    if not (math.isfinite(args.switching_time_ms) and args.switching_time_ms >= 0):
        raise errors.field_error("--switching-time-ms", args.switching_time_ms, "must be >= 0")
    parse_address(args.listen, "--listen")
    if args.operator and not args.fault_injection:
        raise errors.field_error(
            "--operator", args.operator[0], "only with --fault-injection (it names who may call it)"
        )
    if args.netns is not None:
        check_netns(args.netns, "--netns")
    if args.ready_file is not None and not args.ready_file.parent.is_dir():
        raise errors.field_error("--ready-file", str(args.ready_file), "its directory must exist")
    args.tls = tls_from_args(args)
    if args.fault_injection and args.tls is not None and not args.operator:
        raise errors.field_error(
            "--operator",
            [],
            "with --fault-injection and mutual TLS, at least one identity allowed to inject "
            "faults (--operator NAME)",
        )


async def _run(args: argparse.Namespace) -> int:
    log = get_logger("sim_backends.ocs", ocs=args.name)
    dataplane: NetnsOcs | None = None
    try:
        if args.netns:
            circuits = TcCircuits(args.netns, args.ports, args.port_device_prefix)
            ocs_model = SimulatedOcs(args.name, args.ports, args.switching_time_ms / 1000)
            dataplane = await NetnsOcs(ocs_model, circuits).open()
        running, ocs = await serve(
            args.listen,
            name=args.name,
            port_count=args.ports,
            switching_time_s=args.switching_time_ms / 1000,
            tls=args.tls,
            controllers=frozenset(args.controller_identity or ["orl-fabric-controller"]),
            dataplane=dataplane,
            fault_injection=args.fault_injection,
            operators=frozenset(args.operator),
        )
    except errors.OrlError as exc:
        log.error("ocs_start_failed", error=str(exc))
        if dataplane is not None:
            await dataplane.close()
        return 1
    try:
        stop = shutdown_signal()
        log.info(
            "ocs_started",
            ports=ocs.port_count,
            switching_time_s=ocs.switching_time_s,
            address=running.address,
            netns=args.netns,
        )
        write_ready_file(args.ready_file, running.address)
        await stop.wait()
    finally:
        log.info("ocs_stopping", address=running.address)
        await running.stop()
        if dataplane is not None:
            await dataplane.close()  # the circuits stay programmed, like the optics
    log.info("ocs_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        try:
            _check(args)
        except errors.InvalidArgument as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # argparse printed the usage or the error: --help is 0, bad flags 2
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(args.log_level, args.log_format)
    return run(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())

"""An in-process fabric for tests, benchmarks and notebooks: one simulated OCS
server per OCS of a wiring and a controller, all real grpc.aio servers bound to
free loopback ports in the running event loop."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_controller.controller import Controller
from fabric_controller.drivers.agents import AgentClients
from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsDriver
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import Store
from fabric_controller.weight_sync_runner import WeightSync
from orchestrrl import grpcutil, leader
from orchestrrl.model import Wiring
from orchestrrl.v1 import fabric_controller_pb2, fabric_controller_pb2_grpc
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs

SERVICE = fabric_controller_pb2.DESCRIPTOR.services_by_name["FabricController"].full_name


@dataclass
class _ControllerProcess:
    controller: Controller
    store: Store
    server: grpcutil.RunningServer
    drivers: list[OcsDriver]
    liveness: asyncio.Task[None]
    agents: AgentClients

    async def stop(self) -> None:
        self.liveness.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.liveness
        await self.server.stop(0.1)
        for d in self.drivers:
            await d.close()
        await self.agents.close()
        self.store.close()


async def _start_controller(
    wiring: Wiring,
    ocs_addresses: dict[str, str],
    state: Path,
    heartbeat_interval_s: float,
    deadline_s: float,
    options: dict[str, Any],
) -> _ControllerProcess:
    options = dict(options)
    timeout_s = float(options.pop("ocs_timeout_s", 10.0))
    drivers: dict[str, OcsDriver] = {
        name: GrpcOcsDriver(name, addr, timeout_s=timeout_s) for name, addr in ocs_addresses.items()
    }
    return await serve_controller(
        wiring, drivers, state, heartbeat_interval_s=heartbeat_interval_s,
        deadline_s=deadline_s, **options,
    )  # fmt: skip


async def serve_controller(
    wiring: Wiring,
    drivers: dict[str, OcsDriver],
    state: Path,
    *,
    heartbeat_interval_s: float = 1.0,
    deadline_s: float = 3.0,
    **options: Any,
) -> _ControllerProcess:
    """A controller over the given OCS drivers (any backend, e.g. NETCONF) with its state
    in ``state``, serving its gRPC API on a free loopback port; ``stop()`` closes the
    drivers too."""
    store = Store(state)
    controller = Controller(
        wiring,
        store,
        drivers,
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_deadline_s=deadline_s,
        **options,
    )
    await controller.start()
    agents = AgentClients(None)  # weight sync's commands to the agents (plaintext loopback)
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: fabric_controller_pb2_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller, weights=WeightSync(controller, agents.get)), s
        ),
        [SERVICE],
        options=leader.SERVER_OPTIONS,
    )
    liveness = asyncio.create_task(controller.run_liveness())
    return _ControllerProcess(controller, store, server, list(drivers.values()), liveness, agents)


@dataclass
class Fabric:
    wiring: Wiring
    state: Path
    ocs: dict[str, SimulatedOcs]
    ocs_addresses: dict[str, str]
    heartbeat_interval_s: float
    deadline_s: float
    options: dict[str, Any]
    _ocs_servers: list[grpcutil.RunningServer]
    _proc: _ControllerProcess

    @property
    def controller(self) -> Controller:
        return self._proc.controller

    @property
    def address(self) -> str:
        return self._proc.server.address

    async def restart_controller(self) -> None:
        """Stop the controller and start a new one on the same state file (OCSes keep state)."""
        await self._proc.stop()
        self._proc = await _start_controller(
            self.wiring,
            self.ocs_addresses,
            self.state,
            self.heartbeat_interval_s,
            self.deadline_s,
            self.options,
        )

    async def stop(self) -> None:
        await self._proc.stop()
        for server in self._ocs_servers:
            await server.stop(0.1)


async def _serve_switches(
    wiring: Wiring, switching_time_s: float | None
) -> tuple[list[grpcutil.RunningServer], dict[str, SimulatedOcs], dict[str, str]]:
    """A simulated OCS server per OCS of ``wiring`` on a free loopback port: the servers,
    the switches by name and their addresses by name."""
    servers: list[grpcutil.RunningServer] = []
    switches: dict[str, SimulatedOcs] = {}
    addresses: dict[str, str] = {}
    for o in wiring.ocses:
        running, sim = await serve_ocs(
            "127.0.0.1:0",
            name=o.name,
            port_count=o.ports,
            switching_time_s=o.switching_time_s if switching_time_s is None else switching_time_s,
        )
        servers.append(running)
        switches[o.name] = sim
        addresses[o.name] = running.address
    return servers, switches, addresses


async def start_fabric(
    wiring: Wiring,
    state: Path,
    *,
    switching_time_s: float | None = None,
    heartbeat_interval_s: float = 1.0,
    deadline_s: float = 3.0,
    **controller_options: Any,
) -> Fabric:
    """Start the simulated OCSes of ``wiring`` and a controller keeping state in ``state``
    (``controller_options`` go to :class:`Controller`, e.g. ``lock_timeout_s``; and
    ``ocs_timeout_s`` to the OCS drivers)."""
    servers, switches, addresses = await _serve_switches(wiring, switching_time_s)
    proc = await _start_controller(
        wiring, addresses, state, heartbeat_interval_s, deadline_s, controller_options
    )
    return Fabric(
        wiring,
        state,
        switches,
        addresses,
        heartbeat_interval_s,
        deadline_s,
        controller_options,
        servers,
        proc,
    )


@dataclass
class EtcdFabric:
    """A fabric whose controller keeps its state in etcd and leads by election (the HA
    path of ``orl-fabric-controller --etcd``, in-process: one controller, elected)."""

    wiring: Wiring
    ocs: dict[str, SimulatedOcs]
    ocs_addresses: dict[str, str]
    controller: Controller
    token: int  # the fencing token of the controller's term
    _server: grpcutil.RunningServer
    _ocs_servers: list[grpcutil.RunningServer]
    _drivers: list[OcsDriver]
    _liveness: asyncio.Task[None]
    _election: Any
    _etcd: Any

    @property
    def address(self) -> str:
        return self._server.address

    async def stop(self) -> None:
        """Stop serving and resign (the lease is revoked: the election key goes with it)."""
        self._liveness.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._liveness
        await self._server.stop(0.1)
        await self._election.close()
        for d in self._drivers:
            await d.close()
        await self._etcd.close()
        for server in self._ocs_servers:
            await server.stop(0.1)


async def start_etcd_fabric(
    wiring: Wiring,
    endpoints: list[str],
    *,
    prefix: str = "/orchestrrl/",
    election_key: str = "/orchestrrl/leader",
    election_ttl_s: int = 2,
    switching_time_s: float | None = None,
    heartbeat_interval_s: float = 1.0,
    deadline_s: float = 3.0,
    **controller_options: Any,
) -> EtcdFabric:
    """Start the simulated OCSes of ``wiring`` and a controller on the etcd cluster at
    ``endpoints`` (state under ``prefix``): it starts as a standby, wins the election at
    ``election_key`` (waiting for another holder's lease to end), opens the store fenced
    with its lease and token and runs the start-up recovery, as the daemon does. Needs
    the etcd client extra (``orchestrrl[etcd]``)."""
    from fabric_controller.election import Election
    from fabric_controller.etcd_store import Etcd, EtcdStore
    from fabric_controller.leadership import Role

    servers, switches, addresses = await _serve_switches(wiring, switching_time_s)
    options = dict(controller_options)
    timeout_s = float(options.pop("ocs_timeout_s", 10.0))
    drivers: dict[str, OcsDriver] = {
        name: GrpcOcsDriver(name, addr, timeout_s=timeout_s) for name, addr in addresses.items()
    }
    etcd = Etcd(endpoints)
    controller = Controller(
        wiring,
        EtcdStore(etcd, prefix),  # unfenced: a standby writes nothing
        drivers,
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_deadline_s=deadline_s,
        role=Role.standby(),
        **options,
    )
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: fabric_controller_pb2_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller), s
        ),
        [SERVICE],
        options=leader.SERVER_OPTIONS,
    )

    def lost(reason: str) -> None:
        controller.role.lose(reason)

    election = Election(etcd, server.address, key=election_key, ttl_s=election_ttl_s, on_lost=lost)
    await election.start()
    fence = await election.campaign()
    store = await EtcdStore.open(etcd, prefix, fence)
    await controller.lead(store, fence.token, lambda: election.is_leader, server.address)
    liveness = asyncio.create_task(controller.run_liveness())
    return EtcdFabric(
        wiring,
        switches,
        addresses,
        controller,
        fence.token,
        server,
        servers,
        list(drivers.values()),
        liveness,
        election,
        etcd,
    )

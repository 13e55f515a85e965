"""Assemble and run the agent: backends, NodeAgent server, readiness, uplink, shutdown."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import grpc
import structlog

from node_agent.commands import CommandLog
from node_agent.config import AgentConfig, layout_for
from node_agent.engine import busy_fraction
from node_agent.gpus import GpuBackend, NvmlUnavailable, SimulatedGpus, select_backend
from node_agent.nics import SysfsNics
from node_agent.reshard.engine import close_engine, open_engine
from node_agent.roce import RoceConfigurator
from node_agent.routes import HostRoutes
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from node_agent.uplink import Uplink, UplinkSettings
from orchestrrl import errors
from orchestrrl.grpcutil import (
    parse_address,
    sd_notify,
    shutdown_signal,
    start_server,
    watchdog,
    write_ready_file,
)
from orchestrrl.logs import get_logger
from orchestrrl.tls import Authorizer
from orchestrrl.v1 import node_agent_pb2_grpc
from sim_backends.engine import SimulatedEngine

log = get_logger("node_agent")

SHUTDOWN_GRACE_S = 5.0
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def advertised_address(bound: str, advertise_host: str | None) -> str:
    """The address the controller should dial: the bound port on a reachable host."""
    host, port = parse_address(bound, "bound address")
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def run_agent(
    config: AgentConfig,
    stop: Callable[[], Awaitable[object]] | None = None,
    *,
    controller: Callable[[], str] | None = None,
    uplink_settings: UplinkSettings | None = None,
) -> int:
    """Serve until ``stop()`` returns (default: SIGTERM/SIGINT); the daemon's exit status.

    ``controller`` overrides ``config.controller`` and is read before every
    registration (tests move a fake controller between ports).
    """
    structlog.contextvars.bind_contextvars(node=config.node)
    try:
        gpus = await select_backend(config.gpu_backend, config.gpus, config.seed)
    except NvmlUnavailable as exc:
        log.error("gpu_backend_unavailable", error=str(exc))
        return EXIT_FAILURE
    try:
        return await _serve(config, gpus, stop, controller, uplink_settings)
    except errors.InvalidArgument as exc:
        log.error("invalid_configuration", error=str(exc))
        return EXIT_USAGE
    except errors.Unavailable as exc:
        log.error("cannot_start", error=str(exc))
        return EXIT_FAILURE
    finally:
        await gpus.close()


async def _serve(
    config: AgentConfig,
    gpus: GpuBackend,
    stop: Callable[[], Awaitable[object]] | None,
    controller: Callable[[], str] | None,
    uplink_settings: UplinkSettings | None,
) -> int:
    gpu_count = len(await gpus.inventory())
    engine = await open_engine(
        config.reshard_backend,
        SimulatedEngine(gpu_count, layout_for(config, gpu_count), config.seed),
        seed=config.seed,
    )
    if isinstance(gpus, SimulatedGpus):
        gpus.follow(lambda: busy_fraction(engine.stats()))
    collector = Collector(config.node, gpus, SysfsNics(config.nics), engine)
    await collector.open()
    commands = CommandLog()
    servicer = NodeAgentService(
        collector,
        engine,
        commands,
        config.telemetry_interval_s,
        routes=HostRoutes(),
        roce=RoceConfigurator(),
        auth=Authorizer(config.tls),
        controllers=frozenset(config.controller_identities),
    )

    def register(server: grpc.aio.Server) -> None:
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)

    if config.tls is None:
        log.warning("serving WITHOUT TLS (--plaintext): for local development only")
    server = await start_server(config.listen, register, [SERVICE_NAME], tls=config.tls)
    try:
        # signal handlers go in before readiness is announced, so no SIGTERM is missed
        wait_stop = stop if stop is not None else shutdown_signal().wait
        write_ready_file(config.ready_file, server.address)
        agent_address = advertised_address(server.address, config.advertise_host)
        log.info(
            "serving",
            address=server.address,
            agent_address=agent_address,
            controller=config.controller if controller is None else controller(),
            gpu_backend=gpus.name,
            gpus=gpu_count,
            engine="sim",
            reshard_backend=config.reshard_backend,
            tp_layout=list(engine.tp_layout),
            nics=[n.name for n in collector.status().nics],
        )
        uplink = Uplink(
            collector,
            agent_address,
            controller or config.controller,
            config.telemetry_interval_s,
            settings=uplink_settings,
            tls=config.tls,
        )
        async with asyncio.TaskGroup() as tg:
            loops = [tg.create_task(uplink.run()), tg.create_task(watchdog())]
            await wait_stop()
            log.info("stopping")
            sd_notify("STOPPING=1")
            for task in loops:
                task.cancel()
    finally:
        await server.stop(SHUTDOWN_GRACE_S)
        await commands.close()
        await close_engine(engine)
    log.info("stopped")
    return EXIT_OK

"""Assemble and run the agent: backends, NodeAgent server, readiness, uplink, shutdown."""

from __future__ import annotations

import asyncio
import gc
import importlib
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

from node_agent.commands import CommandLog
from node_agent.config import AgentConfig, ConfigChange, layout_for, read_api_key
from node_agent.engine import RolloutEngine, busy_fraction
from node_agent.engines import port_picker, server_factory
from node_agent.engines.base import Device
from node_agent.engines.http_engine import EngineSettings
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.http import GatewayServer, GatewaySettings
from node_agent.gpus import GpuBackend, NvmlUnavailable, select_backend
from node_agent.metrics import AgentMetrics
from node_agent.nics import NetlinkNics
from node_agent.peers import GrpcPeers
from node_agent.rdma import SYSFS_INFINIBAND, SysfsRdma
from node_agent.reload import Reloader
from node_agent.reshard.engine import close_engine, open_engine
from node_agent.roce import RoceConfigurator
from node_agent.routes import HostRoutes
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from node_agent.uplink import Uplink, UplinkSettings
from node_agent.weights.fetch import GrpcCheckpointSource
from node_agent.weights.store import SERVICE_NAME as CHECKPOINT_SERVICE
from node_agent.weights.store import CheckpointDir, CheckpointStoreService
from node_agent.weights.update import WeightLoader, WeightUpdater
from orchestrrl import errors, grpcutil
from orchestrrl.grpcutil import (
    parse_address,
    sd_notify,
    serve_metrics,
    shutdown_signal,
    start_server,
    watchdog,
    write_ready_file,
)
from orchestrrl.logs import get_logger
from orchestrrl.tls import Authorizer
from orchestrrl.v1 import checkpoints_pb2_grpc, node_agent_pb2_grpc

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
    metrics: AgentMetrics | None = None,
    reload: Callable[[], AgentConfig] | None = None,
    hangup: Callable[[], Awaitable[object]] | None = None,
    set_log_level: Callable[[str], None] | None = None,
    rdma_root: Path = SYSFS_INFINIBAND,
) -> int:
    """Serve until ``stop()`` returns (default: SIGTERM/SIGINT); the daemon's exit status.

    ``controller`` overrides ``config.controller`` and is read before every
    registration (tests move a fake controller between ports). ``reload`` re-reads the
    configuration each time ``hangup()`` returns (default: on SIGHUP); ``set_log_level``
    applies a new log level (the shell reconfigures logging; None: not applied).
    """
    shell = _Shell(
        metrics or AgentMetrics(), reload, hangup, set_log_level, rdma_root, uplink_settings
    )
    structlog.contextvars.bind_contextvars(node=config.node)
    try:
        gpus = await select_backend(config.gpu_backend, config.gpus, config.seed)
    except NvmlUnavailable as exc:
        log.error("gpu_backend_unavailable", error=str(exc))
        return EXIT_FAILURE
    try:
        return await _serve(config, gpus, stop, controller, shell)
    except errors.InvalidArgument as exc:
        log.error("invalid_configuration", error=str(exc))
        return EXIT_USAGE
    except errors.Unavailable as exc:
        log.error("cannot_start", error=str(exc))
        return EXIT_FAILURE
    finally:
        await gpus.close()


class _Shell:
    """What run_agent was given besides the config (injected by tests)."""

    def __init__(
        self,
        metrics: AgentMetrics,
        reload: Callable[[], AgentConfig] | None,
        hangup: Callable[[], Awaitable[object]] | None,
        set_log_level: Callable[[str], None] | None,
        rdma_root: Path,
        uplink_settings: UplinkSettings | None,
    ) -> None:
        self.metrics = metrics
        self.reload = reload
        self.hangup = hangup
        self.set_log_level = set_log_level
        self.rdma_root = rdma_root
        self.uplink_settings = uplink_settings


def hangup_signal() -> Callable[[], Awaitable[None]]:
    """A waiter that returns at each SIGHUP (several while busy count as one)."""
    event = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, event.set)

    async def wait() -> None:
        await event.wait()
        event.clear()

    return wait


async def _serve(
    config: AgentConfig,
    gpus: GpuBackend,
    stop: Callable[[], Awaitable[object]] | None,
    controller: Callable[[], str] | None,
    shell: _Shell,
) -> int:
    gpu_count = len(await gpus.inventory())
    rollout = await open_rollout(config, gpus, gpu_count)
    try:
        return await _serve_with(config, gpus, rollout, stop, controller, shell)
    finally:
        await rollout.close()


class Rollout:
    """The node's rollout engine, and what serves it: the gateway (real engines) or the
    simulated engine (``engine = "sim"``)."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        gateway: GatewayEngine | None = None,
        http: GatewayServer | None = None,
        peers: GrpcPeers | None = None,
        simulated: object = None,
    ) -> None:
        self.engine = engine
        self.gateway = gateway
        self.http = http
        self.peers = peers
        self.simulated = simulated

    @property
    def kind(self) -> str:
        return self.gateway.kind if self.gateway is not None else "sim"

    @property
    def loader(self) -> WeightLoader | None:
        """What loads new weights into the engines (weight sync)."""
        if self.gateway is not None:
            return self.gateway
        if isinstance(self.simulated, WeightLoader):
            return self.simulated
        return None

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self.gateway is not None:
            await self.gateway.close()
        if self.peers is not None:
            await self.peers.close()
        await close_engine(self.engine)


def engine_device(config: AgentConfig, gpus: GpuBackend) -> Device:
    """Where engine instances run: the configured device, or for ``auto`` CUDA when NVML
    reports the GPUs and the CPU otherwise (said in the log)."""
    setting = config.engine.device
    device: Device = setting if setting != "auto" else ("cuda" if gpus.name == "nvml" else "cpu")
    log.info(
        "engine_device",
        device=device,
        setting=setting,
        why="configured" if setting != "auto" else f"auto: the GPU backend is {gpus.name}",
    )
    return device


async def open_rollout(config: AgentConfig, gpus: GpuBackend, gpu_count: int) -> Rollout:
    """Start the configured engine; Unavailable when its instances do not start."""
    layout = layout_for(config, gpu_count)
    e = config.engine
    if not e.real:
        # the simulator is loaded only because the configuration asks for it
        sim = importlib.import_module("sim_backends.engine")
        log.warning("engine_simulated", module=sim.__name__, why="engine = sim in the config")
        simulated = sim.SimulatedEngine(
            gpu_count,
            layout,
            config.seed,
            # 100 ms simulation steps (decode iterations are ~10-20 ms, integrated within a
            # step): half the CPU of the 50 ms default, which the agent pays at every sample
            config=sim.SimEngineConfig(step_s=0.1),
        )
        engine = await open_engine(config.reshard_backend, simulated, seed=config.seed)
        return Rollout(engine, simulated=simulated)
    device = engine_device(config, gpus)
    settings = EngineSettings(
        model=e.model,
        command=e.command,
        served_model=e.served_model,
        max_num_seqs=e.max_num_seqs,
        context=e.context,
        args=e.args,
        env=dict(e.env),
        log_dir=e.log_dir,
        start_timeout_s=e.start_timeout_s,
        seed=config.seed,
        cpu_offset=e.cpu_offset,
    )
    peers = GrpcPeers(config.tls)
    gateway = GatewayEngine(
        e.kind,
        gpu_count,
        layout,
        server_factory(e.kind, settings),
        port_picker(e.port_base),
        peers=peers,
        config=GatewayConfig(device=device, weight_version=e.weight_version),
        node=config.node,
    )
    log.info("engine_starting", engine=e.kind, model=e.model, tp_layout=list(layout))
    try:
        await gateway.start()
        http = GatewayServer(
            gateway,
            GatewaySettings(
                served_model=e.served_model,
                max_context=e.context,
                api_key=read_api_key(e.gateway_api_key_file) if e.gateway_api_key_file else None,
            ),
        )
        await http.start(e.gateway_listen)
    except BaseException:
        await gateway.close()
        await peers.close()
        raise
    return Rollout(gateway, gateway=gateway, http=http, peers=peers)


async def _serve_with(
    config: AgentConfig,
    gpus: GpuBackend,
    rollout: Rollout,
    stop: Callable[[], Awaitable[object]] | None,
    controller: Callable[[], str] | None,
    shell: _Shell,
) -> int:
    """The checkpoint store's own server first (``checkpoint_listen``), then the agent."""
    store = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    checkpoints = CheckpointStoreService(config.node, store)
    extra: grpcutil.RunningServer | None = None
    if store is not None and config.checkpoint_listen:
        extra = await start_server(
            config.checkpoint_listen,
            lambda s: checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(checkpoints, s),
            [CHECKPOINT_SERVICE],
            tls=config.tls,
        )
        log.info("serving_checkpoints", address=extra.address, directory=str(store.root))
    try:
        return await _serve_agent(
            config, gpus, rollout, stop, controller, shell, checkpoints, extra
        )
    finally:
        if extra is not None:
            await extra.stop(SHUTDOWN_GRACE_S)


async def _serve_agent(
    config: AgentConfig,
    gpus: GpuBackend,
    rollout: Rollout,
    stop: Callable[[], Awaitable[object]] | None,
    controller: Callable[[], str] | None,
    shell: _Shell,
    checkpoints: CheckpointStoreService,
    extra: grpcutil.RunningServer | None,
) -> int:
    metrics = shell.metrics
    engine = rollout.engine
    if rollout.gateway is not None:
        metrics.watch_gateway(lambda: rollout.gateway.stale_stopped if rollout.gateway else 0)
    store = checkpoints.store
    loader = rollout.loader
    weights = None
    if store is not None and loader is not None:
        tls = config.tls
        weights = WeightUpdater(
            config.node,
            store,
            loader,
            rollout.kind,
            lambda node, address: GrpcCheckpointSource(node, address, tls),
            keep=config.checkpoint_keep,
        )
    collector = Collector(
        config.node,
        gpus,
        NetlinkNics(config.nics),
        engine,
        rdma=SysfsRdma(root=shell.rdma_root),
        engine_kind=rollout.kind,
        gateway=rollout.http.address if rollout.http is not None else "",
        instance_health=rollout.gateway.instance_health if rollout.gateway else None,
        weight_version=(lambda: loader.weight_version) if loader is not None else None,
        checkpoint_address=advertised_address(extra.address, None) if extra else "",
        checkpoints=store is not None,
    )
    follow = getattr(gpus, "follow", None)  # simulated GPUs: load follows the engine's
    if follow is not None:  # figures of the sample being taken
        follow(lambda: busy_fraction(collector.engine_stats))
    await collector.open()
    commands = CommandLog(
        observe=lambda kind, outcome: metrics.commands.labels(kind, outcome).inc()
    )
    servicer = NodeAgentService(
        collector,
        engine,
        commands,
        config.telemetry_interval_s,
        routes=HostRoutes(),
        roce=RoceConfigurator(),
        auth=Authorizer(config.tls),
        controllers=frozenset(config.controller_identities),
        metrics=metrics,
        gateway=rollout.gateway,
        weights=weights,
    )

    def register(server: grpc.aio.Server) -> None:
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
        checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(checkpoints, server)

    if config.tls is None:
        log.warning("serving_without_tls", note="--plaintext: for local development only")
    stop_metrics: Callable[[], None] | None = None
    metrics_address = ""
    try:
        if config.metrics_listen:
            serving = serve_metrics(config.metrics_listen, metrics.registry)
            stop_metrics, metrics_address = serving.stop, serving.address
        server = await start_server(
            config.listen, register, [SERVICE_NAME, CHECKPOINT_SERVICE], tls=config.tls
        )
    except BaseException:  # nothing is serving: release what was opened, then report
        if stop_metrics is not None:
            await asyncio.to_thread(stop_metrics)
        await commands.close()
        collector.close()
        raise
    try:
        # signal handlers go in before readiness is announced, so no SIGTERM is missed
        wait_stop = stop if stop is not None else shutdown_signal().wait
        wait_hangup = shell.hangup if shell.hangup is not None else hangup_signal()
        # what start-up built lives as long as the daemon: out of the cyclic collector,
        # whose full passes would otherwise walk it again inside every large route apply
        gc.freeze()
        write_ready_file(config.ready_file, server.address, metrics=metrics_address)
        agent_address = advertised_address(server.address, config.advertise_host)
        log.info(
            "serving",
            address=server.address,
            agent_address=agent_address,
            controller=config.controller if controller is None else controller(),
            gpu_backend=gpus.name,
            gpus=engine.gpus,
            engine=rollout.kind,
            gateway=rollout.http.address if rollout.http is not None else None,
            reshard_backend=config.reshard_backend,
            tp_layout=list(engine.tp_layout),
            nics=[n.name for n in collector.status().nics],
            metrics=metrics_address or None,
        )
        uplink = Uplink(
            collector,
            agent_address,
            controller or config.controller,
            config.telemetry_interval_s,
            settings=shell.uplink_settings,
            tls=config.tls,
            buffer_samples=config.telemetry_buffer,
            metrics=metrics,
            flush_interval_s=config.telemetry_flush_interval_s,
        )

        async def apply(new: AgentConfig, change: ConfigChange) -> None:
            if "telemetry_flush_interval_s" in change.applied:
                uplink.flush_interval_s = new.telemetry_flush_interval_s
            if "telemetry_interval_s" in change.applied:
                uplink.telemetry_interval_s = new.telemetry_interval_s
                servicer.set_default_interval(new.telemetry_interval_s)
            if "log_level" in change.applied and shell.set_log_level is not None:
                shell.set_log_level(new.log_level)
            if "nics" in change.applied:
                await collector.replace_nics(NetlinkNics(new.nics))

        reloader = Reloader(config, shell.reload, apply)
        if shell.hangup is None:  # the daemon (tests inject their signals): SIGUSR1 too
            _report_cpu_on_sigusr1(rollout.simulated, gpus)
        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(uplink.run()),
                tg.create_task(watchdog()),
                tg.create_task(reloader.serve(wait_hangup)),
            ]
            failed = await _stop_or_gateway_failure(wait_stop, rollout.gateway)
            log.info("stopping", why=failed or "asked to stop")
            sd_notify("STOPPING=1")
            for task in loops:
                task.cancel()
    finally:
        if shell.hangup is None:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        await server.stop(SHUTDOWN_GRACE_S)
        await servicer.close()
        await commands.close()
        collector.close()
        if stop_metrics is not None:
            await asyncio.to_thread(stop_metrics)
    log.info("stopped")
    return EXIT_FAILURE if failed else EXIT_OK


async def _stop_or_gateway_failure(
    wait_stop: Callable[[], Awaitable[object]], gateway: GatewayEngine | None
) -> str:
    """Wait until the daemon is asked to stop ("") or its gateway fails (why): a gateway
    whose task died serves nothing, so the agent exits with an error and its service
    manager restarts it (systemd: Restart=on-failure)."""
    stop = asyncio.ensure_future(wait_stop())
    waits: set[asyncio.Future[Any]] = {stop}
    if gateway is not None:
        waits.add(asyncio.ensure_future(gateway.wait_failed()))
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if stop in done:
        return ""
    why = str(next(iter(done)).result())
    log.error("gateway_failed_agent_exits", why=why)
    return f"the gateway failed: {why}"


def cpu_accounting(engine: object, gpus: GpuBackend) -> dict[str, float]:
    """CPU seconds since start: the whole process, and the parts of it that simulate what a
    real node does elsewhere (the rollout engine's generation; GPU readings stand in for
    NVML calls the agent would make itself)."""
    return {
        "process_cpu_s": time.process_time(),
        "engine_simulation_cpu_s": float(getattr(engine, "simulation_cpu_s", 0.0)),
        "gpu_simulation_cpu_s": float(getattr(gpus, "simulation_cpu_s", 0.0)),
    }


def _report_cpu_on_sigusr1(engine: object, gpus: GpuBackend) -> None:
    """Log :func:`cpu_accounting` at each SIGUSR1 (bench/agent_overhead.py reads it)."""
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: log.info("cpu_accounting", **cpu_accounting(engine, gpus))
    )

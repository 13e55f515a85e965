"""orl-fabric-controller: the central daemon (one per cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from fabric_controller import scheduling
from fabric_controller.controller import Controller
from fabric_controller.drivers.agents import AgentClients
from fabric_controller.drivers.electrical import ElectricalDriver, LinuxSwitchDriver
from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsDriver
from fabric_controller.scheduler_loop import ComputeScheduler
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import Store
from orchestrrl import add_version_flag, errors, grpcutil
from orchestrrl import tls as tls_mod
from orchestrrl import wiring as wiring_mod
from orchestrrl.logs import get_logger, setup_logging
from orchestrrl.tls import add_tls_arguments
from orchestrrl.v1 import fabric_controller_pb2, fabric_controller_pb2_grpc
from scheduler.network import DEFAULT_MODEL_BYTES, DEFAULT_TRAINING_BYTES, PhaseDemand

log = get_logger("fabric_controller")


def _positive(name: str, lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r}: expected a number") from None
        if not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"{name}={text!r}: must be > {lo} and <= {hi}")
        return value

    return parse


def _interval(text: str) -> float:
    try:
        return scheduling.check_interval(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--compute-interval={text!r}: expected seconds") from None
    except errors.InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bytes(name: str) -> Callable[[str], float]:
    """Bytes as a number with an optional SI suffix (29.5e9, 29.5G, 145G, 1T); 0: unknown."""

    def parse(text: str) -> float:
        units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
        t = text.strip().upper().removesuffix("B")
        scale = units.get(t[-1:], 1.0)
        try:
            value = float(t[:-1] if t[-1:] in units else t) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name}={text!r}: expected bytes, e.g. 29.5G or 29.5e9 (0: unknown)"
            ) from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{name}={text!r}: must be a finite number >= 0")
        return value

    return parse


def _override(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--ocs-address={text!r}: expected NAME=HOST:PORT")
    try:
        grpcutil.parse_address(address, f"--ocs-address {name}")
    except errors.InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, address


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orl-fabric-controller",
        description="OrchestrRL fabric controller: phases, epochs, OCS circuits, node registry.",
    )
    add_version_flag(p)
    p.add_argument(
        "--wiring",
        type=Path,
        default=wiring_mod.default_wiring_path(),
        help="cluster wiring file (TOML); default: the embedded 8-node example",
    )
    p.add_argument(
        "--state",
        type=Path,
        default=Path("orchestrrl-state.db"),
        help="SQLite state file (created if missing)",
    )
    p.add_argument(
        "--listen",
        help="HOST:PORT to serve on (default: cluster.controller "
        "of the wiring); port 0 picks a free port",
    )
    p.add_argument(
        "--ocs-address",
        type=_override,
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="override an OCS address of the wiring",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=_positive("--heartbeat-interval", 0.0, 600.0),
        default=1.0,
        help="seconds between agent heartbeats (deadline: 3 intervals)",
    )
    p.add_argument(
        "--reconcile-interval",
        type=_positive("--reconcile-interval", 0.0, 86400.0),
        default=10.0,
        help="seconds between drift checks of the switches against the committed epoch",
    )
    p.add_argument(
        "--lock-timeout",
        type=_positive("--lock-timeout", 0.0, 3600.0),
        default=30.0,
        help="how long a phase change waits for one in progress before ABORTED",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics here (off if unset)",
    )
    p.add_argument(
        "--operator",
        action="append",
        default=[],
        metavar="NAME",
        help="certificate identity (CN or DNS SAN) allowed to change phases and read state; "
        "repeatable (with mutual TLS)",
    )
    p.add_argument(
        "--compute-scheduling",
        choices=["on", "off"],
        default="off",
        help="the compute-scheduling loop: re-plan TP layouts and migrate requests of the "
        "generation nodes from their telemetry, sending Reshard and migration commands to "
        "their agents (default off; `orlctl local up` turns it on)",
    )
    p.add_argument(
        "--compute-interval",
        type=_interval,
        default=1.0,
        metavar="S",
        help="seconds between rounds of the compute-scheduling loop (reactive balancing; "
        "proactive re-plans at step start and at points of the step); default 1",
    )
    p.add_argument(
        "--model-bytes",
        type=_bytes("--model-bytes"),
        default=DEFAULT_MODEL_BYTES,
        metavar="BYTES",
        help="weight-sync demand: the model's weight bytes sent to every generation pod "
        f"(default {DEFAULT_MODEL_BYTES / 1e9:.1f}G, Qwen2.5-14B in BF16; 0: unknown, the "
        "weight-sync phase template is used)",
    )
    p.add_argument(
        "--training-bytes",
        type=_bytes("--training-bytes"),
        default=DEFAULT_TRAINING_BYTES,
        metavar="BYTES",
        help="training demand: bytes all-reduced across the training pods per step "
        f"(default {DEFAULT_TRAINING_BYTES / 1e9:.1f}G, BF16 gradients of Qwen2.5-14B; 0: "
        "unknown, the training phase template is used)",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        help="write the bound address here when serving (and with --metrics-listen the "
        "bound /metrics address to FILE.metrics)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    add_tls_arguments(p)
    return p


async def serve(args: argparse.Namespace) -> int:
    tls = tls_mod.from_args(args)
    if tls is None:
        log.warning("serving_without_tls", note="--plaintext: for local development only")
    w = wiring_mod.load(args.wiring)
    overrides = dict(args.ocs_address)
    unknown = sorted(set(overrides) - {o.name for o in w.ocses})
    if unknown:
        known = ", ".join(o.name for o in w.ocses) or "none"
        raise errors.field_error(
            "--ocs-address", unknown[0], f"no such OCS in the wiring ({known})"
        )
    drivers: dict[str, OcsDriver] = {
        o.name: GrpcOcsDriver(o.name, overrides.get(o.name, o.address), tls=tls) for o in w.ocses
    }
    switches: dict[str, ElectricalDriver] = {
        t.name: LinuxSwitchDriver(t.name, t.netns) for t in w.tors if t.netns
    }
    if switches:
        log.info("tor_routes_enabled", tors=sorted(switches))
    store = Store(args.state)
    interval = float(args.heartbeat_interval)
    controller = Controller(
        w,
        store,
        drivers,
        heartbeat_interval_s=interval,
        heartbeat_deadline_s=3 * interval,
        lock_timeout_s=args.lock_timeout,
        fault_hook=_crash_hook(),
        electrical=switches,
        demand=PhaseDemand(args.model_bytes, args.training_bytes),
    )
    await controller.start()
    # The wiring, the registry and the committed epoch live as long as the daemon: keep
    # them out of the cyclic collector, whose full passes over a 2048-node wiring would
    # otherwise land inside phase changes (tens of ms each; see bench/phase_switch.py).
    gc.freeze()
    metrics_server = (
        grpcutil.serve_metrics(args.metrics_listen, controller.metrics.registry)
        if args.metrics_listen
        else None
    )
    stop_metrics = metrics_server.stop if metrics_server is not None else None
    for d in drivers.values():
        await _probe(d, w.ocs(d.name).ports)
    agents = AgentClients(tls)
    compute = ComputeScheduler(
        controller,
        agents.get,
        config=scheduling.SchedulingConfig(interval_s=args.compute_interval),
        enabled=args.compute_scheduling == "on",
    )
    server = await grpcutil.start_server(
        args.listen or w.controller,
        lambda s: fabric_controller_pb2_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(
                controller, tls_mod.Authorizer(tls, frozenset(args.operator)), compute
            ),
            s,
        ),
        [fabric_controller_pb2.DESCRIPTOR.services_by_name["FabricController"].full_name],
        tls=tls,
        clients=len(w.nodes),  # every agent's stream at once after a restart
    )
    log.info(
        "controller_serving",
        address=server.address,
        cluster=w.cluster,
        nodes=len(w.nodes),
        ocses=len(w.ocses),
        state=str(args.state),
        metrics=metrics_server.address if metrics_server is not None else None,
    )
    stop = grpcutil.shutdown_signal()
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, lambda: _reload(controller, args.wiring)
    )
    grpcutil.write_ready_file(
        args.ready_file,
        server.address,
        metrics=metrics_server.address if metrics_server is not None else "",
    )
    try:
        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(controller.run_liveness()),
                tg.create_task(controller.run_reconcile(args.reconcile_interval)),
                tg.create_task(grpcutil.watchdog()),
            ]
            if compute.enabled:
                log.info("compute_scheduling_on", interval_s=args.compute_interval)
                loops.append(tg.create_task(compute.run()))
            await stop.wait()
            log.info("shutting_down")
            grpcutil.sd_notify("STOPPING=1")
            for task in loops:
                task.cancel()
    finally:
        await server.stop(grace=5.0)
        if stop_metrics:
            stop_metrics()
        for d in drivers.values():
            await d.close()
        await agents.close()
        for e in switches.values():
            await e.close()
        store.close()
    return 0


def _reload(controller: Controller, path: Path) -> None:
    """SIGHUP: validate the wiring file again; adopt it only when valid."""
    try:
        changes = controller.reload(wiring_mod.load(path))
        log.info(
            "wiring_reloaded", wiring=str(path), nodes=len(controller.wiring.nodes),
            changes=changes[:20], changed=len(changes),
        )  # fmt: skip
    except errors.OrlError as exc:
        log.error("wiring_reload_rejected", error=str(exc), note="keeping the last good wiring")


def _crash_hook() -> Callable[[str], None]:
    """Fault injection for crash-recovery tests: ORL_FAULT_CRASH_AT=STAGE makes the
    controller SIGKILL itself right after that stage (as `kill -9` would)."""
    stage = os.environ.get("ORL_FAULT_CRASH_AT", "")
    if not stage:
        return lambda _stage: None
    log.warning("fault_injection_armed", stage=stage, note="will SIGKILL itself")

    def hook(reached: str) -> None:
        if reached == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


async def _probe(driver: OcsDriver, wired_ports: int) -> None:
    """Log whether an OCS answers and agrees with the wiring; never fatal at start-up."""
    try:
        info = await driver.info()
    except errors.OrlError as exc:
        log.warning(
            "ocs_unreachable",
            ocs=driver.name,
            error=str(exc),
            note="phase changes fail until it is reachable",
        )
        return
    if info.port_count < wired_ports:
        log.error(
            "ocs_fewer_ports_than_wiring",
            ocs=driver.name,
            switch_ports=info.port_count,
            wiring_ports=wired_ports,
        )
    else:
        log.info("ocs_reachable", ocs=driver.name, ports=info.port_count, backend=info.backend)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return grpcutil.run(lambda: serve(args))
    except errors.OrlError as exc:
        print(f"orl-fabric-controller: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())

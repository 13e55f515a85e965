"""orl-fabric-controller: the central daemon (one per cluster, or an HA group on etcd).

State: a SQLite file (``--state``, the default: one controller), or an etcd cluster
(``--etcd host:port,...``: any number of controllers, one elected leader; see
docs/ha.md and :mod:`fabric_controller.leadership`). With etcd the daemon starts as a
standby, answering every FabricController call with the standby contract
(``orchestrrl.leader``), and campaigns; the leader serves, runs the drift check and the
compute scheduler, and stamps its fencing token on every OCS batch. A leader that loses
its lease steps down (log and event ``stepped_down``) and campaigns again
as a standby: the process does not exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_controller import scheduling
from fabric_controller.controller import Controller
from fabric_controller.drivers.agents import AgentClients
from fabric_controller.drivers.electrical import ElectricalDriver, LinuxSwitchDriver
from fabric_controller.drivers.netconf import NetconfOcsDriver
from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsDriver
from fabric_controller.leadership import Leadership, Role
from fabric_controller.scheduler_loop import ComputeScheduler
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import EpochStore, Store
from fabric_controller.weight_sync_runner import WeightSync
from orchestrrl import add_version_flag, errors, grpcutil, leader
from orchestrrl import tls as tls_mod
from orchestrrl import wiring as wiring_mod
from orchestrrl.logs import get_logger, setup_logging
from orchestrrl.model import Ocs
from orchestrrl.tls import add_tls_arguments
from orchestrrl.v1 import fabric_controller_pb2, fabric_controller_pb2_grpc
from scheduler.network import DEFAULT_MODEL_BYTES, DEFAULT_TRAINING_BYTES, PhaseDemand
from scheduler.replan import ReplanSchedule

log = get_logger("fabric_controller")

DEFAULT_STATE = Path("orchestrrl-state.db")
DEFAULT_ETCD_PREFIX = "/orchestrrl/"
DEFAULT_ELECTION_TTL_S = 2
ELECTION_TTL_BOUNDS = (1, 60)  # whole seconds: etcd leases; above a minute a takeover is slow
MAX_ETCD_ENDPOINTS = 9  # members of one etcd cluster (etcd recommends 3, 5 or 7)
_PREFIX_CHARS = re.compile(r"/(?:[A-Za-z0-9._-]+/)*")


@dataclass(frozen=True)
class HaConfig:
    """Controller HA on etcd (``--etcd`` and the flags that go with it), validated."""

    endpoints: tuple[str, ...]
    prefix: str = DEFAULT_ETCD_PREFIX
    election_ttl_s: int = DEFAULT_ELECTION_TTL_S
    advertise: str | None = None  # None: the address the server is bound to

    @property
    def election_key(self) -> str:
        return self.prefix + "leader"


def parse_etcd_endpoints(value: str) -> tuple[str, ...]:
    """``--etcd``: HOST:PORT of etcd members' client URLs, separated by commas."""
    allowed = "HOST:PORT of etcd members separated by commas, e.g. 10.0.0.1:2379,10.0.0.2:2379"
    items = [part.strip().removeprefix("http://") for part in value.split(",")]
    if not value.strip() or any(not item for item in items):
        raise errors.field_error("--etcd", value, allowed)
    if len(items) > MAX_ETCD_ENDPOINTS:
        raise errors.field_error("--etcd", value, f"at most {MAX_ETCD_ENDPOINTS} endpoints")
    for item in items:
        _, port = grpcutil.parse_address(item, "--etcd")
        if port == 0:
            raise errors.field_error("--etcd", item, "port must be 1..65535")
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise errors.field_error(
            "--etcd", value, f"each endpoint once ({', '.join(twice)} repeated)"
        )
    return tuple(items)


def check_etcd_prefix(value: str) -> str:
    if not _PREFIX_CHARS.fullmatch(value) or len(value) > 200:
        raise errors.field_error(
            "--etcd-prefix", value,
            "a key path that starts and ends with /, of letters, digits and . _ - "
            "(at most 200 characters), e.g. /orchestrrl/ or /prod/orchestrrl/",
        )  # fmt: skip
    return value


def check_election_ttl(value: str) -> int:
    lo, hi = ELECTION_TTL_BOUNDS
    try:
        ttl = int(value)
    except ValueError:
        raise errors.field_error("--election-ttl", value, f"whole seconds {lo}..{hi}") from None
    if not lo <= ttl <= hi:
        raise errors.field_error("--election-ttl", value, f"whole seconds {lo}..{hi}")
    return ttl


def ha_config(args: argparse.Namespace) -> HaConfig | None:
    """The HA settings of the command line (None: SQLite, one controller); FieldError
    naming the flag, its value and what is allowed."""
    if args.etcd is None:
        for flag, given in (
            ("--advertise", args.advertise),
            ("--etcd-prefix", args.etcd_prefix),
            ("--election-ttl", args.election_ttl),
        ):
            if given is not None:
                raise errors.field_error(
                    flag, given, "only with --etcd (controller HA); without it state is in SQLite"
                )
        return None
    if args.state is not None:
        raise errors.field_error(
            "--state", str(args.state), "not with --etcd: the state is in etcd (drop --state)"
        )
    advertise = None
    if args.advertise is not None:
        advertise = leader.check_address(args.advertise, "--advertise")
    return HaConfig(
        parse_etcd_endpoints(args.etcd),
        check_etcd_prefix(args.etcd_prefix or DEFAULT_ETCD_PREFIX),
        check_election_ttl(args.election_ttl or str(DEFAULT_ELECTION_TTL_S)),
        advertise,
    )


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def advertised(ha: HaConfig, bound: str) -> str:
    """The address standbys name for this controller: ``--advertise``, else the bound
    address when clients can dial it (not a wildcard)."""
    if ha.advertise is not None:
        return ha.advertise
    host, _ = grpcutil.parse_address(bound, "--listen")
    if host in _WILDCARDS:
        raise errors.field_error(
            "--listen", bound,
            "a wildcard address, which clients cannot dial: give --advertise HOST:PORT, the "
            "address standbys send clients to when this controller leads",
        )  # fmt: skip
    return bound


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


def _interval(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return scheduling.check_interval(float(text), name)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r}: expected seconds") from None
        except errors.InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _tail_fraction(text: str) -> float:
    try:
        return scheduling.check_tail_fraction(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--compute-repack-tail={text!r}: expected a number in [0, 1]"
        ) from None
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
        default=None,
        help=f"SQLite state file (created if missing; default {DEFAULT_STATE}); not with --etcd",
    )
    p.add_argument(
        "--etcd",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="keep the state in this etcd cluster instead of SQLite and run as one of an "
        "HA group of controllers: start as a standby, campaign for leadership (an etcd "
        "lease), serve when elected",
    )
    p.add_argument(
        "--etcd-prefix",
        metavar="PATH",
        help=f"key prefix of this cluster's state in etcd (default {DEFAULT_ETCD_PREFIX}); "
        "with --etcd",
    )
    p.add_argument(
        "--election-ttl",
        metavar="S",
        help=f"leader lease TTL in whole seconds, {ELECTION_TTL_BOUNDS[0]}.."
        f"{ELECTION_TTL_BOUNDS[1]} (default {DEFAULT_ELECTION_TTL_S}): a dead leader is "
        "replaced after about this long; with --etcd",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="the address standbys send clients to when this controller leads (default: "
        "the listen address; required when listening on a wildcard); with --etcd",
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
        type=_interval("--compute-interval"),
        default=1.0,
        metavar="S",
        help="seconds between rounds of the compute-scheduling loop (reactive balancing "
        "between re-plans); default 1",
    )
    p.add_argument(
        "--compute-replan-interval",
        type=_interval("--compute-replan-interval"),
        default=ReplanSchedule().interval_s,
        metavar="S",
        help="seconds between proactive re-plans (layouts and placement, reshards "
        "allowed) after the one at step start; default %(default)g, the simulator's "
        "replan_interval_s",
    )
    p.add_argument(
        "--compute-repack-tail",
        type=_tail_fraction,
        default=scheduling.SchedulingConfig.tail_fraction,
        metavar="FRACTION",
        help="async mode: when nothing is queued and at least two engine instances hold "
        "this share of their seats or less, repack their requests onto the fewest nodes and "
        "reshard a node left holding them to one wide instance when that ends its tail "
        "sooner (0: never); default %(default)g",
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
    fault = _fault_hook()
    drivers: dict[str, OcsDriver] = {}
    try:
        for o in w.ocses:
            drivers[o.name] = ocs_driver(o, overrides.get(o.name, o.address), tls, fault)
    except errors.OrlError:
        for d in drivers.values():
            await d.close()
        raise
    switches: dict[str, ElectricalDriver] = {
        t.name: LinuxSwitchDriver(t.name, t.netns) for t in w.tors if t.netns
    }
    if switches:
        log.info("tor_routes_enabled", tors=sorted(switches))
    ha: HaConfig | None = args.ha
    interval = float(args.heartbeat_interval)
    sqlite: Store | None = None
    etcd: Any = None
    store: EpochStore
    if ha is None:
        sqlite = store = Store(args.state or DEFAULT_STATE)
        role = Role()
        log.info("state_store", store="sqlite", path=store.location)
    else:
        etcd_store = _etcd_modules()[0]
        etcd = etcd_store.Etcd(ha.endpoints)
        store = etcd_store.EtcdStore(etcd, ha.prefix)  # unfenced: a standby writes nothing
        role = Role.standby()
        log.info(
            "state_store", store="etcd", path=store.location, endpoints=list(ha.endpoints),
            prefix=ha.prefix, election_ttl_s=ha.election_ttl_s,
            note="standby until elected leader",
        )  # fmt: skip
    controller = Controller(
        w,
        store,
        drivers,
        heartbeat_interval_s=interval,
        heartbeat_deadline_s=3 * interval,
        lock_timeout_s=args.lock_timeout,
        fault_hook=fault,
        electrical=switches,
        demand=PhaseDemand(args.model_bytes, args.training_bytes),
        role=role,
    )
    if ha is None:
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
    controller.identify = lambda node, address: agents.get(node, address).identify()
    compute = ComputeScheduler(
        controller,
        agents.get,
        config=scheduling.SchedulingConfig(
            interval_s=args.compute_interval,
            replan=ReplanSchedule(args.compute_replan_interval),
            tail_fraction=args.compute_repack_tail,
        ),
        enabled=args.compute_scheduling == "on",
    )
    listen = args.listen or w.controller
    if ha is not None:
        advertised(ha, listen)  # refused before binding when it cannot be advertised
    server = await grpcutil.start_server(
        listen,
        lambda s: fabric_controller_pb2_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(
                controller,
                tls_mod.Authorizer(tls, frozenset(args.operator)),
                compute,
                WeightSync(controller, agents.get),
            ),
            s,
        ),
        [fabric_controller_pb2.DESCRIPTOR.services_by_name["FabricController"].full_name],
        tls=tls,
        clients=len(w.nodes),  # every agent's stream at once after a restart
        options=leader.SERVER_OPTIONS,  # callers' pings that tell a hung controller
    )
    leadership = None
    try:
        if ha is not None:
            leadership = _leadership(ha, controller, etcd, advertised(ha, server.address))
        log.info(
            "controller_serving",
            address=server.address,
            role="standby (campaigning)" if ha is not None else "leader (single controller)",
            advertise=leadership.address if leadership is not None else None,
            cluster=w.cluster,
            nodes=len(w.nodes),
            ocses=len(w.ocses),
            state=store.location,
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

        async def fabric_loops() -> None:
            """What programs the fabric on its own: only where this controller leads."""
            async with asyncio.TaskGroup() as tg:
                tg.create_task(controller.run_reconcile(args.reconcile_interval))
                if compute.enabled:
                    log.info(
                        "compute_scheduling_on",
                        interval_s=args.compute_interval,
                        replan_interval_s=args.compute_replan_interval,
                    )
                    tg.create_task(compute.run())

        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(controller.run_liveness()),
                tg.create_task(grpcutil.watchdog()),
            ]
            if leadership is None:
                loops.append(tg.create_task(fabric_loops()))
            else:
                leadership.while_leading = fabric_loops
                loops.append(tg.create_task(leadership.run(), name="leadership"))
            await stop.wait()
            log.info("shutting_down")
            grpcutil.sd_notify("STOPPING=1")
            for task in loops:  # the leadership first resigns: a standby takes over
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
        if sqlite is not None:
            sqlite.close()
        if etcd is not None:
            await etcd.close()
    return 0


def _etcd_modules() -> tuple[Any, Any]:
    """The etcd store and election modules (the etcd client is an optional extra)."""
    try:
        from fabric_controller import election, etcd_store
    except ImportError as exc:
        raise errors.FailedPrecondition(
            f"--etcd needs the etcd client library: pip install 'orchestrrl[etcd]' ({exc})"
        ) from None
    return etcd_store, election


def _leadership(ha: HaConfig, controller: Controller, etcd: Any, address: str) -> Leadership:
    etcd_store, election = _etcd_modules()

    def new_election(on_lost: Callable[[str], None]) -> Any:
        return election.Election(
            etcd, address, key=ha.election_key, ttl_s=ha.election_ttl_s, on_lost=on_lost
        )

    async def open_store(fence: Any) -> EpochStore:
        store: EpochStore = await etcd_store.EtcdStore.open(etcd, ha.prefix, fence)
        return store

    return Leadership(controller, address, new_election, open_store)


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


def ocs_driver(
    o: Ocs, address: str, tls: tls_mod.TlsConfig | None, fault: Callable[[str], None]
) -> OcsDriver:
    """The driver the wiring chooses for an OCS: the OpticalSwitch gRPC contract (with the
    daemon's TLS), or NETCONF over SSH (``driver = "netconf"``, its own credentials)."""
    if o.driver == "netconf":
        assert o.netconf is not None  # the wiring's validation guarantees it
        log.info("ocs_driver", ocs=o.name, driver="netconf", address=address)
        return NetconfOcsDriver(
            o.name, address, o.netconf, switching_time_s=o.switching_time_s, fault_hook=fault
        )
    return GrpcOcsDriver(o.name, address, tls=tls)


def _fault_hook() -> Callable[[str], None]:
    """Fault injection for crash-recovery tests: ORL_FAULT_CRASH_AT=STAGE makes the
    controller SIGKILL itself right after that stage (as `kill -9` would);
    ORL_FAULT_STOP_AT=STAGE makes it SIGSTOP itself there, once (frozen until SIGCONT,
    as a stalled leader whose lease runs out). Stages: the epoch journal's (``planned``,
    ``ocs_programmed``, ``verified``, ``committed``), ``program_ocs`` (after each step of
    OCS batches) and ``netconf_confirmed`` (a NETCONF OCS batch committed but not yet
    confirmed)."""
    crash = os.environ.get("ORL_FAULT_CRASH_AT", "")
    freeze = os.environ.get("ORL_FAULT_STOP_AT", "")
    if not crash and not freeze:
        return lambda _stage: None
    if crash:
        log.warning("fault_injection_armed", stage=crash, note="will SIGKILL itself")
    if freeze:
        log.warning("fault_injection_armed", stage=freeze, note="will SIGSTOP itself once")
    frozen: list[str] = []

    def hook(reached: str) -> None:
        if reached == crash:
            os.kill(os.getpid(), signal.SIGKILL)
        if reached == freeze and not frozen:
            frozen.append(reached)
            log.warning("fault_injection_stopping", stage=reached)
            os.kill(os.getpid(), signal.SIGSTOP)

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
        args.ha = ha_config(args)
        return grpcutil.run(lambda: serve(args))
    except errors.OrlError as exc:
        print(f"orl-fabric-controller: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())

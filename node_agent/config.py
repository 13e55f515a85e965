"""Command-line configuration of orl-node-agent, validated into a frozen value."""

from __future__ import annotations

import argparse
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from node_agent.engine import default_layout, parse_layout, validate_layout
from node_agent.gpus import BACKEND_KINDS, BackendKind
from node_agent.nics import parse_nic
from node_agent.reshard.engine import RESHARD_BACKENDS, ReshardBackend
from node_agent.telemetry import MAX_INTERVAL_S, MIN_INTERVAL_S, check_interval
from orchestrrl import errors
from orchestrrl.grpcutil import parse_address
from orchestrrl.logs import LogFormat
from orchestrrl.tls import TlsConfig, add_tls_arguments
from orchestrrl.tls import from_args as tls_from_args
from orchestrrl.wiring import NAME_RE

DEFAULT_LISTEN = "127.0.0.1:50101"
DEFAULT_CONTROLLER = "127.0.0.1:50051"
CONTROLLER_ENV = "ORL_CONTROLLER"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS: tuple[LogFormat, ...] = ("auto", "json", "console")
MAX_GPUS = 64

S = TypeVar("S", bound=str)


@dataclass(frozen=True)
class AgentConfig:
    node: str
    listen: str = DEFAULT_LISTEN
    controller: str = DEFAULT_CONTROLLER
    advertise_host: str | None = None
    gpus: int = 8
    gpu_backend: BackendKind = "auto"
    nics: tuple[tuple[str, float | None], ...] = ()
    tp_layout: tuple[int, ...] | None = None  # None: the default for the GPU count
    reshard_backend: ReshardBackend = "sim"
    telemetry_interval_s: float = 1.0
    ready_file: Path | None = None
    log_level: str = "info"
    log_format: LogFormat = "auto"
    seed: int = 0
    tls: TlsConfig | None = None  # None: plaintext (only with --plaintext)
    # with mutual TLS, certificate identities whose commands the agent accepts
    controller_identities: tuple[str, ...] = ("orl-fabric-controller",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orl-node-agent",
        description="OrchestrRL node agent: GPU/NIC/engine telemetry up to the fabric "
        "controller, reshard and drain commands down to the rollout engine.",
    )
    p.add_argument("--node", required=True, help="this node's name in the cluster wiring")
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help="HOST:PORT to serve NodeAgent on; port 0 picks a free port "
        f"(default {DEFAULT_LISTEN})",
    )
    p.add_argument(
        "--controller",
        default=os.environ.get(CONTROLLER_ENV, DEFAULT_CONTROLLER),
        help=f"fabric controller HOST:PORT (default ${CONTROLLER_ENV} or {DEFAULT_CONTROLLER})",
    )
    p.add_argument(
        "--advertise-host",
        help="host the controller should use to reach this agent "
        "(default: the --listen host, or this machine's hostname when listening on all addresses)",
    )
    p.add_argument(
        "--gpus",
        default="8",
        help=f"number of simulated GPUs, 1..{MAX_GPUS} (the sim backend; NVML counts real GPUs)",
    )
    p.add_argument(
        "--gpu-backend",
        default="auto",
        help="auto (NVML, else simulated GPUs), nvml (fail without NVML) or sim (default auto)",
    )
    p.add_argument(
        "--nic",
        action="append",
        default=[],
        metavar="NAME[=GBPS]",
        help="a NIC to report (repeatable); GBPS defaults to the link speed from sysfs",
    )
    p.add_argument(
        "--tp-layout",
        metavar="T,T,...",
        help="TP degree of each rollout instance, powers of two summing to the GPU count "
        "(default: TP=2 instances, e.g. 2,2,2,2 on 8 GPUs)",
    )
    p.add_argument(
        "--reshard-backend",
        default="sim",
        help="sim (reshard changes the layout only) or torch (one worker process per GPU "
        "holds weight shards and reshard moves them with torch.distributed; needs the "
        "'reshard' extra) (default sim)",
    )
    p.add_argument(
        "--telemetry-interval",
        default="1.0",
        metavar="S",
        help=f"seconds between telemetry samples, {MIN_INTERVAL_S}..{MAX_INTERVAL_S:g} "
        "(default 1.0)",
    )
    p.add_argument("--ready-file", help="write the bound HOST:PORT here once serving")
    p.add_argument("--log-level", default="info", help=f"{', '.join(LOG_LEVELS)} (default info)")
    p.add_argument(
        "--log-format", default="auto", help="auto (JSON unless a terminal), json or console"
    )
    p.add_argument(
        "--seed", help="seed of the simulated GPUs and engine (default: derived from --node)"
    )
    p.add_argument(
        "--controller-identity",
        action="append",
        default=[],
        metavar="NAME",
        help="with mutual TLS, certificate identity whose commands (reshard, routes, RoCE, "
        "drain/resume) are accepted; repeatable (default: orl-fabric-controller)",
    )
    add_tls_arguments(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    """Parse and validate; a bad flag exits with status 2 and names flag, value and rule."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _validate(args)
    except errors.InvalidArgument as exc:
        parser.error(str(exc))


def _validate(args: argparse.Namespace) -> AgentConfig:
    node: str = args.node
    if not NAME_RE.match(node):
        raise errors.field_error(
            "--node", node, "1-63 characters: letters, digits, '.', '_' or '-', starting alnum"
        )
    parse_address(args.listen, "--listen")
    parse_address(args.controller, "--controller")
    gpus = _int(args.gpus, "--gpus", 1, MAX_GPUS)
    backend = _choice(args.gpu_backend, "--gpu-backend", BACKEND_KINDS)
    layout = None
    if args.tp_layout is not None:
        # The GPU count is only known for the sim backend here; NVML's is checked at start.
        layout = parse_layout(args.tp_layout, gpus if backend == "sim" else None)
    nics = tuple(parse_nic(text) for text in args.nic)
    names = [name for name, _ in nics]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise errors.field_error("--nic", duplicates, "each NIC may be named once")
    interval = check_interval(
        _float(args.telemetry_interval, "--telemetry-interval"), "--telemetry-interval"
    )
    if args.advertise_host is not None:
        parse_address(f"{args.advertise_host}:0", "--advertise-host")
    seed = (
        _int(args.seed, "--seed", 0, 2**63 - 1)
        if args.seed is not None
        else zlib.crc32(node.encode())
    )
    return AgentConfig(
        node=node,
        listen=args.listen,
        controller=args.controller,
        advertise_host=args.advertise_host,
        gpus=gpus,
        gpu_backend=backend,
        nics=nics,
        tp_layout=layout,
        reshard_backend=_choice(args.reshard_backend, "--reshard-backend", RESHARD_BACKENDS),
        telemetry_interval_s=interval,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        log_level=_choice(args.log_level, "--log-level", LOG_LEVELS),
        log_format=_choice(args.log_format, "--log-format", LOG_FORMATS),
        seed=seed,
        tls=tls_from_args(args),
        controller_identities=tuple(args.controller_identity or ["orl-fabric-controller"]),
    )


def layout_for(config: AgentConfig, gpus: int) -> tuple[int, ...]:
    """The configured layout checked against the node's actual GPU count, or the default."""
    if config.tp_layout is None:
        return default_layout(gpus)
    return validate_layout(config.tp_layout, gpus, "--tp-layout")


def _int(text: str, flag: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise errors.field_error(flag, text, f"expected an integer in {low}..{high}") from None
    if not low <= value <= high:
        raise errors.field_error(flag, text, f"expected an integer in {low}..{high}")
    return value


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise errors.field_error(flag, text, "expected a number of seconds, e.g. 1.0") from None


def _choice(text: str, flag: str, allowed: tuple[S, ...]) -> S:
    for option in allowed:
        if text == option:
            return option
    raise errors.field_error(flag, text, f"expected one of {', '.join(allowed)}")

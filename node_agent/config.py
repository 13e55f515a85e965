"""Configuration of orl-node-agent: flags, an optional TOML file, validated into a frozen value.

Every flag can also be set in the file given with ``--config`` (keys are the flag names
with ``_`` for ``-``; the repeatable ``--nic`` and ``--controller-identity`` are the
lists ``nics`` and ``controller_identities``). Precedence: flags, then the file, then
``$ORL_CONTROLLER`` (for ``controller`` only), then the built-in defaults. Every problem
is reported at once, naming the flag or file key, the value and what is allowed.
``controller`` may name several controllers (an HA group: a TOML list, or HOST:PORTs
separated by commas in the file, the flag or ``$ORL_CONTROLLER``); the agent follows the
one that leads.
``node_agent/agent.example.toml`` shows every key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import tempfile
import tomllib
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from node_agent.engine import default_layout, parse_layout, validate_layout
from node_agent.gpus import BACKEND_KINDS, BackendKind
from node_agent.nics import parse_nic
from node_agent.reshard.engine import RESHARD_BACKENDS, ReshardBackend
from node_agent.telemetry import MAX_INTERVAL_S, MIN_INTERVAL_S, check_interval
from node_agent.uplink import (
    DEFAULT_BUFFER_SAMPLES,
    DEFAULT_FLUSH_INTERVAL_S,
    MAX_FLUSH_INTERVAL_S,
    check_flush_interval,
)
from orchestrrl import add_version_flag, errors
from orchestrrl.grpcutil import parse_address
from orchestrrl.leader import parse_addresses
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

MAX_BUFFER_SAMPLES = 1_000_000

S = TypeVar("S", bound=str)


ENGINE_KINDS = ("vllm", "llamacpp", "sglang", "sim")
EngineKind = Literal["vllm", "llamacpp", "sglang", "sim"]
ENGINE_DEVICES = ("auto", "cpu", "cuda")
EngineDevice = Literal["auto", "cpu", "cuda"]
DEFAULT_GATEWAY_LISTEN = "127.0.0.1:50111"
DEFAULT_ENGINE_COMMAND = {"vllm": "python3", "sglang": "python3", "llamacpp": "llama-server"}
MAX_NUM_SEQS = 4096
MAX_CONTEXT = 10_000_000


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engine: ``sim`` (simulated, for local testing) or a real engine whose
    instances the agent runs and serves through its generation gateway."""

    kind: EngineKind
    model: str = ""  # weights: a model directory (vLLM, SGLang) or a GGUF file (llama.cpp)
    command: str = ""  # the engine's Python (vLLM, SGLang) or llama-server
    args: tuple[str, ...] = ()  # more engine arguments
    env: tuple[tuple[str, str], ...] = ()  # more environment variables for the engine
    device: EngineDevice = "auto"  # auto: cuda when NVML reports GPUs, else cpu
    max_num_seqs: int = 64  # sequences per instance
    context: int = 4096  # tokens per sequence (prompt + output)
    port_base: int = 0  # instance on first device d listens on port_base + d; 0: free ports
    start_timeout_s: float = 900.0
    log_dir: Path = Path("engine-logs")
    served_model: str = ""  # the model name clients use (default: from the model path)
    gateway_listen: str = DEFAULT_GATEWAY_LISTEN
    gateway_api_key_file: Path | None = None
    weight_version: str = "0"
    cpu_offset: int = 0  # CPU-only: instance devices map to cores from this one on

    @property
    def real(self) -> bool:
        return self.kind != "sim"


SIM_ENGINE = EngineConfig("sim")


@dataclass(frozen=True)
class AgentConfig:
    node: str
    engine: EngineConfig
    listen: str = DEFAULT_LISTEN
    # HOST:PORT, or the HOST:PORTs of an HA group joined by commas (see ``controllers``)
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
    metrics_listen: str | None = None  # HOST:PORT of Prometheus /metrics; None: off
    telemetry_buffer: int = DEFAULT_BUFFER_SAMPLES  # samples kept while the controller is away
    telemetry_flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S  # 0: send each sample
    # weight sync: the checkpoints this node serves (a trainer writes them there) and where
    # it fetches new weights into; None: neither
    checkpoint_dir: Path | None = None
    # HOST:PORT to serve the checkpoints on besides `listen` (the data-plane NIC: the
    # bytes then cross the fabric); None: only on `listen`
    checkpoint_listen: str | None = None
    checkpoint_keep: int = 2  # checkpoints kept after an update (the served one included)

    @property
    def controllers(self) -> tuple[str, ...]:
        """The controllers' addresses, in the order tried."""
        return tuple(self.controller.split(","))


# Settings a running agent applies on SIGHUP; a change to any other needs a restart.
RUNTIME_FIELDS = frozenset(
    {"telemetry_interval_s", "telemetry_flush_interval_s", "log_level", "nics"}
)

Kind = Literal["str", "int", "number", "bool", "strs", "layout", "addresses"]


@dataclass(frozen=True)
class Key:
    """A setting: its flag, the key in the config file and the TOML type there."""

    name: str  # file key; also the argparse dest
    kind: Kind

    @property
    def flag(self) -> str:
        singular = {
            "nics": "nic",
            "controller_identities": "controller-identity",
            "engine_args": "engine-arg",
            "engine_env": "engine-env",
        }
        return "--" + singular.get(self.name, self.name).replace("_", "-")


KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        Key("node", "str"),
        Key("listen", "str"),
        Key("controller", "addresses"),
        Key("advertise_host", "str"),
        Key("gpus", "int"),
        Key("gpu_backend", "str"),
        Key("nics", "strs"),
        Key("tp_layout", "layout"),
        Key("reshard_backend", "str"),
        Key("engine", "str"),
        Key("engine_model", "str"),
        Key("engine_command", "str"),
        Key("engine_args", "strs"),
        Key("engine_env", "strs"),
        Key("engine_device", "str"),
        Key("engine_max_num_seqs", "int"),
        Key("engine_context", "int"),
        Key("engine_port_base", "int"),
        Key("engine_start_timeout", "number"),
        Key("engine_log_dir", "str"),
        Key("served_model_name", "str"),
        Key("gateway_listen", "str"),
        Key("gateway_api_key_file", "str"),
        Key("weight_version", "str"),
        Key("engine_cpu_offset", "int"),
        Key("telemetry_interval", "number"),
        Key("telemetry_buffer", "int"),
        Key("telemetry_flush_interval", "number"),
        Key("metrics_listen", "str"),
        Key("ready_file", "str"),
        Key("log_level", "str"),
        Key("log_format", "str"),
        Key("seed", "int"),
        Key("controller_identities", "strs"),
        Key("checkpoint_dir", "str"),
        Key("checkpoint_listen", "str"),
        Key("checkpoint_keep", "int"),
        Key("tls_cert", "str"),
        Key("tls_key", "str"),
        Key("tls_ca", "str"),
        Key("plaintext", "bool"),
    )
}

DEFAULTS: dict[str, Any] = {
    "listen": DEFAULT_LISTEN,
    "controller": DEFAULT_CONTROLLER,
    "gpus": "8",
    "gpu_backend": "auto",
    "nics": [],
    "reshard_backend": "sim",
    "engine_args": [],
    "engine_env": [],
    "engine_device": "auto",
    "engine_max_num_seqs": "64",
    "engine_context": "4096",
    "engine_port_base": "0",
    "engine_start_timeout": "900",
    "gateway_listen": DEFAULT_GATEWAY_LISTEN,
    "weight_version": "0",
    "engine_cpu_offset": "0",
    "telemetry_interval": "1.0",
    "telemetry_buffer": str(DEFAULT_BUFFER_SAMPLES),
    "telemetry_flush_interval": str(DEFAULT_FLUSH_INTERVAL_S),
    "log_level": "info",
    "log_format": "auto",
    "controller_identities": [],
    "checkpoint_keep": "2",
    "plaintext": False,
}


class ConfigProblems(errors.InvalidArgument):
    """One or more problems with the flags or the config file, each a line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class ConfigSource:
    """Where the configuration comes from: the flags given and the file, re-read on SIGHUP."""

    flags: Mapping[str, Any]
    path: Path | None = None
    environ: Mapping[str, str] = dataclasses.field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    # No argparse defaults: a flag that is absent must not hide the config file's value.
    p = argparse.ArgumentParser(
        prog="orl-node-agent",
        description="OrchestrRL node agent: GPU/NIC/engine telemetry up to the fabric "
        "controller, reshard and drain commands down to the rollout engine. Every flag can "
        "be set in a TOML --config file instead; flags override the file.",
        argument_default=argparse.SUPPRESS,
    )
    add_version_flag(p)
    p.add_argument(
        "--config", metavar="FILE", help="TOML file of settings (see agent.example.toml)"
    )
    p.add_argument(
        "--check-config",
        metavar="FILE",
        help="validate FILE (with the other flags) and print the resulting configuration "
        "(exit 0) or every problem (exit 2); starts nothing",
    )
    p.add_argument("--node", help="this node's name in the cluster wiring (required)")
    p.add_argument(
        "--listen",
        help="HOST:PORT to serve NodeAgent on; port 0 picks a free port "
        f"(default {DEFAULT_LISTEN})",
    )
    p.add_argument(
        "--controller",
        help="fabric controller HOST:PORT, or the HOST:PORTs of an HA group separated by "
        f"commas: the agent follows the leader (default ${CONTROLLER_ENV} or "
        f"{DEFAULT_CONTROLLER})",
    )
    p.add_argument(
        "--advertise-host",
        help="host the controller should use to reach this agent "
        "(default: the --listen host, or this machine's hostname when listening on all addresses)",
    )
    p.add_argument(
        "--gpus",
        help=f"number of simulated GPUs, 1..{MAX_GPUS} (the sim backend; NVML counts real GPUs) "
        "(default 8)",
    )
    p.add_argument(
        "--gpu-backend",
        help="auto (NVML, else simulated GPUs), nvml (fail without NVML) or sim (default auto)",
    )
    p.add_argument(
        "--nic",
        dest="nics",
        action="append",
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
        help="sim (reshard changes the layout only) or torch (one worker process per GPU "
        "holds weight shards and reshard moves them with torch.distributed; needs the "
        "'reshard' extra) (default sim)",
    )
    g = p.add_argument_group(
        "rollout engine (the node's generation gateway runs one engine server per instance "
        "of the TP layout)"
    )
    g.add_argument(
        "--engine",
        help="vllm, llamacpp or sglang (real engine servers on loopback ports, served to the RL "
        "framework's rollout client through the gateway), or sim (a simulated engine, for "
        "local testing); required",
    )
    g.add_argument(
        "--engine-model",
        metavar="PATH",
        help="the weights: a model directory (vllm, sglang) or a GGUF file (llamacpp)",
    )
    g.add_argument(
        "--engine-command",
        metavar="PATH",
        help="the Python that has vLLM/SGLang installed, or the llama-server executable "
        "(default: python3, or llama-server)",
    )
    g.add_argument(
        "--engine-arg",
        dest="engine_args",
        action="append",
        metavar="ARG",
        help="one more argument for every engine server (repeatable; --engine-arg=--foo)",
    )
    g.add_argument(
        "--engine-env",
        dest="engine_env",
        action="append",
        metavar="NAME=VALUE",
        help="an environment variable for the engine servers (repeatable)",
    )
    g.add_argument(
        "--engine-device",
        help="auto (cuda when NVML reports GPUs, else cpu), cpu (each GPU of the layout is a "
        "CPU core) or cuda (default auto)",
    )
    g.add_argument(
        "--engine-max-num-seqs",
        metavar="N",
        help=f"sequences one instance decodes at once, 1..{MAX_NUM_SEQS} (default 64)",
    )
    g.add_argument(
        "--engine-context",
        metavar="N",
        help="tokens per sequence, prompt and output (default 4096)",
    )
    g.add_argument(
        "--engine-port-base",
        metavar="PORT",
        help="the instance whose first GPU is d listens on PORT+d (0: any free port) (default 0)",
    )
    g.add_argument(
        "--engine-start-timeout",
        metavar="S",
        help="seconds an engine server may take to become healthy (default 900)",
    )
    g.add_argument(
        "--engine-log-dir",
        metavar="DIR",
        help="where engine servers log "
        "(default: $LOGS_DIRECTORY, else a folder in the temporary directory)",
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: from --engine-model)",
    )
    g.add_argument(
        "--gateway-listen",
        metavar="HOST:PORT",
        help=f"where the gateway serves /v1/completions (default {DEFAULT_GATEWAY_LISTEN})",
    )
    g.add_argument(
        "--gateway-api-key-file",
        metavar="FILE",
        help="clients must send 'Authorization: Bearer' with the key in FILE",
    )
    g.add_argument(
        "--engine-cpu-offset",
        metavar="N",
        help="CPU-only node: GPU i of the layout runs on CPU core N+i (several agents on "
        "one host) (default 0)",
    )
    g.add_argument(
        "--weight-version",
        metavar="LABEL",
        help="label of the weights the engines start with (default 0)",
    )
    p.add_argument(
        "--telemetry-interval",
        metavar="S",
        help=f"seconds between telemetry samples, {MIN_INTERVAL_S}..{MAX_INTERVAL_S:g} "
        "(default 1.0)",
    )
    p.add_argument(
        "--telemetry-buffer",
        metavar="N",
        help="telemetry samples kept while the controller is away; when full the oldest is "
        f"dropped (and counted) (default {DEFAULT_BUFFER_SAMPLES})",
    )
    p.add_argument(
        "--telemetry-flush-interval",
        metavar="S",
        help="seconds between uploads of the buffered samples to the controller (one "
        f"message each), 0..{MAX_FLUSH_INTERVAL_S:g}; 0 sends every sample as it is taken "
        f"(default {DEFAULT_FLUSH_INTERVAL_S})",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics there (default: off)",
    )
    p.add_argument(
        "--ready-file",
        help="write the bound HOST:PORT here once serving (and with --metrics-listen the "
        "bound /metrics HOST:PORT to FILE.metrics)",
    )
    p.add_argument("--log-level", help=f"{', '.join(LOG_LEVELS)} (default info)")
    p.add_argument("--log-format", help="auto (JSON unless a terminal), json or console")
    p.add_argument("--seed", help="seed of the simulated GPUs and engine (default: from --node)")
    p.add_argument(
        "--controller-identity",
        dest="controller_identities",
        action="append",
        metavar="NAME",
        help="with mutual TLS, certificate identity whose commands (reshard, routes, RoCE, "
        "drain/resume) are accepted; repeatable (default: orl-fabric-controller)",
    )
    w = p.add_argument_group(
        "weight sync (checkpoints fetched from the training node's agent and loaded into the "
        "engines: `orlctl phase set weight-sync --checkpoint V --from NODE`)"
    )
    w.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="this node's checkpoints: a trainer writes its checkpoints here "
        "(orchestrrl.checkpoint.write) and the agent serves them to other nodes; a generation "
        "node's agent fetches new weights into it (default: none, no weight sync)",
    )
    w.add_argument(
        "--checkpoint-listen",
        metavar="HOST:PORT",
        help="also serve the checkpoints there, e.g. on the data-plane NIC so that the "
        "bytes cross the fabric's circuits (default: only on --listen)",
    )
    w.add_argument(
        "--checkpoint-keep",
        metavar="N",
        help="checkpoints a generation node keeps after an update, the served one included "
        "(default 2)",
    )
    add_tls_arguments(p)
    return p


@dataclass(frozen=True)
class CommandLine:
    source: ConfigSource
    check_only: bool


def parse_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    """Parse the flags only (argparse exits 2 on an unknown flag, 0 on --help)."""
    args = vars(build_parser().parse_args(argv))
    check = args.pop("check_config", None)
    config = args.pop("config", None)
    if check is not None and config is not None and check != config:
        raise ConfigProblems(["--config and --check-config name different files; give one"])
    path = check or config
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()}
    return CommandLine(
        ConfigSource(flags, Path(path) if path else None, dict(os.environ)), check is not None
    )


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    """Parse and validate; a bad flag or file exits with status 2 naming what is wrong."""
    parser = build_parser()
    try:
        return load(parse_command_line(argv).source)
    except errors.InvalidArgument as exc:
        parser.error(str(exc))


def load(source: ConfigSource) -> AgentConfig:
    """Merge flags over the file over the defaults and validate; :class:`ConfigProblems`."""
    problems: list[str] = []
    file_values: dict[str, Any] = {}
    if source.path is not None:
        read = _read_file(source.path, problems)
        if read is None:  # unreadable or not TOML: nothing else is worth reporting
            raise ConfigProblems(problems)
        file_values = read
    values: dict[str, Any] = dict(DEFAULTS)
    if CONTROLLER_ENV in source.environ:
        values["controller"] = source.environ[CONTROLLER_ENV]
    # systemd's LogsDirectory= (the engines' default log folder)
    values["_logs_directory"] = source.environ.get("LOGS_DIRECTORY", "")
    values.update(file_values)
    # Security is one choice: --plaintext overrides the file's TLS files and --tls-* flags
    # override the file's `plaintext`, rather than clashing with them.
    if source.flags.get("plaintext"):
        for name in ("tls_cert", "tls_key", "tls_ca"):
            values.pop(name, None)
    if any(name in source.flags for name in ("tls_cert", "tls_key", "tls_ca")):
        values["plaintext"] = False
    values.update(source.flags)
    where: dict[str, str] = {}
    for name in (n for n in values if not n.startswith("_")):
        where[name] = (
            f"{source.path}: {name}"
            if name in file_values and name not in source.flags
            else KEYS[name].flag
        )
    # Keys of the wrong type or unknown were left out (and are problems already); the
    # rest is validated too, so that one run reports everything.
    config = _validate(values, where, problems)
    if problems or config is None:
        raise ConfigProblems(problems)
    return config


def _read_file(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        problems.append(f"config file {path}: cannot read it ({exc.strerror})")
        return None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"config file {path}: not valid TOML ({exc})")
        return None
    out: dict[str, Any] = {}
    for name, value in doc.items():
        key = KEYS.get(name)
        if key is None:
            problems.append(
                f"{path}: unknown key {name!r}; allowed keys: {', '.join(sorted(KEYS))}"
            )
            continue
        converted = _from_toml(key, value)
        if converted is None:
            problems.append(
                str(errors.field_error(f"{path}: {name}", value, f"expected {_EXPECT[key.kind]}"))
            )
            continue
        out[name] = converted
    return out


_EXPECT: dict[Kind, str] = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "strs": "a list of strings",
    "layout": 'a list of integers, e.g. [2, 2, 2, 2], or a string "2,2,2,2"',
    "addresses": 'a "HOST:PORT" string or a list of them, e.g. ["10.0.0.1:50051", '
    '"10.0.0.2:50051"]',
}


def _from_toml(key: Key, value: Any) -> Any:
    """A file value in the form the flag would have given it; None when of the wrong type."""
    if key.kind == "bool":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if key.kind == "str":
        return value if isinstance(value, str) else None
    if key.kind == "addresses":  # the flag's form: HOST:PORTs separated by commas
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return ",".join(value)
        return value if isinstance(value, str) else None
    if key.kind == "int":
        return str(value) if isinstance(value, int) else None
    if key.kind == "number":
        return str(value) if isinstance(value, int | float) else None
    if key.kind == "strs":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return list(value) if ok else None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return ",".join(str(v) for v in value)
    return None


def _validate(
    values: dict[str, Any], where: dict[str, str], problems: list[str]
) -> AgentConfig | None:
    """Validate every field, collecting each problem; None when there was any."""
    ok: dict[str, Any] = {}

    def check(name: str, fn: Callable[[str], Any]) -> None:
        try:
            ok[name] = fn(where.get(name, KEYS[name].flag))
        except errors.InvalidArgument as exc:
            problems.append(str(exc))

    node = values.get("node")
    if node is None:
        problems.append('--node is required (or `node = "..."` in the --config file)')
    else:
        check("node", lambda f: _node(node, f))
    check("listen", lambda f: parse_address(values["listen"], f) and values["listen"])
    check("controller", lambda f: ",".join(parse_addresses(values["controller"], f)))
    check("gpus", lambda f: _int(values["gpus"], f, 1, MAX_GPUS))
    check("gpu_backend", lambda f: _choice(values["gpu_backend"], f, BACKEND_KINDS))
    if "tp_layout" in values:
        gpus = ok.get("gpus") if ok.get("gpu_backend") == "sim" else None
        # The GPU count is only known for the sim backend here; NVML's is checked at start.
        check("tp_layout", lambda f: parse_layout(values["tp_layout"], gpus, f))
    check("nics", lambda f: _nics(values["nics"], f))
    check(
        "telemetry_interval",
        lambda f: check_interval(_float(values["telemetry_interval"], f), f),
    )
    check("telemetry_buffer", lambda f: _int(values["telemetry_buffer"], f, 1, MAX_BUFFER_SAMPLES))
    check(
        "telemetry_flush_interval",
        lambda f: check_flush_interval(_float(values["telemetry_flush_interval"], f), f),
    )
    if values.get("metrics_listen") is not None:
        check(
            "metrics_listen",
            lambda f: parse_address(values["metrics_listen"], f) and values["metrics_listen"],
        )
    if values.get("advertise_host") is not None:
        check(
            "advertise_host",
            lambda f: (
                parse_address(f"{values['advertise_host']}:0", f) and values["advertise_host"]
            ),
        )
    if values.get("seed") is not None:
        check("seed", lambda f: _int(values["seed"], f, 0, 2**63 - 1))
    if values.get("checkpoint_dir") is not None:
        check("checkpoint_dir", lambda f: _directory(values["checkpoint_dir"], f))
    if values.get("checkpoint_listen") is not None:
        if values.get("checkpoint_dir") is None:
            problems.append(
                f"{where['checkpoint_listen']} needs a checkpoint directory "
                "(--checkpoint-dir or checkpoint_dir): there is nothing to serve"
            )
        check(
            "checkpoint_listen",
            lambda f: parse_address(values["checkpoint_listen"], f) and values["checkpoint_listen"],
        )
    check("checkpoint_keep", lambda f: _int(values["checkpoint_keep"], f, 1, 1000))
    check("reshard_backend", lambda f: _choice(values["reshard_backend"], f, RESHARD_BACKENDS))
    engine = _engine(values, where, problems, ok.get("reshard_backend"))
    check("log_level", lambda f: _choice(values["log_level"], f, LOG_LEVELS))
    check("log_format", lambda f: _choice(values["log_format"], f, LOG_FORMATS))
    tls_args = argparse.Namespace(
        plaintext=values["plaintext"],
        **{
            k: Path(values[k]) if values.get(k) else None for k in ("tls_cert", "tls_key", "tls_ca")
        },
    )
    try:
        ok["tls"] = tls_from_args(tls_args)
    except errors.InvalidArgument as exc:
        problems.append(str(exc))
    if problems or engine is None:
        return None
    return AgentConfig(
        node=ok["node"],
        engine=engine,
        listen=ok["listen"],
        controller=ok["controller"],
        advertise_host=ok.get("advertise_host"),
        gpus=ok["gpus"],
        gpu_backend=ok["gpu_backend"],
        nics=ok["nics"],
        tp_layout=ok.get("tp_layout"),
        reshard_backend=ok["reshard_backend"],
        telemetry_interval_s=ok["telemetry_interval"],
        ready_file=Path(values["ready_file"]) if values.get("ready_file") else None,
        log_level=ok["log_level"],
        log_format=ok["log_format"],
        seed=ok["seed"] if "seed" in ok else zlib.crc32(ok["node"].encode()),
        tls=ok["tls"],
        controller_identities=tuple(values["controller_identities"] or ["orl-fabric-controller"]),
        metrics_listen=ok.get("metrics_listen"),
        telemetry_buffer=ok["telemetry_buffer"],
        telemetry_flush_interval_s=ok["telemetry_flush_interval"],
        checkpoint_dir=ok.get("checkpoint_dir"),
        checkpoint_listen=ok.get("checkpoint_listen"),
        checkpoint_keep=ok["checkpoint_keep"],
    )


def _directory(text: str, field: str) -> Path:
    """A directory, or a path where one can be made (not an existing file)."""
    path = Path(text)
    if not text or (path.exists() and not path.is_dir()):
        raise errors.field_error(field, text, "a directory (made if missing)")
    return path


def _engine(
    values: dict[str, Any], where: dict[str, str], problems: list[str], reshard: str | None
) -> EngineConfig | None:
    """The engine settings; problems are appended (None when there is any)."""
    before = len(problems)

    def check(name: str, fn: Callable[[str], Any]) -> Any:
        try:
            return fn(where.get(name, KEYS[name].flag))
        except errors.InvalidArgument as exc:
            problems.append(str(exc))
            return None

    kind_text = values.get("engine")
    if kind_text is None:
        problems.append(
            "--engine is required (or `engine = ...` in the --config file): vllm, llamacpp or "
            "sglang for a real engine, sim for a simulated one (local testing)"
        )
        return None
    kind = check("engine", lambda f: _choice(kind_text, f, ENGINE_KINDS))
    if kind is None:
        return None
    if kind == "sim":
        return SIM_ENGINE
    model = values.get("engine_model")
    if not model:
        problems.append(f"--engine-model is required with --engine {kind} (the weights' path)")
    elif not Path(model).exists():
        problems.append(str(errors.field_error(where["engine_model"], model, "an existing path")))
    elif kind == "llamacpp" and not Path(model).is_file():
        problems.append(
            str(errors.field_error(where["engine_model"], model, "a GGUF file (llama.cpp)"))
        )
    command = values.get("engine_command") or DEFAULT_ENGINE_COMMAND[kind]
    if shutil.which(command) is None:
        problems.append(
            str(
                errors.field_error(
                    where.get("engine_command", "--engine-command"),
                    command,
                    "an executable (a path, or a name on PATH)"
                    + (": the Python that has the engine installed" if kind != "llamacpp" else ""),
                )
            )
        )
    if reshard is not None and reshard != "sim":
        problems.append(
            f"{where['reshard_backend']}={reshard!r} is not valid with --engine {kind}: a real "
            "engine's reshard restarts its instances from local weights (use sim)"
        )
    env = check("engine_env", lambda f: _env(values["engine_env"], f))
    device = check("engine_device", lambda f: _choice(values["engine_device"], f, ENGINE_DEVICES))
    seqs = check(
        "engine_max_num_seqs", lambda f: _int(values["engine_max_num_seqs"], f, 1, MAX_NUM_SEQS)
    )
    context = check("engine_context", lambda f: _int(values["engine_context"], f, 16, MAX_CONTEXT))
    port_base = check("engine_port_base", lambda f: _port_base(values["engine_port_base"], f))
    timeout = check(
        "engine_start_timeout", lambda f: _seconds(values["engine_start_timeout"], f, 1, 86400)
    )
    listen = check(
        "gateway_listen",
        lambda f: parse_address(values["gateway_listen"], f) and values["gateway_listen"],
    )
    key_file = values.get("gateway_api_key_file")
    if key_file is not None:
        check("gateway_api_key_file", lambda f: read_api_key(Path(key_file), f))
    cpu_offset = check("engine_cpu_offset", lambda f: _int(values["engine_cpu_offset"], f, 0, 4095))
    version = values["weight_version"]
    if not 1 <= len(version) <= 128:
        problems.append(str(errors.field_error(where["weight_version"], version, "1-128 chars")))
    served = values.get("served_model_name") or (_model_name(Path(model)) if model else "")
    if len(problems) > before:
        return None
    log_dir = values.get("engine_log_dir") or os.path.join(
        values.get("_logs_directory") or tempfile.gettempdir(), "orl-engines"
    )
    return EngineConfig(
        kind=kind,
        model=str(model),
        command=command,
        args=tuple(values["engine_args"]),
        env=env,
        device=device,
        max_num_seqs=seqs,
        context=context,
        port_base=port_base,
        start_timeout_s=timeout,
        log_dir=Path(log_dir),
        served_model=served,
        gateway_listen=listen,
        gateway_api_key_file=Path(key_file) if key_file else None,
        weight_version=version,
        cpu_offset=cpu_offset,
    )


def read_api_key(path: Path, field: str = "--gateway-api-key-file") -> str:
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise errors.field_error(field, str(path), f"a readable file ({exc.strerror})") from None
    if not key or len(key) > 4096 or any(c.isspace() for c in key):
        raise errors.field_error(field, str(path), "a file holding one key (no spaces)")
    return key


def _model_name(model: Path) -> str:
    """The default served name: a GGUF file's without .gguf, a directory's whole (Qwen2.5-7B)."""
    return model.stem if model.is_file() else model.name


def _env(texts: Sequence[str], field: str) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for text in texts:
        name, eq, value = text.partition("=")
        ident = name.replace("_", "a")
        if not eq or not name or not (ident.isascii() and ident.isalnum()) or name[0].isdigit():
            raise errors.field_error(field, text, "NAME=VALUE with NAME of letters, digits, _")
        if name in (n for n, _ in out):
            raise errors.field_error(field, text, f"each NAME once ({name} is set twice)")
        out.append((name, value))
    return tuple(out)


def _port_base(text: str, field: str) -> int:
    value = _int(text, field, 0, 65535 - MAX_GPUS)
    if 0 < value < 1024:
        raise errors.field_error(field, text, f"0 (free ports) or 1024..{65535 - MAX_GPUS}")
    return value


def _seconds(text: str, field: str, low: float, high: float) -> float:
    value = _float(text, field)
    if not math.isfinite(value) or not low <= value <= high:
        raise errors.field_error(field, text, f"seconds in {low:g}..{high:g}")
    return value


def _node(node: str, field: str) -> str:
    if not NAME_RE.match(node):
        raise errors.field_error(
            field, node, "1-63 characters: letters, digits, '.', '_' or '-', starting alnum"
        )
    return node


def _nics(texts: Sequence[str], field: str) -> tuple[tuple[str, float | None], ...]:
    nics = tuple(parse_nic(text, field) for text in texts)
    names = [name for name, _ in nics]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise errors.field_error(field, duplicates, "each NIC may be named once")
    return nics


@dataclass(frozen=True)
class ConfigChange:
    """What a reload changes: fields applied at run time and fields that need a restart."""

    applied: tuple[str, ...]
    needs_restart: tuple[str, ...]


def diff(old: AgentConfig, new: AgentConfig) -> ConfigChange:
    changed = [
        f.name
        for f in dataclasses.fields(AgentConfig)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    return ConfigChange(
        tuple(n for n in changed if n in RUNTIME_FIELDS),
        tuple(n for n in changed if n not in RUNTIME_FIELDS),
    )


def to_toml(config: AgentConfig) -> str:
    """The normalised configuration as a config file (every key, defaults included)."""
    tls = config.tls
    values: dict[str, Any] = {
        "node": config.node,
        "listen": config.listen,
        "controller": config.controller if len(config.controllers) == 1 else [*config.controllers],
        "advertise_host": config.advertise_host,
        "gpus": config.gpus,
        "gpu_backend": config.gpu_backend,
        "nics": [name if gbps is None else f"{name}={gbps:g}" for name, gbps in config.nics],
        "tp_layout": list(config.tp_layout) if config.tp_layout is not None else None,
        "reshard_backend": config.reshard_backend,
        **_engine_toml(config.engine),
        "telemetry_interval": config.telemetry_interval_s,
        "telemetry_buffer": config.telemetry_buffer,
        "telemetry_flush_interval": config.telemetry_flush_interval_s,
        "metrics_listen": config.metrics_listen,
        "ready_file": str(config.ready_file) if config.ready_file else None,
        "log_level": config.log_level,
        "log_format": config.log_format,
        "seed": config.seed,
        "controller_identities": list(config.controller_identities),
        "checkpoint_dir": str(config.checkpoint_dir) if config.checkpoint_dir else None,
        "checkpoint_listen": config.checkpoint_listen,
        "checkpoint_keep": config.checkpoint_keep,
        "plaintext": tls is None,
        "tls_cert": str(tls.cert) if tls else None,
        "tls_key": str(tls.key) if tls else None,
        "tls_ca": str(tls.ca) if tls else None,
    }
    lines = []
    for name, value in values.items():
        if value is None:
            lines.append(f"# {name} is not set")
        else:
            lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _engine_toml(e: EngineConfig) -> dict[str, Any]:
    if not e.real:
        return {"engine": e.kind}
    return {
        "engine": e.kind,
        "engine_model": e.model,
        "engine_command": e.command,
        "engine_args": list(e.args),
        "engine_env": [f"{k}={v}" for k, v in e.env],
        "engine_device": e.device,
        "engine_max_num_seqs": e.max_num_seqs,
        "engine_context": e.context,
        "engine_port_base": e.port_base,
        "engine_start_timeout": e.start_timeout_s,
        "engine_log_dir": str(e.log_dir),
        "served_model_name": e.served_model,
        "gateway_listen": e.gateway_listen,
        "gateway_api_key_file": str(e.gateway_api_key_file) if e.gateway_api_key_file else None,
        "weight_version": e.weight_version,
        "engine_cpu_offset": e.cpu_offset,
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


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

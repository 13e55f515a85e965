"""The rollout-engine settings of orl-node-agent, from flags and from the TOML config file."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from node_agent.config import (
    KEYS,
    SIM_ENGINE,
    AgentConfig,
    ConfigProblems,
    ConfigSource,
    EngineConfig,
    load,
    parse_command_line,
    to_toml,
)
from node_agent.main import main

pytestmark = pytest.mark.unit

How = Literal["flags", "file"]
HOWS: tuple[How, ...] = ("flags", "file")
REAL = ("vllm", "llamacpp", "sglang")


@dataclass(frozen=True)
class Node:
    """A machine with models and engine executables in a temporary folder."""

    root: Path
    model_dir: Path  # vLLM / SGLang weights
    gguf: Path  # llama.cpp weights
    python: Path  # an executable standing in for the engine's Python
    llama_server: Path

    def base(self, engine: str) -> dict[str, Any]:
        """The smallest good settings for ``engine``."""
        if engine == "sim":
            return {"node": "n1", "plaintext": True, "engine": "sim"}
        model = self.gguf if engine == "llamacpp" else self.model_dir
        return {"node": "n1", "plaintext": True, "engine": engine, "engine_model": str(model)}

    def load(
        self, settings: dict[str, Any], how: How, environ: dict[str, str] | None = None
    ) -> AgentConfig:
        """Load ``settings`` given as flags or as the config file."""
        if how == "flags":
            argv: list[str] = []
            for name, value in settings.items():
                flag = KEYS[name].flag
                if value is True:
                    argv.append(flag)
                elif isinstance(value, list):
                    argv += [f"{flag}={v}" for v in value]
                else:
                    argv.append(f"{flag}={value}")
        else:
            path = self.root / "agent.toml"
            path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in settings.items()))
            argv = ["--config", str(path)]
        source = parse_command_line(argv).source
        return load(ConfigSource(source.flags, source.path, environ or {}))

    def named(self, key: str, how: How) -> str:
        """How messages name ``key``: its flag, or the file and the key."""
        return KEYS[key].flag if how == "flags" else f"{self.root / 'agent.toml'}: {key}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # nan and inf are TOML floats too
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    model_dir = tmp_path / "models" / "Qwen2.5-0.5B-Instruct"
    model_dir.mkdir(parents=True)
    gguf = tmp_path / "models" / "tiny-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the default commands (python3, llama-server) are looked up on this PATH only
    monkeypatch.setenv("PATH", str(bin_dir))
    python = executable(bin_dir / "python3")
    llama_server = executable(bin_dir / "llama-server")
    return Node(tmp_path, model_dir, gguf, python, llama_server)


def problems_of(node: Node, settings: dict[str, Any], how: How) -> str:
    """Every problem, a line each; fails if the settings load."""
    with pytest.raises(ConfigProblems) as info:
        node.load(settings, how)
    return "\n".join(info.value.problems)


# --- which engine ----------------------------------------------------------------------


@pytest.mark.parametrize("how", HOWS)
def test_the_engine_is_required_and_the_message_lists_the_choices(node: Node, how: How) -> None:
    problems = problems_of(node, {"node": "n1", "plaintext": True}, how)
    assert "--engine is required (or `engine = ...` in the --config file)" in problems
    for kind in ("vllm", "llamacpp", "sglang", "sim"):
        assert kind in problems


@pytest.mark.parametrize("how", HOWS)
def test_an_unknown_engine_names_the_key_the_value_and_the_choices(node: Node, how: How) -> None:
    problems = problems_of(node, {**node.base("sim"), "engine": "tensorrt"}, how)
    assert (
        f"{node.named('engine', how)}='tensorrt' is not valid: "
        "expected one of vllm, llamacpp, sglang, sim"
    ) in problems


def test_a_bad_engine_flag_exits_2(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--plaintext", "--node", "n1", "--engine", "trt"]) == 2
    assert "--engine='trt' is not valid: expected one of vllm" in capsys.readouterr().err


@pytest.mark.parametrize("how", HOWS)
def test_sim_selects_the_simulator_and_needs_no_model(node: Node, how: How) -> None:
    config = node.load(node.base("sim"), how)
    assert config.engine == SIM_ENGINE
    assert not config.engine.real
    assert config.reshard_backend == "sim"


@pytest.mark.parametrize("how", HOWS)
def test_the_torch_reshard_backend_works_with_the_simulator_only(node: Node, how: How) -> None:
    config = node.load({**node.base("sim"), "reshard_backend": "torch"}, how)
    assert (config.engine, config.reshard_backend) == (SIM_ENGINE, "torch")
    for kind in REAL:
        problems = problems_of(node, {**node.base(kind), "reshard_backend": "torch"}, how)
        assert (
            f"{node.named('reshard_backend', how)}='torch' is not valid with --engine {kind}"
        ) in problems
        assert "(use sim)" in problems


# --- the weights and the engine's executable ---------------------------------------------


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_a_real_engine_needs_a_model(node: Node, how: How, kind: str) -> None:
    settings = node.base(kind)
    del settings["engine_model"]
    problems = problems_of(node, settings, how)
    assert f"--engine-model is required with --engine {kind}" in problems


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_the_model_must_exist(node: Node, how: How, kind: str) -> None:
    missing = str(node.root / "models" / "nope")
    problems = problems_of(node, {**node.base(kind), "engine_model": missing}, how)
    assert (
        f"{node.named('engine_model', how)}={missing!r} is not valid: an existing path" in problems
    )


@pytest.mark.parametrize("how", HOWS)
def test_llamacpp_needs_a_gguf_file_not_a_directory(node: Node, how: How) -> None:
    model = str(node.model_dir)
    problems = problems_of(node, {**node.base("llamacpp"), "engine_model": model}, how)
    assert f"{node.named('engine_model', how)}={model!r} is not valid: a GGUF file" in problems


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_vllm_and_sglang_take_a_directory_or_a_file(node: Node, how: How, kind: str) -> None:
    for model in (node.model_dir, node.gguf):
        config = node.load({**node.base(kind), "engine_model": str(model)}, how)
        assert config.engine.model == str(model)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_the_engine_command_must_be_an_executable(node: Node, how: How, kind: str) -> None:
    not_executable = node.root / "python.txt"
    not_executable.write_text("print()\n")
    for command in (
        str(node.root / "nope" / "python"),  # no such file
        "no-such-engine",  # not on PATH
        str(not_executable),
        str(node.root),  # a directory
    ):
        settings = {**node.base(kind), "engine_command": command}
        problems = problems_of(node, settings, how)
        assert (
            f"{node.named('engine_command', how)}={command!r} is not valid: an executable"
        ) in problems


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_the_default_command_must_be_on_path(
    node: Node, how: How, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(node.root / "empty"))
    problems = problems_of(node, node.base(kind), how)
    default = "llama-server" if kind == "llamacpp" else "python3"
    assert f"--engine-command={default!r} is not valid: an executable" in problems


# --- every other engine key --------------------------------------------------------------

BAD_VALUES: list[tuple[str, Any, str]] = [
    # key, bad value, what the message says is allowed
    ("engine_device", "tpu", "expected one of auto, cpu, cuda"),
    ("engine_max_num_seqs", 0, "expected an integer in 1..4096"),
    ("engine_max_num_seqs", -3, "expected an integer in 1..4096"),
    ("engine_max_num_seqs", 4097, "expected an integer in 1..4096"),
    ("engine_context", 0, "expected an integer in 16..10000000"),
    ("engine_context", -1, "expected an integer in 16..10000000"),
    ("engine_context", 15, "expected an integer in 16..10000000"),
    ("engine_port_base", -1, "expected an integer in 0..65471"),
    ("engine_port_base", 65536, "expected an integer in 0..65471"),
    ("engine_port_base", 65472, "expected an integer in 0..65471"),  # no room for 64 GPUs
    ("engine_port_base", 80, "0 (free ports) or 1024..65471"),
    ("engine_start_timeout", 0, "seconds in 1..86400"),
    ("engine_start_timeout", -5, "seconds in 1..86400"),
    ("engine_start_timeout", 0.5, "seconds in 1..86400"),
    ("engine_start_timeout", 86401, "seconds in 1..86400"),
    ("engine_start_timeout", float("nan"), "seconds in 1..86400"),
    ("engine_start_timeout", float("inf"), "seconds in 1..86400"),
    ("gateway_listen", "nowhere", "expected HOST:PORT"),
    ("gateway_listen", "127.0.0.1:99999", "port must be 0..65535"),
    ("gateway_listen", "bad host:1", "host must be a name or an IP address"),
    ("gateway_listen", "127.0.0.1:", "expected HOST:PORT"),
    ("engine_cpu_offset", -1, "expected an integer in 0..4095"),
    ("engine_cpu_offset", 4096, "expected an integer in 0..4095"),
    ("weight_version", "", "1-128 chars"),
    ("weight_version", "v" * 129, "1-128 chars"),
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES)
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(
    node: Node, how: How, key: str, value: Any, allowed: str
) -> None:
    for kind in REAL:
        problems = problems_of(node, {**node.base(kind), key: value}, how)
        assert f"{node.named(key, how)}={str(value)!r} is not valid: {allowed}" in problems


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(
    ("entries", "bad", "allowed"),
    [
        (["NOEQUALS"], "NOEQUALS", "NAME=VALUE with NAME of letters, digits, _"),
        (["A=1", "=1"], "=1", "NAME=VALUE"),
        (["1X=2"], "1X=2", "NAME=VALUE"),
        (["A B=1"], "A B=1", "NAME=VALUE"),
        (["É=1"], "É=1", "NAME=VALUE"),
        (["A=1", "A=2"], "A=2", "each NAME once (A is set twice)"),
    ],
)
def test_engine_env_entries_must_be_name_equals_value(
    node: Node, how: How, entries: list[str], bad: str, allowed: str
) -> None:
    problems = problems_of(node, {**node.base("vllm"), "engine_env": entries}, how)
    assert f"{node.named('engine_env', how)}={bad!r} is not valid: {allowed}" in problems


@pytest.mark.parametrize("how", HOWS)
def test_the_gateway_api_key_file_must_hold_one_key(node: Node, how: How) -> None:
    empty = node.root / "empty.key"
    empty.write_text("  \n")
    spaces = node.root / "spaces.key"
    spaces.write_text("two keys\n")
    for path, allowed in [
        (node.root / "nope.key", "a readable file (No such file or directory)"),
        (node.root, "a readable file (Is a directory)"),
        (empty, "a file holding one key (no spaces)"),
        (spaces, "a file holding one key (no spaces)"),
    ]:
        settings = {**node.base("vllm"), "gateway_api_key_file": str(path)}
        problems = problems_of(node, settings, how)
        assert (
            f"{node.named('gateway_api_key_file', how)}={str(path)!r} is not valid: {allowed}"
        ) in problems


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_key_file(node: Node) -> None:
    key = node.root / "gateway.key"
    key.write_text("k3y\n")
    key.chmod(0)
    problems = problems_of(node, {**node.base("vllm"), "gateway_api_key_file": str(key)}, "flags")
    assert f"--gateway-api-key-file={str(key)!r} is not valid: a readable file" in problems


def test_a_file_value_of_the_wrong_type_names_the_key(node: Node) -> None:
    problems = problems_of(node, {**node.base("vllm"), "engine_port_base": "30000"}, "file")
    assert (
        f"{node.named('engine_port_base', 'file')}='30000' is not valid: expected an integer"
        in (problems)
    )


@pytest.mark.parametrize("how", HOWS)
def test_every_engine_problem_is_reported_at_once(node: Node, how: How) -> None:
    log_dir = node.root / "logs"
    settings = {
        **node.base("llamacpp"),
        "engine_model": str(node.root / "nope.gguf"),
        "engine_command": "no-such-server",
        "engine_env": ["BAD"],
        "engine_max_num_seqs": 0,
        "engine_port_base": -1,
        "gateway_listen": "nowhere",
        "engine_cpu_offset": -1,
        "engine_log_dir": str(log_dir),
    }
    with pytest.raises(ConfigProblems) as info:
        node.load(settings, how)
    assert len(info.value.problems) == 7, info.value.problems
    assert not log_dir.exists()  # validating starts and creates nothing


# --- good configurations -----------------------------------------------------------------


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_the_defaults_of_a_real_engine(node: Node, how: How, kind: str) -> None:
    config = node.load(node.base(kind), how)
    model = node.gguf if kind == "llamacpp" else node.model_dir
    assert config.engine == EngineConfig(
        kind=kind,  # type: ignore[arg-type]
        model=str(model),
        command="llama-server" if kind == "llamacpp" else "python3",
        log_dir=Path(tempfile.gettempdir()) / "orl-engines",
        # a GGUF file's name without .gguf; a directory's whole name, dots and all
        served_model="tiny-Q4_K_M" if kind == "llamacpp" else "Qwen2.5-0.5B-Instruct",
    )
    assert config.engine.real
    assert config.reshard_backend == "sim"
    assert (config.engine.device, config.engine.max_num_seqs, config.engine.context) == (
        "auto",
        64,
        4096,
    )
    assert (config.engine.port_base, config.engine.start_timeout_s) == (0, 900.0)
    assert config.engine.gateway_listen == "127.0.0.1:50111"
    assert config.engine.gateway_api_key_file is None
    assert (config.engine.weight_version, config.engine.cpu_offset) == ("0", 0)


def test_engine_logs_default_to_the_systemd_logs_directory(node: Node) -> None:
    config = node.load(node.base("vllm"), "flags", {"LOGS_DIRECTORY": "/var/log/orl"})
    assert config.engine.log_dir == Path("/var/log/orl/orl-engines")


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", REAL)
def test_a_full_engine_configuration(node: Node, how: How, kind: str) -> None:
    key = node.root / "gateway.key"
    key.write_text("s3cret\n")
    command = node.llama_server if kind == "llamacpp" else node.python
    settings = {
        **node.base(kind),
        "engine_command": str(command),
        "engine_args": ["--dtype=bfloat16", "--seed 7"],
        "engine_env": ["HF_HOME=/srv/hf", "OPTS=a=b", "EMPTY="],
        "engine_device": "cpu",
        "engine_max_num_seqs": 256,
        "engine_context": 32768,
        "engine_port_base": 30000,
        "engine_start_timeout": 120.5,
        "engine_log_dir": str(node.root / "logs"),
        "served_model_name": "qwen-tiny",
        "gateway_listen": "0.0.0.0:50111",
        "gateway_api_key_file": str(key),
        "weight_version": "step-42",
        "engine_cpu_offset": 8,
    }
    config = node.load(settings, how)
    assert config.engine == EngineConfig(
        kind=kind,  # type: ignore[arg-type]
        model=settings["engine_model"],
        command=str(command),
        args=("--dtype=bfloat16", "--seed 7"),
        env=(("HF_HOME", "/srv/hf"), ("OPTS", "a=b"), ("EMPTY", "")),
        device="cpu",
        max_num_seqs=256,
        context=32768,
        port_base=30000,
        start_timeout_s=120.5,
        log_dir=node.root / "logs",
        served_model="qwen-tiny",
        gateway_listen="0.0.0.0:50111",
        gateway_api_key_file=key,
        weight_version="step-42",
        cpu_offset=8,
    )
    # the normalised file (--check-config's output) loads to the same configuration
    again = node.root / "again.toml"
    again.write_text(to_toml(config))
    source = parse_command_line(["--config", str(again)]).source
    assert load(ConfigSource(source.flags, source.path, {})) == config


def test_engine_flags_replace_the_file_lists(node: Node) -> None:
    path = node.root / "agent.toml"
    settings = {**node.base("vllm"), "engine_args": ["--a"], "engine_env": ["A=1"]}
    path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in settings.items()))
    flags = ["--config", str(path), "--engine-arg=--b", "--engine-env=B=2", "--engine-context=64"]
    source = parse_command_line(flags).source
    engine = load(ConfigSource(source.flags, source.path, {})).engine
    assert (engine.args, engine.env, engine.context) == (("--b",), (("B", "2"),), 64)

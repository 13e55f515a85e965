"""The TOML config file of orl-node-agent: precedence, problems, --check-config, reload diff."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from node_agent.config import (
    KEYS,
    SIM_ENGINE,
    AgentConfig,
    ConfigProblems,
    ConfigSource,
    diff,
    load,
    parse_command_line,
    to_toml,
)
from node_agent.main import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "node_agent" / "agent.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    """The file (with ``engine = "sim"`` unless ``text`` names an engine)."""
    path = tmp_path / "agent.toml"
    path.write_text(text if "engine" in text else 'engine = "sim"\n' + text)
    return path


def load_argv(argv: list[str], environ: dict[str, str] | None = None) -> AgentConfig:
    source = parse_command_line(argv).source
    return load(ConfigSource(source.flags, source.path, environ or {}))


def test_every_key_from_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
node = "gen1-n1"
listen = "0.0.0.0:0"
controller = "ctl.example:50051"
advertise_host = "gen1-n1.example"
gpus = 4
gpu_backend = "sim"
nics = ["eth0=400", "eth1"]
tp_layout = [2, 1, 1]
reshard_backend = "sim"
telemetry_interval = 0.25
telemetry_buffer = 50
metrics_listen = "127.0.0.1:9101"
ready_file = "/run/orl/agent.ready"
log_level = "debug"
log_format = "json"
seed = 42
controller_identities = ["ctl-a", "ctl-b"]
plaintext = true
""",
    )
    assert load_argv(["--config", str(path)]) == AgentConfig(
        engine=SIM_ENGINE,
        node="gen1-n1",
        listen="0.0.0.0:0",
        controller="ctl.example:50051",
        advertise_host="gen1-n1.example",
        gpus=4,
        gpu_backend="sim",
        nics=(("eth0", 400.0), ("eth1", None)),
        tp_layout=(2, 1, 1),
        telemetry_interval_s=0.25,
        telemetry_buffer=50,
        metrics_listen="127.0.0.1:9101",
        ready_file=Path("/run/orl/agent.ready"),
        log_level="debug",
        log_format="json",
        seed=42,
        controller_identities=("ctl-a", "ctl-b"),
    )


def test_flags_override_the_file_which_overrides_the_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'node = "n1"\nplaintext = true\ncontroller = "file:1"\ngpus = 4\nnics = ["eth0"]\n',
    )
    env = {"ORL_CONTROLLER": "env:1"}
    config = load_argv(["--config", str(path), "--gpus", "2", "--nic", "eth9"], env)
    assert (config.controller, config.gpus, config.nics) == ("file:1", 2, (("eth9", None),))
    assert load_argv(["--config", str(path), "--controller", "flag:1"], env).controller == "flag:1"
    no_file_key = write(tmp_path, 'node = "n1"\nplaintext = true\n')
    assert load_argv(["--config", str(no_file_key)], env).controller == "env:1"


def test_plaintext_flag_overrides_tls_files_in_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'node = "n1"\ntls_cert = "/x.pem"\ntls_key = "/x.key"\ntls_ca = "/c"\n')
    assert load_argv(["--config", str(path), "--plaintext"]).tls is None


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path: Path) -> None:
    path = write(tmp_path, 'node = "n1"\nplaintext = true\ntelemetry_intervall = 2\n')
    with pytest.raises(ConfigProblems) as info:
        load_argv(["--config", str(path)])
    [problem] = info.value.problems
    assert f"{path}: unknown key 'telemetry_intervall'" in problem
    assert "allowed keys: " in problem
    assert all(name in problem for name in KEYS)


def test_every_problem_is_reported_at_once_naming_key_value_and_rule(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'node = "bad name"\ngpus = "8"\ntelemetry_interval = 0.001\nlog_level = "loud"\n'
        'nics = ["a/b"]\nplaintext = true\n',
    )
    with pytest.raises(ConfigProblems) as info:
        load_argv(["--config", str(path), "--gpu-backend", "cuda"])
    problems = "\n".join(info.value.problems)
    assert len(info.value.problems) == 6, problems
    assert f"{path}: node='bad name' is not valid" in problems
    assert f"{path}: gpus='8' is not valid: expected an integer" in problems
    assert f"{path}: telemetry_interval=0.001 is not valid: must be between" in problems
    assert f"{path}: log_level='loud' is not valid: expected one of debug" in problems
    assert f"{path}: nics='a/b' is not valid" in problems
    assert "--gpu-backend='cuda' is not valid: expected one of auto, nvml, sim" in problems


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node = ", "not valid TOML"),
        ('plaintext = "yes"\nnode = "n"', "plaintext='yes' is not valid: expected true or false"),
        ('plaintext = true\nnode = "n"\ntp_layout = [2.0]', "tp_layout=[2.0] is not valid"),
        ("plaintext = true", "--node is required"),
        ('node = "n"', "no TLS configured"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigProblems) as info:
        load_argv(["--config", str(path)])
    assert message in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigProblems, match="cannot read it"):
        load_argv(["--config", str(tmp_path / "nope.toml")])


def test_check_config_prints_the_normalised_config_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, 'node = "n1"\nplaintext = true\ngpus = 4\nnics = ["eth0=400.0"]\n')
    assert main(["--check-config", str(path)]) == 0
    out = capsys.readouterr().out
    doc = tomllib.loads(out)
    assert doc["node"] == "n1"
    assert doc["gpus"] == 4
    assert doc["nics"] == ["eth0=400"]
    assert doc["telemetry_interval"] == 1.0
    assert doc["plaintext"] is True
    assert set(doc) <= set(KEYS)
    # the output is itself a valid config file that loads to the same configuration
    again = write(tmp_path, out)
    assert load_argv(["--config", str(again)]) == load_argv(["--config", str(path)])


def test_check_config_prints_the_problems_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, 'node = "n1"\nplaintext = true\ngpus = 0\ncolour = "red"\n')
    assert main(["--check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "2 configuration problems" in captured.err
    assert "unknown key 'colour'" in captured.err
    assert "gpus='0' is not valid: expected an integer in 1..64" in captured.err


def test_the_shipped_example_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # its TLS files, model, engine and key file do not exist here: flags replace them
    key = tmp_path / "gateway.key"
    key.write_text("k3y\n")
    argv = ["--check-config", str(EXAMPLE), "--plaintext", f"--engine-model={tmp_path}"]
    argv += [f"--engine-command={sys.executable}", f"--gateway-api-key-file={key}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert 'node = "gen0-n0"' in out and 'engine = "vllm"' in out
    assert 'engine_args = ["--dtype=bfloat16", "--gpu-memory-utilization=0.9"]' in out
    assert set(tomllib.loads(EXAMPLE.read_text())) <= set(KEYS)


def test_to_toml_round_trips_tls(tmp_path: Path) -> None:
    for name in ("a.pem", "a.key", "ca.pem"):
        (tmp_path / name).write_text("x")
    path = write(
        tmp_path,
        f'node = "n1"\ntls_cert = "{tmp_path}/a.pem"\ntls_key = "{tmp_path}/a.key"\n'
        f'tls_ca = "{tmp_path}/ca.pem"\n',
    )
    config = load_argv(["--config", str(path)])
    assert config.tls is not None
    again = write(tmp_path, to_toml(config))
    assert load_argv(["--config", str(again)]) == config


def test_diff_splits_runtime_changes_from_restart_ones() -> None:
    old = AgentConfig(node="n1", engine=SIM_ENGINE)
    new = AgentConfig(
        engine=SIM_ENGINE,
        node="n1",
        telemetry_interval_s=0.5,
        log_level="debug",
        nics=(("eth0", None),),
        gpus=4,
    )
    change = diff(old, new)
    assert set(change.applied) == {"telemetry_interval_s", "log_level", "nics"}
    assert change.needs_restart == ("gpus",)
    assert diff(old, old).applied == diff(old, old).needs_restart == ()


def test_controller_takes_a_list_from_the_file_the_flag_or_the_environment(
    tmp_path: Path,
) -> None:
    group = ["ctl-a.example:50051", "ctl-b.example:50051", "10.0.0.3:50051"]
    as_list = write(
        tmp_path, f'node = "n1"\nplaintext = true\ncontroller = {group!r}\n'.replace("'", '"')
    )
    config = load_argv(["--config", str(as_list)])
    assert config.controllers == tuple(group)
    assert config.controller == ",".join(group)
    # the normalised file keeps the list, and loads back to the same configuration
    assert f'controller = ["{group[0]}", "{group[1]}", "{group[2]}"]' in to_toml(config)
    again = write(tmp_path, to_toml(config))
    assert load_argv(["--config", str(again)]) == config
    commas = write(tmp_path, 'node = "n1"\nplaintext = true\ncontroller = "a:1, b:2"\n')
    assert load_argv(["--config", str(commas)]).controllers == ("a:1", "b:2")
    plain = write(tmp_path, 'node = "n1"\nplaintext = true\n')
    assert load_argv(["--config", str(plain), "--controller", "x:1,y:2"]).controllers == (
        "x:1",
        "y:2",
    )
    assert load_argv(["--config", str(plain)], {"ORL_CONTROLLER": "e:1,f:2"}).controllers == (
        "e:1",
        "f:2",
    )
    assert load_argv(["--config", str(plain)]).controllers == ("127.0.0.1:50051",)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[]", 'controller=[] is not valid: expected a "HOST:PORT" string or a list'),
        ("[1, 2]", "controller=[1, 2] is not valid: expected a"),
        ('"a:1,,b:2"', "controller='a:1,,b:2' is not valid: an empty address in the list"),
        ('["a:1", "nope"]', "controller='nope' is not valid: expected HOST:PORT"),
        ('"a:1,a:1"', "controller='a:1,a:1' is not valid: each address once (a:1 repeated)"),
        ('"a:0"', "controller='a:0' is not valid: port must be 1..65535"),
        ('"a:1,b:99999"', "controller='b:99999' is not valid: port must be 0..65535"),
    ],
)
def test_bad_controller_lists_name_the_key_the_value_and_the_rule(
    tmp_path: Path, value: str, message: str
) -> None:
    path = write(tmp_path, f'node = "n1"\nplaintext = true\ncontroller = {value}\n')
    with pytest.raises(ConfigProblems) as info:
        load_argv(["--config", str(path)])
    [problem] = info.value.problems
    assert problem.startswith(f"{path}: controller="), problem
    assert message in problem, problem


def test_a_bad_controller_flag_names_the_flag(tmp_path: Path) -> None:
    plain = write(tmp_path, 'node = "n1"\nplaintext = true\n')
    with pytest.raises(ConfigProblems) as info:
        load_argv(["--config", str(plain), "--controller", "x:1,y"])
    assert info.value.problems == (
        "--controller='y' is not valid: expected HOST:PORT, e.g. 127.0.0.1:50051",
    )

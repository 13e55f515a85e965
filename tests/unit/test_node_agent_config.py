"""Command-line flags of orl-node-agent and the uplink's backoff."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from node_agent.config import SIM_ENGINE, AgentConfig, layout_for, parse_args
from node_agent.daemon import advertised_address
from node_agent.main import main
from node_agent.uplink import Backoff
from orchestrrl import errors

pytestmark = pytest.mark.unit


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORL_CONTROLLER", raising=False)
    config = parse_args(["--plaintext", "--engine", "sim", "--node", "gen0-n0"])
    assert config == AgentConfig(node="gen0-n0", engine=SIM_ENGINE, seed=config.seed)
    assert config.listen == "127.0.0.1:50101"
    assert config.controller == "127.0.0.1:50051"
    assert config.gpus == 8
    assert config.gpu_backend == "auto"
    assert config.telemetry_interval_s == 1.0
    assert config.telemetry_flush_interval_s == 1.0
    assert config.tp_layout is None
    assert (
        parse_args(["--plaintext", "--engine", "sim", "--node", "gen0-n0"]).seed == config.seed
    )  # stable per node
    assert parse_args(["--plaintext", "--engine", "sim", "--node", "gen0-n1"]).seed != config.seed


def test_controller_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORL_CONTROLLER", "10.0.0.5:50051")
    assert (
        parse_args(["--plaintext", "--engine", "sim", "--node", "n"]).controller == "10.0.0.5:50051"
    )
    assert (
        parse_args(
            ["--plaintext", "--engine", "sim", "--node", "n", "--controller", "c:1"]
        ).controller
        == "c:1"
    )


def test_every_flag() -> None:
    config = parse_args(
        [
            "--plaintext",
            "--engine=sim",
            "--node=gen1-n1",
            "--listen=0.0.0.0:0",
            "--controller=ctl.example:50051",
            "--advertise-host=gen1-n1.example",
            "--gpus=4",
            "--gpu-backend=sim",
            "--nic=eth0=400",
            "--nic=eth1",
            "--tp-layout=2,1,1",
            "--telemetry-interval=0.25",
            "--telemetry-flush-interval=2",
            "--ready-file=/run/orl/agent.ready",
            "--log-level=debug",
            "--log-format=json",
            "--seed=42",
        ]
    )
    assert config == AgentConfig(
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
        telemetry_flush_interval_s=2.0,
        ready_file=Path("/run/orl/agent.ready"),
        log_level="debug",
        log_format="json",
        seed=42,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--node", "bad name"], "--node='bad name'"),
        (["--node", "n", "--listen", "nowhere"], "--listen='nowhere'"),
        (["--node", "n", "--controller", "h:99999"], "--controller='h:99999'"),
        (["--node", "n", "--gpus", "0"], "--gpus='0' is not valid: expected an integer in 1..64"),
        (["--node", "n", "--gpus", "x"], "--gpus='x'"),
        (["--node", "n", "--gpu-backend", "cuda"], "expected one of auto, nvml, sim"),
        (["--node", "n", "--nic", "a/b"], "--nic='a/b'"),
        (["--node", "n", "--nic", "eth0", "--nic", "eth0=100"], "each NIC may be named once"),
        (["--node", "n", "--gpu-backend", "sim", "--tp-layout", "4,2"], "--tp-layout=[4, 2]"),
        (["--node", "n", "--tp-layout", "3,5"], "power of two"),
        (["--node", "n", "--telemetry-interval", "0.01"], "--telemetry-interval=0.01"),
        (["--node", "n", "--telemetry-interval", "soon"], "--telemetry-interval='soon'"),
        (["--node", "n", "--telemetry-flush-interval", "-1"], "--telemetry-flush-interval=-1"),
        (["--node", "n", "--telemetry-flush-interval", "61"], "and 60 seconds"),
        (["--node", "n", "--log-level", "loud"], "--log-level='loud'"),
        (["--node", "n", "--log-format", "xml"], "--log-format='xml'"),
        (["--node", "n", "--seed", "-1"], "--seed='-1'"),
        (["--node", "n", "--advertise-host", "a b"], "--advertise-host"),
        ([], "--node"),
    ],
)
def test_bad_flags_exit_2_naming_flag_and_value(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(flags) == 2
    assert message in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--tp-layout" in capsys.readouterr().out


def test_layout_is_checked_against_the_actual_gpu_count() -> None:
    config = parse_args(
        ["--plaintext", "--engine", "sim", "--node", "n", "--tp-layout", "4,4"]
    )  # auto: count not known yet
    assert layout_for(config, 8) == (4, 4)
    with pytest.raises(errors.InvalidArgument, match=r"--tp-layout=\[4, 4\].*GPU count 4"):
        layout_for(config, 4)
    assert layout_for(parse_args(["--plaintext", "--engine", "sim", "--node", "n"]), 4) == (2, 2)


def test_advertised_address() -> None:
    assert advertised_address("127.0.0.1:4242", None) == "127.0.0.1:4242"
    assert advertised_address("0.0.0.0:4242", "node7") == "node7:4242"
    host, _, port = advertised_address("0.0.0.0:4242", None).rpartition(":")
    assert host not in ("", "0.0.0.0")
    assert port == "4242"


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(0.2, 10.0, random.Random(1))
    delays = [backoff.next() for _ in range(12)]
    ceilings = [min(10.0, 0.2 * 2**i) for i in range(12)]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert 5.0 <= backoff.longest() <= 10.0
    backoff.reset()
    assert 0.1 <= backoff.next() <= 0.2

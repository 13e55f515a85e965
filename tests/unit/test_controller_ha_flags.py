"""The daemon's HA flags (issue 17): parsed, validated with errors naming the flag, the
value and what is allowed, and SQLite (unchanged) when ``--etcd`` is absent."""

from __future__ import annotations

import pytest

from fabric_controller.main import HaConfig, advertised, build_parser, ha_config
from orchestrrl import errors

pytestmark = pytest.mark.unit


def config(*argv: str) -> HaConfig | None:
    return ha_config(build_parser().parse_args(list(argv)))


def test_without_etcd_the_state_is_sqlite_as_before() -> None:
    assert config() is None
    assert config("--state", "x.db") is None


def test_defaults_and_values() -> None:
    assert config("--etcd", "10.0.0.1:2379, 10.0.0.2:2379") == HaConfig(
        ("10.0.0.1:2379", "10.0.0.2:2379"), "/orchestrrl/", 2, None
    )
    got = config(
        "--etcd", "http://e1:2379", "--etcd-prefix", "/prod/orl/", "--election-ttl", "5",
        "--advertise", "ctl-a.example:50051",
    )  # fmt: skip
    assert got == HaConfig(("e1:2379",), "/prod/orl/", 5, "ctl-a.example:50051")
    assert got.election_key == "/prod/orl/leader"


@pytest.mark.parametrize(
    ("argv", "field", "allowed"),
    [
        (["--etcd", ""], "--etcd", "HOST:PORT of etcd members"),
        (["--etcd", "a:2379,,b:2379"], "--etcd", "HOST:PORT of etcd members"),
        (["--etcd", "a:0"], "--etcd", "port must be 1..65535"),
        (["--etcd", "a"], "--etcd", "HOST:PORT"),
        (["--etcd", "a:1,a:1"], "--etcd", "each endpoint once"),
        (["--etcd", ",".join(f"e{i}:1" for i in range(10))], "--etcd", "at most 9"),
        (["--etcd", "a:1", "--election-ttl", "0"], "--election-ttl", "whole seconds 1..60"),
        (["--etcd", "a:1", "--election-ttl", "61"], "--election-ttl", "whole seconds 1..60"),
        (["--etcd", "a:1", "--election-ttl", "1.5"], "--election-ttl", "whole seconds 1..60"),
        (["--etcd", "a:1", "--etcd-prefix", "orl"], "--etcd-prefix", "starts and ends with /"),
        (["--etcd", "a:1", "--etcd-prefix", "/a b/"], "--etcd-prefix", "starts and ends with /"),
        (["--etcd", "a:1", "--advertise", "ctl:0"], "--advertise", "port must be 1..65535"),
        (["--etcd", "a:1", "--state", "x.db"], "--state", "not with --etcd"),
        (["--advertise", "ctl:1"], "--advertise", "only with --etcd"),
        (["--election-ttl", "3"], "--election-ttl", "only with --etcd"),
        (["--etcd-prefix", "/x/"], "--etcd-prefix", "only with --etcd"),
    ],
)
def test_bad_flags_name_field_value_and_what_is_allowed(
    argv: list[str], field: str, allowed: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as bad:
        config(*argv)
    assert field in str(bad.value) and allowed in str(bad.value)


def test_the_advertised_address() -> None:
    ha = HaConfig(("e:1",))
    assert advertised(ha, "10.0.0.5:50051") == "10.0.0.5:50051"
    assert advertised(HaConfig(("e:1",), advertise="ctl:7"), "0.0.0.0:50051") == "ctl:7"
    with pytest.raises(errors.InvalidArgument, match=r"--listen='0\.0\.0\.0:50051'.*--advertise"):
        advertised(ha, "0.0.0.0:50051")

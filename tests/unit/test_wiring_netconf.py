"""The wiring's NETCONF OCS stanza: ``driver = "netconf"`` and its ``netconf`` table,
every bad field named, a valid one frozen and written back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric_controller import cli
from orchestrrl import wiring
from orchestrrl.model import NetconfSettings

pytestmark = pytest.mark.unit

BASE = """
[[ocs]]
name = "ocs0"
address = "192.0.2.10:830"
ports = 8
{ocs}

[[pod]]
name = "t0"
[[tor]]
name = "tor-t0"
pod = "t0"
uplinks = [{{ port = "up0", ocs = "ocs0", ocs_port = 1 }}]
[[node]]
name = "n0"
pod = "t0"
role = "train"
agent = "127.0.0.1:0"
gpus = 8
"""

GOOD = (
    'driver = "netconf"\n'
    'netconf = { username = "orl", key_file = "/etc/orchestrrl/ocs0.key", '
    'known_hosts = "/etc/orchestrrl/known_hosts" }'
)


def problems(ocs: str) -> list[str]:
    with pytest.raises(wiring.WiringError) as info:
        wiring.parse(BASE.format(ocs=ocs))
    return info.value.problems


def test_a_netconf_ocs_is_frozen_with_its_defaults_and_written_back_unchanged() -> None:
    w = wiring.parse(BASE.format(ocs=GOOD))
    o = w.ocs("ocs0")
    assert (o.driver, o.address) == ("netconf", "192.0.2.10:830")
    assert o.netconf == NetconfSettings(
        username="orl",
        key_file="/etc/orchestrrl/ocs0.key",
        known_hosts="/etc/orchestrrl/known_hosts",
        host_key_check=True,
        timeout_s=10.0,
        retries=2,
        confirm_timeout_s=30,
    )
    assert wiring.parse(wiring.to_toml(w)) == w
    assert wiring.to_dict(w)["ocs"][0]["netconf"]["username"] == "orl"
    grpc = wiring.parse(BASE.format(ocs=""))
    assert grpc.ocs("ocs0").driver == "grpc" and grpc.ocs("ocs0").netconf is None
    assert "driver" not in wiring.to_dict(grpc)["ocs"][0]  # unchanged for gRPC switches
    password = wiring.parse(
        BASE.format(
            ocs='driver = "netconf"\n[ocs.netconf]\nusername = "orl"\n'
            'password_file = "/run/secrets/ocs0"\nhost_key_check = false\ntimeout_s = 2\n'
            "retries = 0\nconfirm_timeout_s = 5"
        )
    )
    n = password.ocs("ocs0").netconf
    assert n is not None and (n.password_file, n.key_file, n.host_key_check) == (
        "/run/secrets/ocs0",
        "",
        False,
    )
    assert (n.timeout_s, n.retries, n.confirm_timeout_s) == (2.0, 0, 5)
    assert wiring.parse(wiring.to_toml(password)) == password


@pytest.mark.parametrize(
    ("ocs", "expected"),
    [
        ('driver = "tl1"', ["ocs 'ocs0'.driver = 'tl1': one of 'grpc', 'netconf'"]),
        (
            'driver = "netconf"',
            [
                "ocs 'ocs0'.netconf: missing (required with driver = \"netconf\"), e.g. netconf "
                '= { username = "orl", key_file = "/etc/orchestrrl/ocs0.key", known_hosts = '
                '"/etc/orchestrrl/known_hosts" }'
            ],
        ),
        (
            'netconf = { username = "orl", key_file = "/k" }',
            [
                "ocs 'ocs0'.netconf = {'username': 'orl', 'key_file': '/k'}: only with "
                'driver = "netconf"; remove it'
            ],
        ),
        ('driver = "netconf"\nnetconf = "x"', ["ocs 'ocs0'.netconf = 'x': expected a table"]),
        (
            'driver = "netconf"\nnetconf = { key_file = "/k", colour = 1 }',
            [
                "ocs 'ocs0'.netconf.colour: unknown key (allowed: confirm_timeout_s, "
                "host_key_check, key_file, known_hosts, password_file, retries, timeout_s, "
                "username)",
                "ocs 'ocs0'.netconf.username: missing (required)",
            ],
        ),
        (
            'driver = "netconf"\nnetconf = { username = "a b", key_file = "k.pem" }',
            [
                "ocs 'ocs0'.netconf.username = 'a b': an SSH user name: 1-64 letters, digits, "
                "'.', '_', '@' or '-'",
                "ocs 'ocs0'.netconf.key_file = 'k.pem': an absolute path, e.g. "
                "/etc/orchestrrl/ocs0.key",
            ],
        ),
        (
            'driver = "netconf"\nnetconf = { username = "o", key_file = "/k", '
            'password_file = "/p" }',
            [
                "ocs 'ocs0'.netconf: credentials: give exactly one of key_file (an SSH private "
                "key) or password_file (the password on its first line); both are set"
            ],
        ),
        (
            'driver = "netconf"\nnetconf = { username = "o" }',
            [
                "ocs 'ocs0'.netconf: credentials: give exactly one of key_file (an SSH private "
                "key) or password_file (the password on its first line); neither is set"
            ],
        ),
        (
            'driver = "netconf"\nnetconf = { username = "o", key_file = "/k", '
            'host_key_check = "yes", timeout_s = 0, retries = 11, confirm_timeout_s = "30" }',
            [
                "ocs 'ocs0'.netconf.host_key_check = 'yes': true or false (default true)",
                "ocs 'ocs0'.netconf.timeout_s = 0: a number greater than 0.0 and at most 300.0",
                "ocs 'ocs0'.netconf.retries = 11: an integer from 0 to 10",
                "ocs 'ocs0'.netconf.confirm_timeout_s = '30': an integer from 1 to 3600, not "
                "a string: write it without quotes",
            ],
        ),
        (
            'driver = "netconf"\nnetconf = { username = "o", key_file = "/k", timeout_s = 20 }',
            [
                "ocs 'ocs0'.netconf.confirm_timeout_s = 30: more than twice timeout_s (20 s): the "
                "read-back and the confirming commit must fit in it"
            ],
        ),
    ],
)
def test_a_bad_netconf_stanza_is_named_field_by_field(ocs: str, expected: list[str]) -> None:
    assert problems(ocs) == expected


def test_config_check_shows_how_the_controller_reaches_a_netconf_ocs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "wiring.toml"
    path.write_text(BASE.format(ocs=GOOD))
    assert cli.main(["config", "check", str(path)]) == 0
    assert (
        "  ocs ocs0: 8 ports, 10.0 ms, at 192.0.2.10:830 (NETCONF over SSH as orl, "
        "credentials /etc/orchestrrl/ocs0.key)\n" in capsys.readouterr().out
    )
    path.write_text(BASE.format(ocs='driver = "netconf"'))
    assert cli.main(["config", "check", str(path)]) == 2
    assert "ocs 'ocs0'.netconf: missing (required with" in capsys.readouterr().err

"""The test NETCONF server's preconditions and its private sshd configuration (no server
started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim_backends import netconf_server as ns

pytestmark = pytest.mark.unit


def test_it_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ns.os, "geteuid", lambda: 1000)
    assert ns.unavailable() == "needs root (sshd runs the netconf subsystem only as root)"
    monkeypatch.setattr(ns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ns, "NETCONFD", "/nonexistent/netconfd")
    assert ns.unavailable() == (
        "/nonexistent/netconfd is not installed: make deps as root (Debian packages netconfd "
        "and openssh-server)"
    )


def test_the_private_sshd_maps_its_port_to_its_own_netconfd(tmp_path: Path) -> None:
    server = ns.NetconfServer(tmp_path, "ocs7", ports=8)
    server.port = 40123
    config = server._sshd_config()
    assert f"HostKey {tmp_path.resolve()}/ssh_host_ed25519_key" in config
    assert f"AuthorizedKeysFile {tmp_path.resolve()}/authorized_keys" in config
    assert "PasswordAuthentication no" in config and "UsePAM no" in config
    assert (
        f'Subsystem netconf "{ns.SUBSYSTEM} --ncxserver-sockname='
        f'40123@{tmp_path.resolve()}/ncxserver.sock"' in config
    )
    assert server.settings(timeout_s=2.0).key_file == str(tmp_path.resolve() / "client_key")
    with pytest.raises(ValueError, match="ports=1"):
        ns.NetconfServer(tmp_path, ports=1)

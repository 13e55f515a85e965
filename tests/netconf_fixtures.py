"""A real NETCONF switch for the tests: Debian's netconfd with our YANG module behind a
private sshd on loopback (``sim_backends.netconf_server``), one for the whole session.

Loaded for every test by ``tests/conftest.py`` (``pytest_plugins``); ``netconf``
gives the server reset to a known state (no cross-connects, every port enabled, no
fencing token, netconfd running); ``Observer`` reads it with a separate ncclient session
that shares no code with the driver. Skipped, saying why, when not root or netconfd /
sshd are missing.
"""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim_backends.netconf_server import NetconfServer, unavailable

NS = "urn:orchestrrl:yang:optical-switch"
NC = "urn:ietf:params:xml:ns:netconf:base:1.0"
PORTS = 32


class Observer:
    """A second NETCONF client of the switch (an operator's, or netconf-console's)."""

    def __init__(self, server: NetconfServer | str, username: str = "", key_file: str = "") -> None:
        """On ``server``, or at the address ``server`` (HOST:PORT) as ``username`` with
        ``key_file``."""
        from ncclient import manager

        if isinstance(server, NetconfServer):
            address, username, key_file = server.address, server.username, str(server.key_file)
        else:
            address = server
        host, _, port = address.rpartition(":")
        self.m: Any = manager.connect(
            host=host,
            port=int(port),
            username=username,
            key_filename=key_file,
            hostkey_verify=False,
            allow_agent=False,
            look_for_keys=False,
            timeout=10,
        )

    def pairs(self) -> set[tuple[int, int]]:
        """The directed pairs (ingress, egress) of the running datastore."""
        reply = self.m.get_config(
            source="running", filter=("subtree", f'<cross-connects xmlns="{NS}"/>')
        )
        root = ET.fromstring(reply.data_xml)
        return {
            (int(p.findtext(f"{{{NS}}}ingress") or 0), int(p.findtext(f"{{{NS}}}egress") or 0))
            for p in root.iter(f"{{{NS}}}pair")
        }

    def circuits(self) -> set[tuple[int, int]]:
        """Bidirectional circuits (a < b): both pairs present."""
        pairs = self.pairs()
        return {(a, b) for a, b in pairs if a < b and (b, a) in pairs}

    def controller(self) -> dict[str, str]:
        reply = self.m.get_config(
            source="running", filter=("subtree", f'<controller xmlns="{NS}"/>')
        )
        root = ET.fromstring(reply.data_xml)
        return {el.tag.rpartition("}")[2]: (el.text or "") for el in root.iter() if not len(el)}

    def edit(self, body: str) -> None:
        """Commit ``body`` (children of <config>) from the candidate, as an operator."""
        self.m.lock("candidate")
        try:
            self.m.discard_changes()
            self.m.edit_config(
                target="candidate",
                config=f'<config xmlns:nc="{NC}">{body}</config>',
            )
            self.m.commit()
        finally:
            self.m.unlock("candidate")

    def connect(self, *pairs: tuple[int, int]) -> None:
        body = "".join(f"<pair><ingress>{a}</ingress><egress>{b}</egress></pair>" for a, b in pairs)
        self.edit(f'<cross-connects xmlns="{NS}">{body}</cross-connects>')

    def set_admin(self, port: int, state: str) -> None:
        self.edit(
            f'<ports xmlns="{NS}"><port><port-id>{port}</port-id>'
            f"<admin-state>{state}</admin-state></port></ports>"
        )

    def reset(self) -> None:
        """No cross-connects, every port enabled, no controller leaves (a confirmed commit
        a previous test left pending is cancelled first)."""
        pending = self.controller().get("last-batch", "")
        if pending:
            with contextlib.suppress(Exception):
                self.m.cancel_commit(persist_id=pending)
        ports = "".join(
            f'<port nc:operation="replace"><port-id>{i}</port-id></port>'
            for i in range(1, PORTS + 1)
        )
        self.edit(
            f'<cross-connects xmlns="{NS}" nc:operation="replace"/>'
            f'<controller xmlns="{NS}" nc:operation="replace"/>'
            f'<ports xmlns="{NS}">{ports}</ports>'
        )

    def close(self) -> None:
        try:
            self.m.close_session()
        except Exception:  # the server may be gone (a test killed it)
            self.m._session.close()


class _Session:
    """The session's switch and one operator session on it (opened again when a test
    killed the server or cut its connections)."""

    def __init__(self, server: NetconfServer) -> None:
        self.server = server
        self._observer: Observer | None = None

    def observer(self) -> Observer:
        obs = self._observer
        if obs is not None and obs.m.connected:
            try:
                obs.controller()
                return obs
            except Exception:
                with contextlib.suppress(Exception):
                    obs.m._session.close()
        self._observer = Observer(self.server)
        return self._observer


@pytest.fixture(scope="session")
def _netconf_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Session]:
    why = unavailable()
    if why:
        pytest.skip(f"NETCONF tests need netconfd behind sshd: {why}")
    server = NetconfServer(Path(tmp_path_factory.mktemp("netconf")), "ocs0", PORTS)
    server.start()
    session = _Session(server)
    try:
        yield session
    finally:
        if session._observer is not None:
            with contextlib.suppress(Exception):
                session._observer.m._session.close()
        server.stop()


@pytest.fixture
def netconf(_netconf_session: _Session) -> NetconfServer:
    """The session's switch, reset: running, empty, every port enabled."""
    server = _netconf_session.server
    if not server.netconfd_running:
        server.start_netconfd()
    _netconf_session.observer().reset()
    return server


@pytest.fixture
def observer(netconf: NetconfServer, _netconf_session: _Session) -> Observer:
    """An operator's NETCONF session on the switch, separate from any driver's."""
    return _netconf_session.observer()

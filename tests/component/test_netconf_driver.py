"""The NETCONF OCS driver against a real NETCONF server: netconfd (yuma123) with our YANG
module behind a private sshd on loopback. A second ncclient session (``Observer``) reads
what the switch really holds."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from fabric_controller.drivers.netconf import NetconfOcsDriver
from orchestrrl import errors
from sim_backends.netconf_faults import MisreadingNetconfDriver
from sim_backends.netconf_server import NetconfServer
from tests.netconf_fixtures import Observer

pytestmark = pytest.mark.component


class Died(BaseException):
    """The controller process died at this point (raised by a fault hook)."""


def driver(
    server: NetconfServer,
    cls: type[NetconfOcsDriver] = NetconfOcsDriver,
    fault: Callable[[str], None] = lambda _s: None,
    options: dict[str, object] | None = None,
    **settings: object,
) -> NetconfOcsDriver:
    """A driver of the test switch (``settings``: of its ``netconf`` table)."""
    base: dict[str, object] = {"timeout_s": 5.0, "retries": 1}
    base.update(settings)
    extra: dict[str, object] = options or {}
    return cls("ocs0", server.address, server.settings(**base), fault_hook=fault, **extra)


@pytest.fixture
async def drv(netconf: NetconfServer) -> AsyncIterator[NetconfOcsDriver]:
    d = driver(netconf)
    try:
        yield d
    finally:
        await d.close()


async def test_connect_and_disconnect_batches_land_and_read_back(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    info = await drv.info()
    assert (info.port_count, info.backend) == (32, "netconf (orchestrrl-optical-switch@2026-12-06)")
    assert drv.confirmed_commit  # netconfd --target=candidate announces :confirmed-commit:1.1
    table = await drv.apply([], [(1, 2), (3, 4)], request_id="epoch-1-a-0-ocs0")
    assert table == {(1, 2), (3, 4)}
    assert observer.pairs() == {(1, 2), (2, 1), (3, 4), (4, 3)}  # both ways, one commit
    assert observer.controller()["last-batch"] == "epoch-1-a-0-ocs0"
    # make-before-break's second step: a port moves to a new peer in one batch
    table = await drv.apply([(1, 2)], [(1, 5), (2, 6)], request_id="epoch-2-b-1-ocs0")
    assert table == {(1, 5), (2, 6), (3, 4)} == observer.circuits()
    assert await drv.snapshot() == (table, frozenset())
    assert await drv.cross_connects() == table
    # the same batch again under its id (an answer lost on the way): in already, unchanged
    assert await drv.apply([(1, 2)], [(1, 5), (2, 6)], request_id="epoch-2-b-1-ocs0") == table
    assert observer.controller()["last-batch"] == "epoch-2-b-1-ocs0"
    with pytest.raises(errors.InvalidArgument, match="not cross-connected"):
        await drv.apply([(1, 2)], [(1, 5), (2, 6)], request_id="another-id")
    assert (drv.sessions, drv.settled) == (1, 0)  # one session did all of it


async def test_a_batch_the_switch_refuses_changes_nothing_and_names_the_rpc(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    await drv.apply([], [(1, 2)])
    # port 40 is not in the switch's inventory of 32: its leafref check refuses the edit
    with pytest.raises(errors.FailedPrecondition) as info:
        await drv.apply([(1, 2)], [(3, 40)], request_id="r-1")
    text = str(info.value)
    assert text.startswith(
        f"OCS 'ocs0' (NETCONF {drv.address}): <edit-config> refused by the switch"
    )
    assert "required value instance not found" in text and "ingress='40'" in text
    assert len(text) < 2048
    assert observer.circuits() == {(1, 2)} and observer.controller()["last-batch"] != "r-1"
    # the driver checks what the simulated OCS checks before sending anything
    with pytest.raises(errors.InvalidArgument, match=r"connect\[0\]=\(2, 3\): port 2 carries"):
        await drv.apply([], [(2, 3)])
    assert await drv.apply([], [(3, 4)]) == {(1, 2), (3, 4)}  # locks were released


@pytest.mark.parametrize("plain", [False, True], ids=["confirmed-commit", "plain-commit"])
async def test_a_read_back_that_differs_undoes_the_batch(
    netconf: NetconfServer, observer: Observer, plain: bool
) -> None:
    d = driver(netconf, MisreadingNetconfDriver, options={"plain_commit": plain})
    assert isinstance(d, MisreadingNetconfDriver)
    try:
        await d.apply([], [(1, 2)], request_id="before")
        d.misread_next(5)
        with pytest.raises(errors.FailedPrecondition) as info:
            await d.apply([(1, 2)], [(1, 5), (2, 6)], request_id="lied")
        text = str(info.value)
        assert "read-back after <commit> differs from the batch (pair ingress 5: expected " in text
        assert ("cancel-commit" in text) is not plain and ("put back" in text) is plain
        assert d.misread == 1
        assert observer.circuits() == {(1, 2)} and observer.pairs() == {(1, 2), (2, 1)}
        assert observer.controller()["last-batch"] == "before"
        assert await d.apply([(1, 2)], [(1, 5)]) == {(1, 5)}  # and the switch works on
    finally:
        await d.close()


async def test_another_manager_holding_the_lock_refuses_the_batch_naming_its_session(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    observer.m.lock("candidate")
    try:
        with pytest.raises(errors.Aborted) as info:
            await drv.apply([], [(1, 2)])
        assert "the candidate datastore is locked by another manager (NETCONF session " in str(
            info.value
        )
        assert "(after 2 attempts)" in str(info.value)
    finally:
        observer.m.unlock("candidate")
    assert observer.circuits() == set()
    assert await drv.apply([], [(1, 2)]) == {(1, 2)}


async def test_the_fencing_token_rides_in_the_commit_and_an_older_one_changes_nothing(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    await drv.apply([], [(1, 2)], fencing_token=7)
    assert observer.controller()["fencing-token"] == "7"
    with pytest.raises(
        errors.FailedPrecondition, match="fencing token 6 is older than the newest seen, 7"
    ):
        await drv.apply([(1, 2)], [], fencing_token=6)
    assert observer.circuits() == {(1, 2)}
    await drv.apply([], [(3, 4)], fencing_token=7)  # the same leader again
    with pytest.raises(errors.FailedPrecondition, match="without a fencing token"):
        await drv.apply([], [(5, 6)])  # 0 (no HA) after a leader's token: refused (issue 28)
    assert observer.circuits() == {(1, 2), (3, 4)}
    assert observer.controller()["fencing-token"] == "7"
    with pytest.raises(errors.InvalidArgument, match="fencing_token=-1"):
        await drv.apply([], [(7, 8)], fencing_token=-1)


async def test_an_empty_or_far_ahead_batch_cannot_jam_the_stored_token(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    await drv.apply([], [(1, 2)], fencing_token=7)
    with pytest.raises(errors.InvalidArgument, match=r"at most 1099511627776 \(2\*\*40\) ahead"):
        await drv.apply([], [(3, 4)], fencing_token=2**63)
    await drv.apply([], [], fencing_token=7 + 2**40)  # empty: carried out, token not stored
    assert observer.controller()["fencing-token"] == "7"
    await drv.apply([], [(3, 4)], fencing_token=7)  # the real leader goes on
    assert observer.circuits() == {(1, 2), (3, 4)}


async def test_a_controller_that_dies_before_confirming_is_undone_by_the_next_session(
    netconf: NetconfServer, observer: Observer
) -> None:
    armed: list[bool] = []

    def die(stage: str) -> None:
        assert stage == "netconf_confirmed"
        if armed:
            doomed._mgr._session.close()  # the process is gone: its SSH session with it
            raise Died(stage)

    doomed = driver(netconf, fault=die)
    await doomed.apply([], [(1, 2)], request_id="kept")
    armed.append(True)
    with pytest.raises(Died):
        await doomed.apply([(1, 2)], [(3, 4)], request_id="unconfirmed")
    await doomed.close()
    # committed with <persist>: the switch holds it, unconfirmed, after the session ended
    assert observer.circuits() == {(3, 4)}
    survivor = driver(netconf)
    try:
        # the survivor's first session cancels it: it reads the switch as confirmed
        assert await survivor.snapshot() == (frozenset({(1, 2)}), frozenset())
        assert survivor.settled == 1 and observer.circuits() == {(1, 2)}
        assert observer.controller()["last-batch"] == "kept"
    finally:
        await survivor.close()


async def test_an_unconfirmed_batch_is_rolled_back_by_the_switch_itself(
    netconf: NetconfServer, observer: Observer
) -> None:
    def freeze(_stage: str) -> None:
        frozen._mgr._session.close()
        raise Died("frozen")

    frozen = driver(netconf, fault=freeze, timeout_s=1.0, confirm_timeout_s=3)
    with pytest.raises(Died):
        await frozen.apply([], [(1, 2)], request_id="never-confirmed")
    await frozen.close()
    assert observer.circuits() == {(1, 2)}
    # netconfd checks the confirm timeout only after a second in which no session sent it
    # anything (the idle branch of its select loop, agt_ncxserver.c): look less often
    deadline = time.monotonic() + 20
    while observer.circuits() and time.monotonic() < deadline:  # noqa: ASYNC110 - the switch
        await asyncio.sleep(1.5)
    assert observer.circuits() == set() and observer.controller().get("last-batch", "") == ""


async def test_a_broken_session_is_replaced_within_the_retries(
    drv: NetconfOcsDriver, netconf: NetconfServer
) -> None:
    await drv.apply([], [(1, 2)])
    netconf.drop_connections()  # every SSH session cut, as a network blip would
    assert await drv.snapshot() == (frozenset({(1, 2)}), frozenset())
    netconf.drop_connections()
    assert await drv.apply([(1, 2)], [(3, 4)]) == {(3, 4)}
    assert drv.sessions == 3


async def test_a_disabled_port_is_down_and_refused(
    drv: NetconfOcsDriver, observer: Observer
) -> None:
    observer.set_admin(9, "disabled")
    observer.connect((11, 12))  # a half circuit written by someone else
    assert await drv.snapshot() == (frozenset({(11, 12)}), frozenset({9, 11, 12}))
    with pytest.raises(errors.InvalidArgument, match=r"port 9 is disabled \(admin-state\)"):
        await drv.apply([], [(9, 10)])
    assert await drv.apply([(11, 12)], []) == frozenset()  # removing it clears the ports
    assert observer.pairs() == set()


@pytest.fixture
def strangers(netconf: NetconfServer, tmp_path: Path) -> dict[str, Path | int]:
    """Another SSH key, a wrong password, known-hosts files that do not trust the switch,
    and a loopback port where nothing listens."""
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    password = tmp_path / "password"
    password.write_text("not-the-password\n")
    stranger = tmp_path / "known_hosts"
    stranger.write_text(
        f"[127.0.0.1]:{netconf.port} " + " ".join(Path(f"{other}.pub").read_text().split()[:2])
    )
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed: int = s.getsockname()[1]
    trusted = tmp_path / "trusted"  # the switch's key is known there: only the switch is gone
    trusted.write_text(netconf.known_hosts.read_text().replace(f":{netconf.port} ", f":{closed} "))
    return {"other": other, "password": password, "stranger": stranger, "empty": empty,
            "closed": closed, "trusted": trusted}  # fmt: skip


async def test_wrong_credentials_unknown_host_keys_and_no_server_are_named(
    netconf: NetconfServer, strangers: dict[str, Path | int]
) -> None:
    other, password, stranger, empty, closed, trusted = (
        strangers[k] for k in ("other", "password", "stranger", "empty", "closed", "trusted")
    )
    cases = [
        ({"key_file": str(other)}, errors.FailedPrecondition,
         "SSH authentication as 'root' failed (Authentication failed.): check netconf.username "
         f"and netconf.key_file {other}, and that the switch accepts them"),
        ({"key_file": "", "password_file": str(password)}, errors.FailedPrecondition,
         f"check netconf.username and netconf.password_file {password}"),
        ({"known_hosts": str(stranger)}, errors.FailedPrecondition,
         f"is not the one trusted for [127.0.0.1]:{netconf.port} in {stranger}: if the switch "
         "was replaced, check its key out of band"),
        ({"known_hosts": str(empty)}, errors.FailedPrecondition,
         f"no host key for [127.0.0.1]:{netconf.port} in netconf.known_hosts {empty}: get "
         f"the switch's key (ssh-keyscan -p {netconf.port} 127.0.0.1)"),
    ]  # fmt: skip
    for settings, kind, message in cases:
        d = driver(netconf, **settings)
        try:
            with pytest.raises(kind) as info:
                await d.snapshot()
            assert str(info.value).startswith(f"OCS 'ocs0' (NETCONF {netconf.address}): ")
            assert message in str(info.value), str(info.value)
        finally:
            await d.close()
    d = NetconfOcsDriver(
        "ocs0",
        f"127.0.0.1:{closed}",
        netconf.settings(timeout_s=2.0, retries=1, known_hosts=str(trusted)),
    )
    try:
        with pytest.raises(errors.Unavailable) as info:
            await d.apply([], [(1, 2)])
        assert str(info.value).startswith(
            f"OCS 'ocs0' (NETCONF 127.0.0.1:{closed}): cannot connect"
        )
        assert "check the OCS address and that the switch's NETCONF-over-SSH service runs" in str(
            info.value
        )
    finally:
        await d.close()
    with pytest.raises(errors.InvalidArgument, match=r"ocs 'ocs0'.netconf.key_file='/nonexistent'"):
        NetconfOcsDriver("ocs0", netconf.address, netconf.settings(key_file="/nonexistent"))

"""An OCS driver over NETCONF (RFC 6241) on SSH, with ncclient: Polatis-class switches.

Chosen per OCS in the wiring (``driver = "netconf"`` and a ``netconf`` table: user,
key or password file, known-hosts file). The switch serves our YANG module
(:mod:`fabric_controller.drivers.netconf_xml` holds the mapping and every XML the driver
sends or reads; the module is ``fabric_controller/drivers/yang/``).

Reading (``snapshot``, ``cross_connects``, ``info``): one ``<get>`` of the ports, the
cross-connects and the controller's leaves.

Writing (``apply``), one batch as one transaction on the candidate datastore:

1. ``<lock>`` the candidate (refused while another manager holds it: retried with
   backoff, then an error naming the session that holds it; a candidate left modified
   by an unlocked session is discarded first, as RFC 6241 7.5 asks);
2. ``<get>``: the switch as it is now, under the lock; the fencing token is checked and
   the batch validated against it (the simulated OCS's rules: a disconnect names a
   circuit that is there, a connect uses free, enabled ports);
3. ``<edit-config>`` of the candidate (rollback-on-error where announced): the pairs and
   ``/controller`` (``last-batch`` = the batch id, and the fencing token);
4. with :confirmed-commit:1.1, ``<commit><confirmed/><confirm-timeout>T<persist>ID``:
   the switch rolls the batch back by itself unless it is confirmed within T seconds
   (``confirm_timeout_s``), so a controller that dies or freezes mid-change leaves the
   switch to undo the batch; without it, a plain ``<commit>``;
5. ``<get>`` again: the read-back. A pair or ``last-batch`` that differs cancels the
   commit (``<cancel-commit>`` with the persist-id, or without :confirmed-commit:1.1 an
   edit that restores every touched pair and a commit) and fails verification;
6. the confirming ``<commit><persist-id>ID``, then ``<unlock>``. On any failure before
   that, ``<discard-changes>`` and ``<unlock>``.

The driver locks only the candidate: with the candidate as the only writable datastore
(no :writable-running), that serializes every manager, and netconfd (yuma123 2.13) cannot
roll a confirmed commit back while its session holds the lock on running (its log says
"restore running config failed (config locked)" and the unconfirmed change stays).
Where the server announces :writable-running the driver locks running too.

Recovery agrees with the confirmed commit: a new session first reads
``/controller/last-batch`` and cancels a confirmed commit pending under that persist-id
(a batch whose controller did not live to confirm it), so what any later read shows is
settled: the switch holds exactly the batches that were confirmed. A batch is
acknowledged to the controller only after its confirming commit, so the epoch journal's
``ocs_programmed`` never covers a batch the switch could still undo. A killed netconfd
restarts from its last confirmed configuration (it saves only confirmed commits).

Fencing (controller HA): the token rides in the datastore. Under the candidate lock the
driver reads ``/controller/fencing-token``, refuses a token older than it (changing
nothing, FailedPrecondition as the simulated OCS does, and one more than 2**40 ahead of
it) and writes its own in the same commit as a batch that changes something (an empty
batch stores no token: ``orchestrrl.fencing``). The check is the driver's, made atomic
by the lock: a manager that edits without locking is not fenced (the server has no rule
that compares a value with its previous one).

Errors name the switch, the RPC and the server's ``<rpc-error>`` (tag, message, path,
error-info), bounded. Every RPC has ``timeout_s``; an RPC whose answer is lost (timeout,
broken session) is not resent blindly: the session is dropped, a new one settles (see
above) and reads ``last-batch``, which tells whether the batch landed; if it did not,
the whole transaction is tried again, at most ``retries`` more times.

ncclient is blocking: every call runs on this driver's own thread, never on the event
loop. Its session thread polls its send queue only between 100 ms ``select`` waits
(``ncclient.transport.session.TICK``), so every RPC would wait ~100 ms; the driver lowers
that poll to ``NCCLIENT_POLL_S`` (measured: ~9 ms a ``<get>`` instead of ~100 ms), at
the cost of that many wake-ups a second per open session.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fabric_controller.drivers import netconf_xml as nx
from fabric_controller.drivers.ocs import OcsInfo, PortPair
from orchestrrl import errors
from orchestrrl.fencing import FencingGate
from orchestrrl.logs import get_logger
from orchestrrl.model import NetconfSettings

T = TypeVar("T")
log = get_logger("fabric_controller")

NCCLIENT_POLL_S = 0.005
CONNECT_TIMEOUT_S = 5.0  # at least, for SSH and <hello> (an RPC gets netconf.timeout_s)
INSTALL = "pip install 'orchestrrl[netconf]' (ncclient)"
BACKOFF_S = (0.05, 0.2, 0.5, 1.0)
_REPR = re.compile(r"\w+\((['\"])(.*)\1\)")


class RpcRefused(errors.FailedPrecondition):
    """The server answered an RPC with ``<rpc-error>``s (its verdict: not retried)."""

    def __init__(self, message: str, infos: list[nx.RpcErrorInfo]) -> None:
        super().__init__(message)
        self.infos = infos

    @property
    def tags(self) -> set[str]:
        return {i.tag for i in self.infos}


class _LockBusy(errors.Aborted):
    """Another manager holds the lock: try again shortly."""


def _ncclient() -> Any:
    try:
        import ncclient.manager
        import ncclient.transport.session
    except ImportError:
        raise errors.FailedPrecondition(
            f"the NETCONF OCS driver needs ncclient: {INSTALL}"
        ) from None
    # see the module docstring: one RPC per poll instead of one per 100 ms
    ncclient.transport.session.TICK = min(ncclient.transport.session.TICK, NCCLIENT_POLL_S)
    # their INFO lines are wire dumps of every RPC (XML included) and SSH chatter: the
    # driver logs what matters itself
    for name in ("ncclient", "paramiko"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    return ncclient


def _readable(field: str, path: str, what: str) -> None:
    if not os.access(path, os.R_OK):
        why = "does not exist" if not os.path.exists(path) else "is not readable by this user"
        raise errors.InvalidArgument(f"{field}={path!r}: {why}; it must hold {what}")


class NetconfOcsDriver:
    """Drives one OCS that serves ``orchestrrl-optical-switch`` over NETCONF/SSH.

    ``address``: HOST:PORT of its NETCONF SSH service (830 by IANA); ``settings``: the
    wiring's ``netconf`` table; ``switching_time_s``: the wiring's (the switch does not
    say); ``fault_hook``: called with ``"netconf_confirmed"`` between the confirmed
    commit and its read-back (crash tests stop the controller there)."""

    def __init__(
        self,
        name: str,
        address: str,
        settings: NetconfSettings,
        *,
        switching_time_s: float = 0.0,
        fault_hook: Callable[[str], None] = lambda _stage: None,
    ) -> None:
        self._nc = _ncclient()
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise errors.field_error(f"OCS {name!r} address", address, "HOST:PORT")
        self.name = name
        self.address = address
        self.host = host.strip("[]")
        self.port = int(port_text)
        self.settings = settings
        self.switching_time_s = switching_time_s
        self._fault = fault_hook
        field = f"ocs {name!r}.netconf"  # as the wiring file names it
        if settings.key_file:
            _readable(f"{field}.key_file", settings.key_file, "the SSH private key")
        if settings.password_file:
            _readable(f"{field}.password_file", settings.password_file, "the password")
        if settings.host_key_check and settings.known_hosts:
            _readable(f"{field}.known_hosts", settings.known_hosts, "the switch's host key")
        if not settings.host_key_check:
            log.warning(
                "ocs_host_key_not_checked",
                ocs=name,
                note="netconf.host_key_check = false: anyone on the path can pose as the switch",
            )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"netconf-{name}")
        self._lock = asyncio.Lock()
        self._mgr: Any = None
        self.capabilities: frozenset[str] = frozenset()
        self.sessions = 0  # sessions opened (the first, and one per reconnect)
        self.settled = 0  # unconfirmed commits of dead sessions cancelled at a session start
        self._closed = False

    # -- naming --

    def _what(self, rpc: str) -> str:
        return f"OCS {self.name!r} (NETCONF {self.address}): {rpc}"

    # -- the thread: every ncclient call runs here --

    async def _run(self, what: str, fn: Callable[[], T], rpcs: int = 1) -> T:
        """``fn()`` on the driver's thread, bounded by ``rpcs`` RPC timeouts (ncclient
        bounds each RPC itself; this is the net under it)."""
        if self._closed:
            raise errors.FailedPrecondition(self._what(f"{what}: the driver is closed"))
        loop = asyncio.get_running_loop()
        budget = rpcs * self.settings.timeout_s + 2 * self.settings.timeout_s + 5.0
        future = loop.run_in_executor(self._executor, fn)
        try:
            async with asyncio.timeout(budget):
                return await future
        except TimeoutError:
            # the thread is stuck beyond every RPC timeout: abandon it and its session
            stuck, self._executor = (
                self._executor,
                ThreadPoolExecutor(1, thread_name_prefix=f"netconf-{self.name}"),
            )
            mgr, self._mgr = self._mgr, None
            stuck.submit(self._close_quietly, mgr)
            stuck.shutdown(wait=False)
            raise errors.Unavailable(
                self._what(f"{what}: no answer within {budget:.0f} s; the session was dropped")
            ) from None

    def _rpc(self, rpc: str, call: Callable[[], T]) -> T:
        """One RPC on the open session, its failures as our errors (driver thread)."""
        nc = self._nc
        try:
            return call()
        except nc.operations.rpc.RPCError as exc:
            infos = _infos(exc)
            raise RpcRefused(
                self._what(f"<{rpc}> refused by the switch: {nx.describe_errors(infos)}"), infos
            ) from None
        except nc.operations.errors.TimeoutExpiredError:
            self._drop()
            raise errors.Unavailable(
                self._what(
                    f"<{rpc}>: no answer within {self.settings.timeout_s:g} s "
                    "(netconf.timeout_s); the session was dropped"
                )
            ) from None
        except (nc.transport.errors.TransportError, OSError, EOFError) as exc:
            self._drop()
            raise errors.Unavailable(
                self._what(f"<{rpc}>: the session broke ({_text(exc)}); is the switch up?")
            ) from None
        except nc.operations.errors.MissingCapabilityError as exc:
            raise errors.FailedPrecondition(
                self._what(f"<{rpc}>: the switch lacks a capability it needs: {_text(exc)}")
            ) from None

    def _drop(self) -> None:
        mgr, self._mgr = self._mgr, None
        self._close_quietly(mgr, rpc=False)

    @staticmethod
    def _close_quietly(mgr: Any, rpc: bool = True) -> None:
        if mgr is None:
            return
        with contextlib.suppress(Exception):
            if rpc and mgr.connected:
                mgr.close_session()
        with contextlib.suppress(Exception):
            mgr._session.close()  # the SSH transport (no RPC)

    def _session(self) -> Any:
        """The open session, or a new one (connected, checked and settled)."""
        if self._mgr is not None and self._mgr.connected:
            return self._mgr
        self._drop()
        mgr = self._connect()
        try:
            self._check_capabilities(mgr)
            self._mgr = mgr
            self._settle(mgr)
            log.info(
                "ocs_session_opened",
                ocs=self.name,
                address=self.address,
                session=mgr.session_id,
                confirmed_commit=self.confirmed_commit,
                sessions=self.sessions,
            )
        except BaseException:
            self._mgr = None
            self._close_quietly(mgr)
            raise
        return mgr

    def _connect(self) -> Any:
        nc, s = self._nc, self.settings
        kwargs: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "username": s.username,
            "timeout": max(s.timeout_s, CONNECT_TIMEOUT_S),
            "hostkey_verify": s.host_key_check,
            "allow_agent": False,
            "look_for_keys": False,
            "device_params": {"name": "default"},
            "manager_params": {"timeout": s.timeout_s},
        }
        if s.key_file:
            kwargs["key_filename"] = s.key_file
        else:
            kwargs["password"] = _first_line(s.password_file)
        lookup = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        if s.host_key_check and s.known_hosts:
            kwargs["hostkey_b64"] = self._known_host_key(lookup)
        try:
            mgr = nc.manager.connect(**kwargs)
        except nc.transport.errors.SSHUnknownHostError as exc:
            where = s.known_hosts or "~/.ssh/known_hosts (netconf.known_hosts is not set)"
            raise errors.FailedPrecondition(
                self._what(
                    f"the switch's SSH host key (MD5 {getattr(exc, 'fingerprint', '?')}) is "
                    f"not the one trusted for {lookup} in {where}: if the switch was "
                    "replaced, check its key out of band and update that file; otherwise "
                    "something else answers at this address"
                )
            ) from None
        except nc.transport.errors.AuthenticationError as exc:
            cred = (
                f"netconf.key_file {s.key_file}"
                if s.key_file
                else f"netconf.password_file {s.password_file}"
            )
            raise errors.FailedPrecondition(
                self._what(
                    f"SSH authentication as {s.username!r} failed ({_text(exc)}): check "
                    f"netconf.username and {cred}, and that the switch accepts them"
                )
            ) from None
        except (nc.transport.errors.SSHError, OSError) as exc:
            raise errors.Unavailable(
                self._what(
                    f"cannot connect ({_text(exc)}): check the OCS address and that the "
                    "switch's NETCONF-over-SSH service runs and is reachable from here"
                )
            ) from None
        except nc.transport.errors.TransportError as exc:
            raise errors.Unavailable(
                self._what(
                    f"SSH worked but the session closed before NETCONF started "
                    f"({_text(exc)}): is the switch's NETCONF server running behind its "
                    "SSH 'netconf' subsystem?"
                )
            ) from None
        except (nc.transport.errors.SessionError, nc.operations.errors.TimeoutExpiredError):
            raise errors.Unavailable(
                self._what(
                    f"no NETCONF <hello> within {max(s.timeout_s, CONNECT_TIMEOUT_S):g} s of "
                    "connecting: is the switch's NETCONF server up?"
                )
            ) from None
        mgr.raise_mode = nc.operations.RaiseMode.ERRORS
        self.sessions += 1
        return mgr

    def _known_host_key(self, lookup: str) -> str:
        """The base64 key trusted for ``lookup`` in the configured known-hosts file."""
        import paramiko

        path = self.settings.known_hosts
        try:
            keys = paramiko.HostKeys(path)
        except (OSError, paramiko.SSHException) as exc:
            raise errors.FailedPrecondition(
                self._what(f"netconf.known_hosts {path}: cannot be read: {_text(exc)}")
            ) from None
        found = keys.lookup(lookup) or (keys.lookup(self.host) if self.port == 22 else None)
        if not found:
            raise errors.FailedPrecondition(
                self._what(
                    f"no host key for {lookup} in netconf.known_hosts {path}: get the "
                    f"switch's key (ssh-keyscan -p {self.port} {self.host}), check its "
                    "fingerprint out of band, and add that line to the file"
                )
            )
        for kind in ("ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"):
            if kind in found:
                return base64.b64encode(found[kind].asbytes()).decode()
        return base64.b64encode(next(iter(found.values())).asbytes()).decode()

    def _check_capabilities(self, mgr: Any) -> None:
        caps = frozenset(str(c) for c in mgr.server_capabilities)
        self.capabilities = caps
        missing = []
        if nx.CAP_CANDIDATE not in caps:
            missing.append(":candidate (the driver commits each batch from the candidate)")
        if nx.module_capability(caps) is None:
            missing.append(
                f"the YANG module {nx.MODULE} (namespace {nx.NS}; load "
                f"{nx.yang_file().name} into the switch's server)"
            )
        if missing:
            raise errors.FailedPrecondition(
                self._what(f"the switch does not announce {'; '.join(missing)}")
            )

    @property
    def confirmed_commit(self) -> bool:
        """The switch can roll a batch back by itself (:confirmed-commit:1.1); without
        it the driver commits plainly and undoes a failed read-back with an edit."""
        return nx.CAP_CONFIRMED_COMMIT_11 in self.capabilities

    def _settle(self, mgr: Any) -> None:
        """Cancel a confirmed commit that a dead session left pending (its persist-id is
        the ``last-batch`` it wrote): afterwards the switch holds confirmed batches only."""
        if not self.confirmed_commit:
            return
        reply = self._rpc("get", lambda: mgr.get(filter=list(nx.CONTROLLER_FILTER)))
        pending = nx.parse_state(reply.data_xml).last_batch
        if not pending:
            return
        try:
            self._rpc("cancel-commit", lambda: mgr.cancel_commit(persist_id=pending))
        except RpcRefused:
            return  # nothing pending under that id: the last batch was confirmed
        self.settled += 1
        log.warning(
            "ocs_unconfirmed_commit_cancelled",
            ocs=self.name,
            batch=pending,
            note="a controller did not confirm this batch (it died or froze): rolled back",
        )

    def _fresh_read(self) -> nx.SwitchState:
        """Drop the session and read on a new one, which settles the switch first."""
        self._drop()
        return self._read(self._session())

    def _read_back(self, mgr: Any) -> nx.SwitchState:
        """The read after a commit that decides whether the batch landed."""
        return self._read(mgr)

    def _read(self, mgr: Any) -> nx.SwitchState:
        reply = self._rpc("get", lambda: mgr.get(filter=list(nx.STATE_FILTER)))
        return nx.parse_state(reply.data_xml)

    # -- reading --

    async def _state(self) -> nx.SwitchState:
        """One ``<get>``, tried again on a fresh session (``retries`` times) when the
        session breaks or times out."""
        last: errors.OrlError | None = None
        for attempt in range(self.settings.retries + 1):
            if attempt:
                await asyncio.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
            try:
                async with self._lock:
                    return await self._run("get", lambda: self._read(self._session()), rpcs=4)
            except errors.Unavailable as exc:
                last = exc
        assert last is not None
        raise last

    async def info(self) -> OcsInfo:
        state = await self._state()
        cap = nx.module_capability(self.capabilities) or nx.MODULE
        revision = cap.partition("revision=")[2].partition("&")[0] or "?"
        return OcsInfo(
            self.name,
            len(state.ports),
            self.switching_time_s,
            f"netconf ({nx.MODULE}@{revision})",
        )

    async def cross_connects(self) -> frozenset[PortPair]:
        return (await self._state()).table()

    async def snapshot(self) -> tuple[frozenset[PortPair], frozenset[int]]:
        state = await self._state()
        return state.table(), state.down()

    # -- writing --

    async def apply(
        self,
        disconnect: Iterable[PortPair],
        connect: Iterable[PortPair],
        request_id: str = "",
        fencing_token: int = 0,
    ) -> frozenset[PortPair]:
        if fencing_token < 0:
            raise errors.field_error("fencing_token", fencing_token, "0 (no HA) or a token > 0")
        off = tuple(disconnect)
        on = tuple(connect)
        batch_id = _batch_id(request_id)
        last: errors.OrlError | None = None
        for attempt in range(self.settings.retries + 1):
            if attempt:
                await asyncio.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
            try:
                async with self._lock:
                    return await self._run(
                        "batch",
                        lambda: self._transaction(off, on, batch_id, fencing_token),
                        rpcs=9,
                    )
            except _LockBusy as exc:
                last = exc
                continue
            except errors.Unavailable as exc:
                last = exc
            # the answer was lost: a fresh session settles the switch; last-batch says
            # whether this batch is in (confirmed), else the whole batch goes again
            try:
                async with self._lock:
                    state = await self._run("get", self._fresh_read, rpcs=5)
            except errors.Unavailable as exc:
                last = exc
                continue
            if state.last_batch == batch_id and nx.batch_landed(state, off, on):
                log.warning("ocs_answer_lost_batch_applied", ocs=self.name, batch=batch_id)
                return state.table()
        assert last is not None
        if isinstance(last, _LockBusy):
            raise errors.Aborted(f"{last} (after {self.settings.retries + 1} attempts)")
        raise last

    def _transaction(
        self,
        disconnect: tuple[PortPair, ...],
        connect: tuple[PortPair, ...],
        batch_id: str,
        fencing_token: int,
    ) -> frozenset[PortPair]:
        """One batch as one candidate transaction (the module docstring's steps 1-6)."""
        mgr = self._session()
        targets = ["candidate"]
        if nx.CAP_WRITABLE_RUNNING in self.capabilities:
            targets.insert(0, "running")
        locked: list[str] = []
        done = False
        try:
            for target in targets:
                self._lock_target(mgr, target)
                locked.append(target)
            before = self._read(mgr)
            if before.last_batch == batch_id and nx.batch_landed(before, disconnect, connect):
                done = True  # a repeat of the last batch (its answer was lost): in already
                return before.table()
            gate = FencingGate(self._what("edit-config"))  # the one rule, on the stored token
            gate.newest = before.fencing_token
            gate.check(fencing_token)
            problems = nx.batch_problems(before, disconnect, connect)
            if problems:
                raise errors.InvalidArgument(
                    self._what("batch refused before sending: " + "; ".join(problems))
                )
            ops = nx.directed_ops(before, disconnect, connect)
            # the token is stored with a batch that changes something (FencingGate.record)
            token = fencing_token if ops and fencing_token > before.fencing_token else 0
            config = nx.edit_config(before, ops, batch_id, token)
            rollback = nx.CAP_ROLLBACK_ON_ERROR in self.capabilities
            self._rpc(
                "edit-config",
                lambda: mgr.edit_config(
                    target="candidate",
                    config=config,
                    error_option="rollback-on-error" if rollback else None,
                ),
            )
            if self.confirmed_commit:
                after = self._confirmed(mgr, ops, batch_id)
            else:
                after = self._committed(mgr, before, ops, batch_id)
            done = True
            return after.table()
        finally:
            if not done and self._mgr is mgr:
                with contextlib.suppress(errors.OrlError):
                    self._rpc("discard-changes", mgr.discard_changes)
            for target in reversed(locked):
                if self._mgr is mgr:
                    with contextlib.suppress(errors.OrlError):
                        self._rpc("unlock", functools.partial(mgr.unlock, target=target))

    def _confirmed(self, mgr: Any, ops: Mapping[int, int | None], batch_id: str) -> nx.SwitchState:
        timeout = str(self.settings.confirm_timeout_s)
        started = time.monotonic()
        self._rpc(
            "commit (confirmed)",
            lambda: mgr.commit(confirmed=True, timeout=timeout, persist=batch_id),
        )
        self._fault("netconf_confirmed")
        after = self._read_back(mgr)
        problems = nx.landed_problems(after, ops, batch_id)
        if problems:
            self._rpc("cancel-commit", lambda: mgr.cancel_commit(persist_id=batch_id))
            raise errors.FailedPrecondition(
                self._what(
                    "read-back after <commit> differs from the batch ("
                    + "; ".join(problems)
                    + "): the commit was cancelled (<cancel-commit>), the switch is back "
                    "where it was"
                )
            )
        # never confirm once the switch may have rolled back by itself: a <commit> then
        # would be refused anyway (persist-id no longer pending), but say why
        if time.monotonic() - started > self.settings.confirm_timeout_s - self.settings.timeout_s:
            raise errors.Unavailable(
                self._what(
                    f"the read-back took so long that the confirmed commit's "
                    f"{timeout} s window (netconf.confirm_timeout_s) may have closed; "
                    "not confirmed"
                )
            )
        self._rpc("commit (confirming)", lambda: mgr.commit(persist_id=batch_id))
        return after

    def _committed(
        self, mgr: Any, before: nx.SwitchState, ops: Mapping[int, int | None], batch_id: str
    ) -> nx.SwitchState:
        """Without :confirmed-commit:1.1: commit, read back, and undo by hand."""
        self._rpc("commit", mgr.commit)
        after = self._read_back(mgr)
        problems = nx.landed_problems(after, ops, batch_id)
        if not problems:
            return after
        undo = nx.edit_config(after, nx.revert_ops(before, ops), before.last_batch or "-")
        self._rpc("edit-config (undo)", lambda: mgr.edit_config(target="candidate", config=undo))
        self._rpc("commit (undo)", mgr.commit)
        raise errors.FailedPrecondition(
            self._what(
                "read-back after <commit> differs from the batch ("
                + "; ".join(problems)
                + "): the touched pairs were put back as they were and committed"
            )
        )

    def _lock_target(self, mgr: Any, target: str) -> None:
        try:
            self._rpc("lock", lambda: mgr.lock(target=target))
            return
        except RpcRefused as exc:
            if "lock-denied" in exc.tags or "in-use" in exc.tags:
                holder = nx.error_info_value(exc.infos, "session-id")
                raise _LockBusy(
                    self._what(
                        f"the {target} datastore is locked by another manager"
                        + (f" (NETCONF session {holder})" if holder else "")
                        + ": this batch changed nothing; try again when it is released"
                    )
                ) from None
            if target != "candidate" or "resource-denied" not in exc.tags:
                raise
        # RFC 6241 7.5: the candidate holds uncommitted changes of an unlocked session
        log.warning("ocs_candidate_discarded", ocs=self.name, note="left modified, unlocked")
        self._rpc("discard-changes", mgr.discard_changes)
        self._rpc("lock", lambda: mgr.lock(target=target))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        mgr, self._mgr = self._mgr, None
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.timeout_s + 1):
                await loop.run_in_executor(self._executor, self._close_quietly, mgr)
        self._executor.shutdown(wait=False)


def _infos(exc: Any) -> list[nx.RpcErrorInfo]:
    errs = getattr(exc, "errors", None) or [exc]
    return [
        nx.RpcErrorInfo(
            tag=str(e.tag or ""),
            message=str(e.message or "").strip(),
            path=str(e.path or "").strip(),
            info=str(e.info or ""),
            severity=str(e.severity or "error"),
        )
        for e in errs
    ]


def _text(exc: BaseException) -> str:
    """An exception's message (ncclient wraps paramiko's: the innermost), bounded."""
    while exc.args and isinstance(exc.args[0], BaseException):
        exc = exc.args[0]
    text = str(exc) or type(exc).__name__
    wrapped = _REPR.fullmatch(text)  # ncclient's AuthenticationError holds a repr
    return errors.shown(wrapped.group(2) if wrapped else text, 300).strip("'\"")


def _first_line(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.readline().rstrip("\r\n")


def _batch_id(request_id: str) -> str:
    """The batch's id on the switch (``last-batch``, the persist-id): the request id,
    or a digest of it when too long, or a fresh one without."""
    if not request_id:
        return f"orl-{secrets.token_hex(8)}"
    if len(request_id) <= nx.MAX_BATCH_ID and request_id.isprintable():
        return request_id
    return "orl-" + hashlib.sha256(request_id.encode()).hexdigest()[:32]

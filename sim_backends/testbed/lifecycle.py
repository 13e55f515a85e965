"""`orl-testbed up | down | status`: build a testbed, tear it down, show what exists.

``up`` checks everything it can before creating anything (privileges, the id, the
wiring, the machine's capacity), then builds the namespaces, links and shaping in a
few ``ip``/``tc`` batches, starts the OCS daemons, the controller and one agent per
node namespace, and waits until every node has registered. If anything fails, or it
is interrupted, it removes everything it created before raising.

``down`` needs nothing but the id: it stops every process that carries the testbed's
environment marker or runs in one of its namespaces (SIGTERM, then SIGKILL), deletes
every namespace and host interface whose name starts with ``<id>-``, and removes the
run directory. It is safe to run again, and after a crash or ``kill -9`` of anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.model import Wiring
from scheduler.network import DEFAULT_UPLINK_GBPS
from sim_backends import netns
from sim_backends.testbed import resources
from sim_backends.testbed.plan import (
    DEFAULT_SCALE,
    MGMT_POOL,
    Daemon,
    Scale,
    TestbedPlan,
    check_id,
    commands,
    make_plan,
    prefixlen_for,
)
from sim_backends.testbed.state import (
    ENV_MARKER,
    RUN_ROOT,
    STATE_FILE,
    Proc,
    State,
    alive,
    default_run_dir,
    load,
    marked_pids,
    save,
)

Progress = Callable[[str], None]
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0
PARALLEL_BATCHES = 8
LOG_TAIL_LINES = 8

# Children started by this process, so that `down` in the same process reaps them.
_children: dict[int, subprocess.Popen[bytes]] = {}


def _quiet(_message: str) -> None:
    return None


@dataclass(frozen=True)
class Found:
    """What exists of a testbed, found by name prefix and environment marker."""

    testbed_id: str
    namespaces: tuple[str, ...]
    host_links: tuple[str, ...]
    pids: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not (self.namespaces or self.host_links or self.pids)

    def describe(self) -> str:
        parts = []
        if self.namespaces:
            parts.append(f"{len(self.namespaces)} namespace(s) ({', '.join(self.namespaces[:4])}")
            parts[-1] += ", ...)" if len(self.namespaces) > 4 else ")"
        if self.host_links:
            parts.append(f"{len(self.host_links)} host interface(s)")
        if self.pids:
            parts.append(f"{len(self.pids)} process(es)")
        return ", ".join(parts) or "nothing"


async def find(testbed_id: str) -> Found:
    prefix = f"{check_id(testbed_id)}-"
    spaces = netns.namespaces_with_prefix(prefix)
    links = await netns.links_with_prefix(prefix)
    pids = set(await asyncio.to_thread(marked_pids, testbed_id))
    for ns in spaces:
        pids.update(await netns.netns_pids(ns))
    pids.discard(os.getpid())
    return Found(testbed_id, tuple(spaces), tuple(links), tuple(sorted(pids)))


async def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host namespace routes or has an address in."""
    nets: list[ipaddress.IPv4Network] = []
    routes = await netns.run(["ip", "-j", "-4", "route", "show", "table", "all"])
    for r in json.loads(routes.stdout or "[]"):
        dst = str(r.get("dst", ""))
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(dst, strict=False))
    addrs = await netns.run(["ip", "-j", "-4", "addr", "show"])
    for link in json.loads(addrs.stdout or "[]"):
        for a in link.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


async def choose_mgmt(hosts: int) -> ipaddress.IPv4Network:
    """A free management subnet of MGMT_POOL with room for ``hosts`` addresses."""
    used = await _host_networks()
    length = prefixlen_for(hosts)
    for net in MGMT_POOL.subnets(new_prefix=length):
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise errors.FailedPrecondition(
        f"no free /{length} left in {MGMT_POOL} for the management network of "
        f"{hosts - 1} agents (the host uses parts of it); remove other testbeds first"
    )


async def up(
    wiring_path: Path,
    *,
    testbed_id: str,
    run_dir: Path | None = None,
    scale: float = DEFAULT_SCALE,
    uplink_gbps: float = DEFAULT_UPLINK_GBPS,
    timeout_s: float = START_TIMEOUT_S,
    progress: Progress = _quiet,
) -> State:
    """Build the testbed; on any failure remove what was built and raise."""
    start = time.monotonic()
    check_id(testbed_id)
    w = wiring_mod.load(wiring_path)
    machine = await asyncio.to_thread(resources.read_machine)
    problems = resources.privileges(machine)
    if problems:
        raise errors.FailedPrecondition(
            "cannot build a testbed here (nothing was created):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    timings: dict[str, float] = {}
    procs: list[Proc] = []
    run = (run_dir or default_run_dir(testbed_id)).resolve()
    async with host_lock():  # the id and the management subnet are free until it is built
        plan = await _checked_plan(w, wiring_path, testbed_id, run, scale, uplink_gbps, machine)
        try:
            shutil.rmtree(run, ignore_errors=True)  # an earlier testbed's remains (checked)
            for sub in ("ready", "logs"):
                (run / sub).mkdir(parents=True, exist_ok=True)
            (run / "wiring.toml").write_text(wiring_mod.to_toml(plan.wiring))
            save(State(plan, created_at=time.time()))
            t = time.monotonic()
            await build_network(plan)
            timings["network_s"] = time.monotonic() - t
        except BaseException as exc:
            await _undo(testbed_id, run, exc, progress)
            raise
    progress(
        f"network: {len(plan.namespaces())} namespaces, {len(plan.links)} veth pairs, "
        f"scale {plan.scale.describe(plan.uplink_gbps)} ({timings['network_s']:.1f} s)"
    )
    try:
        t = time.monotonic()
        for group in ("ocs", "controller", "agent"):
            daemons = [d for d in plan.daemons if d.role == group]
            procs += await start_daemons(daemons, testbed_id, timeout_s)
            save(State(plan, tuple(procs), created_at=time.time()))
            where = ", ".join(sorted({d.address.rpartition(":")[0] for d in daemons}))
            progress(f"{len(daemons)} {group} daemon(s) serving ({where})")
        await wait_registered(plan, timeout_s)
        timings["daemons_s"] = time.monotonic() - t
        timings["up_s"] = time.monotonic() - start
        state = State(plan, tuple(procs), True, time.time(), timings)
        save(state)
        progress(f"all {len(plan.nodes)} nodes registered; testbed up in {timings['up_s']:.1f} s")
        return state
    except BaseException as exc:
        await _undo(testbed_id, run, exc, progress)
        raise


async def _checked_plan(
    w: Wiring,
    wiring_path: Path,
    testbed_id: str,
    run: Path,
    scale: float,
    uplink_gbps: float,
    machine: resources.Machine,
) -> TestbedPlan:
    """The plan, once nothing stands in its way (nothing is created here)."""
    existing = await find(testbed_id)
    if not existing.empty:
        raise errors.FailedPrecondition(
            f"testbed id {testbed_id!r} is already in use ({existing.describe()}); run "
            f"`orl-testbed down --id {testbed_id}` first or pick another --id "
            "(nothing was created)"
        )
    if await asyncio.to_thread(_foreign, run):
        raise errors.InvalidArgument(
            f"--run-dir {str(run)!r} exists and holds files that are not a testbed's; "
            "pass an empty or new directory (nothing was created)"
        )
    plan = make_plan(
        w,
        testbed_id=testbed_id,
        run_dir=run,
        mgmt=await choose_mgmt(len(w.nodes) + 1),
        scale=Scale(scale),
        uplink_gbps=uplink_gbps,
        python=sys.executable,
    )
    problems = resources.check(plan, machine)
    if problems:
        need = resources.estimate(plan)
        raise errors.FailedPrecondition(
            f"wiring {str(wiring_path)!r} is too large for this machine ({need.processes} "
            f"daemons, {need.namespaces} namespaces, {need.veths} veth pairs; nothing was "
            "created):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return plan


async def _undo(testbed_id: str, run: Path, exc: BaseException, progress: Progress) -> None:
    """After a failed or interrupted `up`: remove what it built but the daemons' logs,
    which the error points at (`orl-testbed down` removes them too)."""
    detail = str(exc) if isinstance(exc, errors.OrlError) else repr(exc)
    first = detail.splitlines()[0] if detail else "interrupted"
    progress(f"up failed ({first}); removing what was built, keeping {run / 'logs'}")
    with contextlib.suppress(Exception):
        await down(testbed_id, run, keep_logs=True)


LOCK_NAME = b"\0orchestrrl-testbed"  # an abstract socket: no file, freed when we exit
_lock_depth = 0


@contextlib.asynccontextmanager
async def host_lock(timeout_s: float = 60.0) -> AsyncIterator[None]:
    """One `up`/`down` at a time on this host: they pick ids and subnets from what the
    host has. The holder binds an abstract unix socket, which the kernel releases when
    the process ends however it ends; re-entrant within the process (a failed `up`
    calls `down`)."""
    global _lock_depth
    if _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock.bind(LOCK_NAME)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    raise errors.Aborted(
                        f"another orl-testbed up or down has been running on this host for "
                        f"{timeout_s:g} s; try again when it is done"
                    ) from None
                await asyncio.sleep(0.05)
        _lock_depth = 1
        try:
            yield
        finally:
            _lock_depth = 0
    finally:
        sock.close()


async def build_network(plan: TestbedPlan) -> None:
    cmds = commands(plan)
    limit = asyncio.Semaphore(PARALLEL_BATCHES)

    async def bounded(work: Awaitable[object]) -> None:
        async with limit:
            await work

    await netns.batch(cmds.netns)
    await asyncio.gather(*(bounded(netns.set_sysctls(ns, s)) for ns, s in cmds.sysctls.items()))
    await netns.batch(cmds.host)
    await asyncio.gather(
        *(bounded(netns.batch(text, netns=ns)) for ns, text in cmds.inside.items())
    )
    await asyncio.gather(
        *(bounded(netns.batch(text, netns=ns, tool="tc")) for ns, text in cmds.shaping.items())
    )
    # link-state events lag by up to a second; an OCS port that still looked DOWN
    # would be left out by the planner
    await asyncio.gather(*(netns.wait_links_up(ns) for ns in plan.namespaces()))


def _spawn(d: Daemon, testbed_id: str) -> Proc:
    Path(d.ready).unlink(missing_ok=True)
    env = {**os.environ, ENV_MARKER: testbed_id, "PYTHONUNBUFFERED": "1"}
    with open(d.log, "ab") as log_file:
        popen = subprocess.Popen(
            d.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    _children[popen.pid] = popen
    return Proc(d.role, d.name, popen.pid, d.netns, d.address, d.log)


def _tail(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n    ".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


async def start_daemons(daemons: Sequence[Daemon], testbed_id: str, timeout_s: float) -> list[Proc]:
    """Start ``daemons`` at once and wait until each has written its ready file."""
    procs = [_spawn(d, testbed_id) for d in daemons]
    deadline = time.monotonic() + timeout_s
    waiting = dict(zip((p.pid for p in procs), daemons, strict=True))
    while waiting:
        for pid, d in list(waiting.items()):
            if os.path.exists(d.ready):  # noqa: ASYNC240 - one stat, no I/O wait
                del waiting[pid]
            elif (code := _children[pid].poll()) is not None:
                raise errors.FailedPrecondition(
                    f"{d.label} exited with code {code} before serving; last log "
                    f"lines ({d.log}):\n    {_tail(d.log)}"
                )
        if waiting and time.monotonic() > deadline:
            names = ", ".join(d.label for d in waiting.values())
            first = next(iter(waiting.values()))
            raise errors.Unavailable(
                f"{names}: not serving after {timeout_s:.0f} s; last log lines of "
                f"{first.label} ({first.log}):\n    {_tail(first.log)}"
            )
        await asyncio.sleep(0.05)
    return procs


async def wait_registered(plan: TestbedPlan, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with AsyncClient(plan.controller, timeout_s=5.0) as client:
        while True:
            nodes = await client.nodes()
            missing = [n.node for n in nodes if n.health != "up"]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"nodes not registered with the controller after {timeout_s:.0f} s: "
                    f"{', '.join(missing)} (logs in {plan.run_dir}/logs)"
                )
            await asyncio.sleep(0.1)


def _reap(pid: int) -> None:
    popen = _children.get(pid)
    if popen is not None:
        if popen.poll() is not None:
            del _children[pid]
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


async def stop(pids: Sequence[int], grace_s: float) -> tuple[list[int], list[int]]:
    """SIGTERM, then SIGKILL after ``grace_s``; returns (stopped, killed)."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        for pid in pids:
            _reap(pid)
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        for pid in left:
            _reap(pid)
        await asyncio.sleep(0.02)
    for pid in left:
        _reap(pid)
    return [p for p in pids if p not in left], left


async def down(
    testbed_id: str,
    run_dir: Path | None = None,
    *,
    grace_s: float = STOP_GRACE_S,
    keep_logs: bool = False,
    progress: Progress = _quiet,
) -> list[str]:
    """Remove everything of testbed ``testbed_id``; returns what was done."""
    check_id(testbed_id)
    if os.geteuid() != 0:
        raise errors.FailedPrecondition(
            f"removing a testbed needs root (running as uid {os.geteuid()}): run it with sudo"
        )
    async with host_lock():
        return await _down(testbed_id, run_dir, grace_s, keep_logs, progress)


async def _down(
    testbed_id: str, run_dir: Path | None, grace_s: float, keep_logs: bool, progress: Progress
) -> list[str]:
    run = (run_dir or default_run_dir(testbed_id)).resolve()
    report: list[str] = []
    found = await find(testbed_id)
    state = None
    with contextlib.suppress(errors.OrlError, KeyError, TypeError, ValueError):
        state = load(run)
    pids = set(found.pids)
    if state is not None:
        pids.update(p.pid for p in state.procs if alive(p.pid) and _ours(p.pid, testbed_id))
    if pids:
        stopped, killed = await stop(sorted(pids), grace_s)
        report.append(f"stopped {len(stopped)} process(es)")
        if killed:
            report.append(f"killed {len(killed)} after {grace_s:g} s: {killed}")
        progress(report[-1])
    if found.host_links:
        # the bridge first; a veth end goes with its peer's namespace, so these may race
        names = sorted(found.host_links, key=lambda n: not n.endswith("-br"))
        await netns.batch("".join(f"link delete {n}\n" for n in names), force=True)
        report.append(f"deleted {len(found.host_links)} host interface(s)")
        progress(report[-1])
    if found.namespaces:
        await netns.batch("".join(f"netns delete {ns}\n" for ns in found.namespaces), force=True)
        report.append(f"deleted {len(found.namespaces)} namespace(s)")
        progress(report[-1])
    if run.exists() and _is_run_dir(run):
        if keep_logs:
            for entry in run.iterdir():
                if entry.name != "logs":
                    _remove(entry)
            if not any(run.iterdir()):
                run.rmdir()
            report.append(f"removed {run} (logs kept in {run / 'logs'})")
        else:
            shutil.rmtree(run, ignore_errors=True)
            report.append(f"removed {run}")
        if run.parent == RUN_ROOT:
            with contextlib.suppress(OSError):
                run.parent.rmdir()  # when no other testbed uses it
    left = await find(testbed_id)
    if not left.empty:
        raise errors.FailedPrecondition(
            f"testbed {testbed_id!r}: still present after down: {left.describe()}; run "
            "`orl-testbed down` again, or remove them by hand (`ip netns list`)"
        )
    return report


def _ours(pid: int, testbed_id: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{ENV_MARKER}={testbed_id}".encode() in environ.split(b"\0")


RUN_DIR_ENTRIES = frozenset(
    {STATE_FILE, f".{STATE_FILE}.tmp", "wiring.toml", "ready", "logs", "state.db", "checkpoints"}
    | {"state.db-wal", "state.db-shm", "state.db-journal"}
)


def _foreign(run: Path) -> bool:
    """A run directory that holds files a testbed did not put there."""
    return run.exists() and any(run.iterdir()) and not _is_run_dir(run)


def _is_run_dir(path: Path) -> bool:
    """Only ever delete a directory that holds nothing but what a testbed puts there."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return False
    return names <= RUN_DIR_ENTRIES


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Status:
    found: Found
    state: State | None
    alive: dict[int, bool]
    phase: str  # "" when the controller cannot be asked


async def status(testbed_id: str, run_dir: Path | None = None) -> Status:
    run = (run_dir or default_run_dir(testbed_id)).resolve()
    found = await find(testbed_id)
    state = None
    with contextlib.suppress(errors.OrlError, KeyError, TypeError, ValueError):
        state = load(run)
    live = {p.pid: alive(p.pid) and _ours(p.pid, testbed_id) for p in state.procs} if state else {}
    phase = ""
    if state is not None and state.ready and any(live.values()):
        with contextlib.suppress(errors.OrlError):
            async with AsyncClient(state.plan.controller, timeout_s=2.0) as client:
                p = await client.get_phase()
            pairs = sorted({tuple(sorted((c.pod_a, c.pod_b))) for c in p.circuits})
            links = ", ".join(f"{a}<->{b}" for a, b in pairs) or "pods isolated"
            name = p.phase or "no phase yet"
            phase = f"epoch {p.epoch} ({name}): {len(p.circuits)} circuits, {links}"
    return Status(found, state, live, phase)

"""`orlctl local up|down|status`: a whole cluster as background processes on loopback.

The simulated OCS(es), the controller and one agent per node of a wiring file are
started from this Python (``python -m ...``), each writing its bound address to a
ready file; everything about the run (pids, addresses, logs, state) lives in a run
directory so that `down` and `status` work from any later shell. The controller and
every agent serve Prometheus /metrics on an ephemeral loopback port (the simulated OCS
has no metrics), listed by `status`.

With ``ocs="netconf"`` (`orlctl local up --ocs netconf`) every OCS is a real NETCONF
server instead (``python -m sim_backends.netconf_server``: Debian's netconfd with the
project's YANG module behind a private sshd on a loopback port; root), and the controller
runs on a copy of the wiring (``wiring-netconf.toml`` in the run directory) whose OCSes
say ``driver = "netconf"`` with that server's address, client key and known-hosts file.

With ``ha`` (`orlctl local up --ha`) the controller's state lives in a 3-member etcd
cluster on loopback (``python -m sim_backends.etcd_cluster``, Debian's etcd-server) and
several controllers run against it: one leads, the others stand by; the agents and
``ORL_CONTROLLER`` get every controller's address and follow the leader.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.grpcutil import metrics_file
from orchestrrl.model import NetconfSettings, Role, Wiring

DEFAULT_RUN_DIR = Path(".orl-local")
STATE_FILE = "cluster.json"


@dataclass(frozen=True)
class Proc:
    role: str  # "etcd", "ocs", "controller" or "agent"
    name: str
    pid: int
    address: str
    log: str
    metrics: str = ""  # HOST:PORT of its Prometheus /metrics ("": none)


METRICS_LISTEN = "127.0.0.1:0"  # every daemon that has metrics: an ephemeral port
OCS_KINDS = ("sim", "netconf")
NETCONF_WIRING = "wiring-netconf.toml"
HA_ETCD_MEMBERS = 3
HA_CONTROLLERS = (2, 3)  # allowed numbers of controllers with ``ha``

ENGINES_DIR = Path(".engines")  # what `make engines` installs (scripts/install-engines.sh)
INSTALLED = {
    "vllm": ENGINES_DIR / "vllm" / "bin" / "python",
    "llamacpp": ENGINES_DIR / "llama.cpp" / "bin" / "llama-server",
}


def installed_engine(kind: str) -> str | None:
    """The engine `make engines` installed in this checkout, if any: an absolute path that
    keeps its symlinks (vLLM's virtualenv Python resolved is the base interpreter, which
    has no vLLM)."""
    path = INSTALLED.get(kind)
    return str(path.absolute()) if path is not None and path.exists() else None


@dataclass(frozen=True)
class LocalEngine:
    """A real rollout engine for the generation nodes of a local cluster (the training
    nodes keep the simulated one): every generation agent runs its instances on its
    share of this host's CPU cores and serves a gateway on a free port."""

    kind: str  # vllm, llamacpp or sglang
    model: str
    command: str
    args: tuple[str, ...] = ()
    tp_layout: str = ""  # e.g. "1,1"; "" the agent's default
    max_num_seqs: int = 8
    context: int = 2048
    start_timeout_s: float = 600.0

    def agent_args(self, run_dir: Path, node: str, cpu_offset: int) -> list[str]:
        argv = [
            "--engine", self.kind,
            "--engine-model", str(Path(self.model).resolve()),
            "--engine-command", self.command,
            "--engine-max-num-seqs", str(self.max_num_seqs),
            "--engine-context", str(self.context),
            "--engine-start-timeout", str(self.start_timeout_s),
            "--engine-cpu-offset", str(cpu_offset),
            "--engine-log-dir", str((run_dir / "logs" / "engines" / node).resolve()),
            "--gateway-listen", "127.0.0.1:0",
            "--gpu-backend", "sim",  # each GPU of the layout is a CPU core here
        ]  # fmt: skip
        if self.tp_layout:
            argv += ["--tp-layout", self.tp_layout]
        return argv + [f"--engine-arg={a}" for a in self.args]


@dataclass(frozen=True)
class LocalCluster:
    run_dir: str
    wiring: str
    controller: str
    procs: list[Proc]
    started_at: float


def run_dir_default() -> Path:
    return Path(os.environ.get("ORL_RUN_DIR", str(DEFAULT_RUN_DIR)))


def _alive(pid: int, marker: str) -> bool:
    """True when pid runs and is ours (its command line names our run directory)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # zombie: exited, not yet reaped
            return False
    except (OSError, IndexError):
        return False
    return marker in cmdline


def _marker(run_dir: Path) -> str:
    return str(run_dir.resolve())


def load(run_dir: Path) -> LocalCluster | None:
    path = run_dir / STATE_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return LocalCluster(
        run_dir=data["run_dir"],
        wiring=data["wiring"],
        controller=data["controller"],
        procs=[Proc(**p) for p in data["procs"]],
        started_at=data["started_at"],
    )


def status(run_dir: Path) -> tuple[LocalCluster | None, dict[int, bool]]:
    cluster = load(run_dir)
    if cluster is None:
        return None, {}
    marker = _marker(run_dir)
    return cluster, {p.pid: _alive(p.pid, marker) for p in cluster.procs}


def _listen(address: str, ephemeral: bool) -> str:
    host = address.rpartition(":")[0]
    return f"{host}:0" if ephemeral else address


def up(
    wiring_path: Path,
    run_dir: Path,
    *,
    ephemeral_ports: bool = False,
    timeout_s: float = 30.0,
    heartbeat_interval_s: float = 0.5,
    progress: Callable[[str], None] = lambda _msg: None,
    engine: LocalEngine | None = None,
    ha: int = 0,
    ocs: str = "sim",
) -> LocalCluster:
    """Start the cluster; on any failure stop what was started and raise. ``engine``:
    the generation nodes run that real engine (the default: every node simulated).
    ``ha``: that many controllers (2 or 3) on a local etcd cluster, 0 for one
    controller on SQLite. ``ocs``: "sim" (the simulated OCS over gRPC) or "netconf"
    (netconfd behind sshd, the NETCONF driver)."""
    if ha and ha not in HA_CONTROLLERS:
        raise errors.field_error("--ha", ha, "2 or 3 controllers")
    if ocs not in OCS_KINDS:
        raise errors.field_error("--ocs", ocs, f"one of {', '.join(OCS_KINDS)}")
    w = wiring_mod.load(wiring_path)
    existing, alive = status(run_dir)
    if existing is not None and any(alive.values()):
        raise errors.FailedPrecondition(
            f"a local cluster is already running from {run_dir} (controller at "
            f"{existing.controller}); run `orlctl local down --run-dir {run_dir}` first"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    for stale in [run_dir / STATE_FILE, *run_dir.glob("*.addr"), *run_dir.glob("*.metrics")]:
        stale.unlink(missing_ok=True)
    state_db = run_dir / "state.db"
    for suffix in ("", "-wal", "-shm"):  # a fresh simulated OCS needs a fresh epoch history
        Path(f"{state_db}{suffix}").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "etcd", ignore_errors=True)  # likewise for an HA cluster
    for stale_dir in run_dir.glob("netconf-*"):  # and for NETCONF switches
        shutil.rmtree(stale_dir, ignore_errors=True)

    procs: list[Proc] = []
    try:
        ocs_addr = {}
        controller_wiring = Path(wiring_path).resolve()
        for o in w.ocses:
            if ocs == "netconf":
                how = [
                    "sim_backends.netconf_server",
                    "--dir",
                    str(_netconf_dir(run_dir, o.name)),
                    "--name",
                    o.name,
                    "--ports",
                    str(o.ports),
                ]
            else:
                how = [
                    "sim_backends.ocs_server",
                    "--name",
                    o.name,
                    "--ports",
                    str(o.ports),
                    "--switching-time-ms",
                    str(o.switching_time_s * 1000.0),
                    "--listen",
                    _listen(o.address, ephemeral_ports),
                    "--plaintext",  # loopback only
                ]
            proc, ocs_addr[o.name] = _spawn(run_dir, "ocs", o.name, how, timeout_s)
            procs.append(proc)
            progress(
                f"OCS {o.name} serving on {ocs_addr[o.name]}"
                + (" (NETCONF)" if ocs == "netconf" else "")
            )
        overrides = [
            arg for name, a in ocs_addr.items() for arg in ("--ocs-address", f"{name}={a}")
        ]
        if ocs == "netconf":
            controller_wiring = (run_dir / NETCONF_WIRING).resolve()
            controller_wiring.write_text(wiring_mod.to_toml(netconf_wiring(w, run_dir, ocs_addr)))
            overrides = []  # the addresses are in that wiring
        store = ["--state", str(state_db.resolve())]
        if ha:
            proc, endpoints = _spawn(
                run_dir,
                "etcd",
                "etcd",
                [
                    "sim_backends.etcd_cluster",
                    "--size",
                    str(HA_ETCD_MEMBERS),
                    "--data-dir",
                    str((run_dir / "etcd").resolve()),
                ],
                timeout_s,
            )
            procs.append(proc)
            progress(f"etcd: {HA_ETCD_MEMBERS} members at {endpoints}")
            store = ["--etcd", endpoints, "--election-ttl", "2"]
        addresses = []
        for i in range(max(ha, 1)):
            name = "controller" if not ha else f"controller-{i}"
            proc, address = _spawn(
                run_dir,
                "controller",
                name,
                [
                    "fabric_controller.main",
                    "--wiring",
                    str(controller_wiring),
                    *store,
                    "--listen",
                    # the wiring names one controller address: the others take a free port
                    _listen(w.controller, ephemeral_ports or i > 0),
                    "--heartbeat-interval",
                    str(heartbeat_interval_s),
                    "--compute-scheduling",
                    "on",  # the local cluster shows the compute-scheduling loop at work
                    "--plaintext",  # loopback only
                    *overrides,
                ],
                timeout_s,
                metrics=True,
            )
            procs.append(proc)
            addresses.append(address)
            progress(f"{name} serving on {address}")
        controller = ",".join(addresses)
        cores = 0  # generation agents share this host's cores in wiring order
        for n in w.nodes:
            real = engine is not None and n.role is Role.GEN
            if real:
                assert engine is not None
                how = engine.agent_args(run_dir, n.name, cores)
                cores += n.gpus
            else:
                how = ["--gpu-backend", "auto", "--engine", "sim"]
            proc, _ = _spawn(
                run_dir,
                "agent",
                n.name,
                [
                    "node_agent.main",
                    "--node",
                    n.name,
                    "--listen",
                    _listen(n.agent, ephemeral_ports),
                    "--controller",
                    controller,
                    "--gpus",
                    str(n.gpus),
                    *how,
                    # weight sync: a trainer writes here; generation nodes fetch into theirs
                    "--checkpoint-dir",
                    str(checkpoint_dir(run_dir, n.name).resolve()),
                    "--plaintext",  # loopback only
                ],
                engine.start_timeout_s if real and engine is not None else timeout_s,
                metrics=True,
            )
            procs.append(proc)
            if real:
                progress(f"agent {n.name}: {engine.kind if engine else ''} instances up")
        progress(f"{len(w.nodes)} node agents started")
        cluster = LocalCluster(
            str(run_dir.resolve()), str(Path(wiring_path).resolve()), controller, procs, time.time()
        )
        (run_dir / STATE_FILE).write_text(json.dumps(asdict(cluster), indent=2) + "\n")
        _wait_registered(w, controller, timeout_s)
        progress(f"all {len(w.nodes)} nodes registered")
        return cluster
    except BaseException:
        _stop(procs, _marker(run_dir))
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        raise


def checkpoint_dir(run_dir: Path, node: str) -> Path:
    """The node agent's checkpoint_dir in a local cluster (weight sync: a trainer publishes
    a checkpoint with ``orchestrrl.checkpoint.write`` into its training node's)."""
    return run_dir / "checkpoints" / node


def _netconf_dir(run_dir: Path, ocs: str) -> Path:
    return (run_dir / f"netconf-{ocs}").resolve()


def netconf_wiring(w: Wiring, run_dir: Path, addresses: dict[str, str]) -> Wiring:
    """``w`` with every OCS driven over NETCONF at its local server's address, with the
    client key and known-hosts file that server wrote (``sim_backends.netconf_server``)."""
    ocses = []
    for o in w.ocses:
        d = _netconf_dir(run_dir, o.name)
        settings = NetconfSettings(
            username=getpass.getuser(),
            key_file=str(d / "client_key"),
            known_hosts=str(d / "known_hosts"),
        )
        ocses.append(replace(o, address=addresses[o.name], driver="netconf", netconf=settings))
    return replace(w, ocses=tuple(ocses))


def _spawn(
    run_dir: Path, role: str, name: str, args: list[str], timeout_s: float, metrics: bool = False
) -> tuple[Proc, str]:
    """Start a daemon and wait for its ready file; ``metrics``: it serves /metrics too."""
    ready = (run_dir / f"{role}-{name}.addr").resolve()
    log_path = (run_dir / "logs" / f"{role}-{name}.log").resolve()
    cmd = [sys.executable, "-m", *args, "--ready-file", str(ready), "--log-format", "json"]
    if metrics:
        cmd += ["--metrics-listen", METRICS_LISTEN]
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if popen.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise errors.FailedPrecondition(
                f"{role} {name} exited with code {popen.returncode} before serving; "
                f"last log lines ({log_path}):\n    " + "\n    ".join(tail)
            )
        if time.monotonic() > deadline:
            popen.kill()
            raise errors.Unavailable(f"{role} {name} did not become ready in {timeout_s:.0f} s")
        time.sleep(0.02)
    address = ready.read_text().strip()
    served = metrics_file(ready)
    metrics_at = served.read_text().strip() if metrics and served.exists() else ""
    return Proc(role, name, popen.pid, address, str(log_path), metrics_at), address


def _wait_registered(w: Wiring, controller: str, timeout_s: float) -> None:
    from orchestrrl.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(controller, timeout_s=5.0) as client:
        while True:
            try:
                nodes = client.nodes()
                missing = [n.node for n in nodes if n.health != "up"]
            except errors.Unavailable as exc:  # an HA group still electing its leader
                missing = [f"(no controller answers: {exc})"]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"nodes not registered after {timeout_s:.0f} s: {', '.join(missing)}"
                )
            time.sleep(0.05)


async def _role(address: str, timeout_s: float) -> str:
    import grpc

    from orchestrrl import leader
    from orchestrrl.grpcutil import insecure_channel
    from orchestrrl.v1 import fabric_controller_pb2 as pb
    from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

    async with insecure_channel(address) as channel:
        try:
            await pb_grpc.FabricControllerStub(channel).GetPhase(
                pb.GetPhaseRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if leader.is_not_leader(exc):
                return f"standby (leader {leader.leader_of(exc) or 'not elected yet'})"
            return f"not answering ({exc.code().name})"
    return "leader"


def controller_roles(cluster: LocalCluster, timeout_s: float = 2.0) -> dict[str, str]:
    """Each controller's role as it answers now: leader, standby (naming the leader it
    knows) or not answering; asked one by one, never redirected."""
    import asyncio

    async def ask() -> dict[str, str]:
        controllers = [p for p in cluster.procs if p.role == "controller"]
        roles = await asyncio.gather(*(_role(p.address, timeout_s) for p in controllers))
        return {p.name: r for p, r in zip(controllers, roles, strict=True)}

    return asyncio.run(ask())


def _stop(procs: list[Proc], marker: str, grace_s: float = 10.0) -> list[str]:
    """SIGTERM in reverse start order, SIGKILL after the grace period; returns a report."""
    report = []
    for p in reversed(procs):
        if _alive(p.pid, marker):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in reversed(procs):
        while _alive(p.pid, marker) and time.monotonic() < deadline:
            _reap(p.pid)
            time.sleep(0.02)
        if _alive(p.pid, marker):
            os.kill(p.pid, signal.SIGKILL)
            report.append(f"{p.role} {p.name} (pid {p.pid}) killed after {grace_s:.0f} s")
        else:
            report.append(f"{p.role} {p.name} (pid {p.pid}) stopped")
        _reap(p.pid)
    return report


def _reap(pid: int) -> None:
    """Collect our own exited children so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def down(run_dir: Path, grace_s: float = 10.0) -> list[str]:
    cluster = load(run_dir)
    if cluster is None:
        return []
    report = _stop(cluster.procs, _marker(run_dir), grace_s)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return report

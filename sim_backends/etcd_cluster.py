"""Real etcd members on loopback, for tests, benchmarks and a local HA setup.

Starts 1 or 3 ``etcd`` processes (Debian's ``etcd-server``; ``$ORL_ETCD`` names another
binary) with their data in a temporary directory, waits until each one reports healthy,
and lets a caller kill, freeze, stop and restart single members. etcd needs its peer
addresses before it starts, so the ports are picked by binding port 0 and closing the
socket; a start that loses a port to another process is retried with new ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrrl import errors

INSTALL = "apt-get install etcd-server (make deps does it when root), or set $ORL_ETCD"
# Fast elections on loopback: a leader is found within about a second of losing one.
HEARTBEAT_MS = 50
ELECTION_MS = 500
START_ATTEMPTS = 3


def etcd_binary() -> str | None:
    """The etcd server binary: ``$ORL_ETCD``, else ``etcd`` on the PATH."""
    given = os.environ.get("ORL_ETCD")
    if given:
        return given if Path(given).exists() else None
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_suffix(".log")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1 with their data under ``root``."""

    def __init__(
        self,
        root: Path,
        size: int = 1,
        binary: str | None = None,
        *,
        client_hosts: Sequence[str] = (),
    ) -> None:
        """``client_hosts``: more local addresses the members take clients on, beside
        127.0.0.1 (e.g. ``sim_backends.partition.HUB`` for processes in namespaces)."""
        if size not in (1, 3, 5):
            raise errors.field_error("size", size, "1, 3 or 5 etcd members")
        found = binary or etcd_binary()
        if found is None:
            raise errors.FailedPrecondition(f"etcd is not installed: {INSTALL}")
        self.binary = found
        self.root = root
        self.size = size
        self.members: list[EtcdMember] = []
        self.client_hosts = tuple(client_hosts)
        self._generation = 0

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL, in member order."""
        return [m.endpoint for m in self.members]

    def endpoints_on(self, host: str) -> list[str]:
        """``host:port`` of every member, at one of ``client_hosts``."""
        if host not in self.client_hosts:
            raise errors.field_error("host", host, f"one of {', '.join(self.client_hosts)}")
        return [f"{host}:{m.client_port}" for m in self.members]

    def _plan(self) -> None:
        self._generation += 1
        self.members = [
            EtcdMember(f"m{i}", _free_port(), _free_port(), self.root / f"g{self._generation}-m{i}")
            for i in range(self.size)
        ]

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _spawn(self, m: EtcdMember) -> None:
        m.data_dir.parent.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", ",".join(
                [f"http://{m.endpoint}"]
                + [f"http://{h}:{m.client_port}" for h in self.client_hosts]
            ),
            "--advertise-client-urls", f"http://{m.endpoint}",
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", self._initial_cluster(),
            "--initial-cluster-token", f"orl-{os.getpid()}-{self._generation}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        log = m.log_path.open("ab")
        try:
            m.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    def healthy(self, i: int) -> bool:
        """Member ``i`` answers ``/health`` with true (it sees a leader and a quorum)."""
        m = self.members[i]
        if not m.running:
            return False
        url = f"http://{m.endpoint}/health"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return b'"true"' in r.read()
        except (OSError, urllib.error.URLError):
            return False

    def _failed(self, what: str) -> errors.Unavailable:
        detail = "; ".join(
            f"{m.name} ({'running' if m.running else 'exited'}): {m.log_tail(3)}"
            for m in self.members
        )
        return errors.Unavailable(f"etcd {what}: {detail}")

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every member and wait until all are healthy (blocking)."""
        for _attempt in range(START_ATTEMPTS):
            self._plan()
            for m in self.members:
                self._spawn(m)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all(self.healthy(i) for i in range(self.size)):
                    return
                if any(not m.running for m in self.members):
                    break  # a port was taken meanwhile, or a bad flag: try new ports
                time.sleep(0.05)
            else:
                err = self._failed(f"cluster of {self.size} not healthy in {timeout_s} s")
                self.close()
                raise err
            err = self._failed("member exited while starting")
            self.close()
        raise err

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays; ``restart`` brings it back)."""
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait()

    def freeze(self, i: int) -> None:
        """SIGSTOP member ``i``: alive to the kernel, silent to its peers and clients."""
        m = self.members[i]
        if m.running and m.proc is not None:
            m.proc.send_signal(signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        m = self.members[i]
        if m.running and m.proc is not None:
            m.proc.send_signal(signal.SIGCONT)

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its ports with its data (after ``kill``)."""
        self.kill(i)
        self._spawn(self.members[i])

    async def wait_healthy(self, members: list[int] | None = None, timeout_s: float = 20) -> None:
        """Wait until ``members`` (default: all) answer healthy; Unavailable after
        ``timeout_s``."""
        which = range(self.size) if members is None else members
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            checks = [asyncio.to_thread(self.healthy, i) for i in which]
            if all(await asyncio.gather(*checks)):
                return
            await asyncio.sleep(0.05)
        raise self._failed(f"members {list(which)} not healthy in {timeout_s} s")

    def close(self) -> None:
        """Stop every member (a frozen one too) and wait for it."""
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGCONT)
                m.proc.terminate()
            try:
                m.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m sim_backends.etcd_cluster``: run a cluster until SIGTERM or SIGINT (what
    ``orlctl local up --ha`` starts). The ready file gets the members' client endpoints,
    separated by commas, once every member is healthy."""
    import argparse

    from orchestrrl.grpcutil import write_ready_file

    p = argparse.ArgumentParser(
        prog="python -m sim_backends.etcd_cluster",
        description="Real etcd members on loopback, stopped together on SIGTERM/SIGINT.",
    )
    p.add_argument("--size", type=int, default=3, help="members: 1, 3 or 5 (default 3)")
    p.add_argument("--data-dir", type=Path, required=True, help="the members' data")
    p.add_argument("--ready-file", type=Path, help="write the client endpoints here")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to become healthy")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    cluster = EtcdCluster(args.data_dir, args.size)
    try:
        cluster.start(args.timeout)
        write_ready_file(args.ready_file, ",".join(cluster.endpoints))
        print(f"etcd: {args.size} members at {','.join(cluster.endpoints)}", flush=True)
        reported: set[str] = set()
        while not stopping.wait(1.0):
            for m in cluster.members:
                if not m.running and m.name not in reported:
                    reported.add(m.name)
                    print(f"etcd: member {m.name} exited:\n{m.log_tail(5)}", flush=True)
    except errors.OrlError as exc:
        print(f"etcd: {exc}", flush=True)
        return 1
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A real NETCONF server for tests and the local cluster: Debian's netconfd (yuma123)
with OrchestrRL's YANG module, behind a private OpenSSH sshd on a loopback port.

netconfd speaks NETCONF on a UNIX socket; SSH reaches it through sshd's ``netconf``
subsystem (``netconf-subsystem``, which netconfd ships). Nothing of the system's SSH
setup is used or changed: sshd runs in inetd mode (``sshd -i``), one process per
connection, started by a small accept loop on ``127.0.0.1:0`` (the bound port is read
back, as systemd's ssh.socket with Accept=yes does), with its own config, a throwaway
host key and a throwaway client key in the server's directory. The subsystem line maps
that port to this netconfd's socket, so several servers run side by side.

netconfd runs with ``--target=candidate`` (announcing :candidate and
:confirmed-commit:1.0/1.1, no :writable-running) and saves every confirmed commit to its
startup file, so a killed and restarted netconfd comes back with its last confirmed
configuration. It has no instrumentation (SIL) for our module, so it reports no
``oper-state``: ports are judged by ``admin-state``.

Needs root (sshd insists, and logs in as the user running this) and sshd's privilege
separation directory /run/sshd (created if missing, as the ssh service does).

    python -m sim_backends.netconf_server --dir DIR --name ocs0 --ports 32 --ready-file F
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from fabric_controller.drivers import netconf_xml as nx
from orchestrrl.model import NetconfSettings

INSTALL = "make deps as root (Debian packages netconfd and openssh-server)"
NETCONFD = "/usr/sbin/netconfd"
SUBSYSTEM = "/usr/sbin/netconf-subsystem"
SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"


def unavailable() -> str:
    """Why a server cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (sshd runs the netconf subsystem only as root)"
    for path in (NETCONFD, SUBSYSTEM, SSHD):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed: {INSTALL}"
    if shutil.which(SSH_KEYGEN) is None:
        return f"ssh-keygen is not installed: {INSTALL}"
    return ""


class NetconfServer:
    """One switch: netconfd with ``ports`` ports in its inventory, and its SSH front.

    ``root``: a private directory (keys, configs, the socket, logs, the startup file).
    ``address``, ``key_file``, ``known_hosts``, ``username``: what a client needs."""

    def __init__(self, root: Path, name: str = "ocs0", ports: int = 32) -> None:
        if not 2 <= ports <= nx.MAX_PORT:
            raise ValueError(f"ports={ports}: 2..{nx.MAX_PORT}")
        self.root = root.resolve()
        self.name = name
        self.ports = ports
        self.username = getpass.getuser()
        self.host_key = self.root / "ssh_host_ed25519_key"
        self.key_file = self.root / "client_key"
        self.known_hosts = self.root / "known_hosts"
        self.socket_path = self.root / "ncxserver.sock"
        self.startup = self.root / "startup-cfg.xml"
        self.netconfd_log = self.root / "netconfd.log"
        self.sshd_log = self.root / "sshd.log"
        self.sshd_config = self.root / "sshd_config"
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._netconfd: subprocess.Popen[bytes] | None = None
        self._sshds: list[subprocess.Popen[bytes]] = []
        self._sshds_lock = threading.Lock()
        self.connections = 0
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def settings(self, **overrides: object) -> NetconfSettings:
        """The wiring's ``netconf`` table for this server (key file, its known-hosts)."""
        base: dict[str, object] = {
            "username": self.username,
            "key_file": str(self.key_file),
            "known_hosts": str(self.known_hosts),
        }
        base.update(overrides)
        return NetconfSettings(**base)  # type: ignore[arg-type]

    # -- life cycle --

    def start(self, timeout_s: float = 20.0) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(f"NETCONF server {self.name}: {why}")
        self.root.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for key in (self.host_key, self.key_file):
            if not key.exists():
                subprocess.run(
                    [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", f"orl-{self.name}",
                     "-f", str(key)],
                    check=True,
                    capture_output=True,
                )  # fmt: skip
        (self.root / "authorized_keys").write_text(Path(f"{self.key_file}.pub").read_text())
        if not self.startup.exists():
            ports = "".join(
                f"<port><port-id>{i}</port-id></port>" for i in range(1, self.ports + 1)
            )
            self.startup.write_text(
                f'<config xmlns="{nx.NC_NS}"><ports xmlns="{nx.NS}">{ports}</ports></config>\n'
            )
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))  # 0 the first time; the same port again
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        host_pub = Path(f"{self.host_key}.pub").read_text().split()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.sshd_config.write_text(self._sshd_config())
        subprocess.run([SSHD, "-t", "-f", str(self.sshd_config)], check=True, capture_output=True)
        self.start_netconfd(timeout_s)
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"netconf-ssh-{self.name}", daemon=True
        )
        self._thread.start()

    def _sshd_config(self) -> str:
        login = "prohibit-password" if self.username == "root" else "no"
        return "\n".join(
            [
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                f"AllowUsers {self.username}",
                f"PermitRootLogin {login}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PidFile none",
                "PermitTTY no",
                "X11Forwarding no",
                "AllowTcpForwarding no",
                "AllowAgentForwarding no",
                "PrintMotd no",
                "LogLevel VERBOSE",
                f'Subsystem netconf "{SUBSYSTEM} '
                f'--ncxserver-sockname={self.port}@{self.socket_path}"',
                "",
            ]
        )

    def start_netconfd(self, timeout_s: float = 20.0) -> None:
        """Start netconfd (again): it loads its startup file, the last confirmed state."""
        if self.netconfd_running:
            return
        self.socket_path.unlink(missing_ok=True)  # a killed netconfd leaves it behind
        log = open(self.root / "netconfd.out", "ab")  # noqa: SIM115 (the child keeps it)
        with log:
            self._netconfd = subprocess.Popen(
                [
                    NETCONFD,
                    f"--module={nx.yang_file()}",
                    f"--ncxserver-sockname={self.socket_path}",
                    f"--startup={self.startup}",
                    "--target=candidate",
                    f"--superuser={self.username}",
                    f"--port={self.port}",
                    f"--home={self.root}",
                    f"--log={self.netconfd_log}",
                    "--log-append",
                    "--log-level=info",
                ],
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self._socket_ready():
            if self._netconfd.poll() is not None:
                tail = self.netconfd_log.read_text(errors="replace").strip().splitlines()[-8:]
                raise RuntimeError(
                    f"netconfd exited with code {self._netconfd.returncode} at start:\n  "
                    + "\n  ".join(tail)
                )
            if time.monotonic() > deadline:
                self.kill_netconfd()
                raise RuntimeError(f"netconfd did not listen within {timeout_s:.0f} s")
            time.sleep(0.02)

    def _socket_ready(self) -> bool:
        if not self.socket_path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    @property
    def netconfd_running(self) -> bool:
        return self._netconfd is not None and self._netconfd.poll() is None

    @property
    def netconfd_pid(self) -> int:
        return self._netconfd.pid if self._netconfd is not None else 0

    def kill_netconfd(self) -> None:
        """SIGKILL netconfd (as a crash or a power cut would); the SSH front stays."""
        if self._netconfd is not None and self._netconfd.poll() is None:
            self._netconfd.kill()
            self._netconfd.wait(10)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                self._reap()
                continue
            except OSError:
                return
            with conn:
                conn.setblocking(True)
                proc = subprocess.Popen(
                    [SSHD, "-i", "-f", str(self.sshd_config), "-E", str(self.sshd_log)],
                    stdin=conn.fileno(),
                    stdout=conn.fileno(),
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            with self._sshds_lock:
                self._sshds.append(proc)
                self.connections += 1
            self._reap()

    def _reap(self) -> None:
        with self._sshds_lock:
            self._sshds = [p for p in self._sshds if p.poll() is None]

    def drop_connections(self) -> None:
        """End every SSH session (their sshd processes), as a network cut would."""
        with self._sshds_lock:
            for p in self._sshds:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            for p in self._sshds:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            self._sshds = []

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.drop_connections()
        if self._netconfd is not None and self._netconfd.poll() is None:
            self._netconfd.terminate()
            try:
                self._netconfd.wait(5)
            except subprocess.TimeoutExpired:
                self._netconfd.kill()
                self._netconfd.wait(5)

    def __enter__(self) -> NetconfServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="A NETCONF OCS: netconfd with OrchestrRL's YANG module behind a private "
        "sshd on a loopback port (root)."
    )
    p.add_argument("--dir", type=Path, required=True, help="its keys, configs, logs, state")
    p.add_argument("--name", default="ocs0")
    p.add_argument("--ports", type=int, default=32)
    p.add_argument("--ready-file", type=Path, help="write HOST:PORT here when serving")
    p.add_argument("--log-format", default="console", help="(accepted for orlctl local)")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"netconf_server: {why}", file=sys.stderr)
        return 2
    server = NetconfServer(args.dir, args.name, args.ports)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    try:
        print(
            f"NETCONF OCS {args.name}: {server.address} (user {server.username}, key "
            f"{server.key_file}, known hosts {server.known_hosts})",
            flush=True,
        )
        if args.ready_file:
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(server.address + "\n")
            tmp.replace(args.ready_file)
        while not stop.wait(0.5):
            if not server.netconfd_running:
                print("netconfd exited; restarting it", flush=True)
                server.start_netconfd()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

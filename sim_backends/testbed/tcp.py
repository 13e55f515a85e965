"""A built-in TCP sender and receiver, for testbeds on machines without iperf3.

``python -m sim_backends.testbed.tcp receive --bind IP:PORT --streams N`` accepts N
connections, reads each to its end and prints one JSON line: the bytes received and
the seconds from the first to the last byte. ``send --to IP:PORT --streams N
(--bytes B | --seconds S)`` opens N connections that share the byte budget (a faster
stream sends more, as with ``iperf3 -n -P``) and prints its own JSON line, with
``error`` set when it could not connect. Both print ``listening``/``ready`` lines
first so the caller knows when to start the other side; with ``--wait-go`` the
sender connects, says ``ready`` and waits for a line on stdin before sending, so that a
whole schedule starts at once with its handshakes (and ARP) done.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK = 256 * 1024
RCVLOWAT = 64 * 1024
CONNECT_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 30.0


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


@dataclass
class _Budget:
    left: int
    lock: threading.Lock

    def take(self, n: int) -> int:
        with self.lock:
            got = min(n, self.left)
            self.left -= got
            return got


def receive(bind: str, streams: int) -> dict[str, object]:
    with socket.create_server(_address(bind), backlog=streams) as server:
        print("listening", flush=True)
        server.settimeout(IDLE_TIMEOUT_S)
        received = [0] * streams
        first = [float("inf")] * streams
        last = [0.0] * streams

        def drain(conn: socket.socket, i: int) -> None:
            conn.settimeout(IDLE_TIMEOUT_S)
            # wake up for 64 KiB at a time, not for every segment: the receivers of a
            # weight sync would otherwise spend the CPU the shaped links need
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, RCVLOWAT)
            buffer = bytearray(CHUNK)
            with conn:
                while n := conn.recv_into(buffer):
                    if not received[i]:
                        first[i] = time.monotonic()
                    received[i] += n
                last[i] = time.monotonic()

        threads = []
        for i in range(streams):
            conn, _ = server.accept()
            t = threading.Thread(target=drain, args=(conn, i), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    seconds = max(last) - min(first) if sum(received) else 0.0
    return {"bytes": sum(received), "seconds": seconds}


def send(
    to: str,
    streams: int,
    nbytes: int,
    seconds: float,
    wait_go: bool = False,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> dict[str, object]:
    budget = _Budget(nbytes if nbytes > 0 else 1 << 62, threading.Lock())
    sent = [0] * streams
    failures: list[str] = []
    payload = memoryview(bytes(CHUNK))
    conns = []
    try:
        for _ in range(streams):
            conns.append(socket.create_connection(_address(to), timeout=connect_timeout_s))
    except OSError as exc:
        for c in conns:
            c.close()
        return {"bytes": 0, "seconds": 0.0, "error": f"connect {to}: {exc.strerror or exc}"}
    print("ready", flush=True)
    if wait_go:
        sys.stdin.readline()  # the caller starts every sender of a schedule at once
    stop_at = time.monotonic() + seconds if seconds > 0 else float("inf")

    def pump(conn: socket.socket, i: int) -> None:
        conn.settimeout(IDLE_TIMEOUT_S)
        try:
            with conn:
                while time.monotonic() < stop_at and (n := budget.take(CHUNK)):
                    conn.sendall(payload[:n])
                    sent[i] += n
                conn.shutdown(socket.SHUT_WR)
        except OSError as exc:
            failures.append(f"stream {i}: {exc.strerror or exc}")

    start = time.monotonic()
    threads = [threading.Thread(target=pump, args=(c, i)) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, object] = {"bytes": sum(sent), "seconds": time.monotonic() - start}
    if failures:
        out["error"] = "; ".join(failures)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim_backends.testbed.tcp")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("receive")
    r.add_argument("--bind", required=True, metavar="IP:PORT")
    r.add_argument("--streams", type=int, default=1)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True, metavar="IP:PORT")
    s.add_argument("--streams", type=int, default=1)
    s.add_argument("--bytes", type=int, default=0)
    s.add_argument("--seconds", type=float, default=0.0)
    s.add_argument("--wait-go", action="store_true", help="connect, print ready, wait for a line")
    s.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT_S, metavar="S")
    args = p.parse_args(argv)
    try:
        if args.command == "receive":
            result = receive(args.bind, args.streams)
        else:
            result = send(
                args.to, args.streams, args.bytes, args.seconds, args.wait_go, args.connect_timeout
            )
    except OSError as exc:
        result = {"bytes": 0, "seconds": 0.0, "error": str(exc)}
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

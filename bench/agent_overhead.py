#!/usr/bin/env python3
"""CPU and memory overhead of the node agent: the real daemon at 10 Hz with 8 GPUs, 8 NICs.

Runs ``orl-node-agent --plaintext --gpu-backend sim --gpus 8`` as a subprocess with 8
NICs sampling at R Hz (default 10) against a fake controller in this process
(``node_agent.fake_controller``, heartbeats every second), waits until it streams, then
for D seconds measures the agent's CPU time (utime+stime from /proc/PID/stat, as % of
one core) and its RSS (VmRSS from /proc/PID/status, peak of 10 Hz readings). The
baseline, measured over the same window, is an idle ``python -c "import time;
time.sleep(N)"`` process (interpreter start-up excluded, like the agent's).

Every sample is taken at R Hz (GPUs, NICs, RDMA, engine figures); the agent uploads them
in batches every ``--flush-interval`` seconds (its default 1 s; one gRPC message each,
the engine's per-request progress on the newest sample). ``--also-unbatched`` measures,
in the same run, a second agent that sends every sample as it is taken (flush 0).

NICs: as root, the agent runs in a throwaway network namespace holding 8 veth pairs
(``eth0``..``eth7``; idle, but read through rtnetlink exactly like real NICs) plus one
veth link to this process's namespace so it can reach the fake controller; the
namespace is deleted afterwards. Without root, the agent reports the (up to 8)
interfaces this host has, and the table says how many that was.

    python bench/agent_overhead.py [--seconds 20] [--hz 10] [--flush-interval 1]
        [--also-unbatched] [--json out.json]

Targets: < 1 % of one core, < 100 MiB RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node_agent.fake_controller import start_fake_controller

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGET_CPU_PCT = 1.0
TARGET_RSS_MIB = 100.0
NICS = 8


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def nic_namespace() -> Iterator[tuple[list[str], list[str], str]]:
    """A namespace with 8 idle veth NICs and a link to ours: (command prefix, NICs, controller
    host)."""
    tag = f"{os.getpid() % 100000}"
    ns, host_end, ns_end = f"orl-bench-{tag}", f"obh{tag}", f"obn{tag}"
    subnet = f"10.253.{os.getpid() % 250}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", ns)
        ip("addr", "add", f"{subnet}.1/30", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", ns_end)
        ip("-n", ns, "link", "set", ns_end, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        nics = [f"eth{i}" for i in range(NICS)]
        for i, name in enumerate(nics):
            ip("-n", ns, "link", "add", name, "type", "veth", "peer", "name", f"peer{i}")
            ip("-n", ns, "link", "set", name, "up")
            ip("-n", ns, "link", "set", f"peer{i}", "up")
        yield ["ip", "netns", "exec", ns], nics, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", host_end], check=False, capture_output=True)


@contextmanager
def host_nics() -> Iterator[tuple[list[str], list[str], str]]:
    names = sorted(os.listdir("/sys/class/net"))[:NICS]
    yield [], names, "127.0.0.1"


async def measure(args: argparse.Namespace, flush_interval: float) -> dict[str, object]:
    as_root = os.geteuid() == 0 and not args.no_netns
    setup = nic_namespace() if as_root else host_nics()
    with setup as (prefix, nics, controller_host), tempfile.TemporaryDirectory() as tmp:
        controller = await start_fake_controller(f"{controller_host}:0", heartbeat_interval_s=1.0)
        fake = controller.fake
        log_path = Path(tmp) / "agent.log"
        command = [
            *prefix,
            sys.executable,
            "-m",
            "node_agent.main",
            "--plaintext",
            "--node=bench-n0",
            "--listen=127.0.0.1:0",
            f"--controller={controller.address}",
            "--gpu-backend=sim",
            "--gpus=8",
            f"--telemetry-interval={1.0 / args.hz}",
            f"--telemetry-flush-interval={flush_interval}",
            "--log-format=json",
            *[f"--nic={n}" for n in nics],
        ]
        with log_path.open("w") as log_file:
            agent = await asyncio.create_subprocess_exec(
                *command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file
            )
        idle = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            f"import time; time.sleep({args.seconds + 60})",
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while len(fake.samples) < args.hz:  # a second of samples: started and streaming
                if agent.returncode is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the agent did not stream:\n{log_path.read_text()}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # past start-up work (first NVML/sysfs reads, imports)
            start = time.monotonic()
            cpu0 = {p.pid: cpu_seconds(p.pid) for p in (agent, idle)}
            samples0 = len(fake.samples)
            peak = {agent.pid: 0.0, idle.pid: 0.0}
            while (elapsed := time.monotonic() - start) < args.seconds:
                for pid in peak:
                    peak[pid] = max(peak[pid], rss_mib(pid))
                if int(elapsed * 10) % 10 == 0:
                    print(f"\rmeasuring {elapsed:4.0f}/{args.seconds:g} s", end="", file=sys.stderr)
                await asyncio.sleep(0.1)
            wall = time.monotonic() - start
            cpu1 = {p.pid: cpu_seconds(p.pid) for p in (agent, idle)}
            received = len(fake.samples) - samples0
            print(file=sys.stderr)
        finally:
            for proc in (agent, idle):
                proc.terminate()
            async with asyncio.timeout(10):
                for proc in (agent, idle):
                    await proc.wait()
            await controller.server.stop(0)
        nics_reported = len(fake.samples[-1].nics) if fake.samples else 0

    def row(pid: int) -> dict[str, float]:
        return {
            "cpu_pct_of_one_core": 100.0 * (cpu1[pid] - cpu0[pid]) / wall,
            "rss_mib": peak[pid],
        }

    agent_row, idle_row = row(agent.pid), row(idle.pid)
    return {
        "seconds": round(wall, 3),
        "hz": args.hz,
        "flush_interval_s": flush_interval,
        "gpus": 8,
        "nics": nics_reported,
        "nic_setup": "netns with 8 veth pairs" if as_root else "host interfaces",
        "samples_received": received,
        "samples_per_s": round(received / wall, 2),
        "clock_ticks_per_s": CLK_TCK,
        "agent": agent_row,
        "idle_python": idle_row,
        "agent_minus_idle": {k: agent_row[k] - idle_row[k] for k in agent_row},
        "targets": {"cpu_pct_of_one_core": TARGET_CPU_PCT, "rss_mib": TARGET_RSS_MIB},
        "meets_targets": agent_row["cpu_pct_of_one_core"] < TARGET_CPU_PCT
        and agent_row["rss_mib"] < TARGET_RSS_MIB,
    }


def print_table(result: dict[str, object]) -> None:
    agent = result["agent"]
    idle = result["idle_python"]
    delta = result["agent_minus_idle"]
    assert isinstance(agent, dict) and isinstance(idle, dict) and isinstance(delta, dict)
    flush = result["flush_interval_s"]
    uploads = f"uploads every {flush:g} s" if flush else "every sample uploaded at once"
    print(
        f"agent overhead: {result['gpus']} sim GPUs, {result['nics']} NICs "
        f"({result['nic_setup']}), sampling at {result['hz']} Hz, {uploads}, for "
        f"{result['seconds']} s; {result['samples_per_s']} samples/s reached the controller"
    )
    print(f"{'process':<22}{'CPU % of one core':>20}{'peak RSS MiB':>16}")
    for name, r in (("orl-node-agent", agent), ("idle python (baseline)", idle),
                    ("agent - baseline", delta)):  # fmt: skip
        print(f"{name:<22}{r['cpu_pct_of_one_core']:>20.2f}{r['rss_mib']:>16.1f}")
    print(
        f"targets: < {TARGET_CPU_PCT} % CPU, < {TARGET_RSS_MIB:g} MiB RSS (agent, absolute): "
        + ("met" if result["meets_targets"] else "NOT met")
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=20.0, help="measured window (default 20)")
    p.add_argument("--hz", type=float, default=10.0, help="telemetry rate (default 10)")
    p.add_argument(
        "--flush-interval", type=float, default=1.0, help="agent upload interval (default 1)"
    )
    p.add_argument(
        "--also-unbatched",
        action="store_true",
        help="also measure an agent that uploads every sample at once (flush interval 0)",
    )
    p.add_argument("--no-netns", action="store_true", help="use host NICs even as root")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args()
    result = asyncio.run(measure(args, args.flush_interval))
    print_table(result)
    if args.also_unbatched:
        unbatched = asyncio.run(measure(args, 0.0))
        print()
        print_table(unbatched)
        result = {**result, "unbatched": unbatched}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

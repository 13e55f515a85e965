#!/usr/bin/env python3
"""CPU and memory overhead of the node agent: the real daemon at 10 Hz with 8 GPUs, 8 NICs.

Runs ``orl-node-agent --plaintext --gpu-backend sim --gpus 8`` as a subprocess with 8
NICs sampling at R Hz (default 10) against a fake controller in this process
(``sim_backends.fake_controller``, heartbeats every second), waits until it streams, then
for D seconds measures the agent's CPU time (utime+stime from /proc/PID/stat, as % of
one core) and its RSS (VmRSS from /proc/PID/status, peak of 10 Hz readings). The
baseline, measured over the same window, is an idle ``python -c "import time;
time.sleep(N)"`` process (interpreter start-up excluded, like the agent's).

What the table separates, all measured in the same window:

* (a) the whole agent process (utime+stime from /proc/PID/stat);
* (b) the simulated rollout engine's stepping (arrivals, token generation), which on a
  real node runs in vLLM's own processes: the agent accounts the CPU time of its
  simulation steps with ``time.thread_time`` and logs the running totals at each
  SIGUSR1, sent at both ends of the window;
* (a) - (b): the agent's own work, which the target applies to. The simulated GPUs'
  readings stay in it (on a real node the agent makes NVML calls in their place); their
  share is shown on its own line;
* wake-ups per second (voluntary and involuntary context switches of every thread, from
  /proc/PID/task/*/status) and CPU per thread (schedstat, nanoseconds);
* two baselines: an idle ``python`` (sleeping) and a ``python`` that only wakes at R Hz on
  uvloop (the floor any R Hz Python daemon pays on this machine).

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
        [--also-unbatched] [--compare-checkout DIR] [--json out.json]

Targets: < 1 % of one core, < 100 MiB RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sim_backends.fake_controller import start_fake_controller

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


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """Per thread: (name, CPU ns from schedstat, context switches) of a live process."""
    out: dict[int, tuple[str, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            switches = sum(
                int(line.split()[1])
                for line in (task / "status").read_text().splitlines()
                if "ctxt_switches:" in line  # voluntary and nonvoluntary
            )
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, cpu_ns, switches)
    return out


def thread_rows(
    pid: int, before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]],
    wall: float,
) -> list[dict[str, object]]:  # fmt: skip
    """CPU % and wake-ups/s of the threads alive at both ends, main thread first."""
    rows = []
    for tid in sorted(before.keys() & after.keys(), key=lambda t: (t != pid, t)):
        name, ns0, sw0 = before[tid]
        _, ns1, sw1 = after[tid]
        rows.append(
            {
                "thread": "main" if tid == pid else name,
                "cpu_pct_of_one_core": 100.0 * (ns1 - ns0) / 1e9 / wall,
                "wakeups_per_s": (sw1 - sw0) / wall,
            }
        )
    return rows


async def cpu_accounting(pid: int, log_path: Path, seen: int) -> dict[str, float]:
    """Ask the agent for its CPU accounting (SIGUSR1) and wait for the log line."""
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [
            json.loads(line)
            for line in (await asyncio.to_thread(log_path.read_text)).splitlines()
            if '"cpu_accounting"' in line
        ]
        if len(lines) > seen:
            return {k: float(v) for k, v in lines[-1].items() if k.endswith("_cpu_s")}
        await asyncio.sleep(0.02)
    text = await asyncio.to_thread(log_path.read_text)
    raise SystemExit(f"the agent did not answer SIGUSR1:\n{text}")


TICKER = """
import asyncio, sys, uvloop
async def main(period):
    while True:
        await asyncio.sleep(period)
uvloop.run(main(float(sys.argv[1])))
"""


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


async def start_agent(
    prefix: list[str], nics: list[str], controller_address: str, checkout: Path, node: str,
    hz: float, flush_interval: float, log_path: Path,
) -> asyncio.subprocess.Process:  # fmt: skip
    command = [
        *prefix,
        sys.executable,
        "-m",
        "node_agent.main",
        "--plaintext",
        f"--node={node}",
        "--listen=127.0.0.1:0",
        f"--controller={controller_address}",
        "--gpu-backend=sim",
        *(["--engine=sim"] if (checkout / "node_agent" / "engines").is_dir() else []),
        "--gpus=8",
        f"--telemetry-interval={1.0 / hz}",
        f"--telemetry-flush-interval={flush_interval}",
        "--log-format=json",
        *[f"--nic={n}" for n in nics],
    ]
    with log_path.open("w") as log_file:  # ``-m`` imports the agent from the checkout (cwd)
        return await asyncio.create_subprocess_exec(
            *command, cwd=checkout, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file
        )


async def measure(args: argparse.Namespace, flush_interval: float) -> dict[str, object]:
    as_root = os.geteuid() == 0 and not args.no_netns
    setup = nic_namespace() if as_root else host_nics()
    with setup as (prefix, nics, controller_host), tempfile.TemporaryDirectory() as tmp:
        controller = await start_fake_controller(f"{controller_host}:0", heartbeat_interval_s=1.0)
        fake = controller.fake
        log_path = Path(tmp) / "agent.log"
        agent = await start_agent(
            prefix, nics, controller.address, REPO, "bench-n0", args.hz, flush_interval, log_path
        )
        # --compare-checkout: the agent of another checkout (say, before a change), with its
        # own fake controller, measured in the same window (whole process only: it may not
        # answer SIGUSR1)
        other_controller = other = None
        if args.compare_checkout is not None:
            other_controller = await start_fake_controller(
                f"{controller_host}:0", heartbeat_interval_s=1.0
            )
            other = await start_agent(
                prefix, nics, other_controller.address, args.compare_checkout, "bench-n1",
                args.hz, flush_interval, Path(tmp) / "other.log",
            )  # fmt: skip
        idle = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            f"import time; time.sleep({args.seconds + 60})",
            stdin=subprocess.DEVNULL,
        )
        ticker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TICKER, str(1.0 / args.hz), stdin=subprocess.DEVNULL
        )
        baselines = (idle, ticker) if other is None else (idle, ticker, other)
        try:
            deadline = time.monotonic() + 30
            streaming = [(agent, fake, log_path)]
            if other is not None and other_controller is not None:
                streaming.append((other, other_controller.fake, Path(tmp) / "other.log"))
            for proc, receiver, path in streaming:  # a second of samples: streaming
                while len(receiver.samples) < args.hz:
                    if proc.returncode is not None or time.monotonic() > deadline:
                        text = await asyncio.to_thread(path.read_text)
                        raise SystemExit(f"an agent did not stream:\n{text}")
                    await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # past start-up work (first NVML/sysfs reads, imports)
            account0 = await cpu_accounting(agent.pid, log_path, 0)
            start = time.monotonic()
            cpu0 = {p.pid: cpu_seconds(p.pid) for p in (agent, *baselines)}
            threads0 = threads(agent.pid)
            other0 = threads(other.pid) if other is not None else {}
            samples0 = len(fake.samples)
            peak = {p.pid: 0.0 for p in (agent, *baselines)}
            while (elapsed := time.monotonic() - start) < args.seconds:
                for pid in peak:
                    peak[pid] = max(peak[pid], rss_mib(pid))
                if int(elapsed * 10) % 10 == 0:
                    print(f"\rmeasuring {elapsed:4.0f}/{args.seconds:g} s", end="", file=sys.stderr)
                await asyncio.sleep(0.1)
            wall = time.monotonic() - start
            cpu1 = {p.pid: cpu_seconds(p.pid) for p in (agent, *baselines)}
            threads1 = threads(agent.pid)
            other1 = threads(other.pid) if other is not None else {}
            received = len(fake.samples) - samples0
            account1 = await cpu_accounting(agent.pid, log_path, 1)
            print(file=sys.stderr)
        finally:
            for proc in (agent, *baselines):
                proc.terminate()
            async with asyncio.timeout(10):
                for proc in (agent, *baselines):
                    await proc.wait()
            await controller.server.stop(0)
            if other_controller is not None:
                await other_controller.server.stop(0)
        nics_reported = len(fake.samples[-1].nics) if fake.samples else 0

    def row(pid: int) -> dict[str, float]:
        return {
            "cpu_pct_of_one_core": 100.0 * (cpu1[pid] - cpu0[pid]) / wall,
            "rss_mib": peak[pid],
        }

    agent_row, idle_row, ticker_row = row(agent.pid), row(idle.pid), row(ticker.pid)
    # The accounting's window is a few ms wider than /proc's (SIGUSR1 round trips): scaled
    # to the same wall time, in % of one core.
    account = {k: 100.0 * (account1[k] - account0[k]) / wall for k in account0}
    engine_pct = account["engine_simulation_cpu_s"]
    own = agent_row["cpu_pct_of_one_core"] - engine_pct
    per_thread = thread_rows(agent.pid, threads0, threads1, wall)
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
        "agent": agent_row,  # (a) the whole process
        "engine_simulation_cpu_pct": engine_pct,  # (b), measured in the agent
        "agent_own_cpu_pct": own,  # (a) - (b): what the target applies to
        "gpu_simulation_cpu_pct": account["gpu_simulation_cpu_s"],  # part of (a) - (b)
        "agent_accounted_process_cpu_pct": account["process_cpu_s"],  # cross-check of (a)
        "wakeups_per_s": sum(float(str(r["wakeups_per_s"])) for r in per_thread),
        "threads": per_thread,
        "idle_python": idle_row,
        "ticking_python": ticker_row,  # the R Hz wake-up floor
        # the own work in units of that floor: the machine's speed (steal, clocks) moves
        # both, so this tells a slower machine from a heavier agent
        "agent_own_per_floor": own / ticker_row["cpu_pct_of_one_core"]
        if ticker_row["cpu_pct_of_one_core"] > 0
        else None,
        "agent_minus_idle": {k: agent_row[k] - idle_row[k] for k in agent_row},
        "compare_checkout": None
        if other is None
        else {
            "checkout": str(args.compare_checkout),
            **row(other.pid),
            "wakeups_per_s": sum(
                float(str(r["wakeups_per_s"])) for r in thread_rows(other.pid, other0, other1, wall)
            ),
        },
        "targets": {"cpu_pct_of_one_core": TARGET_CPU_PCT, "rss_mib": TARGET_RSS_MIB},
        "meets_targets": own < TARGET_CPU_PCT and agent_row["rss_mib"] < TARGET_RSS_MIB,
        "whole_process_meets_targets": agent_row["cpu_pct_of_one_core"] < TARGET_CPU_PCT
        and agent_row["rss_mib"] < TARGET_RSS_MIB,
    }


def print_table(result: dict[str, object]) -> None:
    agent = result["agent"]
    idle = result["idle_python"]
    ticker = result["ticking_python"]
    assert isinstance(agent, dict) and isinstance(idle, dict) and isinstance(ticker, dict)
    flush = result["flush_interval_s"]
    uploads = f"uploads every {flush:g} s" if flush else "every sample uploaded at once"
    print(
        f"agent overhead: {result['gpus']} sim GPUs, {result['nics']} NICs "
        f"({result['nic_setup']}), sampling at {result['hz']} Hz, {uploads}, for "
        f"{result['seconds']} s; {result['samples_per_s']} samples/s reached the controller"
    )
    print(f"{'':<46}{'CPU % of one core':>18}{'peak RSS MiB':>14}")
    rows: list[tuple[str, object, object]] = [
        ("(a) orl-node-agent, whole process", agent["cpu_pct_of_one_core"], agent["rss_mib"]),
        ("(b)   simulated engine stepping (in (a))", result["engine_simulation_cpu_pct"], None),
        ("(a)-(b) the agent's own work", result["agent_own_cpu_pct"], agent["rss_mib"]),
        ("        of which simulated GPU readings", result["gpu_simulation_cpu_pct"], None),
        ("idle python (baseline)", idle["cpu_pct_of_one_core"], idle["rss_mib"]),
        (f"python waking at {result['hz']:g} Hz (baseline)", ticker["cpu_pct_of_one_core"],
         ticker["rss_mib"]),
    ]  # fmt: skip
    for name, cpu, rss in rows:
        rss_text = f"{rss:>14.1f}" if isinstance(rss, float) else f"{'':>14}"
        print(f"{name:<46}{cpu:>18.3f}{rss_text}")
    other = result.get("compare_checkout")
    if isinstance(other, dict):
        print(
            f"{'the agent of ' + Path(str(other['checkout'])).name + ', whole process':<46}"
            f"{other['cpu_pct_of_one_core']:>18.3f}{other['rss_mib']:>14.1f}"
            f"  (--compare-checkout; {other['wakeups_per_s']:.1f} wake-ups/s)"
        )
    ratio = result.get("agent_own_per_floor")
    if isinstance(ratio, float):
        print(
            f"(a)-(b) is {ratio:.1f} times the {result['hz']:g} Hz floor measured in the same "
            "window (the floor moves with the machine's speed; compare runs by this)"
        )
    print(
        f"agent's own accounting of (a): {result['agent_accounted_process_cpu_pct']:.3f} %; "
        f"wake-ups: {result['wakeups_per_s']:.1f}/s over all threads"
    )
    per_thread = result["threads"]
    assert isinstance(per_thread, list)
    print(
        "  per thread (CPU %, wake-ups/s): "
        + ", ".join(
            f"{r['thread']} {r['cpu_pct_of_one_core']:.2f} {r['wakeups_per_s']:.1f}"
            for r in per_thread
        )
    )
    print(
        f"targets: < {TARGET_CPU_PCT} % CPU, < {TARGET_RSS_MIB:g} MiB RSS; "
        f"the agent's own work (a)-(b): "
        + ("met" if result["meets_targets"] else "NOT met")
        + "; the whole process (a): "
        + ("met" if result["whole_process_meets_targets"] else "NOT met")
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
    p.add_argument(
        "--compare-checkout",
        type=Path,
        help="also run the agent of this checkout (e.g. `git archive` of an older commit, "
        "with its stubs generated) in the same window, for before/after figures",
    )
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

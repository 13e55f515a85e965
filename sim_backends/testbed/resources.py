"""Does a testbed fit this machine? Checked before anything is created.

``read_machine`` reads the facts (the only I/O here); ``check`` is pure and returns
every problem, each saying what is needed, what there is, and what to do.
The per-item costs were measured on the development machine (2 cores, Linux 6.x):
an idle node agent or controller holds about 56 MB resident with 9 threads and
spends about 0.5 s of CPU starting; a namespace and a veth pair cost the kernel
tens of kilobytes each (rounded up generously below).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sim_backends.testbed.plan import TestbedPlan

PROCESS_MB = 64.0  # resident memory of one daemon (agent, controller, OCS)
PROCESS_THREADS = 12
PROCESS_START_CPU_S = 0.6
NETNS_MB = 0.25
VETH_MB = 0.1
MEMORY_SHARE = 0.8  # of MemAvailable the testbed may plan to use
MAX_START_S = 120.0  # daemons' start-up CPU spread over the cores, at most
TOOLS = ("ip", "tc")


@dataclass(frozen=True)
class Machine:
    cpus: int
    mem_available_mb: float
    netns_in_use: int
    max_netns: int  # /proc/sys/user/max_net_namespaces
    free_pids: int  # pid_max minus the tasks running now
    euid: int
    missing_tools: tuple[str, ...]


@dataclass(frozen=True)
class Estimate:
    processes: int
    namespaces: int
    veths: int
    memory_mb: float
    start_cpu_s: float


def read_machine() -> Machine:
    meminfo = Path("/proc/meminfo").read_text()
    available_kb = next(
        (int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")),
        0,
    )
    netns_dir = Path("/run/netns")
    in_use = sum(1 for _ in netns_dir.iterdir()) if netns_dir.is_dir() else 0
    try:
        max_netns = int(Path("/proc/sys/user/max_net_namespaces").read_text())
    except (OSError, ValueError):
        max_netns = 1 << 20
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        tasks = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
    except (OSError, ValueError):
        pid_max, tasks = 1 << 22, 0
    return Machine(
        cpus=os.cpu_count() or 1,
        mem_available_mb=available_kb / 1024.0,
        netns_in_use=in_use,
        max_netns=max_netns,
        free_pids=pid_max - tasks,
        euid=os.geteuid(),
        missing_tools=tuple(t for t in TOOLS if shutil.which(t) is None),
    )


def estimate(plan: TestbedPlan) -> Estimate:
    processes = len(plan.daemons)
    namespaces = len(plan.namespaces())
    veths = len(plan.links)
    memory = processes * PROCESS_MB + namespaces * NETNS_MB + veths * VETH_MB
    return Estimate(processes, namespaces, veths, memory, processes * PROCESS_START_CPU_S)


def privileges(machine: Machine) -> list[str]:
    problems = []
    if machine.euid != 0:
        problems.append(
            f"the testbed needs root (network namespaces, veth, tc; running as uid "
            f"{machine.euid}): run it with sudo, or as root in CI"
        )
    if machine.missing_tools:
        problems.append(
            f"missing commands: {', '.join(machine.missing_tools)}; install iproute2 "
            "(apt-get install iproute2)"
        )
    return problems


def check(plan: TestbedPlan, machine: Machine) -> list[str]:
    """Every reason the plan does not fit ``machine`` (empty: it fits)."""
    need = estimate(plan)
    problems = privileges(machine)
    budget = machine.mem_available_mb * MEMORY_SHARE
    if need.memory_mb > budget:
        problems.append(
            f"memory: {need.processes} daemons ({PROCESS_MB:g} MB each) and "
            f"{need.namespaces} namespaces need about {need.memory_mb:,.0f} MB, but only "
            f"{budget:,.0f} MB ({MEMORY_SHARE:.0%} of the {machine.mem_available_mb:,.0f} MB "
            "available) may be used; use a wiring with fewer nodes"
        )
    free_netns = machine.max_netns - machine.netns_in_use
    if need.namespaces > free_netns:
        problems.append(
            f"namespaces: {need.namespaces} are needed but only {free_netns} more are allowed "
            f"(/proc/sys/user/max_net_namespaces = {machine.max_netns}, "
            f"{machine.netns_in_use} in use)"
        )
    threads = need.processes * PROCESS_THREADS
    if threads > machine.free_pids:
        problems.append(
            f"processes: about {threads} threads are needed but only {machine.free_pids} "
            "process ids are free (/proc/sys/kernel/pid_max)"
        )
    start_s = need.start_cpu_s / max(1, machine.cpus)
    if start_s > MAX_START_S:
        problems.append(
            f"cpu: starting {need.processes} daemons takes about {start_s:.0f} s on "
            f"{machine.cpus} core(s) (at most {MAX_START_S:.0f} s allowed); use a wiring "
            "with fewer nodes or a bigger machine"
        )
    return problems

"""Real TCP transfers between the testbed's node namespaces.

``iperf3`` runs inside the namespaces when installed (``ip netns exec``) for a single
transfer; several transfers at once, and machines without iperf3, use the built-in
sender/receiver of ``sim_backends.testbed.tcp``. Every transfer starts its
receiver first and waits until it listens; the built-in senders then open their
connections (so handshakes and ARP are done before any data flows) and all transfers
start together. Throughput is what a receiver got over the time it took. Every
process carries the testbed's environment marker, so ``orl-testbed down`` stops any
that outlive a crash.

Completion times need the built-in tool: ``iperf3 -n`` ends a test when the sender has
handed its bytes to the kernel, so what is still queued in the shaped links is neither
counted nor waited for, and each iperf3 client connects on its own schedule. The
built-in receiver reads to the end of every stream, so a transfer is complete when its
last byte has arrived; weight sync and pod-to-pod traffic use it.

Weight sync follows the network planner's transfer schedule
(``scheduler.weight_sync.plan_weight_sync``) on the circuits the controller has
committed, with the testbed's emulated capacities, and compares the completion time
with the planner's ideal: the bytes over the bottleneck capacity (100 % link efficiency).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrrl import errors
from orchestrrl.client import AsyncClient, CircuitView
from orchestrrl.model import Circuit, Wiring
from scheduler.weight_sync import plan_weight_sync
from sim_backends.testbed.plan import NodePlan, TestbedPlan
from sim_backends.testbed.state import ENV_MARKER

TOOLS = ("auto", "iperf3", "builtin")
BASE_PORT = 5201
CONNECT_TIMEOUT_MS = 3000
LISTEN_TIMEOUT_S = 10.0
DEFAULT_BYTES = 25_000_000


@dataclass(frozen=True)
class Transfer:
    source: str  # node names
    target: str
    nbytes: int


@dataclass(frozen=True)
class Result:
    source: str
    target: str
    nbytes: int  # received
    seconds: float
    capacity_mbps: float | None  # of the path, from the circuits (None: unknown)
    error: str = ""
    tool: str = ""
    streams: int = 1

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def mbps(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Report:
    results: tuple[Result, ...]
    wall_s: float  # from the start of all senders to the last transfer's completion

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.results)

    @property
    def mbps(self) -> float:
        return self.nbytes * 8 / self.wall_s / 1e6 if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


@dataclass(frozen=True)
class WeightSyncReport:
    mode: str  # the planner's schedule: "p2p" or "tree"
    model_bytes: int
    senders: int
    receivers: int
    traffic: Report
    completion_s: float
    ideal_s: float  # the planner's prediction at 100 % efficiency: bytes / bottleneck
    explanation: str

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.completion_s if self.completion_s > 0 else 0.0


def choose_tool(tool: str, transfers: int = 1) -> str:
    """``auto``: iperf3 for one transfer when installed; the built-in tool for several,
    because it starts them together and times their last bytes (see the docstring)."""
    if tool not in TOOLS:
        raise errors.field_error("--tool", tool, f"one of {', '.join(TOOLS)}")
    if tool == "auto":
        return "iperf3" if transfers == 1 and shutil.which("iperf3") else "builtin"
    if tool == "iperf3" and shutil.which("iperf3") is None:
        raise errors.FailedPrecondition(
            "iperf3 is not installed (apt-get install iperf3); use --tool builtin"
        )
    return tool


def endpoints(plan: TestbedPlan, name: str) -> tuple[NodePlan, ...]:
    """The nodes of a node or pod name."""
    if any(n.name == name for n in plan.nodes):
        return (plan.node(name),)
    members = plan.pod_nodes(name)
    if not members:
        pods = sorted({n.pod for n in plan.nodes})
        raise errors.NotFound(
            f"{name!r} is neither a node nor a pod of testbed {plan.id!r} (pods: "
            f"{', '.join(pods)}; nodes: {', '.join(n.name for n in plan.nodes)})"
        )
    return members


def transfers_between(plan: TestbedPlan, source: str, target: str, nbytes: int) -> list[Transfer]:
    """Every node of ``source`` to every node of ``target`` (a node never to itself)."""
    if nbytes <= 0:
        raise errors.field_error("--bytes", nbytes, "a number of bytes > 0")
    pairs = [
        Transfer(s.name, t.name, nbytes)
        for s in endpoints(plan, source)
        for t in endpoints(plan, target)
        if s.name != t.name
    ]
    if not pairs:
        raise errors.field_error("--to", target, "must differ from --from")
    return pairs


async def committed_circuits(plan: TestbedPlan) -> list[CircuitView] | None:
    """The controller's committed circuits; None when it cannot be asked."""
    try:
        async with AsyncClient(plan.controller, timeout_s=5.0) as client:
            return (await client.get_phase()).circuits
    except errors.OrlError:
        return None


def capacity_mbps(
    plan: TestbedPlan,
    circuits: Sequence[CircuitView] | None,
    source: NodePlan,
    target: NodePlan,
    streams: int,
) -> float | None:
    """The emulated capacity of a transfer: the NICs, and across pods the circuits its
    streams can use (ECMP puts each stream on one circuit)."""
    nics = min(source.nic_mbps, target.nic_mbps)
    if source.pod == target.pod:
        return nics
    if circuits is None:
        return None
    count = sum(1 for c in circuits if {c.pod_a, c.pod_b} == {source.pod, target.pod})
    return min(nics, min(count, streams) * plan.scale.mbps(plan.uplink_gbps))


async def _start(
    netns: str, argv: Sequence[str], testbed_id: str, *, stdin: bool = False
) -> asyncio.subprocess.Process:
    env = {**os.environ, ENV_MARKER: testbed_id, "PYTHONUNBUFFERED": "1"}
    return await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", netns, *argv,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )  # fmt: skip


async def _wait_line(proc: asyncio.subprocess.Process, marker: str) -> list[str] | None:
    """None once a line contains ``marker``; else the lines seen before the process
    ended or LISTEN_TIMEOUT_S passed."""
    assert proc.stdout is not None
    seen: list[str] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LISTEN_TIMEOUT_S):
            while line := (await proc.stdout.readline()).decode(errors="replace"):
                if marker in line:
                    return None
                seen.append(line.strip())
    return seen


async def _finish(proc: asyncio.subprocess.Process | None) -> None:
    if proc is None:
        return
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()


Outcome = tuple[int, float, str]  # bytes received, seconds, error


class _Run:
    """One transfer. ``listen`` starts its receiver; ``connect`` (built-in tool only)
    starts the sender and opens its streams, so that ARP and handshakes are done before
    any data flows; ``go`` sends and returns the outcome and the time it completed."""

    def __init__(
        self, plan: TestbedPlan, t: Transfer, port: int, tool: str, streams: int, seconds: float
    ) -> None:
        self.plan, self.t, self.port, self.tool = plan, t, port, tool
        self.streams, self.seconds = streams, seconds
        self.src, self.dst = plan.node(t.source), plan.node(t.target)
        self.receiver: asyncio.subprocess.Process | None = None
        self.sender: asyncio.subprocess.Process | None = None
        self.failed: Outcome | None = None

    async def listen(self) -> None:
        if self.tool == "iperf3":
            argv = ["iperf3", "-s", "-1", "-B", self.dst.ip, "-p", str(self.port), "--forceflush"]
            marker = "Server listening"
        else:
            argv = [sys.executable, "-m", "sim_backends.testbed.tcp", "receive"]
            argv += ["--bind", f"{self.dst.ip}:{self.port}", "--streams", str(self.streams)]
            marker = "listening"
        self.receiver = await _start(self.dst.netns, argv, self.plan.id)
        seen = await _wait_line(self.receiver, marker)
        if seen is not None:
            raise errors.Unavailable(
                f"receiver on {self.dst.name}:{self.port} did not start: {' | '.join(seen[-3:])}"
            )

    async def connect(self) -> None:
        if self.tool == "iperf3":
            return
        argv = [sys.executable, "-m", "sim_backends.testbed.tcp", "send", "--wait-go"]
        argv += ["--to", f"{self.dst.ip}:{self.port}", "--streams", str(self.streams)]
        if self.seconds > 0:
            argv += ["--seconds", f"{self.seconds:g}"]
        else:
            argv += ["--bytes", str(self.t.nbytes)]
        self.sender = await _start(self.src.netns, argv, self.plan.id, stdin=True)
        seen = await _wait_line(self.sender, "ready")
        if seen is not None:
            error = _last_json("\n".join(seen)).get("error") or "the sender did not connect"
            self.failed = (0, 0.0, str(error))

    async def go(self, timeout_s: float) -> tuple[int, float, str, float]:
        outcome = self.failed or await self._go(timeout_s)
        return (*outcome, time.monotonic())

    async def _go(self, timeout_s: float) -> Outcome:
        try:
            async with asyncio.timeout(timeout_s):
                if self.tool == "iperf3":
                    return await self._iperf3()
                return await self._builtin()
        except TimeoutError:
            return 0, 0.0, f"no result within {timeout_s:g} s (the path may black-hole packets)"

    async def _iperf3(self) -> Outcome:
        amount = ["-t", f"{self.seconds:g}"] if self.seconds > 0 else ["-n", str(self.t.nbytes)]
        argv = ["iperf3", "-c", self.dst.ip, "-p", str(self.port), "-B", self.src.ip]
        argv += ["-P", str(self.streams), "-J", "--connect-timeout", str(CONNECT_TIMEOUT_MS)]
        self.sender = await _start(self.src.netns, [*argv, *amount], self.plan.id)
        out, _ = await self.sender.communicate()
        return _iperf3_result(out.decode(errors="replace"))

    async def _builtin(self) -> Outcome:
        assert self.sender is not None and self.sender.stdin is not None
        assert self.receiver is not None and self.receiver.stdout is not None
        self.sender.stdin.write(b"go\n")
        await self.sender.stdin.drain()
        out, _ = await self.sender.communicate()
        sent = _last_json(out.decode(errors="replace"))
        if sent.get("error"):
            return 0, 0.0, str(sent["error"])
        got = _last_json((await self.receiver.stdout.read()).decode(errors="replace"))
        nbytes, seconds = got.get("bytes", 0), got.get("seconds", 0.0)
        if not isinstance(nbytes, int) or not isinstance(seconds, int | float):
            return 0, 0.0, f"the receiver reported {got!r}"
        return nbytes, float(seconds), str(got.get("error", ""))

    async def close(self) -> None:
        await _finish(self.sender)
        await _finish(self.receiver)


def _last_json(text: str) -> dict[str, object]:
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    return {"error": f"no result in the output: {text.strip()[-200:]!r}"}


def _iperf3_result(text: str) -> tuple[int, float, str]:
    try:
        data = json.loads(text)
    except ValueError:
        return 0, 0.0, f"iperf3 gave no JSON: {text.strip()[-200:]!r}"
    if data.get("error"):
        return 0, 0.0, str(data["error"])
    received = data.get("end", {}).get("sum_received", {})
    return int(received.get("bytes", 0)), float(received.get("seconds", 0.0)), ""


async def run_transfers(
    plan: TestbedPlan,
    transfers: Sequence[Transfer],
    *,
    tool: str = "auto",
    streams: int = 1,
    seconds: float = 0.0,
    timeout_s: float = 120.0,
    circuits: Sequence[CircuitView] | None = None,
) -> Report:
    """Run ``transfers`` at once; each failed one carries its reason (none raises)."""
    if not 1 <= streams <= 128:
        raise errors.field_error("--parallel", streams, "1..128 streams per transfer")
    chosen = choose_tool(tool, len(transfers))
    runs = [_Run(plan, t, BASE_PORT + i, chosen, streams, seconds) for i, t in enumerate(transfers)]
    try:
        await asyncio.gather(*(r.listen() for r in runs))
        await asyncio.gather(*(r.connect() for r in runs))
        start = time.monotonic()
        outcomes = await asyncio.gather(*(r.go(timeout_s) for r in runs))
        wall = max(done for *_, done in outcomes) - start
    finally:
        await asyncio.gather(*(r.close() for r in runs))
    results = tuple(
        Result(
            r.t.source,
            r.t.target,
            nbytes,
            secs,
            capacity_mbps(plan, circuits, r.src, r.dst, streams),
            error,
            chosen,
            streams,
        )
        for r, (nbytes, secs, error, _) in zip(runs, outcomes, strict=True)
    )
    return Report(results, wall)


def scaled_wiring(plan: TestbedPlan) -> Wiring:
    """The wiring with every NIC at its emulated speed (for the planner's arithmetic)."""
    w = plan.wiring
    nodes = tuple(
        replace(n, nics=tuple(replace(x, gbps=x.gbps / plan.scale.divisor) for x in n.nics))
        for n in w.nodes
    )
    return replace(w, nodes=nodes)


async def weight_sync(
    plan: TestbedPlan,
    model_bytes: int,
    *,
    tool: str = "builtin",
    streams: int = 4,
    timeout_s: float = 300.0,
) -> WeightSyncReport:
    """Every training node sends its shard as the planner schedules it; timed end to end."""
    if model_bytes <= 0:
        raise errors.field_error("--bytes", model_bytes, "a number of bytes > 0")
    views = await committed_circuits(plan)
    if views is None:
        raise errors.Unavailable(
            f"the controller at {plan.controller} does not answer; is the testbed up?"
        )
    circuits = [Circuit(c.ocs, c.a, c.b) for c in views]
    ws = plan_weight_sync(
        scaled_wiring(plan),
        circuits,
        float(model_bytes),
        uplink_gbps=plan.scale.mbps(plan.uplink_gbps) / 1000.0,
        link_efficiency=1.0,
        latency_s=0.0,
    )
    if not ws.transfers:
        raise errors.FailedPrecondition(
            f"{ws.explanation}; set the phase first (`orlctl --controller {plan.controller} "
            "phase set weight-sync`)"
        )
    results: list[Result] = []
    wall = 0.0
    for stage in sorted({t.stage for t in ws.transfers}):
        batch = [
            Transfer(t.source, t.target, max(1, round(t.nbytes)))
            for t in ws.transfers
            if t.stage == stage
        ]
        report = await run_transfers(
            plan, batch, tool=tool, streams=streams, timeout_s=timeout_s, circuits=views
        )
        results += report.results
        wall += report.wall_s
    traffic = Report(tuple(results), wall)
    return WeightSyncReport(
        mode=ws.mode,
        model_bytes=model_bytes,
        senders=ws.senders,
        receivers=len({t.target for t in ws.transfers}),
        traffic=traffic,
        completion_s=wall,
        ideal_s=ws.predicted_s,
        explanation=ws.explanation,
    )

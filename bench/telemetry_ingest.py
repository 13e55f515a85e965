#!/usr/bin/env python3
"""Telemetry ingest of the controller: N simulated agents sampling at R Hz.

Runs the real controller daemon as a subprocess on a synthetic wiring of N nodes,
registers N agents, then P load-generator processes (``--procs``) open one telemetry
stream per agent and send for D seconds what real agents send:

* ``--mode batch`` (the default, what ``orl-node-agent`` does): every agent samples at
  R Hz and uploads its samples every ``--flush-interval`` seconds as one
  ``TelemetryBatch`` on ``ReportTelemetryBatch``; the newest sample of each batch
  carries the engine's per-request progress (``--requests`` requests).
* ``--mode sample``: one ``TelemetrySample`` message per sample on ``ReportTelemetry``
  (the agent's behaviour before batching), the newest of each second with progress.

The streams are opened ``OPEN_EARLY_S`` before the measured window, as long-lived agent
streams are. Each sample looks like an agent's (8 GPUs with every NVML field, 8 NICs, engine
figures, TP layout). Samples are serialized once per agent before the run; each send
only splices the current time into the prebuilt bytes (the generators must be cheaper
than the controller to measure it). The timestamp is the sampling time, so in batch
mode a sample waits up to one flush interval in the agent before it is sent.

Reported: the rate offered by the generators against the target N x R, the rate the
controller accepted (its own ``orl_telemetry_samples_total``), the lag when the
controller processed a message (its ``orl_telemetry_lag_seconds`` histogram, upper
bucket bounds: the age of the message's newest sample, so the batching delay of older
samples is not in it) in the first and second half of the run (a lag growing between
the halves is a backlog), the samples still unprocessed when the generators stopped,
and the controller's CPU (% of one core). The generators run in their own processes
(``--procs``) and wake once per message, so they take little of the machine.

    python bench/telemetry_ingest.py [--agents 2048] [--hz 10] [--seconds 10]
        [--mode batch|sample] [--flush-interval 1.0] [--procs 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import re
import socket
import struct
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from orchestrrl import wiring as wiring_mod
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from orchestrrl.v1 import node_agent_pb2
from sim_backends.synthetic import synthetic_wiring

CLK_TCK = os.sysconf("SC_CLK_TCK")
CHANNELS_PER_PROC = 64  # real agents have a connection each; HTTP/2 multiplexes the rest
OPEN_EARLY_S = 3.0  # streams open this long before the measured window
BATCH_METHOD = "/orchestrrl.v1.FabricController/ReportTelemetryBatch"
SAMPLE_METHOD = "/orchestrrl.v1.FabricController/ReportTelemetry"


# -- prebuilt messages ----------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def sample_body(requests: int, seed: int) -> tuple[bytes, bytes]:
    """Fields 3.. of an agent-like TelemetrySample (serialized), without and with progress."""
    gpus = [
        node_agent_pb2.GpuSample(
            index=i, utilization=0.8, memory_used_bytes=77 << 30, memory_total_bytes=80 << 30,
            power_watts=450.0 + i, temperature_c=60.0, sm_clock_mhz=1860.0,
            pcie_tx_bytes_per_s=1.4e8, pcie_rx_bytes_per_s=3.6e8, nvlink_tx_bytes_per_s=8.6e9,
            nvlink_rx_bytes_per_s=8.6e9, ecc_corrected=0, ecc_uncorrected=0, xid_errors=0,
        )
        for i in range(8)
    ]  # fmt: skip
    nics = [
        node_agent_pb2.NicSample(
            name=f"eth{i}", rx_bytes=seed * 1_000_003 + i, tx_bytes=seed * 999_983 + i,
            rx_gbps=12.5, tx_gbps=3.25, oper_up=True,
        )
        for i in range(8)
    ]  # fmt: skip
    engine = node_agent_pb2.EngineSample(
        queued_requests=3, running_requests=requests, tokens_per_s=9000.0, kv_cache_usage=0.6,
        step=7,
    )  # fmt: skip
    plain = node_agent_pb2.TelemetrySample(
        gpus=gpus, nics=nics, engine=engine, engine_state=node_agent_pb2.ENGINE_STATE_RUNNING,
        tp_layout=[2, 2, 2, 2],
    )  # fmt: skip
    detailed = node_agent_pb2.TelemetrySample()
    detailed.CopyFrom(plain)
    detailed.engine.has_progress = True
    for r in range(requests):
        detailed.engine.requests.add(
            request_id=f"{seed:x}-{r}", instance=r % 4, prompt_tokens=512,
            generated_tokens=(r * 37) % 4000, max_tokens=16384,
        )  # fmt: skip
    detailed.engine.completed_lengths.extend([(r * 131) % 8000 + 1 for r in range(requests)])
    return plain.SerializeToString(), detailed.SerializeToString()


class AgentMessages:
    """An agent's prebuilt sample bytes; :meth:`sample` splices in a timestamp."""

    def __init__(self, node: str, requests: int, seed: int) -> None:
        self.head = node_agent_pb2.TelemetrySample(node=node).SerializeToString() + b"\x11"
        self.plain, self.detailed = sample_body(requests, seed)

    def sample(self, timestamp: float, detailed: bool) -> bytes:
        return (
            self.head + struct.pack("<d", timestamp) + (self.detailed if detailed else self.plain)
        )

    def batch(self, timestamps: list[float]) -> bytes:
        """A TelemetryBatch of samples at ``timestamps``, the newest with progress."""
        parts = []
        last = len(timestamps) - 1
        for k, t in enumerate(timestamps):
            s = self.sample(t, k == last)
            parts.append(b"\x0a" + _varint(len(s)) + s)
        return b"".join(parts)


# -- load generator (one process per --procs) -------------------------------------------------


def generator(
    address: str, nodes: list[str], args: dict[str, Any], start_wall: float, out: Any
) -> None:
    """Stream for every node from ``start_wall`` for ``seconds``; put (sent samples,
    sent messages, failures, first failure, (p50, p99) of how late the generator sent a
    message after its newest sample's time) on ``out``."""
    out.put(asyncio.run(_generate(address, nodes, args, start_wall)))


async def _generate(
    address: str, nodes: list[str], args: dict[str, Any], start_wall: float
) -> tuple[int, int, int, str, tuple[float, float]]:
    hz, seconds, mode = args["hz"], args["seconds"], args["mode"]
    per_flush = max(1, round(args["flush_interval"] * hz)) if mode == "batch" else 1
    agents = [AgentMessages(n, args["requests"], i) for i, n in enumerate(nodes)]
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CHANNELS_PER_PROC)
    ]
    sent = messages = 0
    late: list[float] = []
    try:
        calls = [
            ch.stream_unary(
                BATCH_METHOD if mode == "batch" else SAMPLE_METHOD,
                request_serializer=None,  # the requests are prebuilt bytes
                response_deserializer=pb.ReportTelemetryResponse.FromString,
            )
            for ch in channels
        ]
        end = start_wall + seconds

        async def stream(j: int, agent: AgentMessages) -> Any:
            nonlocal sent, messages
            # sampling phases spread over one period and uploads over one flush interval,
            # as independent agents are; every agent takes hz x seconds samples. The
            # generator wakes once per upload (at its newest sample), not once per sample.
            first = start_wall + (j / len(agents)) / hz
            count = math.ceil((end - first) * hz)
            ticks = [first + k / hz for k in range(count)]
            k = 0
            need = per_flush - (j % per_flush)  # samples in the first upload
            while k < count:
                pending = ticks[k : k + need]
                k += len(pending)
                await asyncio.sleep(max(0.0, pending[-1] - time.time()))
                late.append(time.time() - pending[-1])  # the generator's own delay
                if mode == "batch":
                    yield agent.batch(pending)
                else:
                    yield agent.sample(pending[0], round(pending[0] * hz) % max(1, round(hz)) == 0)
                sent += len(pending)
                messages += 1
                need = per_flush

        # Open every stream before the measured window (agents hold theirs open for days;
        # 2048 RPCs starting in one instant are a reconnect storm, not steady ingest).
        await asyncio.sleep(max(0.0, start_wall - OPEN_EARLY_S - time.time()))
        results = await asyncio.gather(
            *(
                calls[j % len(calls)](stream(j, a), timeout=seconds + 60)
                for j, a in enumerate(agents)
            ),
            return_exceptions=True,
        )
    finally:
        for ch in channels:
            await ch.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    late.sort()
    lateness = (late[len(late) // 2], late[int(len(late) * 0.99)]) if late else (0.0, 0.0)
    return sent, messages, len(failed), repr(failed[0]) if failed else "", lateness


# -- the controller and its metrics --------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(orl_telemetry_\w+?)(\{le="([^"]+)"\})? ([0-9.e+-]+)$', line)
        if m:
            key = m.group(1) + (f"@{m.group(3)}" if m.group(3) else "")
            out[key] = float(m.group(4))
    return out


def lag_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float:
    """Quantile of the lag histogram between two scrapes (upper bucket bound)."""
    buckets = sorted(
        (float(k.split("@")[1]), after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith("orl_telemetry_lag_seconds_bucket@") and k.split("@")[1] != "+Inf"
    )
    total = after.get("orl_telemetry_lag_seconds_count", 0) - before.get(
        "orl_telemetry_lag_seconds_count", 0
    )
    for bound, count in buckets:
        if total and count >= q * total:
            return bound
    return float("inf")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def run(args: argparse.Namespace) -> dict[str, object]:
    w = synthetic_wiring(args.agents)
    with tempfile.TemporaryDirectory() as tmp:
        wiring_path = Path(tmp) / "wiring.toml"
        wiring_path.write_text(wiring_mod.to_toml(w))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            metrics_port = s.getsockname()[1]
        ready = Path(tmp) / "ready"
        log = args.controller_log.open("w") if args.controller_log else asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fabric_controller.main", "--wiring", str(wiring_path),
            "--state", str(Path(tmp) / "s.db"), "--listen", "127.0.0.1:0",
            "--ready-file", str(ready), "--heartbeat-interval", "5",
            "--metrics-listen", f"127.0.0.1:{metrics_port}", "--log-level", "warning",
            "--log-format", "json", "--plaintext", stdout=log, stderr=log,
        )  # fmt: skip
        try:
            while not ready.exists():  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.05)
            address = ready.read_text().strip()
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            names = [n.name for n in w.nodes]
            await register(address, names, w.nodes[0].gpus)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            # the generators start, prebuild their messages and open their streams first
            start_wall = time.time() + 3.0 + args.procs + OPEN_EARLY_S
            shares = [names[k :: args.procs] for k in range(args.procs)]
            settings = {
                "hz": args.hz,
                "seconds": args.seconds,
                "mode": args.mode,
                "flush_interval": args.flush_interval,
                "requests": args.requests,
            }
            workers = [
                ctx.Process(target=generator, args=(address, share, settings, start_wall, out))
                for share in shares
            ]
            for p in workers:
                p.start()
            await asyncio.sleep(max(0.0, start_wall - time.time()))
            before = await asyncio.to_thread(scrape, url)
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            await asyncio.sleep(args.seconds / 2)
            mid = await asyncio.to_thread(scrape, url)
            await asyncio.sleep(max(0.0, start_wall + args.seconds - time.time()))
            at_end = await asyncio.to_thread(scrape, url)
            cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
            results = [await asyncio.to_thread(out.get, True, args.seconds + 120) for _ in workers]
            for p in workers:
                p.join(timeout=30)
            after = await asyncio.to_thread(scrape, url)
        finally:
            proc.terminate()
            await proc.wait()
    sent = sum(r[0] for r in results)
    messages = sum(r[1] for r in results)
    failures = sum(r[2] for r in results)
    first_failure = next((r[3] for r in results if r[3]), "")
    generator_late_p50 = max(r[4][0] for r in results)
    generator_late_p99 = max(r[4][1] for r in results)
    total = "orl_telemetry_samples_total"
    accepted = after[total] - before.get(total, 0.0)
    accepted_in_window = at_end[total] - before.get(total, 0.0)
    target = args.agents * args.hz
    return {
        "agents": args.agents,
        "hz": args.hz,
        "seconds": args.seconds,
        "mode": args.mode,
        "flush_interval_s": args.flush_interval if args.mode == "batch" else 0.0,
        "requests_per_progress_sample": args.requests,
        "generator_processes": args.procs,
        "target_rate": target,
        "offered_rate": sent / args.seconds,
        "messages_per_s": messages / args.seconds,
        "accepted_rate": accepted_in_window / args.seconds,
        "accepted_over_offered": accepted / max(1, sent),
        "unprocessed_at_end": max(0.0, sent - accepted_in_window),
        "streams_failed": failures,
        "generator_late_p50_s": generator_late_p50,
        "generator_late_p99_s": generator_late_p99,
        "first_failure": first_failure,
        "lag_p50_first_half_s": lag_quantile(before, mid, 0.5),
        "lag_p99_first_half_s": lag_quantile(before, mid, 0.99),
        "lag_p50_second_half_s": lag_quantile(mid, at_end, 0.5),
        "lag_p99_second_half_s": lag_quantile(mid, at_end, 0.99),
        "controller_cpu_pct_of_one_core": 100.0 * (cpu1 - cpu0) / (t1 - t0),
        "cpu_count": os.cpu_count(),
        # bounded lag: the second half's p99 within a second (or a flush interval), and
        # its median not above twice the first half's (or 100 ms): no growing backlog
        "meets_target": sent >= 0.98 * target * args.seconds
        and accepted >= 0.99 * sent
        and failures == 0
        and lag_quantile(mid, at_end, 0.99) <= max(1.0, args.flush_interval)
        and lag_quantile(mid, at_end, 0.5) <= max(0.1, 2 * lag_quantile(before, mid, 0.5)),
    }


async def register(address: str, names: list[str], gpus: int) -> None:
    status = node_agent_pb2.NodeStatus(gpu_backend="sim")
    for i in range(gpus):
        status.gpus.add(index=i)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        for i in range(0, len(names), 64):
            await asyncio.gather(
                *(
                    stub.Register(
                        pb.RegisterRequest(
                            node=n, agent_address=f"127.0.0.1:{k + 1}", status=status
                        ),
                        timeout=60,
                    )
                    for k, n in enumerate(names[i : i + 64], start=i)
                )
            )


def print_table(r: dict[str, Any]) -> None:
    how = (
        f"batched: one message per agent every {r['flush_interval_s']:g} s"
        if r["mode"] == "batch"
        else "one message per sample"
    )
    print(
        f"telemetry ingest: {r['agents']} agents x {r['hz']:g} Hz for {r['seconds']:g} s "
        f"(target {r['target_rate']:.0f} samples/s; {how}; "
        f"{r['generator_processes']} generator processes)"
    )
    rows = [
        ("offered by the load generators", f"{r['offered_rate']:.0f} samples/s"),
        ("  in messages", f"{r['messages_per_s']:.0f} messages/s"),
        ("accepted by the controller", f"{r['accepted_rate']:.0f} samples/s"),
        ("accepted / offered (after drain)", f"{r['accepted_over_offered']:.3f}"),
        ("unprocessed when sending stopped", f"{r['unprocessed_at_end']:.0f} samples"),
        ("streams that failed", f"{r['streams_failed']}"),
        (
            "generator sending late p50 / p99",
            f"{r['generator_late_p50_s'] * 1000:.0f} / {r['generator_late_p99_s'] * 1000:.0f} ms",
        ),
        ("lag p50 / p99, first half", _lags(r, "first")),
        ("lag p50 / p99, second half", _lags(r, "second")),
        ("controller CPU", f"{r['controller_cpu_pct_of_one_core']:.0f} % of one core"),
    ]
    for name, value in rows:
        print(f"{name:<36}{value:>24}")
    if r["mode"] == "batch":
        print(
            "(lag: age of the newest sample of each upload when the controller processed it; "
            f"older samples of a batch also waited up to {r['flush_interval_s']:g} s in the agent)"
        )
    print(
        "target: the full rate offered and accepted, no failed streams, lag bounded (p99 "
        "<= 1 s) and not growing: "
        + ("met" if r["meets_target"] else "NOT met")
        + (" (with batched uploads)" if r["mode"] == "batch" and r["meets_target"] else "")
    )


def _lags(r: dict[str, Any], half: str) -> str:
    p50, p99 = r[f"lag_p50_{half}_half_s"], r[f"lag_p99_{half}_half_s"]
    return f"<= {p50 * 1000:.0f} / <= {p99 * 1000:.0f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=2048)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--mode", choices=("batch", "sample"), default="batch")
    p.add_argument("--flush-interval", type=float, default=1.0, help="batch mode (default 1)")
    p.add_argument("--requests", type=int, default=64, help="requests in each progress sample")
    p.add_argument("--procs", type=int, default=1, help="load-generator processes (default 1)")
    p.add_argument("--controller-log", type=Path, help="keep the controller's log here")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.agents < 16 or args.agents % 8:
        p.error(f"--agents={args.agents}: a multiple of 8, at least 16")
    if not 1 <= args.procs <= 64:
        p.error(f"--procs={args.procs}: 1..64")
    if args.hz <= 0 or args.seconds <= 0 or args.flush_interval < 0:
        p.error("--hz and --seconds must be > 0, --flush-interval >= 0")
    r = asyncio.run(run(args))
    print_table(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

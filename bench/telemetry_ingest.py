#!/usr/bin/env python3
"""Telemetry ingest of the controller: N simulated agents streaming at R Hz.

Runs the real controller daemon as a subprocess (its own core) on a synthetic wiring
of N nodes, registers N agents, opens N ReportTelemetry streams from this process and
sends one sample per agent every 1/R s for D seconds. Reports the offered rate (what
this load generator managed to send), the controller's sustained accepted rate, and
the lag of samples (age when processed, from the controller's own histogram) in the
first and second half of the run: a lag that grows between halves is a backlog.
The baseline for the ratio is the offered rate measured in the same run.

    python bench/telemetry_ingest.py [--agents 2048] [--hz 10] [--seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from orchestrrl import wiring as wiring_mod
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from orchestrrl.v1 import node_agent_pb2
from sim_backends.synthetic import synthetic_wiring


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


async def run(agents: int, hz: float, seconds: float) -> dict[str, object]:
    w = synthetic_wiring(agents)
    with tempfile.TemporaryDirectory() as tmp:
        wiring_path = Path(tmp) / "wiring.toml"
        wiring_path.write_text(wiring_mod.to_toml(w))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            metrics_port = s.getsockname()[1]
        ready = Path(tmp) / "ready"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fabric_controller.main", "--wiring", str(wiring_path),
            "--state", str(Path(tmp) / "s.db"), "--listen", "127.0.0.1:0",
            "--ready-file", str(ready), "--heartbeat-interval", "5",
            "--metrics-listen", f"127.0.0.1:{metrics_port}", "--log-level", "warning",
            "--log-format", "json", "--plaintext", stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            while not ready.exists():  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.05)
            address = ready.read_text().strip()
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            # real agents each have their own connection; 32 connections carry the load
            # here (HTTP/2 caps concurrent streams per connection)
            channels = [
                grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(32)
            ]
            try:
                stubs = [pb_grpc.FabricControllerStub(ch) for ch in channels]
                names = [n.name for n in w.nodes]
                status = node_agent_pb2.NodeStatus(gpu_backend="sim")
                for i in range(w.nodes[0].gpus):
                    status.gpus.add(index=i)
                for i in range(0, len(names), 64):
                    await asyncio.gather(
                        *(stubs[j % 32].Register(
                            pb.RegisterRequest(node=n, agent_address="127.0.0.1:1",
                                               status=status), timeout=60)
                          for j, n in enumerate(names[i : i + 64], start=i))
                    )  # fmt: skip
                sent = 0
                start = time.monotonic()
                end = start + seconds
                half = start + seconds / 2

                async def samples(node: str) -> object:
                    nonlocal sent
                    tick = start
                    while (tick := tick + 1.0 / hz) < end:
                        await asyncio.sleep(max(0.0, tick - time.monotonic()))
                        sent += 1
                        yield node_agent_pb2.TelemetrySample(node=node, timestamp=time.time())

                first_half: dict[str, dict[str, float]] = {}

                async def midpoint() -> None:
                    await asyncio.sleep(max(0.0, half - time.monotonic()))
                    first_half["m"] = await asyncio.to_thread(scrape, url)

                before = await asyncio.to_thread(scrape, url)
                streams = [
                    stubs[j % 32].ReportTelemetry(samples(n), timeout=seconds + 60)
                    for j, n in enumerate(names)
                ]
                results = await asyncio.gather(midpoint(), *streams, return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                elapsed = time.monotonic() - start
                after = await asyncio.to_thread(scrape, url)
            finally:
                for ch in channels:
                    await ch.close()
        finally:
            proc.terminate()
            await proc.wait()
    accepted = after["orl_telemetry_samples_total"] - before.get("orl_telemetry_samples_total", 0)
    mid = first_half["m"]
    return {
        "agents": agents,
        "hz": hz,
        "seconds": seconds,
        "target_rate": agents * hz,
        "offered_rate": sent / elapsed,
        "accepted_rate": accepted / elapsed,
        "accepted_over_offered": accepted / max(1, sent),
        "streams_failed": len(failed),
        "first_failure": repr(failed[0]) if failed else "",
        "lag_p50_first_half_s": lag_quantile(before, mid, 0.5),
        "lag_p50_second_half_s": lag_quantile(mid, after, 0.5),
        "lag_p99_second_half_s": lag_quantile(mid, after, 0.99),
        "cpu_count": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=2048)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.agents < 8 or args.agents % 8:
        p.error(f"--agents={args.agents}: a multiple of 8, at least 8")
    r = asyncio.run(run(args.agents, args.hz, args.seconds))
    print(f"telemetry ingest: {r['agents']} agents at {r['hz']} Hz for {r['seconds']} s "
          f"(target {r['target_rate']:.0f} samples/s)")  # fmt: skip
    print(f"{'offered by the load generator':<34}{r['offered_rate']:>12.0f} samples/s")
    print(f"{'accepted by the controller':<34}{r['accepted_rate']:>12.0f} samples/s")
    print(f"{'accepted / offered':<34}{r['accepted_over_offered']:>12.3f}")
    print(f"{'streams that failed':<34}{r['streams_failed']:>12}")
    print(f"{'lag p50, first half':<34}{r['lag_p50_first_half_s'] * 1000:>12.1f} ms")
    print(f"{'lag p50, second half':<34}{r['lag_p50_second_half_s'] * 1000:>12.1f} ms")
    print(f"{'lag p99, second half':<34}{r['lag_p99_second_half_s'] * 1000:>12.1f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

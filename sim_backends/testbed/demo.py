"""`make demo-testbed` / `orl-testbed demo`: real packets through the circuits the
controller sets.

Builds the testbed, walks generation -> training -> weight-sync -> training, and in
every phase sends real TCP traffic from a training node to a generation node (and
across the training pods); around ``orlctl phase set weight-sync`` it runs the
planner's weight-sync schedule. Prints what each phase allowed, the throughput against
the emulated capacity, and removes the testbed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrrl import errors
from orchestrrl.model import Phase, Role
from sim_backends.testbed import lifecycle, traffic
from sim_backends.testbed.plan import TestbedPlan, describe

# The demo runs all 16 transfers of the example's weight sync at once: at 1:8000 that is
# 800 Mb/s through six shaped hops each, which two busy cores still forward faithfully
# (1:4000, the testbed's default, asks twice that).
DEFAULT_SCALE = 8000.0
DEFAULT_MODEL_BYTES = 100_000_000  # 4 s of weight sync on the example at 1:8000
PROBE_BYTES = 20_000_000
Out = Callable[[str], None]


@dataclass(frozen=True)
class Row:
    phase: str
    what: str
    result: traffic.Result | None = None
    weight_sync: traffic.WeightSyncReport | None = None


def _probe_line(r: traffic.Result) -> str:
    if not r.ok:
        return f"no path ({r.error})"
    cap = f" = {r.mbps / r.capacity_mbps:.0%} of {r.capacity_mbps:g} Mb/s" if (
        r.capacity_mbps
    ) else ""  # fmt: skip
    return f"{r.mbps:7.1f} Mb/s{cap}"


def _ws_line(ws: traffic.WeightSyncReport) -> str:
    if not ws.traffic.ok:
        failed = sum(1 for r in ws.traffic.results if not r.ok)
        return f"{failed} of {len(ws.traffic.results)} transfers failed"
    return (
        f"{ws.model_bytes / 1e6:.0f} MB in {ws.completion_s:.2f} s "
        f"({ws.traffic.mbps:.0f} Mb/s aggregate); ideal {ws.ideal_s:.2f} s = "
        f"{ws.efficiency:.0%} of ideal"
    )


async def _orlctl(plan: TestbedPlan, phase: Phase, out: Out) -> None:
    argv = [sys.executable, "-m", "fabric_controller.cli", "--controller", plan.controller]
    argv += ["phase", "set", phase.value]
    out(f"$ orlctl --controller {plan.controller} phase set {phase.value}")
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    text, _ = await proc.communicate()
    for line in text.decode(errors="replace").rstrip().splitlines():
        out(f"  {line}")
    if proc.returncode:
        raise errors.FailedPrecondition(f"orlctl phase set {phase.value} exited {proc.returncode}")


async def _probe(plan: TestbedPlan, source: str, target: str) -> traffic.Result:
    circuits = await traffic.committed_circuits(plan)
    report = await traffic.run_transfers(
        plan,
        [traffic.Transfer(source, target, PROBE_BYTES)],
        circuits=circuits,
        timeout_s=30.0,
    )
    return report.results[0]


async def run(
    wiring: Path,
    *,
    testbed_id: str,
    run_dir: Path | None,
    scale: float,
    uplink_gbps: float,
    model_bytes: int,
    keep: bool,
    out: Out,
) -> int:
    t = time.monotonic()
    state = await lifecycle.up(
        wiring,
        testbed_id=testbed_id,
        run_dir=run_dir,
        scale=scale,
        uplink_gbps=uplink_gbps,
        progress=lambda m: out(f"  {m}"),
    )
    up_s = time.monotonic() - t
    plan = state.plan
    out(describe(plan))
    out(f"up in {up_s:.1f} s")
    rows: list[Row] = []
    try:
        train = [n for n in plan.nodes if n.role == Role.TRAIN.value]
        gen = [n for n in plan.nodes if n.role == Role.GEN.value]
        if not train or not gen:
            raise errors.FailedPrecondition("the demo needs training and generation nodes")
        src, dst = train[0], gen[0]
        other_train = next((n for n in train if n.pod != src.pod), None)
        for phase in (Phase.GENERATION, Phase.TRAINING, Phase.WEIGHT_SYNC, Phase.TRAINING):
            out("")
            await _orlctl(plan, phase, out)
            r = await _probe(plan, src.name, dst.name)
            rows.append(Row(phase.value, f"{src.name} -> {dst.name} (1 stream)", r))
            out(f"  train->gen {src.name} -> {dst.name}: {_probe_line(r)}")
            if other_train is not None and phase is Phase.TRAINING:
                r = await _probe(plan, src.name, other_train.name)
                rows.append(Row(phase.value, f"{src.name} -> {other_train.name} (1 stream)", r))
                out(f"  train->train {src.name} -> {other_train.name}: {_probe_line(r)}")
            try:
                ws = await traffic.weight_sync(plan, model_bytes, timeout_s=120.0)
                rows.append(Row(phase.value, "weight-sync schedule", weight_sync=ws))
                out(f"  weight sync: {_ws_line(ws)}")
            except errors.FailedPrecondition as exc:
                rows.append(Row(phase.value, "weight-sync schedule"))
                out(f"  {str(exc).split(';')[0]}")
        out("")
        out("train -> gen weight-sync throughput, before and after `phase set weight-sync`:")
        for row in rows:
            if row.result is not None:
                detail = _probe_line(row.result)
            elif row.weight_sync is not None:
                detail = _ws_line(row.weight_sync)
            else:
                detail = "impossible: no train<->gen circuits"
            out(f"  {row.phase:<12} {row.what:<36} {detail}")
        circuit = plan.scale.mbps(plan.uplink_gbps)
        out(f"  (one circuit: {plan.uplink_gbps:g} Gb/s scaled 1:{plan.scale.divisor:g} = "
            f"{circuit:g} Mb/s; a single TCP stream rides one circuit)")  # fmt: skip
    finally:
        if keep:
            out(f"testbed left up: `orl-testbed down --id {plan.id}` removes it")
        else:
            t = time.monotonic()
            await lifecycle.down(plan.id, Path(plan.run_dir))
            out(f"testbed removed in {time.monotonic() - t:.1f} s")
    synced = [r for r in rows if r.phase == Phase.WEIGHT_SYNC.value]
    if not all(
        (r.result is not None and r.result.ok)
        or (r.weight_sync is not None and r.weight_sync.traffic.ok)
        for r in synced
    ):
        out("FAILED: train -> gen traffic did not get through after `phase set weight-sync`")
        return 1
    return 0

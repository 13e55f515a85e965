"""`make demo` / `orlctl demo`: a local cluster walking the phases of a few RL steps.

Starts the simulated OCS, the controller and one agent per node (real processes,
real gRPC), drives generation -> training -> weight-sync per step through the
Python client as an RL loop would, checks after every change that the OCS's
cross-connects are exactly the epoch's circuits, prints an account, and stops
everything.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from fabric_controller import local
from fabric_controller.drivers.ocs import GrpcOcsDriver
from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient, PhaseChange
from orchestrrl.model import Circuit, Phase, Role

# Seconds each phase lasts in the demo (the work itself is simulated by the agents).
PHASE_DWELL_S = {Phase.GENERATION: 0.6, Phase.TRAINING: 0.3, Phase.WEIGHT_SYNC: 0.2}


def _line(step: int, r: PhaseChange) -> str:
    stages = " | ".join(f"{k} {v * 1000:6.1f} ms" for k, v in r.stages.items())
    pairs = sorted({tuple(sorted((c.pod_a, c.pod_b))) for c in r.circuits})
    links = ", ".join(f"{a}<->{b}" for a, b in pairs) or "pods isolated"
    return (
        f"step {step}  {r.phase:<11} epoch {r.epoch:>3}  +{len(r.added):>2} -{len(r.removed):>2} "
        f"circuits ({len(r.circuits):>2} up: {links})\n"
        f"         {stages}"
    )


async def _walk(wiring_path: Path, cluster: local.LocalCluster, steps: int) -> list[PhaseChange]:
    w = wiring_mod.load(wiring_path)
    ocs_addr = {p.name: p.address for p in cluster.procs if p.role == "ocs"}
    drivers = [GrpcOcsDriver(o.name, ocs_addr[o.name]) for o in w.ocses]
    changes = []
    async with AsyncClient(cluster.controller, timeout_s=30.0) as client:
        try:
            for step in range(1, steps + 1):
                for phase in (Phase.GENERATION, Phase.TRAINING, Phase.WEIGHT_SYNC):
                    r = await client.set_phase(phase, request_id=f"demo-step{step}-{phase.value}")
                    changes.append(r)
                    print(_line(step, r), flush=True)
                    table = {
                        Circuit(d.name, a, b) for d in drivers for a, b in await d.cross_connects()
                    }
                    epoch = {Circuit(c.ocs, c.a, c.b) for c in r.circuits}
                    if table != epoch:
                        raise errors.FailedPrecondition(
                            f"OCS cross-connects differ from epoch {r.epoch}: "
                            f"missing {sorted(map(str, epoch - table))}, "
                            f"extra {sorted(map(str, table - epoch))}"
                        )
                    await asyncio.sleep(PHASE_DWELL_S[phase])
                    if phase is Phase.GENERATION:
                        nodes = await client.nodes()
                        gen = {n.name for n in w.nodes if n.role is Role.GEN}
                        tps = sum(
                            n.telemetry.get("tokens_per_s", 0.0) for n in nodes if n.node in gen
                        )
                        print(f"         generation pool: {tps:,.0f} tokens/s (simulated engines)")
            nodes = await client.nodes()
            down = [n.node for n in nodes if n.health != "up"]
            if down:
                raise errors.FailedPrecondition(f"nodes not up at the end: {', '.join(down)}")
            print(f"all {len(nodes)} nodes up; OCS cross-connects matched every epoch")
        finally:
            for d in drivers:
                await d.close()
    return changes


def run_demo(wiring_path: Path, steps: int, run_dir: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="orl-demo-") as tmp:
        rd = run_dir or Path(tmp)
        print(f"starting a local cluster from {wiring_path} (run dir {rd})", flush=True)
        cluster = local.up(
            wiring_path, rd, ephemeral_ports=True, progress=lambda m: print("  " + m, flush=True)
        )
        try:
            changes = asyncio.run(_walk(wiring_path, cluster, steps))
        finally:
            for line in local.down(rd):
                print("  " + line)
    moved = sum(len(c.added) + len(c.removed) for c in changes)
    ocs_ms = [c.stages.get("program_ocs", 0.0) * 1000 for c in changes if c.changed]
    print(
        f"demo done: {len(changes)} phase changes, {sum(c.changed for c in changes)} epochs "
        f"committed, {moved} circuit changes; OCS programming "
        f"{min(ocs_ms, default=0):.1f}-{max(ocs_ms, default=0):.1f} ms per change"
    )
    return 0

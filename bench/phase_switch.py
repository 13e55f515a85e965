#!/usr/bin/env python3
"""Phase-switch latency of the controller against the OCS alone.

Starts an in-process fabric (simulated OCS servers + controller over real gRPC on
loopback) from a wiring file, walks the RL phases N times through the client, and
for every change also replays the *same* OCS batch directly against a second,
identical simulated switch: the baseline. The ratio controller/baseline is the
controller's overhead (observe, plan, journal, verify, commit) over the optics
themselves, measured in the same run so the machine's noise cancels out.

The controller memoizes phase plans on their inputs, so from the second round on a
change reuses the plan of the same transition; ``--plan-cache 0`` plans every change
from scratch (the first change of a phase, or a fabric whose inputs keep changing).

``--netconf`` adds a NETCONF row (root, `make deps`): every OCS is a real NETCONF server
(netconfd with the project's YANG module behind a private sshd on loopback) driven by
the NETCONF driver (lock, read, edit, confirmed commit, read-back, confirm, unlock), and
the baseline sends the same batches straight to a second, identical netconfd with
ncclient as a script would (``<edit-config>`` of the candidate, ``<commit>``).

    python bench/phase_switch.py [--rounds 20] [--switching-ms 10] [--plan-cache 0]
                                 [--nodes 64,512,2048] [--netconf] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsDriver
from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.logs import setup_logging
from orchestrrl.model import SYNC_PHASES, Wiring
from sim_backends.harness import start_fabric
from sim_backends.ocs_server import serve as serve_ocs
from sim_backends.synthetic import synthetic_wiring

NS = "urn:orchestrrl:yang:optical-switch"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(w: Wiring, rounds: int, switching_s: float, plan_cache: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        fabric = await start_fabric(
            w, Path(tmp) / "state.db", switching_time_s=switching_s, plan_cache_size=plan_cache
        )
        gc.freeze()  # as orl-fabric-controller does once started
        baseline_servers = []
        baseline = {}
        for o in w.ocses:
            server, _ = await serve_ocs(
                "127.0.0.1:0", name=o.name, port_count=o.ports, switching_time_s=switching_s
            )
            baseline_servers.append(server)
            baseline[o.name] = GrpcOcsDriver(o.name, server.address)
        controller_s: list[float] = []
        inside_s: list[float] = []  # the controller's own stages, without the RPC to it
        direct_s: list[float] = []
        stage_s: dict[str, list[float]] = {}
        moved = 0
        try:
            async with AsyncClient(fabric.address, timeout_s=60) as client:
                for i in range(rounds):
                    for phase in SYNC_PHASES:
                        t0 = time.perf_counter()
                        r = await client.set_phase(phase, request_id=f"bench-{i}-{phase.value}")
                        elapsed = time.perf_counter() - t0
                        if not (r.added or r.removed):
                            continue  # nothing for the optics to do: no baseline to compare
                        controller_s.append(elapsed)
                        inside_s.append(sum(r.stages.values()))
                        for k, v in r.stages.items():
                            stage_s.setdefault(k, []).append(v)
                        moved += len(r.added) + len(r.removed)
                        # the same batches, straight to an identical switch
                        t0 = time.perf_counter()
                        for name in {c.ocs for c in r.added + r.removed}:
                            await baseline[name].apply(
                                [(c.a, c.b) for c in r.removed if c.ocs == name],
                                [(c.a, c.b) for c in r.added if c.ocs == name],
                            )
                        direct_s.append(time.perf_counter() - t0)
        finally:
            for d in baseline.values():
                await d.close()
            for s in baseline_servers:
                await s.stop(0.1)
            await fabric.stop()
    return _figures(
        w, rounds, switching_s, plan_cache, controller_s, inside_s, direct_s, stage_s, moved
    )


def _figures(
    w: Wiring,
    rounds: int,
    switching_s: float,
    plan_cache: int,
    controller_s: list[float],
    inside_s: list[float],
    direct_s: list[float],
    stage_s: dict[str, list[float]],
    moved: int,
    ocs: str = "sim",
) -> dict[str, object]:
    ratio = statistics.median(controller_s) / statistics.median(direct_s)
    return {
        "ocs": ocs,
        "wiring": w.source,
        "nodes": len(w.nodes),
        "rounds": rounds,
        "phase_changes": len(controller_s),
        "circuit_changes": moved,
        "switching_time_ms": switching_s * 1000,
        "plan_cache": plan_cache,
        "controller_set_phase_ms": {
            "p50": statistics.median(controller_s) * 1000,
            "p95": pct(controller_s, 0.95) * 1000,
            "max": max(controller_s) * 1000,
        },
        "direct_ocs_apply_ms": {
            "p50": statistics.median(direct_s) * 1000,
            "p95": pct(direct_s, 0.95) * 1000,
            "max": max(direct_s) * 1000,
        },
        "controller_side_ms": {
            "p50": statistics.median(inside_s) * 1000,
            "p95": pct(inside_s, 0.95) * 1000,
        },
        "stages_p50_ms": {k: statistics.median(v) * 1000 for k, v in stage_s.items()},
        "overhead_ratio_p50": ratio,
    }


def _direct_batch(m: Any, removed: list[tuple[int, int]], added: list[tuple[int, int]]) -> None:
    """The batch as a script sends it with ncclient: one <edit-config> of the candidate
    (both pairs of every circuit) and a <commit>."""
    pairs = [
        f'<pair nc:operation="delete"><ingress>{x}</ingress></pair>'
        for a, b in removed
        for x in (a, b)
        if x not in {y for c in added for y in c}
    ]
    pairs += [f'<pair nc:operation="replace"><ingress>{x}</ingress><egress>{y}</egress></pair>'
              for a, b in added for x, y in ((a, b), (b, a))]  # fmt: skip
    m.edit_config(
        target="candidate",
        config=f'<config xmlns:nc="urn:ietf:params:xml:ns:netconf:base:1.0"><cross-connects '
        f'xmlns="{NS}">{"".join(pairs)}</cross-connects></config>',
    )
    m.commit()


async def run_netconf(w: Wiring, rounds: int, plan_cache: int) -> dict[str, object]:
    """The NETCONF row: the controller on netconfd against ncclient straight to netconfd."""
    from ncclient import manager

    from fabric_controller.drivers.netconf import NetconfOcsDriver
    from sim_backends.harness import serve_controller
    from sim_backends.netconf_server import NetconfServer

    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        for role in ("controller", "baseline"):
            for o in w.ocses:
                servers[role, o.name] = NetconfServer(Path(tmp) / role / o.name, o.name, o.ports)
        for server in servers.values():
            server.start()
        proc = None
        direct: dict[str, Any] = {}
        try:
            drivers: dict[str, OcsDriver] = {
                o.name: NetconfOcsDriver(
                    o.name,
                    servers["controller", o.name].address,
                    servers["controller", o.name].settings(),
                    switching_time_s=o.switching_time_s,
                )
                for o in w.ocses
            }
            proc = await serve_controller(
                w, drivers, Path(tmp) / "state.db", plan_cache_size=plan_cache
            )
            for o in w.ocses:
                b = servers["baseline", o.name]
                direct[o.name] = await asyncio.to_thread(
                    manager.connect, host="127.0.0.1", port=b.port, username=b.username,
                    key_filename=str(b.key_file), hostkey_verify=False, allow_agent=False,
                    look_for_keys=False, timeout=30,
                )  # fmt: skip
            gc.freeze()
            controller_s: list[float] = []
            inside_s: list[float] = []
            direct_s: list[float] = []
            stage_s: dict[str, list[float]] = {}
            moved = 0
            async with AsyncClient(proc.server.address, timeout_s=60) as client:
                for i in range(rounds):
                    for phase in SYNC_PHASES:
                        t0 = time.perf_counter()
                        r = await client.set_phase(phase, request_id=f"bench-{i}-{phase.value}")
                        elapsed = time.perf_counter() - t0
                        if not (r.added or r.removed):
                            continue
                        controller_s.append(elapsed)
                        inside_s.append(sum(r.stages.values()))
                        for k, v in r.stages.items():
                            stage_s.setdefault(k, []).append(v)
                        moved += len(r.added) + len(r.removed)
                        t0 = time.perf_counter()
                        await asyncio.gather(*(
                            asyncio.to_thread(
                                _direct_batch, direct[name],
                                [(c.a, c.b) for c in r.removed if c.ocs == name],
                                [(c.a, c.b) for c in r.added if c.ocs == name],
                            )
                            for name in {c.ocs for c in r.added + r.removed}
                        ))  # fmt: skip
                        direct_s.append(time.perf_counter() - t0)
        finally:
            for m in direct.values():
                m.close_session()
            if proc is not None:
                await proc.stop()
            for server in servers.values():
                server.stop()
    return _figures(
        w, rounds, 0.0, plan_cache, controller_s, inside_s, direct_s, stage_s, moved, "netconf"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--wiring", type=Path, default=wiring_mod.default_wiring_path())
    p.add_argument(
        "--nodes",
        help="instead of --wiring, synthetic wirings of these sizes, e.g. 64,512,2048 "
        "(8 nodes and 16 OCS uplinks per pod)",
    )
    p.add_argument("--rounds", type=int, default=20, help="phase cycles (3 changes each)")
    p.add_argument("--switching-ms", type=float, default=10.0, help="simulated OCS switching time")
    p.add_argument(
        "--plan-cache",
        type=int,
        default=16,
        help="plans the controller memoizes (default %(default)s, as the daemon; 0: plan "
        "every change from scratch)",
    )
    p.add_argument(
        "--netconf",
        action="store_true",
        help="add a NETCONF row: the OCS is netconfd behind sshd (root), the baseline the "
        "same batches sent straight to a second netconfd with ncclient",
    )
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be at least 1")
    if args.plan_cache < 0:
        p.error(f"--plan-cache={args.plan_cache}: must be >= 0")
    try:
        wirings = (
            [synthetic_wiring(int(n)) for n in args.nodes.split(",")]
            if args.nodes
            else [wiring_mod.load(args.wiring)]
        )
    except (ValueError, errors.OrlError) as exc:
        p.error(f"--nodes={args.nodes!r}: {exc}")
    setup_logging("warning")
    results = []
    print(
        f"phase-switch latency, OCS switching {args.switching_ms} ms, {args.rounds} rounds, "
        f"plan cache {args.plan_cache}; "
        "inside = the controller's stages (observe, plan, journal, program, verify, commit), "
        "end-to-end = SetPhase seen by a client; ratio = end-to-end / the same batches "
        "sent straight to an identical simulated OCS"
        + (
            " (netconf: to a second netconfd with ncclient, <edit-config> + <commit>; "
            "netconfd moves no optics: no switching time)"
            if args.netconf
            else ""
        )
    )
    print(
        f"{'OCS':>8} {'nodes':>6} {'changes':>8} {'inside p50':>11} {'end-to-end p50':>15} "
        f"{'p95':>8} {'OCS direct p50':>15} {'ratio':>6}  stages p50 (ms)"
    )
    netconf_skip = ""
    if args.netconf:
        from sim_backends.netconf_server import unavailable

        netconf_skip = unavailable()
    runs = [(w, "sim") for w in wirings]
    if args.netconf and not netconf_skip:
        runs += [(w, "netconf") for w in wirings]
    for w, kind in runs:
        if kind == "netconf":
            res = asyncio.run(run_netconf(w, args.rounds, args.plan_cache))
        else:
            res = asyncio.run(run(w, args.rounds, args.switching_ms / 1000, args.plan_cache))
        results.append(res)
        c, d, st = res["controller_set_phase_ms"], res["direct_ocs_apply_ms"], res["stages_p50_ms"]
        inside = res["controller_side_ms"]
        assert isinstance(c, dict) and isinstance(d, dict) and isinstance(st, dict)
        assert isinstance(inside, dict)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in st.items())
        print(
            f"{res['ocs']!s:>8} {res['nodes']:>6} {res['phase_changes']:>8} "
            f"{inside['p50']:>8.2f} ms "
            f"{c['p50']:>12.2f} ms {c['p95']:>8.2f} "
            f"{d['p50']:>12.2f} ms {res['overhead_ratio_p50']:>6.2f}  {stages}",
            flush=True,
        )
    if netconf_skip:
        print(f"NETCONF row skipped: {netconf_skip}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

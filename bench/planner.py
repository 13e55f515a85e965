#!/usr/bin/env python3
"""Planning time of the compute and network planners at cluster scale.

Compute: 128 nodes x 8 H800 GPUs as 1024 TP1 rollout instances (Qwen2.5-14B), with
``--requests`` requests of the step, in these situations, each timed as the controller
makes the decision: the length forecast from the step so far, then the plan:
  step-start         every request queued: dispatch all, choose the layouts; the first
                     plan of a step, so the summary of past steps' lengths that the
                     forecast keeps for the step is computed anew;
  re-plan            mid-step, every request running where a previous plan put it, after
                     some decoding: the proactive re-plan at a regular point of the step,
                     at the layout of the previous re-plan;
  replan-new-layout  the same as the first re-plan at a layout (after a reshard): the
                     candidate layouts and their switching costs, kept per layout, are
                     computed anew;
  balance            the same state, reactive balancing only (layouts fixed).
The forecast's share (of a re-plan) is shown on its own line.
Network: a 2048-GPU fabric (16 pods x 16 nodes x 8 GPUs, 4 ToRs a pod with 32 uplinks
each, 4 OCSes of 576 ports) walking the RL phases with weight sync (145 GB, Qwen2.5-72B)
and training all-reduce workloads: demand, circuits, routes and the weight-sync schedule.

Optionally (``--gap N``) the worst heuristic-vs-MILP gap over N random small cases.

    python bench/planner.py [--requests 4096] [--rounds 9] [--gap 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Circuit, Phase, Role, Wiring
from scheduler import layout
from scheduler.compute import (
    balance,
    plan_compute,
    plan_objective,
    solve,
)
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    NodeGpus,
    Request,
    apply_plan,
    canonical_instances,
)
from scheduler.forecast import LengthForecast, build_forecast, forget_past_steps
from scheduler.network import Workload, plan_network
from scheduler.perf_model import H800, QWEN25_14B, PerfModel

Times = tuple[list[float], list[float]]  # wall, CPU of this process
T = TypeVar("T")


def timed(fn: Callable[[], T], rounds: int) -> tuple[Times, T]:
    """Wall and process CPU time per call. On a shared machine the CPU time is the
    steadier figure: it leaves out the time other processes hold the cores."""
    wall: list[float] = []
    cpu: list[float] = []
    out = fn()  # warm-up (first-call caches), not timed
    for _ in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return (wall, cpu), out


def summary(times: Times) -> dict[str, float]:
    wall, cpu = sorted(times[0]), sorted(times[1])
    return {
        "p50_ms": statistics.median(wall) * 1e3,
        "p90_ms": wall[min(len(wall) - 1, round(0.9 * (len(wall) - 1)))] * 1e3,
        "min_ms": wall[0] * 1e3,
        "cpu_p50_ms": statistics.median(cpu) * 1e3,
    }


# -- compute --------------------------------------------------------------------------


def compute_bench(n_requests: int, rounds: int) -> dict[str, Any]:
    rng = random.Random(1)
    pm = PerfModel(QWEN25_14B, H800)
    nodes = tuple(NodeGpus(f"node{i:03d}", tuple(range(8))) for i in range(128))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, (1,) * 8))
    history = [
        [min(16384, int(rng.lognormvariate(7.6, 0.9))) for _ in range(4096)] for _ in range(3)
    ]
    prompts = [rng.randint(200, 1500) for _ in range(n_requests)]
    results: dict[str, Any] = {"instances": len(insts), "nodes": len(nodes), "requests": n_requests}

    start = ComputeState(
        nodes, tuple(insts), tuple(Request(f"r{i:05d}", prompts[i]) for i in range(n_requests))
    )
    # every decision is timed whole, as the controller's loop makes it: the length forecast
    # from the step's telemetry, then the plan
    queued = [0] * n_requests

    def step_start() -> ComputePlan:
        forget_past_steps()  # a new step: its history summary is not known yet
        return plan_compute(start, build_forecast(history, [], queued, max_tokens=16384), pm, 0.0)

    times, plan = timed(step_start, rounds)
    results["step_start"] = {**summary(times), "decision": plan.reason}

    # mid-step: requests ran where a placement put them, then decoded for a while
    gen = [min(15000, int(rng.lognormvariate(6.8, 0.9))) for _ in range(n_requests)]
    running = tuple(
        Request(f"r{i:05d}", prompts[i], gen[i], insts[i % len(insts)].id, True)
        for i in range(n_requests)
    )
    raw = ComputeState(nodes, tuple(insts), running)
    completed = [x for x in history[-1] if x < 1500][:600]
    fc = build_forecast(history, completed, gen, max_tokens=16384)
    placed = apply_plan(raw, balance(raw, fc, pm, 0.0))
    drift = tuple(
        Request(r.id, r.prompt_tokens, r.generated_tokens + rng.randint(50, 250), r.instance, True)
        for r in placed.requests
    )
    state = ComputeState(nodes, placed.instances, drift)
    lengths = [r.generated_tokens for r in drift]

    def forecast() -> LengthForecast:
        return build_forecast(history, completed, lengths, max_tokens=16384)

    times, _ = timed(forecast, rounds)
    results["forecast"] = summary(times)
    times, plan = timed(lambda: plan_compute(state, forecast(), pm, 10.0), rounds)
    results["replan"] = {**summary(times), "decision": plan.reason}

    def new_layout() -> ComputePlan:
        layout.forget_candidates()  # the first plan at this layout
        return plan_compute(state, forecast(), pm, 10.0)

    times, plan = timed(new_layout, rounds)
    results["replan_new_layout"] = {**summary(times), "decision": plan.reason}
    times, plan = timed(lambda: balance(state, forecast(), pm, 10.0), rounds)
    results["balance"] = {**summary(times), "decision": plan.reason}
    return results


# -- network --------------------------------------------------------------------------


def fabric_2048() -> Wiring:
    pods, nodes_per_pod, tors, uplinks, ocses, ports = 16, 16, 4, 32, 4, 576
    doc: dict[str, Any] = {
        "cluster": {"name": "bench-2048"},
        "ocs": [],
        "pod": [],
        "tor": [],
        "node": [],
    }
    for o in range(ocses):
        doc["ocs"].append({"name": f"ocs{o}", "address": f"127.0.0.1:{6000 + o}", "ports": ports})
    next_port = [1] * ocses
    agent = 10000
    for p in range(pods):
        pod = f"pod{p:02d}"
        doc["pod"].append({"name": pod})
        for t in range(tors):
            ups = []
            for u in range(uplinks):
                o = u % ocses
                ups.append({"port": f"up{u}", "ocs": f"ocs{o}", "ocs_port": next_port[o]})
                next_port[o] += 1
            doc["tor"].append({"name": f"{pod}-tor{t}", "pod": pod, "uplinks": ups})
        for n in range(nodes_per_pod):
            tor = f"{pod}-tor{n % tors}"
            nics = [
                {"name": f"nic{k}", "tor": tor, "tor_port": f"n{n}-{k}", "gbps": 400}
                for k in range(8)
            ]
            doc["node"].append(
                {
                    "name": f"{pod}-n{n:02d}",
                    "pod": pod,
                    "role": "train" if p < pods // 2 else "gen",
                    "agent": f"127.0.0.1:{agent}",
                    "gpus": 8,
                    "nics": nics,
                }
            )
            agent += 1
    return wiring_mod.validate(doc, "bench-2048")


def network_bench(rounds: int) -> dict[str, Any]:
    w = fabric_2048()
    train = w.pods_with_role(Role.TRAIN)
    gen = w.pods_with_role(Role.GEN)
    model_bytes = 145e9  # Qwen2.5-72B in BF16
    phases = {
        Phase.TRAINING: [Workload.training(train, model_bytes)],
        Phase.WEIGHT_SYNC: [Workload.weight_sync(train, gen, model_bytes)],
        Phase.GENERATION: [Workload.generation(g) for g in gen],
    }
    walk = [Phase.TRAINING, Phase.WEIGHT_SYNC, Phase.GENERATION, Phase.TRAINING]
    wall: list[float] = []
    cpu: list[float] = []
    observed: frozenset[Circuit] = frozenset()
    for _ in range(rounds):
        for phase in walk:
            c0, t0 = time.process_time(), time.perf_counter()
            last = plan_network(w, phases[phase], observed, (), 0.0, idle_window_s=1.0)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            observed = last.circuits.desired
    ws_t, ws_plan = timed(
        lambda: plan_network(w, phases[Phase.WEIGHT_SYNC], frozenset(), (), 0.0), rounds
    )
    gpus = sum(n.gpus for n in w.nodes)
    return {
        "gpus": gpus,
        "pods": len(w.pods),
        "ocs_ports": sum(o.ports for o in w.ocses),
        "uplinks": sum(len(t.uplinks) for t in w.tors),
        "phase_plan": summary((wall, cpu)),
        "weight_sync_from_scratch": {
            **summary(ws_t),
            "explanation": ws_plan.weight_sync.explanation if ws_plan.weight_sync else "",
        },
    }


# -- heuristic vs MILP -----------------------------------------------------------------


def gap_sweep(cases: int) -> dict[str, Any]:
    from scheduler.cases import small_problem
    from scheduler.milp import solve_exact

    rng = random.Random(2026)
    pm = PerfModel(QWEN25_14B, H800)
    gaps = []
    for _ in range(cases):
        prob = small_problem(rng, pm, max_requests=10)
        heuristic = plan_objective(prob, solve(prob, 0.0))
        exact = solve_exact(prob).objective_s
        gaps.append(heuristic / exact - 1.0)
    return {"cases": cases, "worst_gap": max(gaps), "mean_gap": statistics.fmean(gaps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--gap", type=int, default=30, help="MILP gap cases (0: skip)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    out: dict[str, Any] = {"compute": [], "target_p50_ms": 50.0}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load:.2f} (other work inflates wall times)"
    )
    out["load_average"] = load
    for n in args.requests:
        print(f"compute planner: 1024 instances on 128 nodes, {n} requests ...", flush=True)
        res = compute_bench(n, args.rounds)
        out["compute"].append(res)
        for key in ("step_start", "replan", "replan_new_layout", "balance"):
            s = res[key]
            s["meets_target"] = s["p50_ms"] < out["target_p50_ms"]
            verdict = "ok" if s["meets_target"] else f"over the {out['target_p50_ms']:g} ms target"
            print(
                f"  {key:<17} p50 {s['p50_ms']:6.1f} ms  p90 {s['p90_ms']:6.1f} ms  "
                f"min {s['min_ms']:6.1f} ms  cpu p50 {s['cpu_p50_ms']:6.1f} ms  {verdict}"
            )
            print(f"  {'':<17} {s['decision'][:104]}")
        s = res["forecast"]
        print(
            f"  {'of which forecast':<17} p50 {s['p50_ms']:6.1f} ms  p90 {s['p90_ms']:6.1f} ms  "
            f"min {s['min_ms']:6.1f} ms  cpu p50 {s['cpu_p50_ms']:6.1f} ms"
        )
    print("network planner: 2048-GPU fabric ...", flush=True)
    net = network_bench(args.rounds)
    out["network"] = net
    s = net["phase_plan"]
    print(
        f"  {net['gpus']} GPUs, {net['pods']} pods, {net['uplinks']} uplinks, "
        f"{net['ocs_ports']} OCS ports"
    )
    print(
        f"  phase plan  p50 {s['p50_ms']:6.1f} ms  p90 {s['p90_ms']:6.1f} ms  "
        f"min {s['min_ms']:6.1f} ms  cpu p50 {s['cpu_p50_ms']:6.1f} ms"
    )
    s = net["weight_sync_from_scratch"]
    print(
        f"  weight sync p50 {s['p50_ms']:6.1f} ms  cpu p50 {s['cpu_p50_ms']:6.1f} ms"
        f"  | {s['explanation']}"
    )
    if args.gap:
        print(f"heuristic vs MILP on {args.gap} random small cases ...", flush=True)
        g = gap_sweep(args.gap)
        out["gap"] = g
        print(f"  worst gap {g['worst_gap']:.2%}, mean {g['mean_gap']:.2%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

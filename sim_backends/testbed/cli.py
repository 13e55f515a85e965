"""orl-testbed: the network-namespace testbed with a real data plane (needs root).

    orl-testbed up --wiring FILE [--id NAME] [--scale N]   build it, start every daemon
    orl-testbed status [--id NAME]                         what exists
    orl-testbed traffic --from NODE|POD --to NODE|POD      real TCP transfers
    orl-testbed traffic --weight-sync [--bytes N]          the planner's weight-sync schedule
    orl-testbed demo                                       up, walk the phases, measure, down
    orl-testbed down [--id NAME]                           remove everything, also after a crash

Exit codes: 0 ok, 1 failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrrl import add_version_flag, errors
from orchestrrl import wiring as wiring_mod
from scheduler.network import DEFAULT_UPLINK_GBPS
from sim_backends.testbed import demo as demo_mod
from sim_backends.testbed import lifecycle, traffic
from sim_backends.testbed.plan import DEFAULT_ID, DEFAULT_SCALE, ID_RULE, describe
from sim_backends.testbed.state import State, default_run_dir, require

ID_ENV = "ORL_TESTBED_ID"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orl-testbed",
        description="A cluster of network namespaces with a real data plane: nodes, ToRs "
        "and OCSes of a wiring file, shaped links, the controller and one agent per node.",
    )
    add_version_flag(p)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--id",
        default=os.environ.get(ID_ENV, DEFAULT_ID),
        help=f"testbed id, prefix of every namespace and interface; {ID_RULE} "
        f"(default ${ID_ENV} or %(default)s)",
    )
    common.add_argument(
        "--run-dir",
        type=Path,
        help="state, wiring, logs (default /run/orchestrrl-testbed/ID)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True)

    u = sub.add_parser("up", parents=[common], help="build the testbed and start its daemons")
    u.add_argument("--wiring", type=Path, required=True, help="cluster wiring file (TOML)")
    _scale_args(u)
    u.add_argument(
        "--timeout", type=float, default=lifecycle.START_TIMEOUT_S, help="seconds per stage"
    )

    d = sub.add_parser("down", parents=[common], help="stop and remove everything of the id")
    d.add_argument("--keep-logs", action="store_true", help="keep RUN_DIR/logs")
    d.add_argument(
        "--grace",
        type=float,
        default=lifecycle.STOP_GRACE_S,
        help="seconds between SIGTERM and SIGKILL (default %(default)s)",
    )

    sub.add_parser("status", parents=[common], help="show what exists of the testbed")

    t = sub.add_parser("traffic", parents=[common], help="real TCP transfers")
    t.add_argument("--from", dest="source", metavar="NODE|POD", help="sending node or pod")
    t.add_argument("--to", dest="target", metavar="NODE|POD", help="receiving node or pod")
    t.add_argument(
        "--weight-sync",
        action="store_true",
        help="every training node sends to the generation nodes on the network planner's "
        "schedule; --bytes is the model size",
    )
    t.add_argument(
        "--bytes",
        type=int,
        default=traffic.DEFAULT_BYTES,
        help="bytes per transfer: every node of --from sends them to every node of --to "
        "(the model's size with --weight-sync; default %(default)s)",
    )
    t.add_argument("--seconds", type=float, default=0.0, help="send for S seconds instead")
    t.add_argument(
        "--parallel", type=int, default=None, help="TCP streams per transfer (default 1; 4 "
        "with --weight-sync, so that ECMP spreads them over the circuits)"
    )  # fmt: skip
    t.add_argument(
        "--tool",
        default="auto",
        choices=traffic.TOOLS,
        help="auto (default): iperf3 for a single transfer when installed, else the "
        "built-in sender/receiver, which starts transfers together and times the arrival "
        "of their last byte",
    )
    t.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer")

    m = sub.add_parser(
        "demo",
        parents=[common],
        help="up, walk the phases, weight-sync throughput before and after, down",
    )
    m.add_argument(
        "--wiring",
        type=Path,
        default=wiring_mod.default_wiring_path(),
        help="cluster wiring (default: the embedded 8-node example)",
    )
    _scale_args(m, demo_mod.DEFAULT_SCALE)
    m.add_argument(
        "--bytes",
        type=int,
        default=demo_mod.DEFAULT_MODEL_BYTES,
        help="model bytes of the weight sync (default %(default)s)",
    )
    m.add_argument("--keep", action="store_true", help="leave the testbed up at the end")
    return p


def _scale_args(p: argparse.ArgumentParser, default: float = DEFAULT_SCALE) -> None:
    p.add_argument(
        "--scale",
        type=float,
        default=default,
        help=f"divide every capacity by this (default %(default)g: 400 Gb/s -> "
        f"{400e3 / default:g} Mb/s)",
    )
    p.add_argument(
        "--uplink-gbps",
        type=float,
        default=DEFAULT_UPLINK_GBPS,
        help="speed of ToR uplinks, hence of circuits, before scaling (default %(default)g)",
    )


def _print(args: argparse.Namespace, text: str, data: Any) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def _progress(args: argparse.Namespace) -> lifecycle.Progress:
    def say(message: str) -> None:
        if not args.json:
            print(f"  {message}", file=sys.stderr, flush=True)

    return say


async def _up(args: argparse.Namespace) -> int:
    state = await lifecycle.up(
        args.wiring,
        testbed_id=args.id,
        run_dir=args.run_dir,
        scale=args.scale,
        uplink_gbps=args.uplink_gbps,
        timeout_s=args.timeout,
        progress=_progress(args),
    )
    plan = state.plan
    where = f"--id {plan.id}" + (f" --run-dir {plan.run_dir}" if args.run_dir else "")
    lines = [
        describe(plan),
        f"run dir {plan.run_dir} (augmented wiring: {plan.run_dir}/wiring.toml)",
        f"up in {state.timings['up_s']:.1f} s. Try:",
        f"  orlctl --controller {plan.controller} phase set weight-sync",
        f"  orl-testbed traffic {where} --from {plan.nodes[0].pod} --to {plan.nodes[-1].pod}",
        f"  orl-testbed traffic {where} --weight-sync --bytes 200000000",
        f"  orl-testbed down {where}",
    ]
    _print(args, "\n".join(lines), _state_json(state))
    return 0


def _state_json(state: State) -> dict[str, Any]:
    plan = state.plan
    return {
        "id": plan.id,
        "run_dir": plan.run_dir,
        "controller": plan.controller,
        "scale": plan.scale.divisor,
        "circuit_mbps": plan.scale.mbps(plan.uplink_gbps),
        "timings": state.timings,
        "nodes": [asdict(n) for n in plan.nodes],
        "processes": [asdict(p) for p in state.procs],
    }


async def _down(args: argparse.Namespace) -> int:
    start = time.monotonic()
    report = await lifecycle.down(
        args.id, args.run_dir, grace_s=args.grace, keep_logs=args.keep_logs,
        progress=_progress(args),
    )  # fmt: skip
    took = time.monotonic() - start
    text = (
        f"testbed {args.id!r} removed in {took:.1f} s: " + "; ".join(report)
        if report
        else f"testbed {args.id!r}: nothing to remove"
    )
    _print(args, text, {"id": args.id, "removed": report, "seconds": took})
    return 0


async def _status(args: argparse.Namespace) -> int:
    st = await lifecycle.status(args.id, args.run_dir)
    run_dir = args.run_dir or default_run_dir(args.id)
    if st.found.empty and st.state is None:
        _print(args, f"testbed {args.id!r}: nothing exists", {"id": args.id, "exists": False})
        return 0
    lines = [f"testbed {args.id!r} (run dir {run_dir})"]
    lines.append(f"  namespaces ({len(st.found.namespaces)}): {' '.join(st.found.namespaces)}")
    lines.append(f"  host interfaces ({len(st.found.host_links)}): {' '.join(st.found.host_links)}")
    if st.state is not None:
        plan = st.state.plan
        lines.append(f"  {describe(plan)}")
        lines.append(f"  ready: {st.state.ready}; timings: {st.state.timings}")
        for p in st.state.procs:
            mark = "running" if st.alive.get(p.pid) else "GONE"
            lines.append(f"  {p.role:<10} {p.name:<14} pid {p.pid:<7} {mark:<8} {p.address}")
    others = sorted(set(st.found.pids) - set(st.alive))
    if others:
        lines.append(f"  other processes of the testbed: {others}")
    lines.append(f"  fabric: {st.phase or 'controller not reachable'}")
    _print(
        args,
        "\n".join(lines),
        {
            "id": args.id,
            "exists": True,
            "namespaces": list(st.found.namespaces),
            "host_interfaces": list(st.found.host_links),
            "pids": list(st.found.pids),
            "processes": {str(pid): up for pid, up in st.alive.items()},
            "fabric": st.phase,
            "ready": st.state.ready if st.state else False,
        },
    )
    return 0


def _result_line(r: traffic.Result) -> str:
    cap = f" of {r.capacity_mbps:g} Mb/s ({r.mbps / r.capacity_mbps:.0%})" if (
        r.capacity_mbps
    ) else ""  # fmt: skip
    if not r.ok:
        return f"  {r.source} -> {r.target}: FAILED: {r.error}"
    return (
        f"  {r.source} -> {r.target}: {r.nbytes / 1e6:.1f} MB received in {r.seconds:.2f} s = "
        f"{r.mbps:.1f} Mb/s{cap} [{r.tool}, {r.streams} stream(s)]"
    )


async def _traffic(args: argparse.Namespace) -> int:
    state = require(args.run_dir or default_run_dir(args.id), args.id)
    plan = state.plan
    if args.weight_sync:
        if args.source or args.target:
            raise errors.InvalidArgument("--weight-sync takes no --from/--to (it uses every pod)")
        tool = "builtin" if args.tool == "auto" else args.tool  # completion times
        ws = await traffic.weight_sync(
            plan, args.bytes, tool=tool, streams=args.parallel or 4, timeout_s=args.timeout
        )
        lines = [ws.explanation] + [_result_line(r) for r in ws.traffic.results]
        lines.append(
            f"weight sync of {ws.model_bytes / 1e6:.1f} MB ({ws.mode}, {ws.senders} senders -> "
            f"{ws.receivers} receivers): {ws.completion_s:.2f} s; ideal {ws.ideal_s:.2f} s "
            f"(bytes / bottleneck capacity) = {ws.efficiency:.0%} of ideal"
        )
        data = {
            "mode": ws.mode,
            "model_bytes": ws.model_bytes,
            "completion_s": ws.completion_s,
            "ideal_s": ws.ideal_s,
            "efficiency": ws.efficiency,
            "ok": ws.traffic.ok,
            "transfers": [{**asdict(r), "mbps": r.mbps} for r in ws.traffic.results],
        }
        _print(args, "\n".join(lines), data)
        return 0 if ws.traffic.ok else 1
    if not args.source or not args.target:
        raise errors.InvalidArgument("traffic needs --from and --to (or --weight-sync)")
    transfers = traffic.transfers_between(plan, args.source, args.target, args.bytes)
    circuits = await traffic.committed_circuits(plan)
    report = await traffic.run_transfers(
        plan,
        transfers,
        tool=args.tool,
        streams=args.parallel or 1,
        seconds=args.seconds,
        timeout_s=args.timeout,
        circuits=circuits,
    )
    lines = [_result_line(r) for r in report.results]
    if len(report.results) > 1:
        lines.append(
            f"  total {report.nbytes / 1e6:.1f} MB in {report.wall_s:.2f} s = "
            f"{report.mbps:.1f} Mb/s"
        )
    data = {
        "ok": report.ok,
        "mbps": report.mbps,
        "wall_s": report.wall_s,
        "transfers": [{**asdict(r), "mbps": r.mbps} for r in report.results],
    }
    _print(args, "\n".join(lines), data)
    return 0 if report.ok else 1


async def _demo(args: argparse.Namespace) -> int:
    return await demo_mod.run(
        args.wiring,
        testbed_id=args.id,
        run_dir=args.run_dir,
        scale=args.scale,
        uplink_gbps=args.uplink_gbps,
        model_bytes=args.bytes,
        keep=args.keep,
        out=print,
    )


COMMANDS = {
    "up": _up,
    "down": _down,
    "status": _status,
    "traffic": _traffic,
    "demo": _demo,
}


async def _guarded(work: Coroutine[Any, Any, int]) -> int:
    """Run a command; SIGTERM cancels it like Ctrl-C does, so `up` cleans up."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return asyncio.run(_guarded(COMMANDS[args.command](args)))
    except (errors.InvalidArgument, errors.NotFound) as exc:
        _error(args, exc, "invalid")
        return 2
    except errors.OrlError as exc:
        _error(args, exc, "failed")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("orl-testbed: interrupted", file=sys.stderr)
        return 130


def _error(args: argparse.Namespace, exc: errors.OrlError, kind: str) -> None:
    if args.json:
        print(json.dumps({"error": {"kind": type(exc).__name__, "message": str(exc)}}))
    else:
        print(f"orl-testbed {args.command}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

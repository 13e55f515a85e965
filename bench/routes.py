#!/usr/bin/env python3
"""Route programming speed: the agent's ApplyRoutes path against `ip -batch`, same run.

Creates two fresh network namespaces with identical links and addresses, then programs
the same N host routes (default 10,000) with K next hops each (default: K = 1, then 4):

- agent: the node agent's full path, from a decoded ``ApplyRoutesRequest`` (parsed from
  its wire bytes before the clock starts) to verified kernel state:
  ``node_agent.routes.request_from_pb`` (validation, RouteSpecs) and
  ``HostRoutes.apply`` (open the adapter, check devices and conflicts, write in batches,
  read back and verify, policy rules), exactly what the ``ApplyRoutes`` RPC runs before
  it builds its response. Building the response is timed too and shown on its own.
  Delete = an ApplyRoutes with no routes and ``prune``.
- ip -batch: one ``ip`` process writing the same routes (``route add``/``route del``,
  protocol 77); it only writes.

Each figure is the median of --repeat runs; the ratio is ip -batch's time over the
agent's (1.0: as fast as ip -batch). CPU seconds are shown too (the agent's process,
user + system, and the ``ip`` child's): on a shared, loaded machine they vary less than
elapsed time. Needs root; the namespaces are deleted at the end.

    python bench/routes.py [--routes 10000] [--ecmp 1 4] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from node_agent.routes import HostRoutes, request_from_pb, response_to_pb
from orchestrrl.logs import setup_logging
from orchestrrl.netlink import OWNER_PROTO, Netlink
from orchestrrl.v1 import node_agent_pb2
from sim_backends import netns

T = TypeVar("T")
BASE = (10 << 24) | (128 << 16)  # 10.128.0.0, room for 8M /32s


def destinations(count: int) -> list[str]:
    return [
        f"{a >> 24}.{a >> 16 & 0xFF}.{a >> 8 & 0xFF}.{a & 0xFF}/32"
        for a in range(BASE, BASE + count)
    ]


def gateways(ecmp: int) -> tuple[str, ...]:
    return tuple(f"10.9.{i // 250}.{i % 250 + 2}" for i in range(ecmp))


def batch(op: str, dsts: list[str], hops: tuple[str, ...]) -> str:
    if op == "del":
        return "".join(f"route del {d} proto {OWNER_PROTO}\n" for d in dsts)
    via = f"via {hops[0]}" if len(hops) == 1 else " ".join(f"nexthop via {g}" for g in hops)
    return "".join(f"route add {d} proto {OWNER_PROTO} {via}\n" for d in dsts)


def decoded_request(
    name: str, dsts: list[str], hops: tuple[str, ...]
) -> node_agent_pb2.ApplyRoutesRequest:
    """The request as the servicer receives it: parsed from its wire bytes."""
    request = node_agent_pb2.ApplyRoutesRequest(
        command_id="bench",
        netns=name,
        prune=True,
        routes=[node_agent_pb2.Route(destination=d, gateways=hops) for d in dsts],
    )
    return node_agent_pb2.ApplyRoutesRequest.FromString(request.SerializeToString())


async def prepare(bed: netns.Testbed) -> str:
    name = await bed.netns("bench")
    await bed.veth("p0", "p1", netns_a=name, netns_b=name)
    await netns.add_address("p0", "10.9.0.1/16", name)
    return name


async def timed(action: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    """Seconds the action took, and its result."""
    start = time.perf_counter()
    result = await action()
    return time.perf_counter() - start, result


def children_cpu() -> float:
    """CPU seconds (user + system) of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def count_owned(name: str) -> int:
    async with Netlink(name) as nl:
        return len(await nl.routes())


async def run_one(count: int, ecmp: int, repeat: int) -> dict[str, object]:
    dsts, hops = destinations(count), gateways(ecmp)
    add_text, del_text = batch("add", dsts, hops), batch("del", dsts, hops)
    agent: dict[str, list[float]] = {"add": [], "delete": [], "reapply": []}
    response: list[float] = []
    ip: dict[str, list[float]] = {"add": [], "delete": []}
    agent_cpu: dict[str, list[float]] = {"add": [], "delete": []}
    ip_cpu: dict[str, list[float]] = {"add": [], "delete": []}
    host = HostRoutes()
    gc.freeze()  # as orl-node-agent does once started
    async with netns.Testbed() as bed:
        ours, theirs = await prepare(bed), await prepare(bed)
        add, remove = decoded_request(ours, dsts, hops), decoded_request(ours, [], hops)

        async def apply(request: node_agent_pb2.ApplyRoutesRequest, op: str) -> float:
            """The agent's path, timed up to the verified kernel state; the response it
            then builds is timed on its own."""
            cpu = time.process_time()
            seconds, result = await timed(lambda: host.apply(request_from_pb(request)))
            agent_cpu.setdefault(op, []).append(time.process_time() - cpu)
            if request.routes:
                start = time.perf_counter()
                response_to_pb(request.command_id, result)
                response.append(time.perf_counter() - start)
            return seconds

        async def ip_batch(text: str) -> float:
            cpu = children_cpu()
            seconds = (
                await timed(lambda: netns.run(["ip", "-n", theirs, "-batch", "-"], stdin=text))
            )[0]
            ip_cpu["delete" if text.startswith("route del") else "add"].append(children_cpu() - cpu)
            return seconds

        for _ in range(repeat):
            agent["add"].append(await apply(add, "add"))
            agent["reapply"].append(await apply(add, "reapply"))
            assert await count_owned(ours) == count
            agent["delete"].append(await apply(remove, "delete"))
            ip["add"].append(await ip_batch(add_text))
            assert await count_owned(theirs) == count
            ip["delete"].append(await ip_batch(del_text))
            assert await count_owned(ours) == await count_owned(theirs) == 0

    def figures(op: str) -> dict[str, float]:
        agent_s, ip_s = statistics.median(agent[op]), statistics.median(ip[op])
        return {
            "agent_s": agent_s,
            "agent_routes_per_s": count / agent_s,
            "ip_batch_s": ip_s,
            "ip_batch_routes_per_s": count / ip_s,
            "agent_over_ip_batch": ip_s / agent_s,
            "agent_cpu_s": statistics.median(agent_cpu[op]),
            "ip_batch_cpu_s": statistics.median(ip_cpu[op]),
            "agent_over_ip_batch_cpu": statistics.median(ip_cpu[op])
            / statistics.median(agent_cpu[op]),
        }

    return {
        "routes": count,
        "next_hops_per_route": ecmp,
        "repeat": repeat,
        "add": figures("add"),
        "delete": figures("delete"),
        "reapply_unchanged_s": statistics.median(agent["reapply"]),
        "response_to_pb_s": statistics.median(response),
    }


def print_table(results: list[dict[str, object]]) -> None:
    first = results[0]
    print(
        f"route programming: {first['routes']:,} routes, median of {first['repeat']}; "
        "agent = decoded ApplyRoutesRequest -> verified kernel state; "
        "ip -batch = one `ip` process writing"
    )
    print(
        f"{'hops':>4} {'operation':<9} {'agent s':>8} {'routes/s':>9} {'ip -batch s':>11} "
        f"{'routes/s':>9} {'agent/ip':>9} {'agent cpu':>9} {'ip cpu':>7} {'cpu ratio':>9}"
    )
    for res in results:
        for op in ("add", "delete"):
            f = res[op]
            assert isinstance(f, dict)
            print(
                f"{res['next_hops_per_route']:>4} {op:<9} {f['agent_s']:>8.3f} "
                f"{f['agent_routes_per_s']:>9,.0f} {f['ip_batch_s']:>11.3f} "
                f"{f['ip_batch_routes_per_s']:>9,.0f} {f['agent_over_ip_batch']:>9.2f} "
                f"{f['agent_cpu_s']:>9.3f} {f['ip_batch_cpu_s']:>7.3f} "
                f"{f['agent_over_ip_batch_cpu']:>9.2f}"
            )
    for res in results:
        print(
            f"{res['next_hops_per_route']} hop(s): re-applying the same routes (no change) "
            f"{res['reapply_unchanged_s']:.3f} s; building the response (not in the agent "
            f"column) {res['response_to_pb_s']:.3f} s"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--routes", type=int, default=10_000, help="number of routes (default 10000)")
    p.add_argument(
        "--ecmp", type=int, nargs="+", default=[1, 4], help="next hops per route, 1..64 (1 4)"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs; the median is shown (default 3)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    if not 1 <= args.routes <= 1_000_000:
        p.error(f"--routes={args.routes}: expected 1..1000000")
    for ecmp in args.ecmp:
        if not 1 <= ecmp <= 64:
            p.error(f"--ecmp={ecmp}: expected 1..64")
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat}: must be at least 1")
    if os.geteuid() != 0:
        p.error("needs root to create network namespaces (run with sudo)")
    setup_logging("warning")
    results = [asyncio.run(run_one(args.routes, ecmp, args.repeat)) for ecmp in args.ecmp]
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Route programming speed: the netlink adapter against `ip -batch`, same routes, same run.

Creates two fresh network namespaces with identical links and addresses, then programs
the same N host routes (default 10,000; --ecmp K gives each route K next hops) into one
through ``orchestrrl.netlink.Netlink.ensure_routes`` and into the other with
``ip -batch`` (one ``ip`` process reading the whole batch), and removes them again
(adapter: ensure of an empty set with prune; ip: a batch of ``route del``). Both use
route protocol 77. The adapter's figures include everything an ensure does: read the
current routes, validate, write in batches, read back and verify; ``ip -batch`` only
writes. Median of --repeat runs. Needs root; the namespaces are deleted at the end.

    python bench/routes.py [--routes 10000] [--ecmp 1] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from orchestrrl.logs import setup_logging
from orchestrrl.netlink import OWNER_PROTO, Netlink
from orchestrrl.routing import RouteSpec
from sim_backends import netns

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


async def prepare(bed: netns.Testbed) -> str:
    name = await bed.netns("bench")
    await bed.veth("p0", "p1", netns_a=name, netns_b=name)
    await netns.add_address("p0", "10.9.0.1/16", name)
    return name


async def timed(action: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await action()
    return time.perf_counter() - start


async def count_owned(name: str) -> int:
    async with Netlink(name) as nl:
        return len(await nl.routes())


async def run(count: int, ecmp: int, repeat: int) -> dict[str, object]:
    dsts, hops = destinations(count), gateways(ecmp)
    start = time.perf_counter()
    routes = [RouteSpec(d, hops) for d in dsts]
    build_s = time.perf_counter() - start
    add_text, del_text = batch("add", dsts, hops), batch("del", dsts, hops)
    samples: dict[str, list[float]] = {k: [] for k in ("add", "reapply", "delete")}
    ip_samples: dict[str, list[float]] = {"add": [], "delete": []}
    async with netns.Testbed() as bed:
        ours, theirs = await prepare(bed), await prepare(bed)
        async with Netlink(ours) as nl:
            for _ in range(repeat):
                samples["add"].append(await timed(lambda: nl.ensure_routes(routes, False)))
                samples["reapply"].append(await timed(lambda: nl.ensure_routes(routes, True)))
                assert await count_owned(ours) == count
                samples["delete"].append(await timed(lambda: nl.ensure_routes([], True)))
                ip_samples["add"].append(
                    await timed(
                        lambda: netns.run(["ip", "-n", theirs, "-batch", "-"], stdin=add_text)
                    )
                )
                assert await count_owned(theirs) == count
                ip_samples["delete"].append(
                    await timed(
                        lambda: netns.run(["ip", "-n", theirs, "-batch", "-"], stdin=del_text)
                    )
                )
                assert await count_owned(ours) == await count_owned(theirs) == 0

    def figures(op: str) -> dict[str, float]:
        ours_s, ip_s = statistics.median(samples[op]), statistics.median(ip_samples[op])
        return {
            "adapter_s": ours_s,
            "adapter_routes_per_s": count / ours_s,
            "ip_batch_s": ip_s,
            "ip_batch_routes_per_s": count / ip_s,
            "adapter_over_ip_batch": ip_s / ours_s,
        }

    return {
        "routes": count,
        "next_hops_per_route": ecmp,
        "repeat": repeat,
        "add": figures("add"),
        "delete": figures("delete"),
        "reapply_unchanged_s": statistics.median(samples["reapply"]),
        "build_routespecs_s": build_s,
    }


def print_table(res: dict[str, object]) -> None:
    print(
        f"route programming: {res['routes']:,} routes x {res['next_hops_per_route']} next "
        f"hop(s), median of {res['repeat']}; adapter = full ensure (observe, validate, "
        "write, read back, verify), ip -batch = one `ip` process writing"
    )
    print(
        f"{'operation':<10} {'adapter s':>10} {'routes/s':>10} {'ip -batch s':>12} "
        f"{'routes/s':>10} {'adapter/ip':>11}"
    )
    for op in ("add", "delete"):
        f = res[op]
        assert isinstance(f, dict)
        print(
            f"{op:<10} {f['adapter_s']:>10.3f} {f['adapter_routes_per_s']:>10,.0f} "
            f"{f['ip_batch_s']:>12.3f} {f['ip_batch_routes_per_s']:>10,.0f} "
            f"{f['adapter_over_ip_batch']:>11.2f}"
        )
    print(
        f"re-applying the same {res['routes']:,} routes (no change): "
        f"{res['reapply_unchanged_s']:.3f} s; building the RouteSpecs: "
        f"{res['build_routespecs_s']:.3f} s"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--routes", type=int, default=10_000, help="number of routes (default 10000)")
    p.add_argument("--ecmp", type=int, default=1, help="next hops per route, 1..64 (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="runs; the median is shown (default 3)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    if not 1 <= args.routes <= 1_000_000:
        p.error(f"--routes={args.routes}: expected 1..1000000")
    if not 1 <= args.ecmp <= 64:
        p.error(f"--ecmp={args.ecmp}: expected 1..64")
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat}: must be at least 1")
    if os.geteuid() != 0:
        p.error("needs root to create network namespaces (run with sudo)")
    setup_logging("warning")
    res = asyncio.run(run(args.routes, args.ecmp, args.repeat))
    print_table(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Daemons in network namespaces whose traffic can be dropped and restored: a network
partition of one process, for failover benchmarks (``bench/failover.py``). Needs root.

Each slot is a namespace joined to the host by a veth pair. Every host end carries the
hub address ``10.211.0.1/32`` (a host may hold one address on several links), each
namespace end its own ``10.211.0.<k+1>/32``, with host routes both ways, so:

- services of the host (etcd, simulated OCSes, the benchmark's client) listen on the hub
  address and are reached from every slot there;
- the process of slot ``k`` listens on ``10.211.0.<k+1>`` and is reached from the host.

:meth:`Partitions.drop` redirects everything the host end receives and sends to a sink
(a veth whose peer is down, which discards silently): the slot's process sees its
connections go silent and new ones never complete, as a host behind a broken switch
does, and its peers see the same of it (nothing is refused, nothing answers). ``tc``'s
``drop`` action is not available on every kernel; ``u32`` + ``mirred`` is (see
docs/DESIGN's testbed notes). :meth:`Partitions.heal` removes the filters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from orchestrrl import errors
from sim_backends import netns

NET = "10.211.0."
HUB = f"{NET}1"  # the host's address on every slot's link
MAX_SLOTS = 200


@dataclass(frozen=True)
class Slot:
    index: int
    netns: str
    host_link: str  # the host end of the slot's veth pair
    address: str  # the slot's own IPv4 address (its process listens there)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the slot's namespace (``ip netns exec`` execs it: the pid
        of the process started is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Partitions:
    """``slots`` namespaces, made on entry and removed on exit (also after a failure)."""

    def __init__(self, slots: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise errors.field_error("slots", slots, f"1..{MAX_SLOTS}")
        self.count = slots
        self.slots: list[Slot] = []
        self._testbed = netns.Testbed()
        tag = os.getpid() % 100_000
        self._sink = f"o{tag}k0"
        self._prefix = f"o{tag}s"
        self.dropped: set[int] = set()

    async def __aenter__(self) -> Partitions:
        if os.geteuid() != 0:
            raise errors.FailedPrecondition("a network partition needs root (namespaces, tc)")
        try:
            await self._build()
        except BaseException:
            await self._testbed.cleanup()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._testbed.cleanup()

    async def _build(self) -> None:
        used = await netns.run(["ip", "-4", "-o", "addr", "show"])
        if f" {NET}" in used.stdout:
            raise errors.FailedPrecondition(
                f"addresses {NET}0/24 are in use on this host already: a partition bench "
                "still running, or a network of the host"
            )
        # the sink: one end up, its peer down, so whatever is sent into it is discarded
        await self._testbed.veth(self._sink, f"{self._sink}p")
        await netns.run(["ip", "link", "set", f"{self._sink}p", "down"])
        for k in range(1, self.count + 1):
            ns = await self._testbed.netns("fo")
            host_link, address = f"{self._prefix}{k}", f"{NET}{k + 1}"
            await self._testbed.veth(host_link, "eth0", netns_b=ns)
            await netns.batch(
                f"addr add {HUB}/32 dev {host_link}\n"
                f"route add {address}/32 dev {host_link} src {HUB}\n"
            )
            await netns.batch(
                f"addr add {address}/32 dev eth0\nroute add {HUB}/32 dev eth0 src {address}\n",
                netns=ns,
            )
            self.slots.append(Slot(k, ns, host_link, address))

    async def drop(self, slot: Slot) -> None:
        """Silently discard every packet between the slot and the host, both ways."""
        dev = slot.host_link
        await netns.batch(
            f"qdisc add dev {dev} clsact\n"
            + "".join(
                f"filter add dev {dev} {hook} protocol all u32 match u32 0 0 "
                f"action mirred egress redirect dev {self._sink}\n"
                for hook in ("ingress", "egress")
            ),
            tool="tc",
        )
        self.dropped.add(slot.index)

    async def heal(self, slot: Slot) -> None:
        """Let the slot's traffic through again."""
        await netns.run(["tc", "qdisc", "del", "dev", slot.host_link, "clsact"], check=False)
        self.dropped.discard(slot.index)

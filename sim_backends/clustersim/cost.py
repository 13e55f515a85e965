"""Network cost: what each fabric is built from, priced per unit (TopoOpt's method).

Counted, as TopoOpt does: switch ports and transceivers, plus OCS ports and fibres.
GPUs, servers and NICs are the same under every fabric and are left out (so are
power, software and labour). Every count is installed hardware, not just the part a
phase uses.

Price assumptions (USD per unit, 400G generation; override with :class:`Prices`).
They are public list-price orders of magnitude, not quotes, and were fixed before any
result was computed; ratios between fabrics depend on them, so the report should
show the assumptions next to the results:

- electrical switch port, 400G: a 64 x 400G switch (Broadcom Tomahawk-4 / NVIDIA
  QM9700 class) lists around 40-50 kUSD, i.e. about 700 USD per port;
- transceiver, 400G (QSFP-DD/OSFP DR4 or SR8, third-party list prices, 2024): about
  600 USD; 100G (QSFP28): about 100 USD (TopoOpt's table uses 99 USD);
- OCS port (3D MEMS, Calient S320 class): about 500 USD per port; an OCS is passive
  optics, so a circuit needs no transceiver of its own, only the two ToR-side ones;
- fibre (patch cord or trunk share, per link): about 30 USD.

Counting rules (E = endpoints = nodes x NICs per node, k = switch radix):

- every host NIC link: 1 ToR/leaf port, 2 transceivers (NIC side and switch side), 1 fibre;
- electrical Clos (``fat-tree``): the number of tiers L is the smallest with
  ``2 (k/2)^L >= E``; a folded Clos has ``E (2L - 1)`` switch ports: ``E`` host-facing,
  ``E (L - 1)`` inter-switch links of 2 ports, 2 transceivers and 1 fibre each;
- oversubscribed by o at the leaf: leaf uplinks ``E/o``; above the leaf a Clos with
  the same number of tiers carries ``E/o``: ``(E/o)(2L - 3)`` spine ports and
  ``(E/o)(L - 1)`` inter-switch links;
- ``rail-optimised``: one Clos per rail over that rail's ``nodes`` endpoints;
- optical (``static-optical``, ``rfabric``): leaves with 1:1 uplinks (``E`` uplink
  ports, one transceiver each, one fibre each to an OCS port), ``E`` OCS ports over
  as many OCSes as the pods' ports need (rounded up). No electrical spine; a cluster of
  one pod has nothing above its leaves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrrl import errors


@dataclass(frozen=True)
class Prices:
    switch_port: float = 700.0  # 400G electrical switch port
    transceiver: float = 600.0  # 400G optical transceiver
    ocs_port: float = 500.0  # 3D MEMS OCS port
    fibre: float = 30.0  # one fibre link

    def __post_init__(self) -> None:
        for name in ("switch_port", "transceiver", "ocs_port", "fibre"):
            value = getattr(self, name)
            if not value >= 0:
                raise errors.field_error(f"prices.{name}", value, "a number >= 0")


DEFAULT_PRICES = Prices()


@dataclass(frozen=True)
class CostBreakdown:
    """``items``: name -> (count, unit price in USD); ``total`` = sum of count x price."""

    items: Mapping[str, tuple[float, float]]
    total: float

    @staticmethod
    def of(items: Mapping[str, tuple[float, float]]) -> CostBreakdown:
        kept = {k: v for k, v in items.items() if v[0] > 0}
        return CostBreakdown(kept, float(sum(n * p for n, p in kept.values())))

    def count(self, item: str) -> float:
        return self.items[item][0] if item in self.items else 0.0

    def above_hosts(self) -> CostBreakdown:
        """Without the host links (leaf host ports, their transceivers and fibres), which
        every fabric has alike: the part in which fabrics differ."""
        return CostBreakdown.of({k: v for k, v in self.items.items() if "host" not in k})


def clos_tiers(endpoints: int, radix: int) -> int:
    """Tiers of the smallest folded Clos of ``radix``-port switches with ``endpoints``
    non-blocking host ports: the least L with ``2 (radix/2)^L >= endpoints``."""
    if endpoints < 1:
        raise errors.field_error("endpoints", endpoints, "an integer >= 1")
    if radix < 4 or radix % 2:
        raise errors.field_error("switch_radix", radix, "an even integer >= 4")
    tiers = 1
    while 2 * (radix // 2) ** tiers < endpoints:
        tiers += 1
    return tiers


def _host_links(endpoints: int, prices: Prices) -> dict[str, tuple[float, float]]:
    return {
        "leaf port (host-facing)": (endpoints, prices.switch_port),
        "transceiver (host link)": (2 * endpoints, prices.transceiver),
        "fibre (host link)": (endpoints, prices.fibre),
    }


def fat_tree_cost(
    endpoints: int, radix: int, oversubscription: float = 1.0, prices: Prices = DEFAULT_PRICES
) -> CostBreakdown:
    """Electrical folded Clos; ``oversubscription`` > 1 thins everything above the leaf."""
    if not oversubscription >= 1:
        raise errors.field_error("oversubscription", oversubscription, "a number >= 1")
    tiers = clos_tiers(endpoints, radix)
    items = _host_links(endpoints, prices)
    if tiers > 1:
        up = math.ceil(endpoints / oversubscription)
        links = up * (tiers - 1)
        items["switch port (inter-switch)"] = (2 * links, prices.switch_port)
        items["transceiver (inter-switch)"] = (2 * links, prices.transceiver)
        items["fibre (inter-switch)"] = (links, prices.fibre)
    return CostBreakdown.of(items)


def rail_cost(nodes: int, rails: int, radix: int, prices: Prices = DEFAULT_PRICES) -> CostBreakdown:
    """One non-blocking Clos per rail, each over ``nodes`` endpoints."""
    per_rail = fat_tree_cost(nodes, radix, 1.0, prices)
    return CostBreakdown.of({k: (n * rails, p) for k, (n, p) in per_rail.items.items()})


def optical_cost(
    endpoints: int, uplinks: int, ocs_count: int, ocs_ports: int, prices: Prices = DEFAULT_PRICES
) -> CostBreakdown:
    """Electrical leaves with ``uplinks`` ports cabled to OCS ports, no spine. OCS ports
    are counted as installed (``ocs_count`` switches of ``ocs_ports``)."""
    items = _host_links(endpoints, prices)
    items["leaf port (uplink)"] = (uplinks, prices.switch_port)
    items["transceiver (uplink)"] = (uplinks, prices.transceiver)
    items["fibre (uplink to OCS)"] = (uplinks, prices.fibre)
    items["OCS port"] = (ocs_count * ocs_ports, prices.ocs_port)
    return CostBreakdown.of(items)

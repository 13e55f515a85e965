"""Flow-level network model: max-min fair rates and an event-driven transfer simulation.

Rates are max-min fair (progressive filling / water-filling): every unfrozen flow's
rate rises together until some link fills; the flows crossing a full link freeze at
that rate; repeat. The simulation recomputes the rates whenever a flow starts or ends
and advances analytically in between, so its cost is (events) x (one filling), not
proportional to bytes. Flows finishing within a relative 1e-9 of each other end in the
same event.

ECMP: a transfer with several paths is split into equal sub-flows, one per path (ideal
per-packet spraying; hash-based ECMP can only be worse); it finishes when its last
sub-flow does.

The public functions take hashable link and flow keys; fabrics use the indexed core
(:func:`fill_indexed`, :func:`simulate_indexed`) with numpy arrays directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from orchestrrl import errors

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_REL_TOL = 1e-9


def fill_indexed(
    capacity: FloatArray, entry_flow: IntArray, entry_link: IntArray, nflows: int
) -> FloatArray:
    """Max-min fair rates of ``nflows`` flows; flow ``entry_flow[i]`` crosses link
    ``entry_link[i]``. A flow that crosses no link gets ``inf``."""
    nlinks = capacity.shape[0]
    rate = np.full(nflows, np.inf)
    frozen = np.bincount(entry_flow, minlength=nflows) == 0
    rate[~frozen] = 0.0
    rem = capacity.astype(np.float64, copy=True)
    ef, el = entry_flow, entry_link
    level = 0.0
    while ef.size:
        cnt = np.bincount(el, minlength=nlinks)
        used = cnt > 0
        share = np.full(nlinks, np.inf)
        share[used] = rem[used] / cnt[used]
        inc = max(float(share.min()), 0.0)
        level += inc
        rem -= inc * cnt
        saturated = used & (share <= inc * (1.0 + _REL_TOL))
        newly = np.unique(ef[saturated[el]])
        rate[newly] = level
        frozen[newly] = True
        keep = ~frozen[ef]
        ef, el = ef[keep], el[keep]
    return rate


def max_min_rates(
    capacity: Mapping[Hashable, float], flows: Mapping[Hashable, Sequence[Hashable]]
) -> dict[Hashable, float]:
    """Max-min fair rate of every flow (a flow is the sequence of links it crosses).

    A flow that crosses no link is unconstrained (``inf``). Capacities must be >= 0 and
    every link a flow names must be in ``capacity``.
    """
    links = {k: i for i, k in enumerate(capacity)}
    cap = np.array([float(capacity[k]) for k in links], dtype=np.float64)
    if cap.size and (np.isnan(cap).any() or (cap < 0).any()):
        bad = next(k for k in links if not float(capacity[k]) >= 0)
        raise errors.field_error(f"capacity[{bad!r}]", capacity[bad], "a number >= 0")
    ef: list[int] = []
    el: list[int] = []
    keys = list(flows)
    for i, key in enumerate(keys):
        for link in flows[key]:
            if link not in links:
                raise errors.field_error(f"flows[{key!r}] link", link, "a link of capacity")
            ef.append(i)
            el.append(links[link])
    rate = fill_indexed(
        cap, np.asarray(ef, dtype=np.int64), np.asarray(el, dtype=np.int64), len(keys)
    )
    return {k: float(rate[i]) for i, k in enumerate(keys)}


@dataclass(frozen=True)
class FlowTransfer:
    """``nbytes`` over ``paths`` (split equally, one sub-flow per path), from ``start``."""

    key: Hashable
    nbytes: float
    paths: tuple[tuple[Hashable, ...], ...]
    start: float = 0.0


@dataclass(frozen=True)
class FlowResult:
    finish: Mapping[Hashable, float]  # per transfer key; inf if it can never finish
    link_bytes: Mapping[Hashable, float]  # bytes each link carried
    makespan: float  # last finish


@dataclass(frozen=True)
class IndexedResult:
    finish: FloatArray  # per transfer
    link_bytes: FloatArray  # per link
    events: int  # rate recomputations


def simulate_indexed(
    capacity: FloatArray,
    sub_owner: IntArray,
    sub_bytes: FloatArray,
    entry_sub: IntArray,
    entry_link: IntArray,
    starts: FloatArray,
) -> IndexedResult:
    """Event-driven simulation of transfers made of sub-flows.

    ``sub_owner[j]`` is the transfer of sub-flow ``j`` (``sub_bytes[j]`` bytes), which
    crosses the links ``entry_link[entry_sub == j]``; transfer ``i`` starts at
    ``starts[i]``. Returns the finish time of every transfer (its start when it has no
    bytes; ``inf`` when a sub-flow can never finish, e.g. a zero-capacity link).
    """

    nsub = sub_owner.shape[0]
    nlinks = capacity.shape[0]
    remaining = sub_bytes.astype(np.float64, copy=True)
    sub_start = starts[sub_owner] if nsub else np.zeros(0)
    done = remaining <= 0
    sub_finish = np.where(done, sub_start, np.nan)
    start_times = np.unique(sub_start[~done]) if nsub else np.zeros(0)
    t = float(start_times[0]) if start_times.size else 0.0
    events = 0
    while not done.all():
        active = ~done & (sub_start <= t * (1.0 + _REL_TOL) + 1e-15)
        later = start_times[start_times > t * (1.0 + _REL_TOL) + 1e-15]
        next_start = float(later[0]) if later.size else np.inf
        if not active.any():
            t = next_start
            continue
        idx = np.flatnonzero(active)
        local = np.full(nsub, -1, dtype=np.int64)
        local[idx] = np.arange(idx.size)
        mask = active[entry_sub]
        rate = fill_indexed(capacity, local[entry_sub[mask]], entry_link[mask], idx.size)
        events += 1
        with np.errstate(divide="ignore"):
            ttf = np.where(rate > 0, remaining[idx] / rate, np.inf)
        dt = min(float(ttf.min()), next_start - t)
        if np.isinf(dt):
            sub_finish[idx] = np.inf
            done[idx] = True
            break
        finishing = ttf <= dt * (1.0 + _REL_TOL)
        remaining[idx] -= np.where(np.isinf(rate), remaining[idx], rate * dt)
        ended = idx[finishing]
        remaining[ended] = 0.0
        t += dt
        sub_finish[ended] = t
        done[ended] = True
    finish = starts.astype(np.float64, copy=True)
    if nsub:
        np.maximum.at(finish, sub_owner, sub_finish)
    link_bytes = np.bincount(entry_link, weights=sub_bytes[entry_sub], minlength=nlinks)
    return IndexedResult(finish, link_bytes.astype(np.float64), events)


def simulate(capacity: Mapping[Hashable, float], transfers: Sequence[FlowTransfer]) -> FlowResult:
    """Finish time of every transfer under max-min fair sharing, recomputed at every
    start and end (see the module docstring)."""
    links = {k: i for i, k in enumerate(capacity)}
    cap = np.array([float(capacity[k]) for k in links], dtype=np.float64)
    owner: list[int] = []
    sbytes: list[float] = []
    es: list[int] = []
    el: list[int] = []
    seen: set[Hashable] = set()
    for i, tr in enumerate(transfers):
        if tr.key in seen:
            raise errors.field_error("transfer.key", tr.key, "unique per transfer")
        seen.add(tr.key)
        if not tr.nbytes >= 0:
            raise errors.field_error(f"transfer[{tr.key!r}].nbytes", tr.nbytes, "a number >= 0")
        if not tr.paths:
            raise errors.field_error(f"transfer[{tr.key!r}].paths", tr.paths, "at least one path")
        share = tr.nbytes / len(tr.paths)
        for path in tr.paths:
            j = len(owner)
            owner.append(i)
            sbytes.append(share)
            for link in path:
                if link not in links:
                    raise errors.field_error(
                        f"transfer[{tr.key!r}] link", link, "a link of capacity"
                    )
                es.append(j)
                el.append(links[link])
    res = simulate_indexed(
        cap,
        np.asarray(owner, dtype=np.int64),
        np.asarray(sbytes, dtype=np.float64),
        np.asarray(es, dtype=np.int64),
        np.asarray(el, dtype=np.int64),
        np.asarray([tr.start for tr in transfers], dtype=np.float64),
    )
    finish = {tr.key: float(res.finish[i]) for i, tr in enumerate(transfers)}
    return FlowResult(
        finish=finish,
        link_bytes={k: float(res.link_bytes[i]) for k, i in links.items()},
        makespan=max(finish.values(), default=0.0),
    )

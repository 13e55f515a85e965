"""Repack the long tail onto few engines (and raise their TP), so the rest take fresh work.

In asynchronous RL an engine that waits for a new weight version stops admitting
requests and drains: its batch shrinks to the few long responses it still runs, and its
GPUs idle in proportion (Laminar, arXiv 2510.12633: "long-tail trajectory repacking").
This planner takes the draining engines whose batch fell to ``tail_fraction`` of their
seats or below and consolidates their requests onto as few of them as fit (best-fit
decreasing, the bin-packing rule: the largest request first, into the engine that it
fills best), moving each request's KV cache; the emptied engines load the new version at
once and take fresh prompts. Engines of different versions never share a tail (a
request's remaining tokens must come from its own version's weights).

With ``by_node`` (for a reshard) whole nodes are emptied into the fewest nodes able to
hold the tail, and each node left holding a tail may reshard to one engine of the node's
width at that moment (TP = the node's GPUs, the largest per-token speed for a small
batch) when :func:`reshard_pays`: its longest request ends sooner that way, pauses
included; the emptied nodes keep their (small) TP for the fresh prompts. Each half is a
separate switch so the simulator measures them apart.

On a live cluster (the compute-scheduling loop in async mode) :func:`plan_tail` makes the
same decision a :class:`~scheduler.compute_state.ComputePlan` the loop carries out like
its other plans (reshards first, then the moves).

Pure: engines and requests in, moves out; the caller charges the moves (KV transfer or
recompute, :meth:`scheduler.perf_model.PerfModel.kv_move_time`) and the reshards
(:meth:`~scheduler.perf_model.PerfModel.reshard_time`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from orchestrrl import errors
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    Migration,
    MoveMethod,
    NodeGpus,
    Prediction,
    Request,
    Reshard,
    canonical_instances,
)
from scheduler.forecast import LengthForecast
from scheduler.perf_model import PerfModel


@dataclass(frozen=True)
class TailEngine:
    """A draining engine: its GPUs' node, TP, weight version, seats (running sequences
    it admits), KV capacity in tokens, and its running requests (id, KV tokens held)."""

    id: str
    node: str
    tp: int
    version: int
    seats: int
    kv_tokens: int
    requests: tuple[tuple[str, int], ...]

    @property
    def held(self) -> int:
        return sum(t for _, t in self.requests)


@dataclass(frozen=True)
class RepackMove:
    request: str
    source: str
    target: str  # an engine id, or "node:<name>" for a resharded node's new engine
    tokens: int


@dataclass(frozen=True)
class RepackPlan:
    """``moves``; ``freed``: engines emptied; ``targets``: engines (or ``node:<name>``)
    the moves go to; ``reshard_nodes``: (node, requests it holds) of the nodes left
    holding a tail, candidates for a reshard to one wide engine."""

    moves: tuple[RepackMove, ...]
    freed: tuple[str, ...]
    targets: tuple[str, ...]
    reshard_nodes: tuple[tuple[str, int], ...]
    reason: str

    @property
    def empty(self) -> bool:
        return not self.freed and not self.reshard_nodes


NONE = RepackPlan((), (), (), (), "nothing to repack")


def tail_engines(engines: Sequence[TailEngine], tail_fraction: float) -> tuple[TailEngine, ...]:
    """The engines whose batch fell to ``tail_fraction`` of their seats or below (and
    still holds something)."""
    if not 0 < tail_fraction <= 1:
        raise errors.field_error("tail_fraction", tail_fraction, "a number in (0, 1]")
    return tuple(e for e in engines if e.requests and len(e.requests) <= tail_fraction * e.seats)


@dataclass
class _Bin:
    key: str
    seats: int
    kv: int
    used_seats: int
    used_kv: int

    def fits(self, tokens: int) -> bool:
        return self.used_seats < self.seats and self.used_kv + tokens <= self.kv

    def room(self) -> tuple[float, int]:
        return (self.seats - self.used_seats) / max(1, self.seats), self.kv - self.used_kv


def plan_repack(
    engines: Sequence[TailEngine], *, tail_fraction: float, by_node: bool = False
) -> RepackPlan:
    """Consolidate the tail of ``engines`` (module doc). ``by_node``: whole nodes are
    emptied into other nodes (each node's room: the seats and KV cache of its engines),
    and every node kept holding a tail is a candidate for a reshard
    (:attr:`RepackPlan.reshard_nodes`: the node and the requests it holds; the caller
    decides with :func:`reshard_pays`); nodes with an engine outside the tail are packed
    engine by engine."""
    tail = tail_engines(engines, tail_fraction)
    if len(tail) < 2:
        return NONE
    by_version: dict[int, list[TailEngine]] = defaultdict(list)
    for e in tail:
        by_version[e.version].append(e)
    moves: list[RepackMove] = []
    freed: list[str] = []
    targets: set[str] = set()
    candidates: list[tuple[str, int]] = []
    all_by_node: dict[str, list[TailEngine]] = defaultdict(list)
    for e in engines:
        all_by_node[e.node].append(e)
    for version in sorted(by_version):
        group = by_version[version]
        rest = list(group)
        if by_node:
            in_tail = {e.id for e in group}
            # a node is whole in the tail when each of its engines is (an idle engine
            # beside a tail engine is room, not a reason to keep the node)
            whole = sorted(
                n
                for n, es in all_by_node.items()
                if any(e.id in in_tail for e in es)
                and all(e.id in in_tail or not e.requests for e in es)
            )
            if len(whole) >= 2:
                bins: dict[str, _Bin] = {}
                srcs: list[tuple[str, Sequence[tuple[str, int]], str]] = []
                for n in whole:
                    es = all_by_node[n]
                    held = [r for e in es for r in e.requests]
                    used = sum(t for _, t in held)
                    seats = sum(e.seats for e in es)
                    kv = sum(e.kv_tokens for e in es)
                    bins[n] = _Bin(n, max(seats, len(held)), max(kv, used), len(held), used)
                    srcs += [(n, e.requests, e.id) for e in es]
                node_moves, emptied_nodes = _pack(srcs, bins)
                moves += [
                    RepackMove(m.request, m.source, f"node:{m.target}", m.tokens)
                    for m in node_moves
                ]
                for n in emptied_nodes:
                    freed += [e.id for e in all_by_node[n]]
                for n in whole:
                    if n not in emptied_nodes:
                        if any(m.target == n for m in node_moves):
                            targets.add(f"node:{n}")
                        candidates.append((n, bins[n].used_seats))
                rest = [e for e in group if e.node not in whole]
        if len(rest) >= 2:
            bins = {e.id: _Bin(e.id, e.seats, e.kv_tokens, len(e.requests), e.held) for e in rest}
            eng_moves, emptied = _pack([(e.id, e.requests, e.id) for e in rest], bins)
            moves += eng_moves
            freed += emptied
            targets |= {m.target for m in eng_moves}
    if not freed and not candidates:
        return NONE
    reason = (
        f"repacked {len(moves)} tail request(s) from {len(freed)} engine(s) onto "
        f"{len(targets)} target(s)"
    )
    return RepackPlan(
        tuple(moves), tuple(sorted(freed)), tuple(sorted(targets)), tuple(candidates), reason
    )


def reshard_pays(
    *,
    base_tp: int,
    wide_tp: int,
    batch: int,
    context_tokens: float,
    remaining_tokens: float,
    iteration_s: Callable[[int, int, float], float],
    pause_s: float,
) -> bool:
    """Whether a node holding a tail of ``batch`` requests frees sooner as one engine of
    ``wide_tp`` GPUs than as its ``wide_tp / base_tp`` engines of ``base_tp``: the node
    is busy until its longest request ends (``remaining_tokens`` decode iterations away),
    and the wide layout costs a reshard there and one back (``2 x pause_s``)."""
    if batch <= 0 or remaining_tokens <= 0:
        return False
    engines = max(1, wide_tp // base_tp)
    per = -(-batch // engines)
    keep = remaining_tokens * iteration_s(base_tp, per, context_tokens)
    wide = 2.0 * pause_s + remaining_tokens * iteration_s(wide_tp, batch, context_tokens)
    return wide < keep


def _pack(
    sources: Sequence[tuple[str, Sequence[tuple[str, int]], str]], bins: dict[str, _Bin]
) -> tuple[list[RepackMove], list[str]]:
    """Empty bins lightest first into the other bins, best fit decreasing (the largest
    request first, into the bin it leaves the least room in); a bin is emptied whole or
    not at all. ``sources``: (bin key, its requests, the engine they run on); a bin (an
    engine, or a node) may have several engines' requests."""
    per_node: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for node, reqs, engine in sources:
        per_node[node] += [(rid, t, engine) for rid, t in reqs]
    moves: list[RepackMove] = []
    emptied: list[str] = []
    received: set[str] = set()  # a bin that took requests is a target from then on
    for node in sorted(per_node, key=lambda n: (len(per_node[n]), n)):
        if node in received:
            continue
        others = {k: b for k, b in bins.items() if k != node and k not in emptied}
        trial = {k: _Bin(b.key, b.seats, b.kv, b.used_seats, b.used_kv) for k, b in others.items()}
        placed: list[RepackMove] = []
        ok = bool(trial)
        for rid, tokens, engine in sorted(per_node[node], key=lambda r: (-r[1], r[0])):
            fit = [b for b in trial.values() if b.fits(tokens)]
            if not fit:
                ok = False
                break
            best = min(fit, key=lambda b: (b.room(), b.key))
            best.used_seats += 1
            best.used_kv += tokens
            placed.append(RepackMove(rid, engine, best.key, tokens))
        if not ok:
            continue
        bins.update(trial)
        bins[node] = _Bin(node, bins[node].seats, bins[node].kv, 0, 0)
        emptied.append(node)
        received |= {m.target for m in placed}
        moves += placed
    return moves, emptied


# -- the tail of a live cluster (the compute-scheduling loop in async mode) --------------


def plan_tail(
    state: ComputeState,
    *,
    versions: Mapping[str, str],
    seats: int,
    perf: PerfModel,
    forecast: LengthForecast,
    now: float,
    tail_fraction: float,
    settled: frozenset[str] = frozenset(),
) -> ComputePlan | None:
    """The repack of a live cluster's tail as a :class:`ComputePlan`, or None.

    The tail: no request waits in a queue (none would take a freed seat) and at least two
    instances hold ``tail_fraction`` of their ``seats`` or less (0: the perf model's cap
    per TP). :func:`plan_repack` (by node) empties whole nodes into the fewest nodes that
    hold the tail; a node left holding one reshards to one instance of its width when
    :func:`reshard_pays` (its pause at no less than the one it last measured), the rest
    move onto the instance with the most room. Nodes (``versions``: the weight version
    each serves) of different versions never share a tail. None when nothing would move
    or reshard, or a request that would move was moved a moment ago (``settled``): the
    loop waits for its cooldown rather than carry out half a repack."""
    if not state.requests or any(r.instance is None for r in state.requests):
        return None
    on: dict[str, list[Request]] = defaultdict(list)
    for r in state.requests:
        if r.instance is not None:
            on[r.instance].append(r)

    def cap(tp: int) -> int:
        return seats or perf.max_num_seqs(tp)

    vid = {v: k for k, v in enumerate(sorted(set(versions.values())))}
    engines = [
        TailEngine(
            inst.id,
            inst.node,
            len(inst.gpus),
            vid.get(versions.get(inst.node, ""), -1),
            cap(len(inst.gpus)),
            perf.kv_capacity_tokens(len(inst.gpus)),
            tuple((r.id, r.prompt_tokens + r.generated_tokens) for r in on[inst.id]),
        )
        for inst in state.instances
    ]
    repack = plan_repack(engines, tail_fraction=tail_fraction, by_node=True)
    if repack.empty or any(m.request in settled for m in repack.moves):
        return None
    nodes = {n.name: n for n in state.nodes}
    insts = {i.id: i for i in state.instances}
    req = {r.id: r for r in state.requests}
    wide = _widened(state, repack, on, req, nodes, cap, perf, forecast)
    if not repack.moves and not wide:
        return None  # nodes left holding a tail, none of them better off wide
    after = [i for i in state.instances if i.node not in wide] + [i for i, _ in wide.values()]
    load = {i.id: len(on[i.id]) for i in after}
    for node, (inst, _) in wide.items():
        load[inst.id] = sum(len(on[i.id]) for i in state.instances_on(node))
    migrations: list[Migration] = []
    assignment: dict[str, str] = {}
    for m in repack.moves:
        load[m.source] -= 1
        src = insts[m.source]
        if m.target.startswith("node:"):
            node = m.target[5:]
            dst = (
                wide[node][0]
                if node in wide
                else max(
                    (i for i in after if i.node == node),
                    key=lambda i: (cap(len(i.gpus)) - load[i.id], i.id),
                )
            )
        else:
            dst = insts[m.target]
        load[dst.id] += 1
        r = req[m.request]
        cost, method = _move_cost(perf, r.prompt_tokens + r.generated_tokens, src, dst, nodes)
        migrations.append(Migration(m.request, src.id, dst.id, method, cost))
        assignment[m.request] = dst.id
    for r in state.requests:
        if r.id not in assignment and r.instance is not None:
            node = insts[r.instance].node
            assignment[r.id] = wide[node][0].id if node in wide else r.instance
    reshards = []
    for node, (inst, pause) in wide.items():
        mine = state.instances_on(node)
        before = tuple(sorted((len(i.gpus) for i in mine), reverse=True))
        reshards.append(
            Reshard(node, before, (len(inst.gpus),), tuple(i.id for i in mine), (inst,), pause)
        )
    switching = max((r.pause_s for r in reshards), default=0.0)
    stall: dict[str, float] = defaultdict(float)
    for mig in migrations:
        stall[mig.target] += mig.cost_s
    by_after: dict[str, list[Request]] = defaultdict(list)
    for rid, iid in assignment.items():
        by_after[iid].append(req[rid])
    keep = max(_drain_s(perf, forecast, len(i.gpus), on[i.id]) for i in state.instances)
    runs = {i.id: _drain_s(perf, forecast, len(i.gpus), by_after[i.id]) for i in after}
    planned = switching + max(stall[i] + runs[i] for i in runs)
    node_after = {i.id: i.node for i in after}
    emptied = sorted(
        {insts[iid].node for iid, rs in on.items() if rs}
        - {node_after[iid] for iid in assignment.values()}
    )
    reason = repack.reason
    if emptied:
        reason += f"; frees {', '.join(emptied)} for fresh prompts and the next weights"
    if wide:
        reason += "; reshards " + ", ".join(
            f"{n} to one TP{len(i.gpus)} instance" for n, (i, _) in wide.items()
        )
    return ComputePlan(
        now=now,
        reshards=tuple(reshards),
        migrations=tuple(migrations),
        dispatched=(),
        assignment=tuple(sorted(assignment.items())),
        unplaced=(),
        instances=tuple(sorted(after, key=lambda i: i.id)),
        prediction=Prediction(keep, planned, max(runs.values()), switching, sum(stall.values())),
        reason=reason,
    )


def _widened(
    state: ComputeState,
    repack: RepackPlan,
    on: Mapping[str, Sequence[Request]],
    req: Mapping[str, Request],
    nodes: Mapping[str, NodeGpus],
    cap: Callable[[int], int],
    perf: PerfModel,
    forecast: LengthForecast,
) -> dict[str, tuple[Instance, float]]:
    """The nodes left holding a tail that reshard to one instance of their width (and
    its pause): those whose tail, after the moves, fits its seats and ends sooner there
    (:func:`reshard_pays`)."""
    moving = {m.request for m in repack.moves}
    out: dict[str, tuple[Instance, float]] = {}
    for node, _ in repack.reshard_nodes:
        spec = nodes[node]
        gpus, mine = spec.gpus, state.instances_on(node)
        staying = [r for i in mine for r in on.get(i.id, ()) if r.id not in moving]
        arriving = [req[m.request] for m in repack.moves if m.target == f"node:{node}"]
        tail = staying + arriving
        width = len(gpus)
        if max(len(i.gpus) for i in mine) >= width or not tail or len(tail) > cap(width):
            continue
        per_gpu = [len(i.gpus) for i in mine for _ in i.gpus]
        pause = _pause(perf, spec, per_gpu, [width] * width)
        if reshard_pays(
            base_tp=min(per_gpu),
            wide_tp=width,
            batch=len(tail),
            context_tokens=sum(r.prompt_tokens + r.generated_tokens for r in tail) / len(tail),
            remaining_tokens=max(forecast.remaining_mean(r.generated_tokens) for r in tail),
            iteration_s=perf.decode_iteration_time,
            pause_s=pause,
        ):
            out[node] = (canonical_instances(node, gpus, (width,))[0], pause)
    return out


def _pause(perf: PerfModel, node: NodeGpus, old: Sequence[int], new: Sequence[int]) -> float:
    """A reshard's pause: the perf model's, at no less than the node's measured one."""
    return max(perf.reshard_time(old, new), node.reshard_pause_s)


def _move_cost(
    perf: PerfModel, tokens: int, src: Instance, dst: Instance, nodes: Mapping[str, NodeGpus]
) -> tuple[float, MoveMethod]:
    """A running request's move: its KV cache over NVLink or the network, or recomputed
    by prefill on ``dst`` when that is sooner or ``dst``'s engine takes no KV cache."""
    rec = perf.recompute_time(len(dst.gpus), tokens)
    if not nodes[dst.node].kv_import:
        return rec, MoveMethod.RECOMPUTE
    same = src.node == dst.node
    kv = perf.kv_move_time(tokens, same_node=same, src_tp=len(src.gpus), dst_tp=len(dst.gpus))
    if rec < kv:
        return rec, MoveMethod.RECOMPUTE
    return kv, MoveMethod.KV_NVLINK if same else MoveMethod.KV_NETWORK


def _drain_s(
    perf: PerfModel, forecast: LengthForecast, tp: int, requests: Sequence[Request]
) -> float:
    """Seconds until an instance of ``tp`` running ``requests`` ends its longest (the
    forecast's expected remaining tokens, at the batch's mean context)."""
    if not requests:
        return 0.0
    remaining = max(forecast.remaining_mean(r.generated_tokens) for r in requests)
    ctx = sum(r.prompt_tokens + r.generated_tokens for r in requests) / len(requests)
    return remaining * perf.decode_iteration_time(tp, len(requests), ctx)

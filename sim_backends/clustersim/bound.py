"""The fluid lower bound on a step's generation time under the performance model.

A relaxation of the simulator (:mod:`.generation`): no reshard pauses, no move costs, no
whole instances (any token may run at any TP degree of ``tps`` and any batch, on any
GPUs, at any moment), no queueing order. What it keeps, and what every schedule the
simulator runs obeys: an instance of TP ``t`` runs at most ``B_t = min(max_num_seqs,
perf.max_num_seqs(t))`` sequences (the simulator's own cap), its batch's KV fits its
cache, every response needs one decode iteration per token and every prompt is
prefilled once. Plans are taken to respect the caps the simulator enforces on admission
(a move that overfills an instance's batch or KV cache is not a schedule of the model).

Notation. An iteration of an instance of TP ``t`` and batch ``b`` whose contexts sum to
``S`` lasts ``tau(t, b, S/b)`` (:meth:`PerfModel.decode_iteration_time`) =
``(max(max(C, M) + K + A, H) + O) * cal``, with compute ``C`` and memory ``M`` affine
and non-decreasing in the mean context and the other terms constant (checked per
``(t, b)``), so ``tau`` is convex and non-decreasing in ``S``; it occupies ``t`` GPUs,
``G(t, b, S) = t * tau`` GPU-seconds. The simulator charges a decode segment by the
trapezoid rule and a partial one by the matching linear interpolation; both lie above a
convex ``tau`` (the chord), so every iteration lasts at least ``tau`` at its contexts.

Step 1, KV. After an iteration the simulator preempts one sequence (context at least
``p_min``, the shortest prompt) if the cache overflowed; the batch grows by ``b``
tokens per iteration meanwhile, so an iteration of batch ``b >= 2`` starts with
``S <= Smax_t = cap_t + m (m + 1) / 2``, ``m = max(0, B_t - p_min)`` (a batch of 1
is never limited). Every running context is at least ``p_min``.

Step 2, prices (GPU-seconds). For each ``(t, b)`` take one line
``g_tb(c) = a + s c`` with ``b a + s S <= G(t, b, S)`` for every feasible ``S``: the
affine piece of ``G`` active at a reference context (any piece of a maximum of affine
functions lies below it everywhere), or a line through ``(Smax_t, G(Smax_t))`` steeper
than the piece active there (below ``G`` left of that point, which is all a batch can
reach). A token of context ``c`` run in such a batch is charged ``g_tb(c)``; the
charges of one iteration sum to at most its ``G``. A token that cannot be in a
``(t, b)`` batch (``c + (b - 1) p_min > Smax_t``) is never charged for it.

Step 3, own time. The same token's iteration lasts at least
``d_tb(c) = tau(t, b, (c + (b - 1) p_min) / b)``: the others' contexts are at least
``p_min`` each and ``tau`` is non-decreasing.

Step 4, prefill. A prefill chunk of ``n <= PREFILL_CHUNK`` tokens occupies ``t`` GPUs for
``perf.prefill_time(t, n)``; so prefill costs at least
``kappa = min over t, n of t * prefill_time(t, n) / n`` GPU-seconds per prompt token,
``P = kappa * (sum of prompts)`` in all, on GPUs that decode nothing meanwhile.

Step 5, the coupled bound. Let a schedule end at ``T`` on ``G`` GPUs. The GPU-seconds
it uses are at most ``G T`` and at least ``P + sum over tokens of g`` (at the config the
token ran in); response ``i``'s iterations follow one another, so
``sum over its tokens of d <= T``. For any prices ``nu_i >= 0`` (GPUs) add ``nu_i``
times the second to the first:
``(G + sum nu_i) T >= P + sum_i M_i(nu_i)``, where
``M_i(nu) = sum over the tokens of i of min over (t, b) of (g_tb(c) + nu d_tb(c))``.
Hence for any ``T'``: if ``P + sum_i max over nu of (M_i(nu) - nu T') >= G T'``, then
``T >= T'`` (take each ``nu_i`` at its maximum). The left side minus ``G T'`` falls
with ``T'``; bisection finds the largest such ``T'`` over a grid of ``nu`` (any grid is
valid; ``nu = 0`` everywhere is the plain work bound ``(P + sum M_i(0)) / G``). It
joins the work to every response's own speed: a long response must run its tokens at a
small batch or large TP, whose tokens cost more GPU-seconds, and the bulk can no longer
take the cheapest configuration when ``T'`` is short.

Step 6, discretisation. ``g + nu d`` is non-decreasing in ``c`` and the set of configs a
token may use only shrinks as ``c`` grows, so each token is priced at the lower edge of
its ``BIN_TOKENS``-wide context bin: lower, hence still valid.

Step 7, the critical path. A token of context ``c`` shares its iteration with others of
context at least 0, so it lasts at least ``lb(c) = min over (t, b) of tau(t, b, c / b)``
(batch 1 at the fastest TP); ``lb`` is non-decreasing, summed as a step function on a
grid below it over each response's contexts: a bound on the longest response's time.

``bound = max(work, coupled, critical path)``. Every price is a lower bound for every
choice of line (``STEEPNESS``), so the best of those choices is kept. Everything comes
from the same :class:`~scheduler.perf_model.PerfModel` the simulator uses, so the bound
moves with it. What it cannot see (hence the gap to real schedules): which contexts
share a batch beyond ``p_min`` (the supply of short-context partners is finite), and
whole instances on whole nodes.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from orchestrrl import errors
from scheduler.perf_model import PerfModel
from sim_backends.clustersim.generation import PREFILL_CHUNK

GRID_TOKENS = 256  # spacing of the critical path's context grid
BIN_TOKENS = 16  # width of the context bins of the work and the coupled bound
# the prices of a request's own time tried (GPUs: GPU-seconds per second of its time)
NU_GRID = (0.0, *(float(v) for v in np.geomspace(1e-2, 1e4, 49)))
# how steeply a batch's price line rises past its KV limit (None: the tangent at the
# reference context); every choice is a valid bound, the best is kept
STEEPNESS: tuple[float | None, ...] = (None, 0.6, 0.7, 0.8, 0.85, 0.9)
COUPLED_CHOICES = 2  # of those, the ones with the highest work bound go on to step 5

Array = NDArray[np.float64]


@dataclass(frozen=True)
class FluidBound:
    seconds: float  # max(work_s, path_s, coupled_s)
    work_s: float  # GPU-seconds (decode and prefill) lower bound / generation GPUs
    path_s: float  # the longest response's own decode time lower bound
    coupled_s: float  # work and every response's own time together (the drain)
    reference_context: float
    prefill_s: float  # the prefill's part of work_s


def _terms(perf: PerfModel, tp: int, batch: int) -> Array:
    """(C0, C1, M0, M1, K + A, H, O, cal) of ``decode_breakdown(tp, batch, x)``: compute
    ``C0 + C1 x`` and memory ``M0 + M1 x`` in the mean context ``x``, the rest constant.
    Checked at a third context (the model's compute and memory terms are affine in it)."""
    b0 = perf.decode_breakdown(tp, batch, 0.0)
    b1 = perf.decode_breakdown(tp, batch, 1.0)
    probe = perf.decode_breakdown(tp, batch, 8192.0)
    c1, m1 = b1.compute_s - b0.compute_s, b1.memory_s - b0.memory_s
    affine = math.isclose(
        b0.compute_s + 8192.0 * c1, probe.compute_s, rel_tol=1e-9
    ) and math.isclose(b0.memory_s + 8192.0 * m1, probe.memory_s, rel_tol=1e-9)
    rest_same = (
        probe.kernels_s == b0.kernels_s
        and probe.allreduce_s == b0.allreduce_s
        and probe.host_s == b0.host_s
        and probe.overhead_s == b0.overhead_s
        and probe.calibration == b0.calibration
    )
    if not (affine and rest_same and c1 >= 0.0 and m1 >= 0.0):
        raise errors.FailedPrecondition(
            f"the performance model's decode terms are not affine and non-decreasing in "
            f"the context at TP{tp} batch {batch}: the fluid bound's derivation does not hold"
        )
    return np.array(
        [
            b0.compute_s,
            c1,
            b0.memory_s,
            m1,
            b0.kernels_s + b0.allreduce_s,
            b0.host_s,
            b0.overhead_s,
            b0.calibration,
        ]
    )


@functools.lru_cache(maxsize=32)
def prefill_gpu_s_per_token(perf: PerfModel, tps: tuple[int, ...]) -> float:
    """The fewest GPU-seconds per prompt token any prefill chunk costs: the minimum of
    ``t * prefill_time(t, n) / n`` over ``t`` in ``tps`` and every chunk size ``n`` the
    simulator uses (1 .. ``PREFILL_CHUNK``)."""
    best = math.inf
    for t in tps:
        for n in range(1, PREFILL_CHUNK + 1):
            best = min(best, t * perf.prefill_time(t, n) / n)
    return best


@dataclass(frozen=True)
class _Configs:
    """Every (TP, batch) a schedule may run, as parallel arrays (one row each)."""

    tp: Array
    batch: Array
    terms: Array  # rows of _terms
    x_hi: Array  # the largest mean context the batch's KV cache allows (inf: no limit)

    def tau(self, x: Array) -> Array:
        """Iteration time of every row at mean contexts ``x`` (rows x columns)."""
        c0, c1, m0, m1, ka, host, over, cal = (v[:, None] for v in self.terms.T)
        gpu = np.maximum(c0 + c1 * x, m0 + m1 * x) + ka
        return np.asarray((np.maximum(gpu, host) + over) * cal)


def _configs(perf: PerfModel, tps: Sequence[int], max_num_seqs: int, p_min: int) -> _Configs:
    tp: list[float] = []
    batch: list[float] = []
    x_hi: list[float] = []
    rows: list[Array] = []
    for t in tps:
        cap_b = min(max_num_seqs, perf.max_num_seqs(t))
        # KV overshoot the simulator allows: after an iteration that leaves the cache
        # over capacity it preempts one sequence (context >= p_min) per iteration while
        # the batch still grows by its size; the excess is at most sum_k (k - p_min)^+
        m = max(0, cap_b - p_min)
        smax = perf.kv_capacity_tokens(t) + m * (m + 1) / 2.0
        for b in range(1, cap_b + 1):
            hi = math.inf if b == 1 else smax / b
            if hi < p_min:
                break  # no batch this large fits (nor any larger one)
            tp.append(float(t))
            batch.append(float(b))
            x_hi.append(hi)
            rows.append(_terms(perf, t, b))
    return _Configs(np.array(tp), np.array(batch), np.array(rows), np.array(x_hi))


def _lines(cfg: _Configs, ref: float, p_min: float, steep: float | None) -> tuple[Array, Array]:
    """Per row the price line ``a + s * c`` of a token of context ``c`` (GPU-seconds)."""
    c0, c1, m0, m1, ka, host, over, cal = cfg.terms.T
    hi = cfg.x_hi
    if steep is None:
        x = np.minimum(np.maximum(ref, p_min), hi)
    else:
        x = np.where(np.isfinite(hi), hi, max(ref, p_min))
    comp = c0 + c1 * x + ka
    mem = m0 + m1 * x + ka
    use_host = host >= np.maximum(comp, mem)
    use_comp = ~use_host & (comp >= mem)
    alpha = np.where(use_host, host, np.where(use_comp, c0 + ka, m0 + ka)) + over
    slope = np.where(use_host, 0.0, np.where(use_comp, c1, m1))
    scale = cal * cfg.tp / cfg.batch
    a = scale * alpha  # per token: a + s * (its own context)
    s = scale * slope
    if steep is not None:
        # through (hi, phi(hi)) with a steeper slope: valid below hi only, which is all
        # a batch's mean context can reach
        lim = np.isfinite(hi) & (hi > p_min)
        at_hi = a + s * np.where(lim, hi, 0.0)
        steeper = np.maximum(s, steep * at_hi / np.where(lim, hi - p_min, 1.0))
        s = np.where(lim, steeper, s)
        a = np.where(lim, at_hi - s * hi, a)
    return a, s


def _coupled(big: Array, nus: Array, prefill: float, gpus: int) -> float:
    """The largest ``T`` with ``prefill + sum_i max_k (big[i, k] - nus[k] T) >= gpus T``
    (step 5; ``nus[0] == 0``, so the work bound is where the search starts)."""

    def slack(t: float) -> float:
        return prefill + float((big - nus[None, :] * t).max(axis=1).sum()) - gpus * t

    lo = (prefill + float(big[:, 0].sum())) / gpus
    hi = 2.0 * lo + 1.0
    while slack(hi) >= 0.0:
        lo, hi = hi, 2.0 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if slack(mid) >= 0.0:
            lo = mid
        else:
            hi = mid
    return lo


def _critical_path(cfg: _Configs, reqs: Sequence[tuple[int, int]], top: int) -> float:
    """Step 7: the longest response's own decode time, ``lb`` held flat on a grid."""
    grid = list(range(0, top + GRID_TOKENS, GRID_TOKENS))
    ctx = np.array(grid, dtype=np.float64)
    lb = [float(v) for v in cfg.tau(ctx[None, :] / cfg.batch[:, None]).min(axis=0)]
    prefix = [0.0]
    for k in range(len(grid) - 1):
        prefix.append(prefix[-1] + lb[k] * (grid[k + 1] - grid[k]))

    def path(p: int, n: int) -> float:
        # sum of the step function over contexts p .. p + n - 1
        end = p + n
        i = bisect.bisect_right(grid, p) - 1
        j = bisect.bisect_right(grid, end) - 1
        if i == j:
            return lb[i] * n
        total = lb[i] * (grid[i + 1] - p) + (prefix[j] - prefix[i + 1])
        return total + lb[j] * (end - grid[j])

    return max(path(p, n) for p, n in reqs)


def fluid_bound(
    perf: PerfModel,
    requests: Sequence[tuple[int, int]],
    gpus: int,
    tps: Sequence[int],
    max_num_seqs: int,
) -> FluidBound:
    """Lower bound on the generation time of ``requests`` ((prompt tokens, response
    tokens) each) on ``gpus`` GPUs by any schedule whose instances use TP degrees from
    ``tps`` and run at most ``min(max_num_seqs, perf.max_num_seqs(t))`` sequences (the
    simulator's cap). The argument is the module docstring's."""
    for p, n in requests:
        if p < 0 or n < 0:
            raise errors.field_error("requests", (p, n), "(prompt, response) tokens >= 0")
    if not tps or any(t < 1 for t in tps):
        raise errors.field_error("tps", tuple(tps), "one or more TP degrees >= 1")
    if max_num_seqs < 1:
        raise errors.field_error("max_num_seqs", max_num_seqs, ">= 1")
    reqs = [(p, n) for p, n in requests if n > 0]
    if not reqs or gpus <= 0:
        return FluidBound(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    tps = tuple(sorted(set(tps)))
    prompts = np.array([p for p, _ in reqs], dtype=np.float64)
    lens = np.array([n for _, n in reqs], dtype=np.float64)
    p_min = int(prompts.min())
    ref = float((lens * (prompts + (lens - 1) / 2.0)).sum() / lens.sum())
    cfg = _configs(perf, tps, max_num_seqs, p_min)
    prefill = prefill_gpu_s_per_token(perf, tps) * float(prompts.sum())

    # context bins [j w, (j + 1) w): a token is priced at its bin's lower edge (step 6)
    w = BIN_TOKENS
    top = int((prompts + lens).max())
    edges = np.arange(-(-top // w), dtype=np.float64) * w
    others = (cfg.batch[:, None] - 1.0) * p_min  # the rest of the batch: >= p_min each
    kv = np.where(cfg.batch == 1.0, math.inf, cfg.x_hi * cfg.batch)[:, None]
    fits = edges[None, :] + others <= kv
    d = np.where(fits, cfg.tau((edges[None, :] + others) / cfg.batch[:, None]), math.inf)
    # each request's tokens per bin: part of its first bin, whole bins, part of its last
    start, end = prompts, prompts + lens
    j0 = (start // w).astype(np.int64)
    j1 = ((end - 1) // w).astype(np.int64)
    first = np.minimum(end, (j0 + 1) * w) - start
    last = np.where(j1 > j0, end - np.maximum(start, j1 * w), 0.0)
    nus = np.array(NU_GRID)

    def per_request(m: Array) -> Array:
        """Sum of ``m`` (bins x columns) over each request's tokens (requests x columns)."""
        cum = np.vstack([np.zeros((1, m.shape[1])), np.cumsum(m * w, axis=0)])
        out = first[:, None] * m[j0] + (cum[j1] - cum[np.minimum(j0 + 1, j1)])
        return np.asarray(out + last[:, None] * m[j1])

    prices = []
    for steep in STEEPNESS:
        a, s = _lines(cfg, ref, p_min, steep)
        g = np.where(fits, a[:, None] + s[:, None] * edges[None, :], math.inf)
        work = (prefill + float(per_request(g.min(axis=0)[:, None]).sum())) / gpus
        prices.append((work, g))
    prices.sort(key=lambda wg: -wg[0])
    work_s = prices[0][0]
    coupled_s = 0.0
    for _, g in prices[:COUPLED_CHOICES]:  # every choice is valid; the costly step for few
        m = np.stack([(g + nu * d).min(axis=0) if nu > 0 else g.min(axis=0) for nu in nus], 1)
        coupled_s = max(coupled_s, _coupled(per_request(m), nus, prefill, gpus))
    path_s = _critical_path(cfg, reqs, top)
    return FluidBound(
        max(work_s, path_s, coupled_s), work_s, path_s, coupled_s, ref, prefill / gpus
    )


__all__ = ["FluidBound", "fluid_bound", "prefill_gpu_s_per_token"]

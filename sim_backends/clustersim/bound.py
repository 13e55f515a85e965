"""The fluid lower bound on a step's generation time under the performance model.

A relaxation of the simulator: no reshard pauses, no move costs, no whole instances (any
token may run at any TP degree and batch at any moment) and no KV-capacity limit; only
``max_num_seqs`` caps a batch, and every response still needs one decode iteration per
token. Prefill is left out (it only adds time). The bound is the larger of two:

**Work.** An iteration of an instance of TP ``t`` with batch ``b`` whose contexts sum to
``S`` occupies ``t`` GPUs for ``tau(t, b, S/b)``
(:meth:`PerfModel.decode_iteration_time`), which is
``(max(max(C, M) + K + A, H) + O) * cal`` with ``C`` (compute) and ``M`` (memory)
affine in ``S`` and the other terms independent of it. So ``G(S) = t * tau`` is at least
each of its affine pieces ``alpha + beta * S`` (``C + K + A + O``, ``M + K + A + O`` or
``H + O``, times ``cal * t``). Taking, per ``(t, b)``, the piece that is active at a
reference context ``c*`` (any choice is valid; the workload's token-weighted mean
context makes it tight), an iteration costs at least
``sum over its b tokens of (alpha / b + beta * c_i)`` GPU-seconds, hence at least
``sum_i h(c_i)`` with ``h(c) = min over (t, b) of (alpha / b + beta * c)``. ``h`` is a
minimum of affine functions, hence concave, so a response of ``L`` tokens from prompt
``p`` (contexts ``p .. p + L - 1``) needs at least ``L * (h(p) + h(p + L - 1)) / 2``
GPU-seconds (the chord lies below a concave function). Summed over the step's responses
and divided by the generation GPUs, that is a time no schedule can beat. The simulator
evaluates an iteration at its batch's mean context and a segment by the trapezoid rule,
which for the (convex) iteration time is never below the exact sum; it only adds pauses,
prefills and idle GPUs.

**Critical path.** A response's token at context ``c`` shares its iteration with
``b - 1`` others, whose contexts sum to at least 0, and every term of ``tau`` is
non-decreasing in the batch's context sum, so that iteration takes at least
``lb(c) = min over (t, b) of tau(t, b, c / b)``. ``lb`` is non-decreasing in ``c``;
evaluated on a grid of contexts and held flat to the next grid point it stays below
itself, so summing it over ``p .. p + L - 1`` bounds the response's own decode time.

``bound = max(work / GPUs, longest critical path)``. Everything comes from the same
:class:`~scheduler.perf_model.PerfModel` the simulator uses, so the bound moves with it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from orchestrrl import errors
from scheduler.perf_model import PerfModel

GRID_TOKENS = 256  # spacing of the critical path's context grid


@dataclass(frozen=True)
class FluidBound:
    seconds: float  # max(work_s, path_s)
    work_s: float  # the step's GPU-seconds lower bound / generation GPUs
    path_s: float  # the longest response's own decode time lower bound
    reference_context: float


def _terms(perf: PerfModel, tp: int, batch: int) -> NDArray[np.float64]:
    """(C0, C1, M0, M1, K + A, H, O, cal) of ``decode_breakdown(tp, batch, c)``: compute
    ``C0 + C1 c`` and memory ``M0 + M1 c`` in the mean context ``c``, the rest constant.
    Checked at a third context (the model's compute and memory terms are affine in it)."""
    b0 = perf.decode_breakdown(tp, batch, 0.0)
    b1 = perf.decode_breakdown(tp, batch, 1.0)
    probe = perf.decode_breakdown(tp, batch, 8192.0)
    c1, m1 = b1.compute_s - b0.compute_s, b1.memory_s - b0.memory_s
    affine = math.isclose(
        b0.compute_s + 8192.0 * c1, probe.compute_s, rel_tol=1e-9
    ) and math.isclose(b0.memory_s + 8192.0 * m1, probe.memory_s, rel_tol=1e-9)
    if not affine:
        raise errors.FailedPrecondition(
            f"the performance model's decode terms are not affine in the context at "
            f"TP{tp} batch {batch}: the fluid bound's derivation does not hold"
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


def fluid_bound(
    perf: PerfModel,
    requests: Sequence[tuple[int, int]],
    gpus: int,
    tps: Sequence[int],
    max_num_seqs: int,
) -> FluidBound:
    """Lower bound on the generation time of ``requests`` ((prompt tokens, response
    tokens) each) on ``gpus`` GPUs using TP degrees ``tps``; ``max_num_seqs`` is the
    largest batch an instance may run (a larger value only lowers the bound)."""
    reqs = [(p, n) for p, n in requests if n > 0]
    if not reqs or gpus <= 0:
        return FluidBound(0.0, 0.0, 0.0, 0.0)
    tokens = sum(n for _, n in reqs)
    ref = sum(n * (p + (n - 1) / 2.0) for p, n in reqs) / tokens
    tb = [(t, b) for t in tps for b in range(1, max(max_num_seqs, perf.max_num_seqs(t)) + 1)]
    terms = np.array([_terms(perf, t, b) for t, b in tb])
    tp = np.array([float(t) for t, _ in tb])
    batch = np.array([float(b) for _, b in tb])
    c0, c1, m0, m1, ka, host, over, cal = terms.T

    def tau(x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Iteration time of every (TP, batch) (rows) at mean contexts ``x`` (columns)."""
        comp = c0[:, None] + c1[:, None] * x
        mem = m0[:, None] + m1[:, None] * x
        gpu = np.maximum(comp, mem) + ka[:, None]
        return np.asarray((np.maximum(gpu, host[:, None]) + over[:, None]) * cal[:, None])

    # work: per (t, b) the affine piece of t * tau active at the reference context
    comp_r = c0 + c1 * ref + ka + over
    mem_r = m0 + m1 * ref + ka + over
    host_r = host + over
    use_host = host_r >= np.maximum(comp_r, mem_r)
    use_comp = ~use_host & (comp_r >= mem_r)
    alpha = np.where(use_host, host_r, np.where(use_comp, c0 + ka + over, m0 + ka + over))
    slope = np.where(use_host, 0.0, np.where(use_comp, c1, m1))
    a = cal * tp * alpha / batch  # per token: a + s * (its own context)
    sl = cal * tp * slope / batch
    ends = np.array([[p, p + n - 1] for p, n in reqs], dtype=np.float64)
    counts = np.array([n for _, n in reqs], dtype=np.float64)
    h = np.empty_like(ends)
    for k in range(0, len(reqs), 1024):  # min over the lines, in chunks
        block = ends[k : k + 1024].ravel()
        h[k : k + 1024] = (a[:, None] + sl[:, None] * block).min(axis=0).reshape(-1, 2)
    work = float((counts * (h[:, 0] + h[:, 1]) / 2.0).sum())
    # the critical path: lb on a grid, a step function below lb (lb is non-decreasing)
    top = max(p + n for p, n in reqs)
    grid = list(range(0, top + GRID_TOKENS, GRID_TOKENS))
    ctx = np.array(grid, dtype=np.float64)
    lb = [float(v) for v in tau(ctx[None, :] / batch[:, None]).min(axis=0)]
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

    longest = max(path(p, n) for p, n in reqs)
    work_s = work / gpus
    return FluidBound(max(work_s, longest), work_s, longest, ref)


__all__ = ["FluidBound", "fluid_bound"]

"""Training traffic under a parallelism layout: compute time and the collectives of one
RL step's training, as node-to-node transfers the fabrics time.

Strategies (``Parallelism.strategy``), on ``n`` training nodes of ``g`` GPUs (rank order =
the order of the training nodes given; node-level collectives as in
:mod:`.collectives`):

- ``megatron``: tensor parallelism inside a node (``tp`` divides ``g``; its traffic stays
  on NVLink), ``pp`` pipeline stages (stage ``s`` = the ``s``-th block of ``n/pp`` nodes,
  Megatron's rank order with PP slowest), data parallelism with ZeRO-1 (distributed
  optimizer) over the ``n/pp`` nodes of a stage: per optimizer step a reduce-scatter of
  the gradients and an all-gather of the parameters, the bytes of an all-reduce of the
  stage's ``params/pp x grad bytes`` per node. Stage boundaries carry activations
  forward and their gradients backward (``tokens x hidden x bytes`` each). The pipeline
  bubble adds ``(pp-1)/m`` of the compute (``m`` micro-batches per replica).
- ``fsdp`` (ZeRO-3, verl's default trainer): the parameters sharded over every training
  GPU; per micro-batch (``micro_batch_tokens`` per GPU, verl's
  ``ppo_max_token_len_per_gpu``) an all-gather of the weights in the forward, another in
  the backward and a reduce-scatter of the gradients; the log-prob pass gathers once per
  micro-batch.
- ``ep`` (MoE): expert parallelism over groups of ``ep`` GPUs (consecutive ranks; a
  group of ``ep/g`` nodes), attention and router data-parallel (ZeRO-1) over every
  training GPU; per pass an all-to-all inside each group (dispatch + combine of every
  token's ``active_experts`` hidden states, :func:`.models.a2a_bytes_per_token_layer`,
  every layer); gradients of the dense part all-reduced over all nodes and those of the
  experts over the nodes holding the same experts (one per expert-parallel group).

Compute: ``6 x active params x tokens`` per update over the training pool at the
performance model's training MFU, plus ``2 x active params x tokens`` for the log-prob
pass of the old policy (and as much for a reference model). Communication of a mini-batch
is the sum of its collectives (one after another on the network), each the fabric's time
for its transfers plus ``calls x latency steps x network latency``. Exposed
communication = ``max(0, communication - overlap x compute)`` per mini-batch and for the
log-prob pass (``overlap`` in [0, 1]: the share of compute that communication can hide
behind; 0 = none, the simulator's conservative default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from orchestrrl import errors
from scheduler.perf_model import ModelShape
from sim_backends.clustersim.collectives import (
    ALGORITHMS,
    CollectiveTraffic,
    all_to_all,
    allgather,
    allreduce,
    reduce_scatter,
)
from sim_backends.clustersim.fabrics import Transfer
from sim_backends.clustersim.models import a2a_bytes_per_token_layer

STRATEGIES = ("megatron", "fsdp", "ep")
ALGORITHM_CHOICES = (*ALGORITHMS, "auto")
TIMINGS = ("flow", "bottleneck")


@dataclass(frozen=True)
class Parallelism:
    """How the training pool runs; see the module doc. ``tp`` 0: every GPU of a node;
    ``ep`` 0: ``min(experts, all training GPUs)``; ``algorithm``: ``ring``, ``tree``
    (all-reduces; all-gathers and reduce-scatters, which have no tree algorithm, use
    ``ring``), ``hierarchical``, or ``auto`` (the fastest option of each collective);
    ``timing``: how the fabric times a collective, ``flow`` (the flow-level simulation)
    or ``bottleneck`` (its closed form, fast at thousands of GPUs)."""

    strategy: str = "megatron"
    tp: int = 0
    pp: int = 1
    ep: int = 0
    micro_batch_tokens: int = 16384
    overlap: float = 0.0
    algorithm: str = "ring"
    timing: str = "flow"

    def problems(self, shape: ModelShape, train_nodes: int, gpus_per_node: int) -> list[str]:
        """Every reason this layout cannot run ``shape`` on the pool (field, value,
        allowed)."""
        out: list[str] = []

        def bad(key: str, value: object, allowed: str) -> None:
            out.append(str(errors.field_error(f"parallelism.{key}", value, allowed)))

        if self.strategy not in STRATEGIES:
            bad("strategy", self.strategy, "one of " + ", ".join(STRATEGIES))
        if self.algorithm not in ALGORITHM_CHOICES:
            bad("algorithm", self.algorithm, "one of " + ", ".join(ALGORITHM_CHOICES))
        if self.timing not in TIMINGS:
            bad("timing", self.timing, "one of " + ", ".join(TIMINGS))
        if not 0.0 <= self.overlap <= 1.0:
            bad("overlap", self.overlap, "a number in [0, 1]")
        if self.micro_batch_tokens < 1:
            bad("micro_batch_tokens", self.micro_batch_tokens, "an integer >= 1")
        g = gpus_per_node
        if self.tp and (self.tp > g or g % self.tp):
            bad("tp", self.tp, f"0 (a whole node) or a divisor of gpus_per_node ({g})")
        if self.pp < 1 or train_nodes % self.pp:
            bad("pp", self.pp, f"a divisor of the training nodes ({train_nodes})")
        if self.strategy != "megatron" and self.pp != 1:
            bad("pp", self.pp, "1 unless strategy = megatron")
        if self.strategy == "ep":
            if not shape.moe:
                bad("strategy", "ep", f"a dense strategy: {shape.name} has no experts")
            ep = self.ep_gpus(shape, train_nodes * g)
            if self.ep and (
                ep > train_nodes * g or (ep > g and (ep % g or train_nodes % (ep // g)))
            ):
                bad(
                    "ep",
                    self.ep,
                    f"a divisor of gpus_per_node ({g}) or a multiple of it whose node "
                    f"count divides the training nodes ({train_nodes})",
                )
            if shape.moe and self.ep and shape.experts % min(self.ep, shape.experts):
                bad("ep", self.ep, f"a divisor of the experts ({shape.experts})")
        return out

    def ep_gpus(self, shape: ModelShape, train_gpus: int) -> int:
        return self.ep or min(shape.experts, train_gpus)


@dataclass(frozen=True)
class Pattern:
    """One collective of training: its traffic under each available algorithm, the
    collective calls it is issued in (for the latency term) and how often it runs per
    mini-batch and in the step's log-prob pass."""

    name: str
    collective: str  # all-reduce | all-gather | reduce-scatter | all-to-all | p2p
    options: tuple[CollectiveTraffic, ...]
    calls: int
    per_minibatch: float
    per_logprob: float

    def option(self, algorithm: str) -> CollectiveTraffic:
        """The traffic under ``algorithm`` (``tree`` falls back to ``ring`` where a
        collective has none; a pattern with one option always gives it)."""
        if len(self.options) == 1:
            return self.options[0]
        for o in self.options:
            if o.algorithm == algorithm:
                return o
        return next(o for o in self.options if o.algorithm == "ring")

    @property
    def nbytes(self) -> float:
        """Bytes of one occurrence on the network under its first option (ring/direct)."""
        return sum(t.nbytes for t in self.options[0].transfers)


@dataclass(frozen=True)
class TrainingTraffic:
    strategy: str
    mini_batches: int
    update_compute_s: float  # per mini-batch
    logprob_compute_s: float  # the step's log-prob (and reference) pass
    patterns: tuple[Pattern, ...]

    @property
    def compute_s(self) -> float:
        return self.mini_batches * self.update_compute_s + self.logprob_compute_s

    def demand(self, algorithm: str) -> list[Transfer]:
        """One RL step's training traffic under ``algorithm`` (``auto``: hierarchical),
        every transfer scaled by how often it runs: what an optical fabric plans its
        circuits for."""
        algo = "hierarchical" if algorithm == "auto" else algorithm
        out: list[Transfer] = []
        for p in self.patterns:
            times = p.per_minibatch * self.mini_batches + p.per_logprob
            if times > 0:
                out += [
                    Transfer(t.src, t.dst, t.nbytes * times, t.tag)
                    for t in p.option(algo).transfers
                ]
        return out


def training_traffic(
    shape: ModelShape,
    layout: Parallelism,
    nodes: Sequence[int],
    gpus_per_node: int,
    pod_of: Callable[[int], int],
    *,
    tokens: int,
    mini_batches: int,
    flops_per_gpu: float,
    grad_bytes_per_param: int = 2,
    reference_model: bool = False,
    gpus: int = 0,
    old_logprob: bool = True,
) -> TrainingTraffic:
    """The compute and collectives of training one RL step's batch of ``tokens`` on
    ``nodes`` (rank order) under ``layout``; ``flops_per_gpu`` = peak x training MFU.
    ``gpus``: the training GPUs when a node is shared with generation (fewer than
    ``nodes x gpus_per_node``; 0: every GPU of the nodes): compute is timed on them, the
    collectives on the nodes. ``old_logprob`` False: no pass recomputing the old policy's
    log-probabilities (the engines' own are used); a reference model's pass stays."""
    problems = layout.problems(shape, len(nodes), gpus_per_node)
    if problems:
        raise errors.InvalidArgument("; ".join(problems))
    if mini_batches < 1:
        raise errors.field_error("training.mini_batches", mini_batches, "an integer >= 1")
    n = len(nodes)
    if not 0 <= gpus <= n * gpus_per_node:
        raise errors.field_error("gpus", gpus, f"0 or at most the nodes' {n * gpus_per_node}")
    gpus = gpus or n * gpus_per_node
    tok_mb = tokens / mini_batches
    active = shape.active_params
    update = 6.0 * active * tok_mb / (gpus * flops_per_gpu)
    passes = (2.0 if old_logprob else 0.0) + (2.0 if reference_model else 0.0)
    logprob = passes * active * tokens / (gpus * flops_per_gpu)
    b, gb = shape.dtype_bytes, grad_bytes_per_param
    pats: list[Pattern] = []

    def reduce(name: str, group: Sequence[Sequence[int]], nbytes: float, calls: int) -> None:
        if nbytes <= 0 or max((len(x) for x in group), default=0) < 2:
            return
        opts = tuple(
            _merge([allreduce(list(x), nbytes, a, pod_of, name) for x in group], a)
            for a in ALGORITHMS
        )
        pats.append(Pattern(name, "all-reduce", opts, calls, 1.0, 0.0))

    if layout.strategy == "megatron":
        pp = layout.pp
        per = n // pp
        stages = [list(nodes[s * per : (s + 1) * per]) for s in range(pp)]
        reduce("dp-grad all-reduce (ZeRO-1)", stages, shape.params / pp * gb, 1)
        if pp > 1:
            act_mb = tok_mb / per * shape.hidden * b  # per node, per boundary
            act_lp = tokens / per * shape.hidden * b
            for label, nb, fwd_bwd in (
                ("pp activations", act_mb, True),
                ("pp activations (log-prob)", act_lp, False),
            ):
                ts: list[Transfer] = []
                for s in range(pp - 1):
                    for a, c in zip(stages[s], stages[s + 1], strict=True):
                        ts.append(Transfer(a, c, nb, label))
                        if fwd_bwd:
                            ts.append(Transfer(c, a, nb, label))
                opt = CollectiveTraffic("direct", tuple(ts), pp - 1)
                mb, lp = (1.0, 0.0) if fwd_bwd else (0.0, 1.0)
                pats.append(Pattern(label, "p2p", (opt,), 1, mb, lp))
            micro = max(1.0, tok_mb / per / gpus_per_node / layout.micro_batch_tokens)
            bubble = 1.0 + (pp - 1) / micro
            update *= bubble
            logprob *= bubble
    elif layout.strategy == "fsdp":
        weights = shape.params * b
        micro = math.ceil(tok_mb / gpus / layout.micro_batch_tokens)
        micro_lp = math.ceil(tokens / gpus / layout.micro_batch_tokens)
        if n > 1:
            ag = tuple(
                allgather(list(nodes), weights, a, pod_of, "fsdp all-gather")
                for a in ("ring", "hierarchical")
            )
            rs = tuple(
                reduce_scatter(list(nodes), shape.params * gb, a, pod_of, "fsdp reduce-scatter")
                for a in ("ring", "hierarchical")
            )
            pats.append(
                Pattern("fsdp all-gather", "all-gather", ag, shape.layers, 2.0 * micro, micro_lp)
            )
            pats.append(
                Pattern("fsdp reduce-scatter", "reduce-scatter", rs, shape.layers, micro, 0.0)
            )
    else:  # ep
        ep_nodes = max(1, layout.ep_gpus(shape, gpus) // gpus_per_node)
        groups = [list(nodes[i : i + ep_nodes]) for i in range(0, n, ep_nodes)]
        if ep_nodes > 1:
            per_tok = shape.layers * a2a_bytes_per_token_layer(shape)
            for label, tok, mb, lp in (
                ("ep all-to-all", tok_mb, 2.0, 0.0),
                ("ep all-to-all (log-prob)", tokens, 0.0, 1.0),
            ):
                opt = all_to_all(groups, tok / n * per_tok, label)
                pats.append(Pattern(label, "all-to-all", (opt,), 2 * shape.layers, mb, lp))
        reduce("dense-grad all-reduce (ZeRO-1)", [list(nodes)], shape.dense_params * gb, 1)
        ep = layout.ep_gpus(shape, gpus)
        held = shape.all_expert_params * min(1.0, gpus_per_node / ep)  # per node
        replicas = [list(nodes[j::ep_nodes]) for j in range(ep_nodes)]
        reduce("expert-grad all-reduce", replicas, held * gb, 1)
    return TrainingTraffic(layout.strategy, mini_batches, update, logprob, tuple(pats))


def _merge(parts: Sequence[CollectiveTraffic], algorithm: str) -> CollectiveTraffic:
    """Concurrent calls of one collective in disjoint groups, as one."""
    return CollectiveTraffic(
        algorithm,
        tuple(t for p in parts for t in p.transfers),
        max((p.steps for p in parts), default=0),
    )


@dataclass(frozen=True)
class TrainingTime:
    """One RL step's training on a fabric (seconds). ``algorithm``: what the run used
    (``auto``: per collective, in ``choices``)."""

    algorithm: str
    compute_s: float
    comm_s: float
    exposed_s: float
    pattern_s: Mapping[str, float]  # per pattern, all its occurrences in the step
    choices: Mapping[str, str]  # per pattern, the algorithm used

    @property
    def train_s(self) -> float:
        return self.compute_s + self.exposed_s


def time_training(
    traffic: TrainingTraffic,
    seconds_of: Callable[[Sequence[Transfer]], float],
    *,
    algorithm: str,
    overlap: float,
    latency_s: float,
) -> TrainingTime:
    """Time ``traffic`` with ``seconds_of`` (the fabric's time for transfers started
    together) under ``algorithm`` (``auto``: each collective's fastest option)."""
    if algorithm not in ALGORITHM_CHOICES:
        raise errors.field_error("algorithm", algorithm, "one of " + ", ".join(ALGORITHM_CHOICES))
    mb_comm = lp_comm = 0.0
    per: dict[str, float] = {}
    choices: dict[str, str] = {}
    for p in traffic.patterns:
        opts = p.options if algorithm == "auto" else (p.option(algorithm),)
        timed = [(seconds_of(o.transfers) + p.calls * o.steps * latency_s, o) for o in opts]
        t, o = min(timed, key=lambda x: x[0])
        choices[p.name] = o.algorithm
        mb_comm += p.per_minibatch * t
        lp_comm += p.per_logprob * t
        per[p.name] = (p.per_minibatch * traffic.mini_batches + p.per_logprob) * t
    exposed = traffic.mini_batches * max(0.0, mb_comm - overlap * traffic.update_compute_s)
    exposed += max(0.0, lp_comm - overlap * traffic.logprob_compute_s)
    return TrainingTime(
        algorithm=algorithm,
        compute_s=traffic.compute_s,
        comm_s=traffic.mini_batches * mb_comm + lp_comm,
        exposed_s=exposed,
        pattern_s=per,
        choices=choices,
    )

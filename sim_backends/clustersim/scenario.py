"""Scenario files of the cluster simulator: TOML in, frozen values out.

Everything is validated before anything runs: unknown keys (at every level), wrong
types, negative or zero sizes, and splits that need more GPUs than the cluster has are
reported together, each naming the field, the value and what is allowed.

A scenario (every key optional except ``cluster.nodes``; defaults below)::

    name = "compute-14b"
    seed = 1
    steps = 4                      # RL steps simulated

    [cluster]
    nodes = 8
    gpus_per_node = 8
    nics_per_node = 8
    nic_gbps = 400.0
    nodes_per_pod = 16             # optional: the fabric module's default otherwise
    hardware = "H800-SXM"          # scheduler.perf_model.HARDWARE

    [model]
    name = "Qwen2.5-14B"           # scheduler.perf_model.MODELS (MoE: "Qwen3-235B-A22B")

    [split]                        # disaggregation: whole nodes per pool (by default)
    train_gpus = 16
    gen_gpus = 48
    choose = "fixed"               # or "auto" / "plan": see SplitConfig
    unit_gpus = 0                  # 0: whole nodes; e.g. 2: pools may share a node
    sweep_train_gpus = [8, 16, 24] # only with choose = "auto"

    [workload]   ...  see WorkloadConfig
    [generation] ...  see GenerationConfig
    [training]   ...  see TrainingConfig
    [parallelism] ... see sim_backends.clustersim.parallel.Parallelism
    [fabric]     ...  see FabricConfig
    [rollout]    ...  see RolloutConfig (full, partial or asynchronous rollout)
    [async]      ...  see AsyncConfig (the asynchronous mode's weights, tail and split)

Defaults and their public basis are documented on each dataclass.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from orchestrrl import errors
from scheduler.async_rollout import MAX_LAG_LIMIT, MAX_LEASE_S, AsyncPolicy, Pull, WeightUpdate
from scheduler.perf_model import HARDWARE, MODELS, default_model
from scheduler.rollout import (
    MAX_OVER_PROVISION,
    MAX_STALENESS_LIMIT,
    MIN_OVER_PROVISION,
    RolloutRule,
    build_rule,
)
from sim_backends.clustersim.models import SHAPES
from sim_backends.clustersim.parallel import Parallelism

# divided rollout: a chunk shorter than this would move requests every few seconds
MIN_CHUNK_TOKENS = 256
POLICIES = ("static", "proactive", "reactive", "adaptive", "prompt-oracle", "oracle")
SPLIT_CHOICES = ("fixed", "auto", "plan")
PLACEMENTS = ("contiguous", "scattered")
FABRIC_KINDS = ("fat-tree", "fat-tree-oversub", "rail-optimised", "static-optical", "rfabric")


@dataclass(frozen=True)
class ClusterConfig:
    """GPU servers. Defaults: an H800 node of 8 GPUs with 8 x 400 Gb/s RDMA NICs
    (MISSION.md). ``nodes_per_pod`` 0 means the fabric module's documented default."""

    nodes: int
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 400.0
    nodes_per_pod: int = 0
    hardware: str = "H800-SXM"

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ModelConfig:
    name: str = "Qwen2.5-14B"


@dataclass(frozen=True)
class SplitConfig:
    """GPUs of the training and the generation pool (whole nodes each). 0 for both means
    a quarter of the nodes train and the rest generate: generation dominates RL step
    time, and asynchronous RL systems give it most of the GPUs (an assumption; the
    sensitivity experiment sweeps the split).

    ``choose``: ``fixed`` runs that split; ``auto`` keeps the pool total
    (``train_gpus + gen_gpus``) and picks the split of it that minimises the best static
    layout's mean steady step time in the one-step-asynchronous pipeline (every whole-node
    split, or the training-pool sizes listed in ``sweep_train_gpus``; ties go to the split
    with more generation GPUs). The rule is :func:`~.pipeline.choose_split`, with
    hindsight (every split simulated). ``plan``: starts on this split and lets the step
    planner (:mod:`scheduler.step_plan`) move whole nodes between the pools from the third
    step on, from its forecast and what the last step measured (no hindsight).

    ``placement``: ``contiguous`` (the training pool fills whole pods first, generation
    the pods after) or ``scattered`` (training ranks dealt round-robin over the pods, as a
    shared cluster's scheduler hands out free nodes); see :func:`~.pipeline.pools`.

    ``unit_gpus``: the granularity of the split (0: whole nodes, the default). A divisor
    of ``cluster.gpus_per_node`` whose GPUs own whole NICs (``unit_gpus x nics_per_node``
    a multiple of ``gpus_per_node``; with the default one NIC per GPU, any divisor): the
    pools may then share one node, its GPUs in two parts, each with its own NICs (the two
    pools share only the node's NVSwitch, which is non-blocking, and its host). Both pools
    are multiples of the unit and together whole nodes. The simulator takes the shared
    node's network as the training pool's (generation has no network traffic in this
    model; the generation GPUs there get the weights over NVLink) and times training's
    compute on its exact GPU count; ``auto`` and ``plan`` move the split by units.
    """

    train_gpus: int = 0
    gen_gpus: int = 0
    choose: str = "fixed"
    sweep_train_gpus: tuple[int, ...] = ()
    placement: str = "contiguous"
    unit_gpus: int = 0

    @property
    def total_gpus(self) -> int:
        return self.train_gpus + self.gen_gpus

    def unit(self, gpus_per_node: int) -> int:
        """GPUs the split moves by: ``unit_gpus``, or a whole node."""
        return self.unit_gpus or gpus_per_node

    def candidates(self, gpus_per_node: int) -> tuple[SplitConfig, ...]:
        """The splits ``auto`` chooses from, fewest training GPUs first (just this split
        when ``fixed``)."""
        if self.choose != "auto":
            return (self,)
        total = self.total_gpus
        u = self.unit(gpus_per_node)
        trains = self.sweep_train_gpus or tuple(range(u, total, u))
        return tuple(
            SplitConfig(t, total - t, placement=self.placement, unit_gpus=self.unit_gpus)
            for t in sorted(trains)
        )


@dataclass(frozen=True)
class WorkloadConfig:
    """GRPO steps: ``prompts_per_step`` prompts x ``samples_per_prompt`` responses.

    Response length of a sample = ``median_response_tokens`` x prompt difficulty x
    sample noise (both log-normal, sigmas below), capped at ``max_response_tokens``;
    the median grows by ``drift_per_step`` (relative) every step.

    Basis: DAPO (arXiv 2503.14476) trains Qwen2.5-32B with 16 samples per prompt and
    a 20,480-token generation limit, and its mean response length grows steadily during
    training (its Figure on response length); verl's GRPO examples use
    ``rollout.n`` = 5-16. The median (1,500 tokens), the sigmas and the drift are this
    simulator's assumptions, stated here and not tuned to any result.

    ``dataset_prompts``: 0 draws fresh prompts every step; ``N > 0`` walks a dataset of
    ``N`` prompts in a seeded shuffled order per epoch (a DataLoader with shuffle and
    drop_last: ``N // prompts_per_step`` steps per epoch; DAPO-Math-17k has ~17k prompts,
    so at 512 per step a prompt comes back every ~34 steps), each prompt keeping its
    difficulty across epochs. ``difficulty_drift_sigma``: the sd of a prompt's
    per-epoch change of difficulty (log scale, added to the persistent term): the policy
    is retrained between two occurrences. The default 0.3 makes the prompt term of two
    epochs correlate 0.6^2 / (0.6^2 + 0.3^2) = 0.8; an assumption, not fitted to a
    measurement. ``start_step``: the run's step the simulation starts at (a later epoch:
    the prompts have been met before), only with a dataset; ``median_response_tokens``
    is the median there. ``prompt_history``: the RL loop passes each prompt's lengths at
    its previous occurrence to the scheduler (false: the scheduler ignores them).
    """

    prompts_per_step: int = 64
    samples_per_prompt: int = 16
    prompt_tokens: int = 512
    prompt_sigma: float = 0.3
    median_response_tokens: float = 1500.0
    prompt_sigma_response: float = 0.6  # difficulty of a prompt (shared by its samples)
    sample_sigma: float = 0.8  # spread between samples of one prompt
    max_response_tokens: int = 20480
    drift_per_step: float = 0.05
    dataset_prompts: int = 0
    difficulty_drift_sigma: float = 0.3
    start_step: int = 0
    prompt_history: bool = True

    @property
    def requests_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclass(frozen=True)
class GenerationConfig:
    """Rollout instances and the compute scheduler.

        ``policy``: ``static`` (a fixed TP layout, the step's requests split evenly over the
        instances up front as verl does), ``proactive`` (the compute planner re-plans the
        layout and dispatch at every ``replan_interval_s``, no reactive moves of running
        requests), ``reactive`` (fixed layout; the planner's balancing moves requests off
        stragglers), ``adaptive`` (both), ``prompt-oracle`` (``adaptive`` told every
        prompt's difficulty, not each response's length: the ceiling of group-level
        length information), ``oracle`` (knows every response length: the
    clairvoyant baseline of :mod:`.oracle`). ``static_tp`` 0 picks the best uniform layout by
        simulating each (``orl-sim`` reports which). ``max_num_seqs``: vLLM's default 256.

        ``chunk_tokens``: Seer's divided rollout (arXiv 2511.14617, section 3.2; 0: off):
        a request generates at most this many tokens per dispatch, then goes on on the
        instance with the most room, its KV cache moved or recomputed at a migration's
        cost (:meth:`.generation.GenerationSim._next_chunk`). Any policy; at least 256.
    """

    policy: str = "adaptive"
    static_tp: int = 0
    initial_tp: int = 0  # adaptive policies start from this layout (0: same as static_tp)
    replan_interval_s: float = 5.0
    max_num_seqs: int = 256
    chunk_tokens: int = 0


@dataclass(frozen=True)
class TrainingConfig:
    """Training pool: ``mini_batches`` optimizer steps per RL step (verl's defaults
    ``train_batch_size`` 1024 / ``ppo_mini_batch_size`` 256 give 4), each followed by the
    data-parallel gradient reduce-scatter + all-gather over the network between nodes
    (model sharded by TP inside a node). FLOPs: 6 x params x tokens for the update plus
    2 x params x tokens to recompute the old policy's log-probabilities (plus as much
    again for a reference model when ``reference_model``; MoE: active parameters).
    ``model``: the shape trained (one of ``scheduler.perf_model.MODELS``, MoE
    Qwen3-235B-A22B and Qwen3-30B-A3B among them); empty: ``model.name``.
    ``old_logprob``: the trainer recomputes the old policy's log-probabilities (the 2 x
    params x tokens pass); false when the engines' own log-probs are used (verl's
    fully-async recipe: ``use_rollout_log_probs=True``). Generation is
    timed with ``model.name``'s performance model, which has a MoE decode: with
    ``model.name`` = Qwen3-235B-A22B the instances are one node each (experts over the
    node's GPUs, on NVLink; the regime map of ``orl-sim reproduce`` also times instances
    spanning nodes). A MoE ``training.model`` with a dense ``model.name`` sizes the
    training traffic and the weight sync only. The parallelism layout and its collectives are the
    ``[parallelism]`` table's."""

    mini_batches: int = 4
    reference_model: bool = False
    grad_bytes_per_param: int = 2
    model: str = ""
    old_logprob: bool = True


@dataclass(frozen=True)
class RolloutConfig:
    """When a step's generation ends (:mod:`scheduler.rollout`, the rule's reference).

    ``mode``: ``full`` (every group of the step completes: verl's synchronous rollout,
    run one step asynchronous here) or ``partial`` (a step ends by ``end`` and carries
    its unfinished responses into the next step on the new weights: Kimi k1.5, AReaL,
    APRIL, RollPacker). ``over_provision``: prompt groups kept in flight per group the
    trainer takes, 1.0-2.0 (APRIL and Seer's Partial Rollout baseline use 2.0,
    RollPacker 1.25; 1.0 in full mode). ``max_staleness``: weight versions a response may
    span beyond the pipeline's one-step lag, 0-16 (AReaL's eta; beyond it the response and
    its group are dropped and counted). ``end``: ``groups`` (default: once
    ``prompts_per_step`` groups are complete), ``tokens`` (``token_budget`` tokens
    generated in the step) or ``time`` (``time_budget_s`` seconds); empty: the mode's own.
    A partial step never ends before the trainer has finished the previous batch
    (generation goes on meanwhile). Carried requests recompute their KV cache on the new
    weights when admitted (a prefill of prompt and prefix, the migration path's
    recompute).

    ``async``: the trainer and the engines run at once (AReaL, verl's fully-async
    recipe); a step is one weight version. A new group starts only while the groups
    started stay within ``(version + 1 + bound) x prompts_per_step``: the bound is
    ``staleness_threshold`` (verl's fractional form, 0-16) when set, else
    ``max_staleness`` (AReaL's integer eta). How the weights reach the engines, the
    tail repack and the split planner are the ``[async]`` table's."""

    mode: str = "full"
    over_provision: float = 1.0
    max_staleness: int = 1
    end: str = ""
    token_budget: int = 0
    time_budget_s: float = 0.0
    staleness_threshold: float = 0.0

    def built(self) -> tuple[RolloutRule | None, list[str]]:
        return build_rule(
            mode=self.mode,
            end=self.end,
            over_provision=self.over_provision,
            max_staleness=self.max_staleness,
            token_budget=self.token_budget,
            time_budget_s=self.time_budget_s,
            staleness_threshold=self.staleness_threshold,
        )

    @property
    def rule(self) -> RolloutRule:
        """The validated rule (a parsed scenario's is always valid)."""
        rule, problems = self.built()
        if rule is None:
            raise errors.InvalidArgument("; ".join(problems))
        return rule


@dataclass(frozen=True)
class AsyncConfig:
    """The asynchronous mode (``rollout.mode = "async"``; :mod:`scheduler.async_rollout`).

    ``weight_update``: ``relay`` (the trainer pushes each version once to relay copies
    in the rollout nodes' memory, one head per rollout pod and a chain inside it, and goes
    on; an engine loads it when its batch drains, ``pull = "drain"``, or at once,
    aborting and resuming its requests, ``pull = "abort"``) or ``global`` (verl's: every
    engine paused for one sync, its running requests aborted and resumed with their KV
    recomputed). ``local_updates``: optimizer updates per version, each on
    ``prompts_per_step / local_updates`` groups as they complete (verl's
    ``trigger_parameter_sync_step``; each runs ``training.mini_batches`` optimizer
    steps). ``max_lag``: a group whose oldest token is more versions behind the trainer
    is dropped and counted (-1: none, as verl). ``repack``: the draining engines'
    requests move onto as few of them as hold them (best fit, KV moved) every
    ``repack_interval_s`` (5 s) and at each new version (engines at ``tail_fraction`` of
    their seats or below; 1.0: all), so the others load the new version and take fresh
    prompts; ``reshard``: whole nodes are emptied, and a node left with a tail reshards
    to one engine of the node's width when that frees it sooner
    (:func:`scheduler.repack.reshard_pays`). ``plan_split``: the split
    planner moves GPUs between the pools every ``plan_every`` versions, within
    ``min_train_gpus``..``max_train_gpus`` (0: unbounded). ``lease_s``: how long each
    weight-broadcast wave may hold extra circuits (0: none; optical fabrics only),
    ``repack_lease_s`` the same for bulk repack moves. ``versions``: weight versions
    simulated, ``warmup``: the first ones left out of every mean."""

    weight_update: str = "relay"
    pull: str = "drain"
    local_updates: int = 1
    max_lag: int = -1
    repack: bool = False
    reshard: bool = False
    tail_fraction: float = 1.0
    repack_interval_s: float = 5.0
    plan_split: bool = False
    plan_every: int = 2
    min_train_gpus: int = 0
    max_train_gpus: int = 0
    lease_s: float = 0.0
    repack_lease_s: float = 0.0
    versions: int = 8
    warmup: int = 2

    def built(self, gpus: int = 0, unit: int = 1) -> tuple[AsyncPolicy | None, list[str]]:
        """The policy, or None and every problem (``gpus``/``unit``: the split's)."""
        problems: list[str] = []
        updates = [w.value for w in WeightUpdate]
        pulls = [p.value for p in Pull]
        if self.weight_update not in updates:
            problems.append(
                str(
                    errors.field_error(
                        "async.weight_update", self.weight_update, "one of " + ", ".join(updates)
                    )
                )
            )
        if self.pull not in pulls:
            problems.append(
                str(errors.field_error("async.pull", self.pull, "one of " + ", ".join(pulls)))
            )
        if not 2 <= self.versions <= 1000:
            problems.append(
                str(
                    errors.field_error("async.versions", self.versions, "an integer from 2 to 1000")
                )
            )
        if not 0 <= self.warmup < self.versions:
            problems.append(
                str(
                    errors.field_error(
                        "async.warmup",
                        self.warmup,
                        f"an integer from 0 to versions - 1 ({self.versions - 1})",
                    )
                )
            )
        if problems:
            return None, problems
        policy = AsyncPolicy(
            WeightUpdate(self.weight_update),
            Pull(self.pull),
            self.local_updates,
            self.max_lag,
            self.repack,
            self.reshard,
            self.tail_fraction,
            self.repack_interval_s,
            self.plan_split,
            self.plan_every,
            self.min_train_gpus,
            self.max_train_gpus,
            self.lease_s,
            self.repack_lease_s,
        )
        problems = policy.problems("async", gpus, unit)
        return (None if problems else policy), problems


@dataclass(frozen=True)
class FabricConfig:
    """The network (see sim_backends.clustersim.fabrics). Defaults: a 3:1
    oversubscribed Fat-Tree when that kind is chosen; a 3D MEMS OCS of 320 ports
    switching in 10 ms (Calient-class, the paper's simulator assumption, MISSION.md)."""

    kind: str = "rfabric"
    oversubscription: float = 3.0
    ocs_switching_s: float = 0.010
    ocs_ports: int = 320
    reconfigure: bool = True
    optical_oversubscription: float = 1.0


@dataclass(frozen=True)
class Scenario:
    cluster: ClusterConfig
    name: str = "scenario"
    seed: int = 1
    steps: int = 4
    model: ModelConfig = ModelConfig()
    split: SplitConfig = SplitConfig()
    workload: WorkloadConfig = WorkloadConfig()
    generation: GenerationConfig = GenerationConfig()
    training: TrainingConfig = TrainingConfig()
    parallelism: Parallelism = field(default_factory=Parallelism)
    fabric: FabricConfig = FabricConfig()
    rollout: RolloutConfig = RolloutConfig()
    asynchronous: AsyncConfig = AsyncConfig()
    source: str = field(default="", compare=False)

    @property
    def train_nodes(self) -> int:
        """Nodes holding training GPUs (a node the pools share counts here: its network
        is the training pool's, see ``SplitConfig.unit_gpus``)."""
        return -(-self.split.train_gpus // self.cluster.gpus_per_node)

    @property
    def gen_nodes(self) -> int:
        """Nodes all of whose GPUs generate."""
        return self.split.gen_gpus // self.cluster.gpus_per_node

    @property
    def shared_gen_gpus(self) -> int:
        """Generation GPUs on the node the pools share (0: whole nodes)."""
        return self.split.gen_gpus % self.cluster.gpus_per_node


_SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "model": ModelConfig,
    "split": SplitConfig,
    "workload": WorkloadConfig,
    "generation": GenerationConfig,
    "training": TrainingConfig,
    "parallelism": Parallelism,
    "fabric": FabricConfig,
    "rollout": RolloutConfig,
    "async": AsyncConfig,
}
# a section whose field on Scenario has another name ("async" is a Python keyword)
_FIELD = {"async": "asynchronous"}
_TOP = {"name": str, "seed": int, "steps": int}

# (section, key) -> (minimum, inclusive) for numbers; everything else positive
_NON_NEGATIVE = {
    ("cluster", "nodes_per_pod"),
    ("split", "train_gpus"),
    ("split", "gen_gpus"),
    ("split", "unit_gpus"),
    ("generation", "static_tp"),
    ("generation", "initial_tp"),
    ("generation", "chunk_tokens"),
    ("workload", "prompt_sigma"),
    ("workload", "prompt_sigma_response"),
    ("workload", "sample_sigma"),
    ("workload", "drift_per_step"),
    ("workload", "dataset_prompts"),
    ("workload", "difficulty_drift_sigma"),
    ("workload", "start_step"),
    ("fabric", "ocs_switching_s"),
    ("parallelism", "tp"),
    ("parallelism", "ep"),
    ("parallelism", "overlap"),
}
# numbers whose range the section checks itself (scheduler.rollout), and the allowed
# values a wrong type is told
_OWN_RANGE = {
    ("rollout", "over_provision"): (
        f"a number from {MIN_OVER_PROVISION} to {MAX_OVER_PROVISION} "
        "(prompts started / prompts the trainer takes)"
    ),
    ("rollout", "max_staleness"): f"an integer from 0 to {MAX_STALENESS_LIMIT}",
    ("rollout", "token_budget"): 'an integer > 0 with rollout.end = "tokens", else 0',
    ("rollout", "time_budget_s"): 'a number > 0 with rollout.end = "time", else 0',
    ("rollout", "staleness_threshold"): f"a number from 0 to {MAX_STALENESS_LIMIT}",
    ("async", "local_updates"): "an integer from 1 to 64",
    ("async", "max_lag"): f"-1 (no limit) or an integer from 0 to {MAX_LAG_LIMIT}",
    ("async", "tail_fraction"): "a number in (0, 1]",
    ("async", "repack_interval_s"): "a number from 0.1 to 3600 seconds",
    ("async", "plan_every"): "an integer from 1 to 1000 versions",
    ("async", "min_train_gpus"): "0 (no bound) or a number of GPUs",
    ("async", "max_train_gpus"): "0 (no bound) or a number of GPUs",
    ("async", "lease_s"): f"a number from 0 (no lease) to {MAX_LEASE_S:g} seconds",
    ("async", "repack_lease_s"): f"a number from 0 (no lease) to {MAX_LEASE_S:g} seconds",
    ("async", "versions"): "an integer from 2 to 1000",
    ("async", "warmup"): "an integer from 0 to versions - 1",
}


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise errors.InvalidArgument(f"scenario {str(p)!r}: cannot read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise errors.InvalidArgument(f"scenario {str(p)!r}: not valid TOML: {exc}") from None
    return replace(parse_scenario(data, where=str(p)), source=str(p))


def parse_scenario(data: Mapping[str, Any], where: str = "scenario") -> Scenario:
    """Validate a parsed TOML document; every problem is reported at once."""
    problems: list[str] = []
    top: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    allowed_top = sorted([*_TOP, *_SECTIONS])
    for key, value in data.items():
        if key in _TOP:
            if _typed(key, value, _TOP[key], problems):
                top[key] = value
        elif key in _SECTIONS:
            if not isinstance(value, Mapping):
                problems.append(f"{key}={value!r} is not valid: a table [{key}]")
                continue
            built = _section(key, value, problems)
            if built is not None:
                sections[_FIELD.get(key, key)] = built
        else:
            problems.append(
                f"{key}={value!r} is not valid: unknown key; allowed: {', '.join(allowed_top)}"
            )
    if "cluster" not in data:
        problems.append("cluster is missing: a [cluster] table with at least nodes = N")
    for key in ("seed",):
        if key in top and top[key] < 0:
            problems.append(str(errors.field_error(key, top[key], "an integer >= 0")))
    if "steps" in top and top["steps"] < 1:
        problems.append(str(errors.field_error("steps", top["steps"], "an integer >= 1")))
    if "cluster" not in sections:
        raise _invalid(where, problems)
    # the sections that parsed are checked together (others at their defaults), so one
    # run reports every problem
    scenario = _default_split(Scenario(**sections, **top))
    _check_semantics(scenario, problems)
    if problems:
        raise _invalid(where, problems)
    return scenario


def _invalid(where: str, problems: list[str]) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"{where}: invalid scenario:\n" + "\n".join(f"  - {p}" for p in problems)
    )


def _typed(
    name: str, value: Any, kind: Any, problems: list[str], allowed: str | None = None
) -> bool:
    ok: bool
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        problems.append(str(errors.field_error(name, value, allowed or f"a {kind.__name__}")))
    return ok


_KINDS: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "tuple[int, ...]": tuple,
}


def _int_list(name: str, value: Any, problems: list[str]) -> bool:
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
    if not ok:
        problems.append(str(errors.field_error(name, value, "a list of integers")))
    return ok


def _section(name: str, table: Mapping[str, Any], problems: list[str]) -> Any:
    cls = _SECTIONS[name]
    kinds = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    before = len(problems)
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if key not in kinds:
            problems.append(
                f"{dotted}={value!r} is not valid: unknown key; allowed: "
                + ", ".join(sorted(kinds))
            )
            continue
        kind = _KINDS[str(kinds[key])]
        if kind is tuple:
            if not _int_list(dotted, value, problems):
                continue
            kwargs[key] = tuple(value)
            continue
        if not _typed(dotted, value, kind, problems, _OWN_RANGE.get((name, key))):
            continue
        if kind in (int, float):
            if (name, key) in _OWN_RANGE:
                pass
            elif (name, key) in _NON_NEGATIVE:
                if value < 0:
                    problems.append(str(errors.field_error(dotted, value, "a number >= 0")))
                    continue
            elif value <= 0:
                problems.append(str(errors.field_error(dotted, value, "a number > 0")))
                continue
            if kind is float:
                value = float(value)
        kwargs[key] = value
    if name == "cluster" and "nodes" not in table:
        problems.append("cluster.nodes is missing: the number of GPU servers (an integer > 0)")
    if len(problems) > before:
        return None
    return cls(**kwargs)


def _default_split(s: Scenario) -> Scenario:
    if s.split.train_gpus == 0 and s.split.gen_gpus == 0:
        nodes = s.cluster.nodes
        train = max(1, nodes // 4)
        gen = nodes - train
        g = s.cluster.gpus_per_node
        return replace(s, split=replace(s.split, train_gpus=train * g, gen_gpus=gen * g))
    return s


def _check_split_choice(s: Scenario, problems: list[str]) -> None:
    sp, g = s.split, s.cluster.gpus_per_node
    if sp.choose not in SPLIT_CHOICES:
        problems.append(
            str(errors.field_error("split.choose", sp.choose, "one of " + ", ".join(SPLIT_CHOICES)))
        )
        return
    sweep = sp.sweep_train_gpus
    if sweep and sp.choose != "auto":
        problems.append(
            str(
                errors.field_error(
                    "split.sweep_train_gpus",
                    list(sweep),
                    'only with split.choose = "auto" (the training-pool sizes it tries)',
                )
            )
        )
        return
    total = sp.total_gpus
    u = sp.unit(g) if sp.unit_gpus >= 0 and g % max(1, sp.unit_gpus) == 0 else g
    bad = [t for t in sweep if t <= 0 or t % u or t >= total]
    if bad or len(set(sweep)) != len(sweep):
        problems.append(
            str(
                errors.field_error(
                    "split.sweep_train_gpus",
                    list(sweep),
                    f"distinct training-pool sizes, each a positive multiple of {u} GPUs "
                    f"below the pool total train_gpus + gen_gpus = {total} (so both pools "
                    "keep some GPUs)",
                )
            )
        )


def _check_semantics(s: Scenario, problems: list[str]) -> None:
    c = s.cluster
    if c.hardware not in HARDWARE:
        problems.append(
            str(errors.field_error("cluster.hardware", c.hardware, "one of " + ", ".join(HARDWARE)))
        )
    if s.model.name not in MODELS:
        problems.append(
            str(errors.field_error("model.name", s.model.name, "one of " + ", ".join(MODELS)))
        )
    g = c.gpus_per_node
    unit = s.split.unit_gpus
    if unit and (unit < 0 or g % unit or (unit * c.nics_per_node) % g):
        problems.append(
            str(
                errors.field_error(
                    "split.unit_gpus",
                    unit,
                    f"0 (whole nodes) or a divisor of cluster.gpus_per_node ({g}) whose GPUs own "
                    f"whole NICs (unit x nics_per_node ({c.nics_per_node}) a multiple of {g})",
                )
            )
        )
        unit = 0
    u = unit or g
    for key in ("train_gpus", "gen_gpus"):
        v = getattr(s.split, key)
        if v <= 0 or v % u:
            problems.append(
                str(errors.field_error(f"split.{key}", v, f"a positive multiple of {u} GPUs"))
            )
    if u != g and s.split.total_gpus % g:
        problems.append(
            str(
                errors.field_error(
                    "split.gen_gpus",
                    s.split.gen_gpus,
                    f"with split.unit_gpus = {u}, a number making train_gpus + gen_gpus whole "
                    f"nodes of {g} (the pools share at most one node, all of it)",
                )
            )
        )
    _check_split_choice(s, problems)
    if s.split.placement not in PLACEMENTS:
        problems.append(
            str(
                errors.field_error(
                    "split.placement", s.split.placement, "one of " + ", ".join(PLACEMENTS)
                )
            )
        )
    trained = s.training.model or s.model.name
    if s.training.model and s.training.model not in SHAPES:
        problems.append(
            str(
                errors.field_error(
                    "training.model", s.training.model, "empty or one of " + ", ".join(SHAPES)
                )
            )
        )
    elif trained in SHAPES and s.train_nodes >= 1:
        problems += s.parallelism.problems(SHAPES[trained], s.train_nodes, g)
    total = s.split.train_gpus + s.split.gen_gpus
    if total > c.gpus:
        problems.append(
            f"split.train_gpus + split.gen_gpus = {s.split.train_gpus} + {s.split.gen_gpus} = "
            f"{total} is not valid: the cluster has {c.gpus} GPUs "
            f"({c.nodes} nodes x {g})"
        )
    w = s.workload
    if w.prompt_tokens + w.max_response_tokens <= 0:
        problems.append("workload: prompt and response tokens must be > 0")
    if w.dataset_prompts and w.dataset_prompts < w.prompts_per_step:
        problems.append(
            str(
                errors.field_error(
                    "workload.dataset_prompts",
                    w.dataset_prompts,
                    f"0 (fresh prompts every step) or at least workload.prompts_per_step "
                    f"({w.prompts_per_step})",
                )
            )
        )
    if w.start_step and not w.dataset_prompts:
        problems.append(
            str(
                errors.field_error(
                    "workload.start_step",
                    w.start_step,
                    "0 unless workload.dataset_prompts > 0 (fresh prompts have no epochs)",
                )
            )
        )
    gen = s.generation
    if gen.policy not in POLICIES:
        problems.append(
            str(
                errors.field_error("generation.policy", gen.policy, "one of " + ", ".join(POLICIES))
            )
        )
    if gen.chunk_tokens and gen.chunk_tokens < MIN_CHUNK_TOKENS:
        problems.append(
            str(
                errors.field_error(
                    "generation.chunk_tokens",
                    gen.chunk_tokens,
                    f"0 (off) or at least {MIN_CHUNK_TOKENS} tokens per chunk",
                )
            )
        )
    for key in ("static_tp", "initial_tp"):
        tp = getattr(gen, key)
        if tp and (tp > g or g % tp or tp & (tp - 1)):
            problems.append(
                str(
                    errors.field_error(
                        f"generation.{key}", tp, f"0 (best) or a power of two dividing {g}"
                    )
                )
            )
    if s.model.name in MODELS and c.hardware in HARDWARE:
        perf = default_model(s.model.name, c.hardware)
        for key in ("static_tp", "initial_tp"):
            tp = getattr(gen, key)
            if tp and (not perf.fits(tp) or perf.model.heads % tp):
                problems.append(
                    str(
                        errors.field_error(
                            f"generation.{key}",
                            tp,
                            f"a TP degree whose shard of {s.model.name} fits one GPU's memory",
                        )
                    )
                )
    problems += s.rollout.built()[1]
    unit = s.split.unit(g) if s.split.unit_gpus >= 0 and g % max(1, s.split.unit_gpus) == 0 else g
    problems += s.asynchronous.built(s.split.total_gpus, unit)[1]
    if s.asynchronous != AsyncConfig() and s.rollout.mode != "async":
        problems.append(
            str(
                errors.field_error(
                    "rollout.mode", s.rollout.mode, "async when the scenario has an [async] table"
                )
            )
        )
    f = s.fabric
    if f.kind not in FABRIC_KINDS:
        problems.append(
            str(errors.field_error("fabric.kind", f.kind, "one of " + ", ".join(FABRIC_KINDS)))
        )
    if f.oversubscription < 1.0:
        problems.append(
            str(errors.field_error("fabric.oversubscription", f.oversubscription, ">= 1"))
        )
    if f.optical_oversubscription < 1.0:
        problems.append(
            str(
                errors.field_error(
                    "fabric.optical_oversubscription", f.optical_oversubscription, ">= 1"
                )
            )
        )
    if c.nodes_per_pod and c.nodes_per_pod > c.nodes:
        problems.append(
            str(
                errors.field_error(
                    "cluster.nodes_per_pod", c.nodes_per_pod, f"at most cluster.nodes ({c.nodes})"
                )
            )
        )

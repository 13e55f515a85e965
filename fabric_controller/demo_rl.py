"""`make demo-rl` / `orlctl demo-rl`: a real GRPO loop learning through OrchestrRL, on a CPU.

A local cluster (``examples/local-engines.toml``: a training node and two generation
nodes of two "GPUs" each, one CPU core per GPU here; a simulated OCS) whose generation
agents run a real engine (llama.cpp by default, or vLLM) on a tiny Llama policy built here
from random weights. Each step is the RL loop the paper describes:

1. ``generation``: the phase is set; ``G`` prompts x ``n`` samples of a verifiable toy
   task (:class:`orchestrrl.rl.tasks.TargetStop`) go through the gateways as groups
   (:mod:`orchestrrl.rollout`), every token with its logprob and weight version, while
   the controller's compute-scheduling loop reshards and migrates;
2. ``training``: the phase is set; the trainer recomputes the logprobs of every sampled
   token under the weights it pushed (they must equal the engines', fp32: the step fails
   otherwise) and takes one GRPO step (:class:`orchestrrl.rl.trainer.PolicyTrainer`);
3. ``weight-sync``: the new weights are written as a checkpoint that the training node's
   agent serves, and the phase is set with it: the circuits move, every generation node
   fetches it over them, loads it into its engines (llama.cpp: converted to GGUF and
   restarted; vLLM: in place) and the controller answers when all run it.

It prints a row per step (reward, response lengths, weight version, the time of each
phase, reshards and migrations, the logprob check), writes the reward curve as a PNG
and, with ``--json``, the same figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric_controller import local
from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.logs import setup_logging
from orchestrrl.rollout import AsyncRollout, Group, PartialRollout

if TYPE_CHECKING:
    from fabric_controller.demo_rl_async import AsyncResult

WIRING = Path(__file__).resolve().parents[1] / "examples" / "local-engines.toml"
TRAIN_NODE = "train0-n0"
ENGINES = ("llamacpp", "vllm")
ROLLOUTS = ("full", "partial")
MODES = ("phased", "async")  # async: fabric_controller.demo_rl_async
IN_FLIGHT = ("resume", "finish")


@dataclass(frozen=True)
class RLConfig:
    engine: str = "llamacpp"
    command: str = ""  # default: what `make engines` installed
    steps: int = 10
    prompts: int = 4  # groups per step (G)
    samples: int = 8  # samples per prompt (n)
    max_tokens: int = 1024
    # the policy: a random Llama that stops about once in ``vocab`` tokens at first (a long
    # tail of responses), slow enough on a CPU core (~3 ms a token) for the compute loop
    # to act while a step's tail runs, small enough to train in seconds a step
    vocab: int = 256
    hidden: int = 512
    layers: int = 2
    target_length: int = 48
    length_weight: float = 0.9  # the reward's weight on stopping near target_length
    ramble: float = 0.0  # the first policy's logit spread (0: as initialised; see build_policy)
    learning_rate: float = 2e-4
    seed: int = 0
    seats: int = 4  # sequences per engine instance
    rollout: str = "full"
    over_provision: float = 1.5  # partial: groups started per group trained (1.0-2.0)
    max_staleness: int = 1  # partial: weight versions a response may span
    run_dir: Path | None = None
    plot: Path | None = None
    # --mode async (fabric_controller.demo_rl_async): trainer and rollout at once (and
    # max_staleness above: groups start at most 1 + max_staleness batches ahead)
    mode: str = "phased"
    in_flight: str = "resume"

    def check(self) -> None:
        p = errors.Problems()
        self._check_async(p)
        if self.engine not in ENGINES:
            p.add(str(errors.field_error("--engine", self.engine, " or ".join(ENGINES))))
        if self.rollout not in ROLLOUTS:
            p.add(str(errors.field_error("--rollout", self.rollout, " or ".join(ROLLOUTS))))
        for name, value, lo, hi in (
            ("--steps", self.steps, 1, 1000),
            ("--prompts", self.prompts, 1, 1024),
            ("--samples", self.samples, 2, 64),
            ("--max-tokens", self.max_tokens, 8, 4096),
            ("--seats", self.seats, 1, 64),
        ):
            if isinstance(value, bool) or not lo <= value <= hi:
                p.add(str(errors.field_error(name, value, f"an integer in {lo}..{hi}")))
        op = self.over_provision
        if isinstance(op, bool) or not isinstance(op, int | float) or not 1.0 <= op <= 2.0:
            p.add(str(errors.field_error("--over-provision", op, "a number from 1.0 to 2.0")))
        st = self.max_staleness
        if isinstance(st, bool) or not isinstance(st, int) or not 0 <= st <= 16:
            p.add(str(errors.field_error("--max-staleness", st, "an integer in 0..16")))
        if not math.isfinite(self.learning_rate) or not 0 < self.learning_rate <= 1:
            p.add(str(errors.field_error("--lr", self.learning_rate, "a number in (0, 1]")))
        if p:
            raise p.error()

    def _check_async(self, p: errors.Problems) -> None:
        if self.mode not in MODES:
            p.add(str(errors.field_error("--mode", self.mode, " or ".join(MODES))))
        if self.in_flight not in IN_FLIGHT:
            p.add(str(errors.field_error("--in-flight", self.in_flight, " or ".join(IN_FLIGHT))))
        if self.mode == "async" and self.rollout != "full":
            p.add(str(errors.field_error(
                "--rollout", self.rollout, "full with --mode async (its groups run across "
                "weight versions already)",
            )))  # fmt: skip


@dataclass
class StepRow:
    step: int
    weight_version: str  # the weights the rollout ran on
    reward_mean: float
    length_p50: float
    length_p99: float
    length_mean: float
    stop_fraction: float
    logprob_mean_abs_diff: float
    logprob_max_abs_diff: float
    phase_s: dict[str, float]
    reshards: int
    migrations: int  # migrate actions of the compute loop during the rollout
    moved_running: int  # samples moved to another node with tokens already generated
    moved_tokens: int  # the tokens they had generated before the move
    samples: int
    sync_bytes: int
    versions_seen: list[str]
    # partial rollout: responses carried into the next step, trained responses carried in
    # from the previous one, the trained tokens of an older version, groups dropped as too
    # stale, and requests lost or trained twice
    carried: int = 0
    resumed: int = 0
    spanned: int = 0  # trained responses with tokens of two or more weight versions
    offpolicy_share: float = 0.0
    dropped: int = 0
    lost: int = 0


@dataclass
class RLResult:
    engine: str
    rollout: str = "full"
    steps: list[StepRow] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    cluster_up_s: float = 0.0
    run_s: float = 0.0
    lost_or_duplicated: int = 0
    aborted_at_end: int = 0  # partial: responses still in flight after the last step

    @property
    def reshards(self) -> int:
        return sum(s.reshards for s in self.steps)

    @property
    def migrations(self) -> int:
        return sum(s.migrations for s in self.steps)

    @property
    def moved_running(self) -> int:
        return sum(s.moved_running for s in self.steps)

    def doc(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "rollout": self.rollout,
            "steps": [
                {
                    "step": s.step,
                    "reward_mean": s.reward_mean,
                    "weight_version": s.weight_version,
                    "logprob_max_abs_diff": s.logprob_max_abs_diff,
                    "logprob_mean_abs_diff": s.logprob_mean_abs_diff,
                    "length_p50": s.length_p50,
                    "length_p99": s.length_p99,
                    "stop_fraction": s.stop_fraction,
                    "phase_s": s.phase_s,
                    "reshards": s.reshards,
                    "migrations": s.migrations,
                    "moved_running": s.moved_running,
                    "sync_bytes": s.sync_bytes,
                    "carried": s.carried,
                    "resumed": s.resumed,
                    "spanned": s.spanned,
                    "offpolicy_share": s.offpolicy_share,
                    "dropped": s.dropped,
                }
                for s in self.steps
            ],
            "reshards": self.reshards,
            "migrations": self.migrations,
            "moved_running": self.moved_running,
            "lost_or_duplicated": self.lost_or_duplicated,
            "aborted_at_end": self.aborted_at_end,
            "cluster_up_s": self.cluster_up_s,
            "run_s": self.run_s,
        }


def check_rollout(groups: Sequence[Group], prompts: int, n: int, version: str) -> int:
    """Requests lost or duplicated in a step's rollout (0: every group has its ``n``
    samples, each request id once), and every token made by ``version``."""
    ids = [s.request_id for g in groups for s in g.samples]
    bad = abs(len(groups) - prompts) + sum(abs(len(g.samples) - n) for g in groups)
    bad += len(ids) - len(set(ids))
    stale = [s.request_id for g in groups for s in g.samples if set(s.versions) - {version}]
    if stale:
        raise errors.FailedPrecondition(
            f"samples {errors.listed(stale)} carry tokens of another weight version than "
            f"{version!r}: the weight sync did not reach their engine"
        )
    return bad


def check_partial(
    groups: Sequence[Group], n: int, versions: Sequence[str], trained: set[str]
) -> int:
    """Requests lost or duplicated in a partial step's batch (0: every group has its ``n``
    samples, no request trained before), and every token made by one of ``versions``
    (the step's and the ``max_staleness`` before it). Adds the batch's ids to ``trained``."""
    ids = [s.request_id for g in groups for s in g.samples]
    bad = sum(abs(len(g.samples) - n) for g in groups) + len(ids) - len(set(ids))
    bad += sum(1 for i in set(ids) if i in trained)
    trained.update(ids)
    stale = [s.request_id for g in groups for s in g.samples if set(s.versions) - set(versions)]
    if stale:
        raise errors.FailedPrecondition(
            f"samples {errors.listed(stale)} carry tokens of a weight version other than "
            f"{errors.listed(versions)}: a carried response outlived max_staleness"
        )
    return bad


class ActionWatch:
    """The compute-scheduling loop's actions, as the controller reports them."""

    def __init__(self, controller: str) -> None:
        self.controller = controller
        self.seen: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        async with AsyncClient(self.controller, timeout_s=10.0) as client:
            while True:
                for a in (await client.schedule()).actions:
                    key = (a["command_id"], a["kind"], a["node"])
                    if all((x["command_id"], x["kind"], x["node"]) != key for x in self.seen):
                        self.seen.append(a)
                await asyncio.sleep(0.25)

    def __enter__(self) -> ActionWatch:
        self._task = asyncio.get_running_loop().create_task(self._poll())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def since(self, mark: int) -> list[dict[str, Any]]:
        return [a for a in self.seen[mark:] if a["ok"]]


def _to_samples(groups: Sequence[Group]) -> list[list[Any]]:
    from orchestrrl.rl.grpo import Sample

    return [
        [
            Sample(
                g.prompt_ids,
                s.completion_ids,
                tuple(s.logprobs or ()),
                s.finish_reason if s.finish_reason in ("stop", "length") else "length",
                s.versions[0] if s.versions else "",
                s.versions,
            )
            for s in g.samples
        ]
        for g in groups
    ]


def build_policy(cfg: RLConfig, root: Path) -> tuple[Any, Path]:
    """The trainer (torch) and the engines' first model: checkpoint version 0 in the
    training node's checkpoint directory (llama.cpp: also converted to GGUF)."""
    import torch

    from node_agent.engines import gguf_convert
    from orchestrrl.rl import policy
    from orchestrrl.rl.trainer import PolicyTrainer, TrainConfig

    torch.set_num_threads(1)  # a tiny model: one thread is fastest (and leaves a core)
    torch.manual_seed(cfg.seed)
    config = policy.llama_config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers
    )
    model = policy.new_policy(config, cfg.seed)
    if cfg.ramble:
        # a base model that rambles: its logits spread to ``ramble`` (standard deviation)
        # and end-of-sequence at 0, so it stops about once in 63 * e^(ramble^2 / 2) tokens
        with torch.no_grad():
            w = model.lm_head.weight
            w.mul_(cfg.ramble / (float(w.std()) * cfg.hidden**0.5))
            w[policy.eos_id(model)] = 0.0
    # partial rollout: the weights of the last max_staleness versions are kept, so that a
    # carried response's tokens are checked against the weights that sampled each
    keep = cfg.max_staleness if cfg.rollout == "partial" or cfg.mode == "async" else 0
    trainer = PolicyTrainer(
        model,
        config,
        TrainConfig(learning_rate=cfg.learning_rate, logprob_tolerance=1e-3, keep_versions=keep),
    )
    ckpt = trainer.save(root)
    if cfg.engine == "llamacpp":
        return trainer, gguf_convert.convert(ckpt.path, root.parent / "policy-0.f32.gguf")
    return trainer, ckpt.path


@dataclass
class Started:
    """What :func:`started` set up for a demo's loop."""

    task: Any  # orchestrrl.rl.tasks.TargetStop
    store: Path  # the training node's checkpoint directory
    trainer: Any  # orchestrrl.rl.trainer.PolicyTrainer
    cluster: local.LocalCluster
    up_s: float  # the time to start the cluster


@contextlib.asynccontextmanager
async def started(cfg: RLConfig, run_dir: Path, say: Any, intro: str) -> AsyncIterator[Started]:
    """The task, the trainer and its first checkpoint, and a local cluster whose generation
    agents serve it on ``cfg.engine`` (stopped on exit); the same for both modes."""
    from orchestrrl.rl.tasks import TargetStop

    command = cfg.command or local.installed_engine(cfg.engine)
    if command is None:
        raise errors.FailedPrecondition(
            f"{cfg.engine} is not installed in .engines/: run `make engines` "
            "(or pass --engine-command)"
        )
    task = TargetStop(cfg.vocab, target_length=cfg.target_length, length_weight=cfg.length_weight)
    store = local.checkpoint_dir(run_dir, TRAIN_NODE)
    store.mkdir(parents=True, exist_ok=True)
    trainer, model = await asyncio.to_thread(build_policy, cfg, store)
    say(f"{intro}: GRPO on a {cfg.layers}-layer Llama (vocab {cfg.vocab}, hidden {cfg.hidden}) "
        f"on {cfg.engine}, {cfg.prompts} prompts x {cfg.samples} samples per step")  # fmt: skip
    args = (
        ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")
        if cfg.engine == "vllm"
        else ()
    )
    context = 64 + cfg.max_tokens
    engine = local.LocalEngine(cfg.engine, str(model), command, args, "1,1", cfg.seats, context)
    t = time.perf_counter()
    cluster = await asyncio.to_thread(
        local.up, WIRING, run_dir, ephemeral_ports=True, engine=engine,
        progress=lambda m: say(f"  {m}"),
    )  # fmt: skip
    try:
        yield Started(task, store, trainer, cluster, time.perf_counter() - t)
    finally:
        await asyncio.to_thread(local.down, Path(cluster.run_dir))


async def _run(cfg: RLConfig, run_dir: Path, say: Any) -> RLResult:
    result = RLResult(cfg.engine, cfg.rollout)
    async with started(cfg, run_dir, say, "demo-rl") as s:
        task, store, trainer, cluster = s.task, s.store, s.trainer, s.cluster
        result.cluster_up_s = s.up_s
        if cfg.rollout == "partial":
            say(f"  partial rollout: {cfg.over_provision:g}x the prompts in flight, unfinished "
                f"ones carried into the next step (max staleness {cfg.max_staleness})")  # fmt: skip
        async with AsyncClient(cluster.controller, timeout_s=60.0) as client:
            nodes = await client.nodes()
            gateways = sorted(f"http://{n.gateway}" for n in nodes if n.gateway)
            say(f"  gateways: {', '.join(gateways)}")
            t0 = time.perf_counter()
            with ActionWatch(cluster.controller) as watch:
                async with AsyncRollout(gateways) as rollout:
                    partial = None
                    if cfg.rollout == "partial":
                        partial = rollout.partial(
                            cfg.prompts,
                            n=cfg.samples,
                            over_provision=cfg.over_provision,
                            max_staleness=cfg.max_staleness,
                            max_tokens=cfg.max_tokens,
                            temperature=1.0,
                            seed=cfg.seed * 1_000_003,
                            logprobs=True,
                        )
                    say(header(partial is not None))
                    trained: set[str] = set()
                    try:
                        for step in range(cfg.steps):
                            row = await _step(
                                cfg, step, task, trainer, client, rollout, watch, store,
                                partial, trained,
                            )  # fmt: skip
                            result.steps.append(row)
                            if partial is None:
                                result.lost_or_duplicated += row.samples - cfg.prompts * cfg.samples
                            else:
                                result.lost_or_duplicated += row.lost
                            say(format_row(row, partial is not None))
                    finally:
                        if partial is not None:
                            result.aborted_at_end = len(await partial.close())
            result.actions = watch.seen
            result.run_s = time.perf_counter() - t0
    return result


async def _step(
    cfg: RLConfig,
    step: int,
    task: Any,
    trainer: Any,
    client: AsyncClient,
    rollout: AsyncRollout,
    watch: ActionWatch,
    store: Path,
    partial: PartialRollout | None = None,
    trained: set[str] | None = None,
) -> StepRow:
    phase_s: dict[str, float] = {}
    version = str(trainer.version)
    t = time.perf_counter()
    await client.set_phase("generation")
    mark = len(watch.seen)
    carried = resumed = spanned = dropped = lost = 0
    offpolicy = 0.0
    if partial is None:
        prompts = task.prompts(cfg.prompts, seed=cfg.seed * 100_003 + step)
        groups = await rollout.generate(
            prompts,
            n=cfg.samples,
            max_tokens=cfg.max_tokens,
            temperature=1.0,
            seed=cfg.seed * 1_000_003 + step * 7919,
            logprobs=True,
            group_ids=[f"s{step}-p{k}" for k in range(len(prompts))],
        )
    else:
        need = partial.to_start()
        prompts = task.prompts(need, seed=cfg.seed * 100_003 + step) if need else []
        done = await partial.step(
            prompts, version=version, group_ids=[f"s{step}-p{k}" for k in range(need)]
        )
        groups = list(done.groups)
        carried, resumed = len(done.carried), len(done.resumed)
        spanned = sum(1 for c in done.resumed if len(c.tokens_by_version) > 1)
        dropped, offpolicy = done.dropped_responses, done.offpolicy_share
    phase_s["generation"] = time.perf_counter() - t
    await asyncio.sleep(0.3)  # the loop's last records of the step
    acted = watch.since(mark)
    if partial is None:
        bad = check_rollout(groups, cfg.prompts, cfg.samples, version)
    else:
        allowed = [str(trainer.version - k) for k in range(cfg.max_staleness + 1)]
        bad = lost = check_partial(
            groups, cfg.samples, allowed, trained if trained is not None else set()
        )
    t = time.perf_counter()
    await client.set_phase("training")
    samples = _to_samples(groups)
    rewards = [[task.reward(s.prompt_ids, s.completion_ids) for s in g] for g in samples]
    report = await asyncio.to_thread(trainer.step, samples, rewards)
    ckpt = await asyncio.to_thread(trainer.save, store)
    phase_s["training"] = time.perf_counter() - t
    t = time.perf_counter()
    change = await client.set_phase(
        "weight-sync",
        checkpoint=ckpt.version,
        source=TRAIN_NODE,
        checksum=ckpt.checksum,
        # partial rollout: the responses in flight go on from where they are on the new weights
        in_flight="resume" if partial is not None else "finish",
    )
    phase_s["weight-sync"] = time.perf_counter() - t
    sync = change.weight_sync
    return StepRow(
        step=step,
        weight_version=version,
        reward_mean=report.reward_mean,
        length_p50=report.length_p50,
        length_p99=report.length_p99,
        length_mean=report.length_mean,
        stop_fraction=report.stop_fraction,
        logprob_mean_abs_diff=report.logprob_diff_mean,
        logprob_max_abs_diff=report.logprob_diff_max,
        phase_s=phase_s,
        reshards=sum(1 for a in acted if a["kind"] == "reshard"),
        migrations=sum(1 for a in acted if a["kind"] == "migrate"),
        moved_running=sum(1 for g in groups for s in g.samples if s.moved_running),
        moved_tokens=sum(s.moved_running for g in groups for s in g.samples),
        samples=sum(len(g.samples) for g in groups) - bad,
        sync_bytes=sum(n.bytes_fetched for n in sync.nodes) if sync is not None else 0,
        versions_seen=sorted({v for g in groups for s in g.samples for v in s.versions}),
        carried=carried,
        resumed=resumed,
        spanned=spanned,
        offpolicy_share=offpolicy,
        dropped=dropped,
        lost=lost,
    )


def header(partial: bool = False) -> str:
    extra = f" {'carried':>7} {'resumed':>7} {'offpol':>6} {'dropped':>7}" if partial else ""
    return (
        f"  {'step':>4} {'ver':>4} {'reward':>7} {'len p50':>7} {'p99':>5} {'stop':>5} "
        f"{'gen s':>6} {'train s':>7} {'sync s':>6} {'reshard':>7} {'migrate':>7} "
        f"{'moved':>5} {'|dlogp| max':>11}{extra}"
    )


def format_row(r: StepRow, partial: bool = False) -> str:
    p = r.phase_s
    extra = (
        f" {r.carried:>7} {r.resumed:>7} {r.offpolicy_share:>6.1%} {r.dropped:>7}"
        if partial
        else ""
    )
    return (
        f"  {r.step:>4} {r.weight_version:>4} {r.reward_mean:>7.3f} {r.length_p50:>7.0f} "
        f"{r.length_p99:>5.0f} {r.stop_fraction:>5.2f} {p['generation']:>6.2f} "
        f"{p['training']:>7.2f} {p['weight-sync']:>6.2f} {r.reshards:>7} {r.migrations:>7} "
        f"{r.moved_running:>5} {r.logprob_max_abs_diff:>11.1e}{extra}"
    )


def reward_ends(rewards: Sequence[float], window: int = 3) -> tuple[int, float, float]:
    """The window (``window`` steps, at most half the run) and the mean reward of the
    first and of the last steps: a demo learned when the last beats the first."""
    w = max(1, min(window, len(rewards) // 2))
    return w, sum(rewards[:w]) / w, sum(rewards[-w:]) / w


def summary(r: RLResult, window: int = 3) -> str:
    w, first, last = reward_ends([s.reward_mean for s in r.steps], window)
    worst = max((s.logprob_max_abs_diff for s in r.steps), default=0.0)
    return (
        f"  reward {first:.3f} (first {w} steps) -> {last:.3f} (last {w}); weight version "
        f"{r.steps[0].weight_version} -> {r.steps[-1].weight_version}; {r.reshards} reshard(s) "
        f"and {r.migrations} migration(s) during rollouts, {r.moved_running} sample(s) moved "
        f"to another node while running ({sum(s.moved_tokens for s in r.steps)} tokens "
        f"generated before their moves); engines' logprobs within "
        f"{worst:.1e} of the trainer's; {r.lost_or_duplicated} request(s) lost or duplicated; "
        f"{r.run_s:.0f} s"
        + (
            f"; partial rollout: {sum(s.carried for s in r.steps)} response(s) carried into "
            f"the next step, {sum(s.resumed for s in r.steps)} trained there "
            f"({sum(s.spanned for s in r.steps)} with tokens of two weight versions), "
            f"off-policy token share {_mean([s.offpolicy_share for s in r.steps]):.1%} "
            f"(mean per step), {sum(s.dropped for s in r.steps)} dropped as too stale, "
            f"{r.aborted_at_end} still in flight at the end (aborted)"
            if r.rollout == "partial"
            else ""
        )
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def plot(r: RLResult, path: Path) -> Path | None:
    """The reward curve (and mean response length) as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [s.step for s in r.steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [s.reward_mean for s in r.steps], marker="o", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean)", color="tab:blue")
    twin = ax.twinx()
    twin.plot(steps, [s.length_p50 for s in r.steps], marker=".", color="tab:orange")
    twin.set_ylabel("response length p50 (tokens)", color="tab:orange")
    ax.set_title(f"GRPO through OrchestrRL ({r.engine})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_demo_rl(cfg: RLConfig, *, as_json: bool = False) -> int:
    """Run the demo; 0 when it learned (reward up), the logprobs matched and no request was
    lost or duplicated, 1 otherwise. ``as_json``: the rows go to stderr and the figures,
    as JSON, to stdout."""
    cfg.check()
    setup_logging("warning", "console", sys.stderr)
    out = sys.stderr if as_json else sys.stdout

    def say(message: str) -> None:
        print(message, file=out, flush=True)

    r: RLResult | AsyncResult
    with tempfile.TemporaryDirectory(prefix=f"orl-demo-rl-{cfg.mode}-") as tmp:
        run_dir = cfg.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode == "async":
            from fabric_controller import demo_rl_async

            r = asyncio.run(demo_rl_async.run(cfg, run_dir, say))
            say(demo_rl_async.summary(r))
        else:
            r = asyncio.run(_run(cfg, run_dir, say))
            say(summary(r))
            png = plot(r, cfg.plot or Path("demo-rl-reward.png"))
            if png is not None:
                say(f"  reward curve: {png}")
    if as_json:
        print(json.dumps(r.doc(), indent=2), flush=True)
    _, first, last = reward_ends([s.reward_mean for s in r.steps])
    learned = last > first
    return 0 if learned and r.lost_or_duplicated == 0 else 1

"""`orlctl demo-rl --mode async`: the GRPO demo with trainer and rollout running at once.

The same local cluster, policy and task as :mod:`fabric_controller.demo_rl`, but no phase
walk: the cluster is put in async mode (the controller commits one standing topology for
both roles, training mesh and trainer -> rollout circuits; ``orlctl mode`` shows it) and

- a rollout producer (:class:`orchestrrl.rl.async_groups.AsyncGroups`) keeps prompt
  groups in flight through the gateways, at most ``(1 + max_staleness) x N`` groups ahead
  of what the trainer consumed (AReaL's bound), every token tagged with the weight version
  that produced it;
- the trainer takes the next ``N`` complete groups, dropping (and counting) any whose
  oldest token is more than ``max_staleness`` versions behind, checks the engines'
  logprobs per version (each token against the trainer's weights of the version that
  produced it, kept in memory while a trajectory may still carry them: fp32, < 1e-3 or
  the step fails), takes one GRPO step (the clipped ratio against the engines' logprobs
  corrects the off-policy tokens), writes the checkpoint and pushes it with the
  controller's weight sync over the standing circuits, in the background: the engines
  load it without a global pause (``--in-flight resume``: running requests stop and
  resume on the new weights, their later tokens tagged with it; ``finish``: they end on
  the old ones while the node admits nothing new), while the trainer waits for its next
  batch; one push at a time;
- the controller's compute-scheduling loop keeps resharding and migrating meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_controller.demo_rl import (
    TRAIN_NODE,
    ActionWatch,
    RLConfig,
    _to_samples,
    reward_ends,
    started,
)
from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.rl.async_groups import AsyncGroups, Batch
from orchestrrl.rl.staleness import bad_token_versions, version_number
from orchestrrl.rollout import AsyncRollout, Group


@dataclass
class AsyncRow:
    step: int
    version: int  # the trainer's version the batch trained from
    reward_mean: float
    length_p50: float
    length_p99: float
    stop_fraction: float
    lag_max: int
    versions_seen: list[int]  # versions of the trained tokens
    mixed: int  # trained samples whose tokens span two versions or more
    dropped: int  # over-stale groups dropped while taking this batch
    wait_s: float  # the trainer waited for complete groups
    train_s: float
    push_s: float  # seconds the previous version's push took (0: none)
    logprob_max_abs_diff: float
    reshards: int
    migrations: int
    moved_running: int
    in_flight: int  # groups in flight when the batch was taken
    repacks: int = 0  # tail repacks the compute loop carried out meanwhile


@dataclass
class AsyncResult:
    engine: str
    max_staleness: int
    in_flight: str
    mode_shown: str = ""
    steps: list[AsyncRow] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    accounting: dict[str, int] = field(default_factory=dict)
    lost_or_duplicated: int = 0
    cluster_up_s: float = 0.0
    run_s: float = 0.0
    sync_s: list[float] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.steps)

    def doc(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "mode": "async",
            "cluster_mode": self.mode_shown,
            "max_staleness": self.max_staleness,
            "in_flight": self.in_flight,
            "steps": [dataclasses.asdict(s) for s in self.steps],
            "reshards": sum(s.reshards for s in self.steps),
            "repacks": sum(s.repacks for s in self.steps),
            "migrations": sum(s.migrations for s in self.steps),
            "moved_running": sum(s.moved_running for s in self.steps),
            "dropped": self.dropped,
            "accounting": self.accounting,
            "lost_or_duplicated": self.lost_or_duplicated,
            "weight_push_s": self.sync_s,
            "cluster_up_s": self.cluster_up_s,
            "run_s": self.run_s,
        }


def check_versions(groups: Sequence[Group], version: int) -> None:
    """Every token's version is one the trainer pushed by now (<= ``version``) and never
    goes back within a sample; FailedPrecondition naming the sample otherwise."""
    for g in groups:
        for s in g.samples:
            if bad_token_versions(s.versions, version):
                raise errors.FailedPrecondition(
                    f"sample {s.request_id} carries versions {s.weight_versions}: not a "
                    f"non-decreasing run of versions <= {version}"
                )


async def _steps(
    cfg: RLConfig,
    task: Any,
    trainer: Any,
    client: AsyncClient,
    gateways: list[str],
    watch: ActionWatch,
    store: Path,
    result: AsyncResult,
    say: Any,
) -> None:
    n = cfg.samples
    push: asyncio.Task[float] | None = None

    def prompt_of(k: int) -> Sequence[int]:
        prompt: Sequence[int] = task.prompts(1, seed=cfg.seed * 100_003 + k)[0]
        return prompt

    async with (
        AsyncRollout(gateways) as rollout,
        AsyncGroups(
            rollout,
            prompt_of,
            batch_groups=cfg.prompts,
            n=n,
            max_staleness=cfg.max_staleness,
            max_tokens=cfg.max_tokens,
            temperature=1.0,
            seed=cfg.seed * 1_000_003,
            logprobs=True,
            on_weight_update=cfg.in_flight,
        ) as groups,
    ):
        for step in range(cfg.steps):
            mark = len(watch.seen)
            batch: Batch = await groups.take(trainer.version)
            in_flight = groups.in_flight
            check_versions(batch.groups, trainer.version)
            t = time.perf_counter()
            samples = _to_samples(batch.groups)
            rewards = [[task.reward(s.prompt_ids, s.completion_ids) for s in g] for g in samples]
            version = trainer.version
            # each token's logprob checked under the weights of its own version (the
            # trainer keeps the last max_staleness versions): LogprobMismatch otherwise
            report = await asyncio.to_thread(trainer.step, samples, rewards)
            ckpt = await asyncio.to_thread(trainer.save, store)
            train_s = time.perf_counter() - t
            push_s = 0.0
            if push is not None:  # one push at a time: the gateways take one update each
                push_s = await push
                result.sync_s.append(push_s)
                groups.set_version(version)  # the engines run it now
            push = asyncio.get_running_loop().create_task(
                _push(client, ckpt.version, ckpt.checksum, cfg.in_flight)
            )
            acted = watch.since(mark)
            samples_all = [s for g in batch.groups for s in g.samples]
            row = AsyncRow(
                step=step,
                version=version,
                reward_mean=report.reward_mean,
                length_p50=report.length_p50,
                length_p99=report.length_p99,
                stop_fraction=report.stop_fraction,
                lag_max=max(batch.lags),
                versions_seen=sorted({version_number(v) for s in samples_all for v in s.versions}),
                mixed=sum(1 for s in samples_all if len(set(s.versions)) > 1),
                dropped=len(batch.dropped),
                wait_s=batch.waited_s,
                train_s=train_s,
                push_s=push_s,
                logprob_max_abs_diff=report.logprob_diff_max,
                reshards=sum(1 for a in acted if a["kind"] == "reshard"),
                migrations=sum(1 for a in acted if a["kind"] == "migrate"),
                moved_running=sum(1 for s in samples_all if s.moved_running),
                in_flight=in_flight,
                repacks=sum(1 for a in acted if a["kind"] == "repack"),
            )
            result.steps.append(row)
            say(format_row(row))
        if push is not None:
            result.sync_s.append(await push)
        result.accounting = groups.accounting()
        taken = [*groups.trained, *groups.dropped]
        ids = [s.request_id for g in taken for s in g.samples]
        result.lost_or_duplicated = (
            result.accounting["lost"]
            + sum(abs(len(g.samples) - n) for g in taken)
            + len(ids) - len(set(ids))
        )  # fmt: skip


async def _push(client: AsyncClient, version: str, checksum: str, in_flight: str) -> float:
    """The controller's weight sync of ``version`` over the standing circuits; its
    seconds. The compute loop goes on meanwhile (it migrates requests off and onto
    nodes that are loading the new weights)."""
    t = time.perf_counter()
    await client.set_phase(
        "weight-sync",
        checkpoint=version,
        source=TRAIN_NODE,
        checksum=checksum,
        in_flight=in_flight,
    )
    return time.perf_counter() - t


def header() -> str:
    return (
        f"  {'step':>4} {'ver':>3} {'reward':>7} {'len p50':>7} {'p99':>5} {'stop':>5} "
        f"{'lag':>3} {'tok vers':>8} {'mixed':>5} {'drop':>4} {'wait s':>6} {'train s':>7} "
        f"{'push s':>6} {'repack':>6} {'reshard':>7} {'migrate':>7} {'moved':>5} "
        f"{'|dlogp| max':>11}"
    )


def format_row(r: AsyncRow) -> str:
    vers = ",".join(str(v) for v in r.versions_seen)
    return (
        f"  {r.step:>4} {r.version:>3} {r.reward_mean:>7.3f} {r.length_p50:>7.0f} "
        f"{r.length_p99:>5.0f} {r.stop_fraction:>5.2f} {r.lag_max:>3} {vers:>8} {r.mixed:>5} "
        f"{r.dropped:>4} {r.wait_s:>6.2f} {r.train_s:>7.2f} {r.push_s:>6.2f} {r.repacks:>6} "
        f"{r.reshards:>7} "
        f"{r.migrations:>7} {r.moved_running:>5} {r.logprob_max_abs_diff:>11.1e}"
    )


def summary(r: AsyncResult, window: int = 3) -> str:
    w, first, last = reward_ends([s.reward_mean for s in r.steps], window)
    worst = max((s.logprob_max_abs_diff for s in r.steps), default=0.0)
    lag = max((s.lag_max for s in r.steps), default=0)
    push = sorted(r.sync_s)
    p50 = push[len(push) // 2] if push else 0.0
    a = r.accounting
    return (
        f"  reward {first:.3f} (first {w} steps) -> {last:.3f} (last {w}); "
        f"{sum(s.repacks for s in r.steps)} tail repack(s), "
        f"{sum(s.reshards for s in r.steps)} reshard(s) and "
        f"{sum(s.migrations for s in r.steps)} migration(s) while training, "
        f"{sum(s.moved_running for s in r.steps)} trained sample(s) moved while running; "
        f"trained lag <= {lag} (bound {r.max_staleness}), {r.dropped} over-stale group(s) "
        f"dropped; {sum(s.mixed for s in r.steps)} trained sample(s) spanning two versions; "
        f"weight push p50 {p50:.2f} s without a global pause ({r.in_flight}); logprobs "
        f"within {worst:.1e} of the trainer's per version; groups: {a.get('started', 0)} "
        f"started, {a.get('trained', 0)} trained, {a.get('dropped', 0)} dropped, "
        f"{a.get('waiting', 0) + a.get('in_flight', 0) + a.get('cancelled', 0)} unfinished "
        "at the end; "
        f"{r.lost_or_duplicated} request(s) lost or duplicated; {r.run_s:.0f} s"
    )


async def run(cfg: RLConfig, run_dir: Path, say: Any) -> AsyncResult:
    """The async loop on a local cluster (what ``demo-rl --mode async`` runs)."""
    result = AsyncResult(cfg.engine, cfg.max_staleness, cfg.in_flight)
    async with started(cfg, run_dir, say, "demo-rl --mode async") as s:
        task, store, trainer, cluster = s.task, s.store, s.trainer, s.cluster
        result.cluster_up_s = s.up_s
        # stale tokens are checked under the weights of their own version (build_policy
        # keeps max_staleness versions in async mode), not the current ones
        say(f"  max_staleness {cfg.max_staleness}, in-flight requests at an update: "
            f"{cfg.in_flight}")  # fmt: skip
        async with AsyncClient(cluster.controller, timeout_s=60.0) as client:
            entered = await client.set_mode("async")
            shown = await client.get_mode()
            result.mode_shown = shown.mode
            say(f"  cluster mode: {shown.mode} (epoch {entered.epoch}, phase {shown.phase}, "
                f"{shown.circuits} standing circuit(s): training mesh and trainer -> "
                "rollout pods)")  # fmt: skip
            nodes = await client.nodes()
            gateways = sorted(f"http://{n.gateway}" for n in nodes if n.gateway)
            say(f"  gateways: {', '.join(gateways)}")
            t0 = time.perf_counter()
            with ActionWatch(cluster.controller) as watch:
                say(header())
                await _steps(cfg, task, trainer, client, gateways, watch, store, result, say)
            result.actions = watch.seen
            result.run_s = time.perf_counter() - t0
    return result

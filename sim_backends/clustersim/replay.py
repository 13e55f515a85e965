"""Scenario replay of verl's published fully-async runs, and OrchestrRL's mode on the same GPUs.

verl's ``fully_async_policy`` README (volcengine/verl, ``verl/experimental/
fully_async_policy/README.md``, "Last updated: 12/25/2025"; read at commit b178a3cd)
publishes, on H20 GPUs with DAPO-Math-17k, 16 responses per prompt and 512 prompts per
parameter version:

- Qwen2.5-Math-7B, max response 28K, ``staleness_threshold`` 0.5, partial rollout,
  ``trigger_parameter_sync_step`` 4 x ``require_batches`` 4 x ``ppo_mini_batch_size`` 32,
  vLLM TP4, FSDP2: 16:16 trainer:rollout GPUs 294.77 s/step (gen 21.26, update_actor
  313.81), 32:32 189.26 s (28.46, 156.98), 64:64 150.63 s (33.14, 113.16); colocate sync
  790.10 / 365.28 / 356.30 s at 32 / 64 / 128 GPUs;
- Qwen3-30B-A3B-Base, max response 8K, the same staleness, 96 rollout : 32 trainer GPUs:
  282.75 s/step (gen 22.06, ref 50.05, update_actor 206.63); colocate sync 497.89 s.

verl's ``timing_s/step`` sums, over the version's local updates, the trainer's wait for
samples (``gen``) and its update (its ``param_sync`` is logged apart); the model's
``logged_step_s`` is the same sum. Each row runs (:func:`replay_row`):

- ``verl``: a model of verl's mode: the fixed split, a global parameter sync that
  pauses every engine and aborts its running requests (partial rollout: resumed after
  the sync, their KV cache recomputed), the trainer blocked for the sync, admission by
  ``staleness_threshold``, no trajectory dropped (verl drops none);
- ``orchestrrl``: the same GPUs and staleness bound with OrchestrRL's mode: the split
  planner, the relay tier (no global pause: engines drain and load on their own),
  repack and reshard of the tail, and circuit leases for the weight waves;
- each mechanism alone on top of verl's mode: ``split`` (the planner's split), ``relay``
  (no global pause), ``repack`` (relay + repack), ``reshard`` (relay + repack +
  reshard), ``circuits`` (verl's mode on RFabric with a lease per weight wave).

The workload is not fitted to verl: its lengths are the simulator's DAPO-like
assumption (median 1,500 response tokens, log-normal prompt and sample terms, the
suite's), capped at each row's maximum, without drift (the README's figures are means
over 400 steps); verl's response lengths are not published.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrrl import errors
from scheduler.async_rollout import AsyncPolicy, Pull, WeightUpdate
from sim_backends.clustersim.async_rl import AsyncRun, run_async
from sim_backends.clustersim.pipeline import perf_model, train_shape
from sim_backends.clustersim.scenario import Scenario, load_scenario

VERL_DIR = Path(__file__).resolve().parents[2] / "examples" / "sim" / "verl"
SOURCE = (
    "volcengine/verl verl/experimental/fully_async_policy/README.md (12/25/2025), "
    "tables 'Asynchronous Training on 7B Model' and '30B Model Mode Experiment'"
)
LEASE_S = 1.0  # a weight wave's circuit lease: longer than any wave here (< 1 s)


@dataclass(frozen=True)
class Published:
    """One row of verl's README: its scenario file, GPUs and the figures it reports."""

    key: str
    scenario: str
    gpus: int
    split: str  # trainer:rollout GPUs
    step_s: float
    gen_s: float  # the trainer's wait for samples
    update_s: float  # update_actor
    colocate_s: float  # colocate sync on the same GPUs
    ref_s: float = 0.0


PUBLISHED = (
    Published("7b-32", "qwen25-math-7b-32.toml", 32, "16:16", 294.77, 21.26, 313.81, 790.10),
    Published("7b-64", "qwen25-math-7b-64.toml", 64, "32:32", 189.26, 28.46, 156.98, 365.28),
    Published("7b-128", "qwen25-math-7b-128.toml", 128, "64:64", 150.63, 33.14, 113.16, 356.30),
    Published(
        "30b-a3b-128", "qwen3-30b-a3b-128.toml", 128, "32:96", 282.75, 22.06, 206.63, 497.89, 50.05
    ),
)
TARGET_ROWS = ("7b-128", "30b-a3b-128")  # the issue's >= 1.3x rows


def _policies(base: AsyncPolicy) -> dict[str, Callable[[Scenario], tuple[Scenario, AsyncPolicy]]]:
    relay = replace(base, weight_update=WeightUpdate.RELAY, pull=Pull.DRAIN)

    def same(p: AsyncPolicy) -> Callable[[Scenario], tuple[Scenario, AsyncPolicy]]:
        return lambda s: (s, p)

    def on_rfabric(p: AsyncPolicy) -> Callable[[Scenario], tuple[Scenario, AsyncPolicy]]:
        return lambda s: (replace(s, fabric=replace(s.fabric, kind="rfabric")), p)

    everything = replace(relay, repack=True, reshard=True, plan_split=True, lease_s=LEASE_S)
    return {
        "verl": same(base),
        "split": same(replace(base, plan_split=True)),
        "relay": same(relay),
        "repack": same(replace(relay, repack=True)),
        "reshard": same(replace(relay, repack=True, reshard=True)),
        "circuits": on_rfabric(replace(base, lease_s=LEASE_S)),
        "orchestrrl": on_rfabric(everything),
    }


VARIANTS = ("verl", "split", "relay", "repack", "reshard", "circuits", "orchestrrl")


def replay_scenario(pub: Published, quick: bool = False) -> Scenario:
    """The row's scenario (examples/sim/verl/); ``quick``: 16 prompts x 4 responses a
    version, a 4,096-token cap and 4 versions, 1 left out."""
    s = load_scenario(VERL_DIR / pub.scenario)
    if quick:
        s = replace(
            s,
            workload=replace(
                s.workload, prompts_per_step=16, samples_per_prompt=4, max_response_tokens=4096
            ),
            asynchronous=replace(s.asynchronous, versions=4, warmup=1),
        )
    return s


def variant_runs(s: Scenario) -> dict[str, AsyncRun]:
    """Every variant of :data:`VARIANTS` on ``s`` (its ``[async]`` table is verl's mode)."""
    perf = perf_model(s)
    built, problems = s.asynchronous.built(s.split.total_gpus, s.cluster.gpus_per_node)
    if built is None:
        raise errors.InvalidArgument("; ".join(problems))
    runs: dict[str, AsyncRun] = {}
    for key, make in _policies(built).items():
        sc, pol = make(s)
        runs[key] = run_async(sc, perf, policy=replace(pol, label=key), label=key)
    return runs


def _variant_rows(runs: dict[str, AsyncRun]) -> dict[str, Any]:
    verl = runs["verl"]
    rows = {}
    for key, r in runs.items():
        d = r.summary()
        d["speedup"] = r.samples_per_s / verl.samples_per_s
        rows[key] = d
    return rows


def stress_row(quick: bool = False, seed: int = 1) -> dict[str, Any]:
    """Not a published run: the 128-GPU 7B row with 96 trainer and 32 rollout GPUs, where
    the rollout bounds verl's mode and the rollout-side mechanisms have work."""
    pub = next(p for p in PUBLISHED if p.key == "7b-128")
    s = replay_scenario(pub, quick)
    s = replace(s, seed=s.seed + seed - 1, split=replace(s.split, train_gpus=96, gen_gpus=32))
    return {
        "model": s.model.name,
        "hardware": s.cluster.hardware,
        "train_gpus": s.split.train_gpus,
        "gen_gpus": s.split.gen_gpus,
        "variants": _variant_rows(variant_runs(s)),
    }


def replay_row(pub: Published, quick: bool = False, seed: int = 1) -> dict[str, Any]:
    """Every variant of one published row, against verl's published figures."""
    s = replay_scenario(pub, quick)
    s = replace(s, seed=s.seed + seed - 1)
    runs = variant_runs(s)
    verl = runs["verl"]
    rows = _variant_rows(runs)
    model_step = verl.mean_logged_step_s
    return {
        "implied_tokens_per_response": implied_tokens(s, pub),
        "published": {
            "step_s": pub.step_s,
            "gen_s": pub.gen_s,
            "update_s": pub.update_s,
            "colocate_s": pub.colocate_s,
            "ref_s": pub.ref_s,
            "split": pub.split,
            "gpus": pub.gpus,
            "trainer_idle": pub.gen_s / pub.step_s,
        },
        "model": s.model.name,
        "hardware": s.cluster.hardware,
        "train_gpus": s.split.train_gpus,
        "gen_gpus": s.split.gen_gpus,
        "staleness_threshold": s.rollout.staleness_threshold,
        "max_response_tokens": s.workload.max_response_tokens,
        "median_response_tokens": s.workload.median_response_tokens,
        "model_step_s": model_step,
        "error": model_step / pub.step_s - 1.0,
        "update_error": verl.summary()["mean_train_s"] / pub.update_s - 1.0,
        "trained_tokens_per_response": (
            sum(v.tokens for v in verl.steady) / max(1, sum(v.responses for v in verl.steady))
        ),
        "variants": rows,
    }


def implied_tokens(s: Scenario, pub: Published) -> dict[str, float]:
    """Trained tokens per response (prompt and response) that verl's published update time
    (with its reference pass where logged) implies under the model's training FLOPs, at
    the model's MFU and at the GPU's whole peak (an upper bound)."""
    perf = perf_model(s)
    t = s.training
    factor = 6.0 + (2.0 if t.old_logprob else 0.0) + (2.0 if t.reference_model else 0.0)
    active = train_shape(s, perf).active_params
    gpus = int(pub.split.split(":")[0])
    per_gpu = perf.hardware.peak_flops
    responses = s.workload.requests_per_step
    seconds = pub.update_s + pub.ref_s
    at_peak = seconds * gpus * per_gpu / (factor * active) / responses
    return {"at_mfu": at_peak * perf.efficiency.training_mfu, "at_peak": at_peak}


def replay(quick: bool = False, seed: int = 1) -> dict[str, Any]:
    """Every published row (:data:`PUBLISHED`)."""
    return {
        "source": SOURCE,
        "rows": {pub.key: replay_row(pub, quick, seed) for pub in PUBLISHED},
    }


__all__ = [
    "PUBLISHED",
    "SOURCE",
    "TARGET_ROWS",
    "VARIANTS",
    "Published",
    "replay",
    "replay_row",
    "stress_row",
    "variant_runs",
]

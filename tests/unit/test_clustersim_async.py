"""The simulator's asynchronous mode (sim_backends.clustersim.async_rl) on tiny jobs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from orchestrrl import errors
from scheduler.async_plan import PeriodMeasure, SplitDecision
from scheduler.async_rollout import admission_limit
from scheduler.rollout import FULL
from sim_backends.clustersim.async_rl import AsyncRun, AsyncSim, run_async
from sim_backends.clustersim.pipeline import perf_model
from sim_backends.clustersim.scenario import Scenario, parse_scenario

pytestmark = pytest.mark.unit


def _scenario(rollout: dict[str, Any] | None = None, **table: Any) -> Scenario:
    return parse_scenario(
        {
            "name": "async-tiny",
            "seed": 5,
            "cluster": {"nodes": 4, "nodes_per_pod": 2},
            "model": {"name": "Qwen2.5-14B"},
            "split": {"train_gpus": 8, "gen_gpus": 24},
            "workload": {
                "prompts_per_step": 8,
                "samples_per_prompt": 4,
                "max_response_tokens": 2048,
                "drift_per_step": 0.0,
            },
            "generation": {"static_tp": 2},
            "rollout": rollout or {"mode": "async", "staleness_threshold": 0.5},
            "async": {"versions": 4, "warmup": 1, **table},
            "fabric": {"kind": "fat-tree"},
        }
    )


def _checks(run: AsyncRun, groups: int = 8, n: int = 4) -> None:
    for v in run.versions:
        assert v.groups == groups and v.responses == groups * n
        assert len(v.lags) == groups
        # every trained token carries a version: by lag they add up to the trained tokens
        assert sum(t for _, t in v.tokens_by_lag) == v.response_tokens > 0
        assert v.step_s == pytest.approx(v.wait_s + v.train_s + v.sync_s + v.switch_s)
    starts = [v.start_s for v in run.versions]
    assert starts == sorted(starts)


@pytest.mark.parametrize("update", ["global", "relay"])
def test_every_version_trains_its_groups_with_every_token_tagged(update: str) -> None:
    run = run_async(_scenario(weight_update=update))
    _checks(run)
    assert run.samples_per_s > 0 and 0.0 <= run.trainer_idle <= 1.0
    assert 0.0 <= run.rollout_idle <= 1.0


def test_admission_never_runs_ahead_of_the_bound() -> None:
    s = _scenario()
    seen: list[tuple[int, int]] = []

    class Watched(AsyncSim):
        def _admit_groups(self, now: float) -> None:
            super()._admit_groups(now)
            seen.append((self.started, self.consumed))

    sim = Watched(s, perf_model(s), s.rollout.rule, s.asynchronous.built(32, 8)[0], 2)  # type: ignore[arg-type]
    sim.simulate()
    assert seen and all(started <= admission_limit(0.5, c, 8) for started, c in seen)
    assert seen[0] == (12, 0)  # (1 + 0.5) x 8 groups at the start


@pytest.mark.parametrize("update", ["global", "relay"])
def test_a_zero_bound_is_synchronous_every_trajectory_on_its_own_version(update: str) -> None:
    run = run_async(
        _scenario({"mode": "async", "max_staleness": 0}, weight_update=update, pull="abort")
    )
    _checks(run)
    assert {lag for v in run.versions for lag in v.lags} == {0}
    assert run.offpolicy_token_share == 0.0


def test_over_stale_groups_are_dropped_counted_and_never_trained() -> None:
    loose = run_async(_scenario({"mode": "async", "max_staleness": 3}, max_lag=-1))
    lags = {lag for v in loose.versions for lag in v.lags}
    assert max(lags) >= 1  # groups run ahead of the trainer under this bound
    strict = run_async(_scenario({"mode": "async", "max_staleness": 3}, max_lag=0))
    assert {lag for v in strict.versions for lag in v.lags} == {0}
    assert sum(v.dropped_responses for v in strict.versions) > 0
    assert all(v.dropped_responses == 4 * v.dropped_groups for v in strict.versions)


def test_the_global_sync_pauses_every_engine_and_reaches_them_at_once() -> None:
    run = run_async(_scenario(weight_update="global"))
    assert len(run.propagation_s) == len(run.versions) - 1 or len(run.propagation_s) == len(
        run.versions
    )
    for v, p in zip(run.versions, run.propagation_s, strict=False):
        assert p == pytest.approx(v.sync_s) and v.sync_s > 0
    assert set(run.stalls_s) == {run.versions[0].sync_s}


def test_relay_updates_reach_every_engine_after_the_push_and_a_load() -> None:
    s = _scenario(weight_update="relay", pull="abort")
    run = run_async(s)
    perf = perf_model(s)
    load = perf.weight_bytes_per_shard(2) / perf.hardware.h2d_bandwidth
    assert run.propagation_s and all(p >= load for p in run.propagation_s)
    assert all(p < 30.0 for p in run.propagation_s)  # abort: no engine waits for a tail
    assert min(run.stalls_s) == pytest.approx(load)
    for v in run.versions:
        assert v.sync_s > 0  # the trainer waits for its push only


def test_draining_engines_are_repacked_and_no_request_is_lost() -> None:
    # a bound of 2 versions keeps groups in flight across every version's end: the
    # engines running them drain, and the repack consolidates their tails
    rollout = {"mode": "async", "max_staleness": 2}
    s = _scenario(rollout, weight_update="relay", pull="drain", repack=True, local_updates=4)
    run = run_async(s)
    _checks(run)
    assert run.repacks > 0 and run.repack_moves > 0
    plain = run_async(_scenario(rollout, weight_update="relay", pull="drain", local_updates=4))
    assert plain.repacks == 0
    _checks(plain)


def test_a_split_move_takes_whole_nodes_and_charges_the_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sim_backends.clustersim import async_rl

    decided: list[float] = []

    def to_16(m: PeriodMeasure, **kw: Any) -> SplitDecision:
        decided.append(kw["switch_s"](m.train_gpus, 16))
        if m.train_gpus == 16:
            return SplitDecision(16, 16, False, 0.0, "kept", ())
        return SplitDecision(16, 16, True, decided[-1], "split 24/8 -> 16/16", ())

    monkeypatch.setattr(async_rl, "plan_async_split", to_16)
    run = run_async(_scenario(plan_split=True, plan_every=1))
    assert [v.train_gpus for v in run.versions] == [8, 16, 16, 16]
    assert [v.gen_gpus for v in run.versions] == [24, 16, 16, 16]
    assert run.split_timeline[0] == (0.0, 8, 24) and run.split_timeline[1][1:] == (16, 16)
    # one node to the trainer: its training state over its NICs and the reshard's setup
    assert run.versions[1].switch_s == pytest.approx(decided[0]) and decided[0] > 2.0
    _checks(run)


def test_the_split_planner_gets_what_the_period_measured() -> None:
    s = _scenario(plan_split=True, plan_every=1)
    run = run_async(s)
    assert len(run.plans) == len(run.versions) - 1
    assert all("trainer idle" in p and "rollout idle" in p for p in run.plans)


def test_runs_are_deterministic() -> None:
    s = _scenario(weight_update="relay", repack=True, reshard=True)
    assert run_async(s).summary() == run_async(s).summary()


def test_the_asynchronous_driver_refuses_other_modes_and_split_units() -> None:
    s = _scenario()
    with pytest.raises(errors.InvalidArgument, match=r"rollout\.mode"):
        run_async(s, rule=FULL)
    with pytest.raises(errors.InvalidArgument, match=r"split\.unit_gpus"):
        run_async(replace(s, split=replace(s.split, unit_gpus=4)))

"""The simulated engine's per-request progress, generation steps, and pause hook."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from sim_backends.engine import SimEngineConfig, SimulatedEngine
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


def engine(clock: FakeClock, **config: float) -> SimulatedEngine:
    return SimulatedEngine(
        8, (2, 2, 2, 2), seed=3, clock=clock, config=SimEngineConfig(**config),  # type: ignore[arg-type]
        request_prefix="n0",
    )  # fmt: skip


def test_progress_lists_running_and_queued_requests_of_the_step() -> None:
    clock = FakeClock()
    e = engine(clock)
    clock.now = 20.0
    stats, progress = e.stats(), e.progress()
    running = [r for r in progress.requests if r.instance >= 0]
    queued = [r for r in progress.requests if r.instance == -1]
    assert (len(running), len(queued)) == (stats.running_requests, stats.queued_requests)
    assert running and all(0 <= r.instance < 4 for r in running)
    assert all(r.request_id.startswith("n0-") for r in progress.requests)
    assert len({r.request_id for r in progress.requests}) == len(progress.requests)
    assert all(r.prompt_tokens == 512 and r.max_tokens == 16384 for r in progress.requests)
    assert any(r.generated_tokens > 0 for r in running)
    assert progress.step == stats.step == 0  # continuous arrivals: one endless step
    # finished requests left their output lengths behind, each within the cap
    assert progress.completed_lengths and all(1 <= n <= 16384 for n in progress.completed_lengths)


def test_progress_only_grows_while_requests_decode() -> None:
    clock = FakeClock()
    e = engine(clock)
    clock.now = 10.0
    before = {r.request_id: r.generated_tokens for r in e.progress().requests}
    done_before = len(e.progress().completed_lengths)
    clock.now = 11.0
    after = e.progress()
    for r in after.requests:
        assert r.generated_tokens >= before.get(r.request_id, 0)
    assert len(after.completed_lengths) >= done_before


def test_steps_of_a_fixed_number_of_requests() -> None:
    clock = FakeClock()
    e = engine(clock, requests_per_step=16, output_median_tokens=64.0, output_sigma=0.5)
    clock.now = 0.1
    first = e.progress()
    assert first.step == 0 and len(first.requests) == 16
    clock.now = 60.0  # long enough for several steps of short requests
    later = e.progress()
    assert later.step >= 2
    assert e.stats().step == later.step
    # the lengths are those of the current step only, at most its 16 requests
    assert len(later.completed_lengths) + len(later.requests) == 16
    assert all(r.request_id.startswith("n0-") for r in later.requests)


async def test_pause_stops_generation_and_unpause_resumes_it() -> None:
    clock = FakeClock()
    e = engine(clock)
    clock.now = 10.0
    await e.pause()
    held = e.progress()
    assert e.paused and e.stats().tokens_per_s == 0.0
    clock.now = 30.0  # twenty seconds paused: not a token, no admission, nothing done
    paused = e.progress()
    running = {r.request_id: r for r in held.requests if r.instance >= 0}
    assert {r.request_id: r for r in paused.requests if r.instance >= 0} == running
    assert paused.completed_lengths == held.completed_lengths
    assert len(paused.requests) >= len(held.requests)  # arrivals still queue
    await e.unpause()
    clock.now = 31.0
    resumed = {r.request_id: r.generated_tokens for r in e.progress().requests}
    assert not e.paused and e.stats().tokens_per_s > 0
    assert any(resumed.get(i, 1 << 30) > r.generated_tokens for i, r in running.items())


def test_grouped_steps_tag_siblings_and_repeat_prompts_each_epoch() -> None:
    clock = FakeClock()
    e = engine(
        clock,
        requests_per_step=12,
        samples_per_prompt=4,
        prompt_sigma=1.0,
        prompts_per_epoch=3,
        output_median_tokens=64.0,
        output_sigma=0.3,
    )
    clock.now = 0.1
    first = e.progress()
    groups = [r.group for r in first.requests]
    assert sorted(set(groups)) == ["n0-p0", "n0-p1", "n0-p2"]
    assert all(groups.count(g) == 4 for g in set(groups))
    clock.now = 120.0  # several steps: the same three prompts every step (one epoch each)
    later = e.progress()
    assert later.step >= 2
    seen = set(later.completed_groups) | {r.group for r in later.requests}
    assert seen <= {"n0-p0", "n0-p1", "n0-p2"}
    assert len(later.completed_groups) == len(later.completed_lengths)


def test_grouped_settings_are_validated() -> None:
    for name, value in (
        ("samples_per_prompt", 0),
        ("prompt_sigma", -1.0),
        ("prompts_per_epoch", -1),
    ):
        with pytest.raises(errors.InvalidArgument, match=name):
            SimEngineConfig(**{name: value})  # type: ignore[arg-type]

"""Generation: the simulated decode equals the performance model; plans are applied."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler.compute_problem import PlannerConfig
from scheduler.perf_model import H800, PerfModel, default_model
from sim_backends.clustersim.generation import (
    DecodeTimes,
    decode_time,
    gen_node_names,
    prefill_batch_time,
    simulate_step,
    uniform_layout,
)
from sim_backends.clustersim.scenario import WorkloadConfig
from sim_backends.clustersim.workload import RolloutRequest, step_workload

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B")
ONE_NODE = {"gen000": (8,)}


def _req(i: int, prompt: int, length: int) -> RolloutRequest:
    return RolloutRequest(f"r{i}", i, prompt, length)


def _token_by_token(perf: PerfModel, tp: int, prompts: list[int], lengths: list[int]) -> float:
    """Reference: every request admitted at t=0 (one prefill), then one decode iteration
    per token, the batch shrinking as requests finish."""
    t = prefill_batch_time(perf, tp, sum(prompts))
    ctx = list(prompts)
    left = list(lengths)
    while any(left):
        live = [i for i, x in enumerate(left) if x > 0]
        t += perf.decode_iteration_time(tp, len(live), sum(ctx[i] for i in live) / len(live))
        for i in live:
            ctx[i] += 1
            left[i] -= 1
    return t


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_single_request_decode_time_equals_the_performance_model(tp: int) -> None:
    prompt, length = 700, 3000
    res = simulate_step(PERF, [_req(0, prompt, length)], {"gen000": (tp,) * (8 // tp)})
    expected = PERF.prefill_time(tp, prompt) + sum(
        PERF.decode_iteration_time(tp, 1, prompt + i) for i in range(length)
    )
    assert res.seconds == pytest.approx(expected, rel=1e-9)
    assert res.completions == (res.seconds,)


def test_a_shrinking_batch_matches_token_by_token_decoding() -> None:
    prompts, lengths = [300, 500, 800], [400, 1500, 900]
    reqs = [_req(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    res = simulate_step(PERF, reqs, ONE_NODE)
    assert res.seconds == pytest.approx(_token_by_token(PERF, 8, prompts, lengths), rel=1e-9)
    assert len(res.completions) == 3


def test_decode_time_trapezoid_is_exact_when_memory_bound() -> None:
    direct = sum(PERF.decode_iteration_time(4, 3, 1000 + i) for i in range(500))
    assert decode_time(PERF, 4, 3, 3 * 1000, 500) == pytest.approx(direct, rel=1e-9)
    assert decode_time(PERF, 4, 0, 0, 10) == 0.0


def test_static_split_is_round_robin() -> None:
    reqs = [_req(i, 200, 1000) for i in range(8)]
    four = simulate_step(PERF, reqs, {"gen000": (2, 2, 2, 2)})
    # two requests per instance, all instances alike
    expected = _token_by_token(PERF, 2, [200, 200], [1000, 1000])
    assert four.seconds == pytest.approx(expected, rel=1e-9)
    assert len(set(four.completions)) == 1
    assert {s.tp for s in four.segments} == {2}
    assert four.layout_end == {"gen000": (2, 2, 2, 2)}


def test_kv_overflow_preempts_and_every_request_still_finishes() -> None:
    # an H800 with just enough memory for ~2,000 tokens of KV per TP8 instance
    small = PerfModel(PERF.model, replace(H800, hbm_bytes=7.01e9))
    cap = small.kv_capacity_tokens(8)
    assert 1000 < cap < 4000
    reqs = [_req(i, 200, 600) for i in range(6)]
    res = simulate_step(small, reqs, ONE_NODE)
    assert res.preemptions > 0
    assert len(res.completions) == 6
    assert res.decode_tokens == 6 * 600  # every token decoded once


def test_a_preempted_request_decodes_every_token_after_it_is_admitted_again() -> None:
    """A request preempted and admitted again on its instance decodes all of its tokens:
    its completion entry from before the preemption used to end it early (here 5,451 of
    6,553 tokens were decoded)."""
    small = PerfModel(PERF.model, replace(H800, hbm_bytes=7.01e9))
    rng = random.Random(0)
    lengths = [rng.randint(100, 1500) for _ in range(8)]
    reqs = [_req(i, 200, n) for i, n in enumerate(lengths)]
    res = simulate_step(small, reqs, ONE_NODE)
    assert res.preemptions > 0
    assert res.decode_tokens == sum(lengths) == 6553
    # slower than with room for all: preempted requests recompute their KV
    assert res.seconds > simulate_step(PERF, reqs, ONE_NODE).seconds


def test_the_engines_per_tp_cap_on_running_sequences_is_honoured() -> None:
    """An instance runs at most ``min(config.max_num_seqs, perf.max_num_seqs(tp))``: with
    the model's TP8 cap at 2, four equal requests run as two pairs, one after the other."""
    capped = replace(PERF, efficiency=replace(PERF.efficiency, max_num_seqs_by_tp=((8, 2),)))
    assert capped.max_num_seqs(8) == 2
    reqs = [_req(i, 200, 1000) for i in range(4)]
    res = simulate_step(capped, reqs, ONE_NODE)
    pair = _token_by_token(capped, 8, [200, 200], [1000, 1000])
    assert res.seconds == pytest.approx(2 * pair, rel=1e-9)
    # the planner's cap is the other bound: with it at 1 the requests run one by one
    one = simulate_step(capped, reqs, ONE_NODE, config=PlannerConfig(max_num_seqs=1))
    assert one.seconds == pytest.approx(4 * _token_by_token(capped, 8, [200], [1000]), rel=1e-9)


WL = WorkloadConfig(prompts_per_step=24, samples_per_prompt=8, max_response_tokens=6000)


@pytest.mark.parametrize("policy", ["proactive", "reactive", "adaptive"])
def test_planner_policies_finish_every_request_deterministically(policy: str) -> None:
    nodes = gen_node_names(3)
    reqs = step_workload(WL, 5, 1).requests
    history = [tuple(r.response_tokens for r in step_workload(WL, 5, 0).requests)]
    kwargs = {
        "policy": policy,
        "replan_interval_s": 2.0,
        "config": PlannerConfig(all_candidates_limit=0),
        "max_response_tokens": WL.max_response_tokens,
        "history": history,
    }
    a = simulate_step(PERF, reqs, uniform_layout(nodes, 8, 2), **kwargs)  # type: ignore[arg-type]
    b = simulate_step(PERF, reqs, uniform_layout(nodes, 8, 2), **kwargs)  # type: ignore[arg-type]
    assert a == b
    assert a.plans > 1
    assert sorted(a.lengths) == sorted(r.response_tokens for r in reqs)
    assert len(a.completions) == len(reqs) and a.completions[-1] == a.seconds
    assert all(sum(p) == 8 for p in a.layout_end.values())
    if policy == "reactive":
        assert a.reshards == 0 and a.layout_end == uniform_layout(nodes, 8, 2)
    if policy == "proactive":
        assert a.migrations == 0
    pauses = [s for s in a.segments if s.kind == "pause"]
    assert len(pauses) == a.reshards
    assert a.pause_s == pytest.approx(sum(s.end - s.start for s in pauses))


def test_reshard_pause_is_charged() -> None:
    """A node the planner reshards does no work during the plan's pause."""
    nodes = gen_node_names(2)
    reqs = step_workload(WL, 3, 0).requests
    res = simulate_step(
        PERF,
        reqs,
        uniform_layout(nodes, 8, 1),
        policy="proactive",
        replan_interval_s=2.0,
        config=PlannerConfig(all_candidates_limit=0),
        max_response_tokens=WL.max_response_tokens,
    )
    pauses = [s for s in res.segments if s.kind == "pause"]
    assert pauses, "the planner should reshard TP1 nodes as the step drains"
    for pause in pauses:
        assert pause.end > pause.start
        born = [
            s
            for s in res.segments
            if s.kind == "run" and s.node == pause.node and s.start == pause.start
        ]
        assert born
        for run in born:  # instances created by the reshard work only after the pause
            assert run.busy_end == run.start or run.busy_end >= pause.end


@pytest.mark.parametrize(("tp", "batch"), [(1, 1), (2, 64), (4, 256), (8, 200)])
def test_decode_times_equal_the_performance_model(tp: int, batch: int) -> None:
    fast = DecodeTimes(PERF)
    for ctx in (0.0, 37.5, 1000.0, 9000.0, 30000.0):
        assert fast.at(tp, batch, ctx) == pytest.approx(
            PERF.decode_iteration_time(tp, batch, ctx), rel=1e-12
        )


def test_the_planners_step_forecast_is_not_the_median_requests() -> None:
    """At the step start the planner predicts the rest of the step; the step ends with
    its longest response, so the prediction must be of that order, not of a median
    request's (with the median as every request's critical path it predicted a quarter
    of the realised step under a capped long tail)."""
    wl = WorkloadConfig(prompts_per_step=32, samples_per_prompt=8, max_response_tokens=8192)
    nodes = gen_node_names(2)
    history = [tuple(r.response_tokens for r in step_workload(wl, 2, 0).requests)]
    res = simulate_step(
        PERF,
        step_workload(wl, 2, 1).requests,
        uniform_layout(nodes, 8, 8),
        policy="proactive",
        replan_interval_s=5.0,
        config=PlannerConfig(all_candidates_limit=0),
        max_response_tokens=wl.max_response_tokens,
        history=history,
    )
    first_at, first_rest = res.predicted[0]
    assert first_at == 0.0
    assert first_rest >= 0.6 * res.seconds, (first_rest, res.seconds)


@pytest.mark.parametrize("policy", ["adaptive", "oracle"])
def test_moved_requests_never_exceed_an_instances_seats_or_kv_cache(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request moved with its KV cache onto an instance without a free seat (or KV room)
    waits first in line there and is recomputed when admitted, as an engine would: the
    running batch never exceeds ``max_num_seqs`` nor the KV cache."""
    from sim_backends.clustersim.generation import GenerationSim

    tight = replace(
        PERF,
        efficiency=replace(PERF.efficiency, max_num_seqs_by_tp=((1, 4), (2, 6), (4, 8), (8, 10))),
    )
    start = GenerationSim._start
    seen = {"starts": 0}

    def checked(self: GenerationSim, s: object, r: object) -> None:
        start(self, s, r)  # type: ignore[arg-type]
        seen["starts"] += 1
        assert len(s.running) <= self._seq_cap(s.tp)  # type: ignore[attr-defined]
        assert len(s.running) == 1 or s.ctx_sum <= s.cap  # type: ignore[attr-defined]

    monkeypatch.setattr(GenerationSim, "_start", checked)
    nodes = gen_node_names(3)
    reqs = step_workload(WL, 5, 1).requests
    res = simulate_step(
        tight, reqs, uniform_layout(nodes, 8, 2), policy=policy, replan_interval_s=2.0,
        max_response_tokens=WL.max_response_tokens,
    )  # fmt: skip
    assert len(res.completions) == len(reqs) and seen["starts"] >= len(reqs)

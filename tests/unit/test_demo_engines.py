"""`orlctl demo-engines` shows a reshard and a migration of a running request in every run
because it resumes the paused loop on a state it drives: the first wave of requests
fills gen0-n0's seats (nothing queued, gen0-n1 idle), the longest at least ``RESUME_AT``
tokens in, the others started. Here, on the controller's own pure decision (its default
planner and perf model), every such state the loop can see gives that plan; and the
step's shape is checked up front."""

from __future__ import annotations

import dataclasses
import itertools
import time
import types

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fabric_controller import demo_engines as demo
from fabric_controller import scheduling
from orchestrrl import errors
from orchestrrl.v1 import node_agent_pb2 as pb
from scheduler.compute_state import MoveMethod
from scheduler.perf_model import H800, QWEN25_14B, PerfModel

pytestmark = pytest.mark.unit

PERF = PerfModel(QWEN25_14B, H800)  # the controller's default (ComputeScheduler)
CAPS = demo.step_caps(demo.DemoConfig())  # `make demo-engines`: the default step
PROMPTS = demo.prompts(len(CAPS))
# which instance of gen0-n0 each first-wave request runs on: two seats each
PLACEMENTS = sorted({p for p in itertools.permutations([0] * demo.SEATS + [1] * demo.SEATS)})


def sample(requests: list[pb.RequestProgress], timestamp: float) -> pb.TelemetrySample:
    return pb.TelemetrySample(
        node="x",
        timestamp=timestamp,
        engine_state=pb.ENGINE_STATE_RUNNING,
        tp_layout=demo.LAYOUT,
        engine=pb.EngineSample(requests=requests, step=1, has_progress=True),
    )


def decide(generated: list[int], placement: tuple[int, ...]) -> tuple[object, object]:
    """The loop's first round after resuming, on gen0-n0 running the first wave."""
    running = [
        pb.RequestProgress(
            request_id=f"demo-{k}",
            instance=placement[k],
            prompt_tokens=len(PROMPTS[k]),
            generated_tokens=generated[k],
            max_tokens=CAPS[k],
        )
        for k in range(demo.FIRST_WAVE)
    ]
    views = []
    for node, requests in ((demo.GEN_NODE, running), ("gen0-n1", [])):
        got = scheduling.node_view(
            node, sum(demo.LAYOUT), sample(requests, 100.0), kv_import=False,
            max_num_seqs=demo.SEATS,
        )  # fmt: skip
        assert isinstance(got, scheduling.NodeView), got
        views.append(got)
    config = scheduling.SchedulingConfig()
    tracker = scheduling.observe(scheduling.StepTracker(), views, 90.0, config.history_steps)
    tracker = scheduling.planned(  # paused since: a plan made earlier in the step...
        tracker,
        scheduling.Decision("replan", object(), ""),
        95.0,  # type: ignore[arg-type]
    )
    tracker = scheduling.replan_now(tracker)  # ...and resumed: it re-plans now
    snap = scheduling.build_state(views)
    decision = scheduling.decide(tracker, snap, PERF, 100.0, config)
    assert decision.mode == "replan" and decision.plan is not None
    return decision, scheduling.commands_for(decision.plan, snap, "t", config.max_migrations)


GAP = 100  # tokens: what the staggered start keeps between requests (demo.STAGGER)


def staggered(generated: list[int], placement: tuple[int, ...]) -> bool:
    """The states a staggered start gives: the two requests of an instance at least GAP
    apart (they decode in lockstep, their gap stays), and the two gaps GAP apart."""
    gaps = []
    for instance in (0, 1):
        a, b = (generated[k] for k in range(len(placement)) if placement[k] == instance)
        gaps.append(abs(a - b))
    return min(gaps) >= GAP and abs(gaps[0] - gaps[1]) >= GAP


@settings(max_examples=300)
@given(
    st.integers(demo.RESUME_AT, 1500),
    st.lists(
        st.integers(demo.RUNNING_AT, 1500),
        min_size=demo.FIRST_WAVE - 1,
        max_size=demo.FIRST_WAVE - 1,
    ),
    st.sampled_from(PLACEMENTS),
)
def test_every_state_at_resume_gives_a_reshard_and_a_running_migration(
    longest: int, others: list[int], placement: tuple[int, ...]
) -> None:
    generated = [min(g, CAPS[k] - 1) for k, g in enumerate([longest, *others])]
    assume(staggered(generated, placement))
    decision, (reshards, migrations) = decide(generated, placement)
    assert {r.node for r in reshards} == {demo.GEN_NODE, "gen0-n1"}, decision
    assert all(r.layout == (2,) for r in reshards)
    running = [
        m
        for m in migrations
        if m.method is MoveMethod.RECOMPUTE and m.source == demo.GEN_NODE
        and m.target == "gen0-n1"
    ]  # fmt: skip
    assert running, migrations
    moved = {rid for m in running for rid in m.request_ids}
    assert all(generated[int(rid.split("-")[1])] >= demo.RUNNING_AT for rid in moved)


def test_why_the_first_wave_is_staggered() -> None:
    """Started together, two requests of one instance stay equal (lockstep decoding);
    with both instances alike the planner reshards but moves nothing: no request moved
    gains anything while an equal one stays."""
    decision, (reshards, migrations) = decide([700, 800, 700, 800], (0, 1, 0, 1))
    assert reshards and not migrations, decision


def test_before_the_resume_point_the_planner_would_not_act() -> None:
    """Why the demo waits: a few tokens in, the same state gives no reshard."""
    _, (reshards, migrations) = decide([50] * demo.FIRST_WAVE, PLACEMENTS[0])
    assert not reshards and not migrations


def test_the_step_must_hold_what_the_demo_shows() -> None:
    demo.check_config(demo.DemoConfig())  # the default step
    with pytest.raises(errors.InvalidArgument, match="at least 2000 with 8 requests"):
        demo.check_config(demo.DemoConfig(max_tokens=1600))
    with pytest.raises(errors.InvalidArgument, match="--requests=3 is not valid: at least 4"):
        demo.check_config(demo.DemoConfig(requests=3))
    with pytest.raises(errors.InvalidArgument, match=r"--max-tokens=1000 .*: at least 1250:"):
        demo.check_config(demo.DemoConfig(max_tokens=1000, equal_lengths=True))


class FakeLoop:
    """The controller as the demo sees it: ``decisions`` are the actions each resumed
    round takes (the first fails, as a reshard whose new engine did not start)."""

    def __init__(self, decisions: list[list[dict[str, object]]]) -> None:
        self.decisions = decisions
        self.calls: list[str] = []
        self.actions: list[dict[str, object]] = []
        self.planned_at = 0.0

    async def nodes(self) -> list[object]:
        @dataclasses.dataclass
        class Node:
            node: str
            telemetry: dict[str, float]

        return [Node(demo.GEN_NODE, {"timestamp": time.time() + 1.0})]

    async def pause_schedule(self, paused: bool = True) -> object:
        self.calls.append("pause" if paused else "resume")
        if not paused:
            self.actions += self.decisions.pop(0)
            self.planned_at = time.time()
        return None

    async def schedule(self) -> object:
        return types.SimpleNamespace(
            planned_at=self.planned_at, acted=True, reshards=[1], migrations=[],
            actions=list(self.actions),
        )  # fmt: skip


def action(
    kind: str, ok: bool, method: str = "", requests: tuple[str, ...] = ()
) -> dict[str, object]:
    return {"kind": kind, "ok": ok, "method": method, "requests": list(requests),
            "timestamp": time.time() + 5.0, "seconds": 1.0, "node": "gen0-n0 -> gen0-n1",
            "command_id": f"c-{kind}-{ok}-{method}"}  # fmt: skip


async def test_a_decision_that_moved_no_running_request_is_taken_again() -> None:
    progress = demo.Progress()
    progress.add("demo-0", 600)  # tokens of demo-0 had reached the client
    failed = [action("reshard", False), action("migrate", True, "dispatch", ("demo-5",))]
    moved = [action("reshard", True), action("migrate", True, "recompute", ("demo-0",))]
    loop = FakeLoop([failed, moved])
    result = demo.DemoResult("llamacpp")
    resumes = await demo._resume(loop, result, progress, 0.0, lambda _: None, [])  # type: ignore[arg-type]
    assert resumes == 2 and loop.calls == ["resume", "pause", "resume"]
    [move] = demo.running_moves(loop.actions, progress)
    assert (move.request_id, move.method, move.tokens) == ("demo-0", "recompute", 600)
    # and it gives up after RESUMES decisions that moved none
    loop = FakeLoop([failed] * demo.RESUMES)
    resumes = await demo._resume(loop, result, progress, 0.0, lambda _: None, [])  # type: ignore[arg-type]
    assert resumes == demo.RESUMES and loop.calls.count("resume") == demo.RESUMES

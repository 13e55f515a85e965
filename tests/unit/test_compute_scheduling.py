"""The compute-scheduling loop's pure core: telemetry -> ComputeState -> decision -> commands."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from fabric_controller import scheduling as s
from orchestrrl import errors
from orchestrrl.v1 import node_agent_pb2 as pb
from scheduler.compute_state import Migration, MoveMethod, apply_plan, canonical_instances
from scheduler.forecast import PriorLengths
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.replan import ReplanSchedule

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)
RNG = random.Random(3)
HISTORY = tuple(
    tuple(min(16384, int(RNG.lognormvariate(7.0, 1.0))) for _ in range(256)) for _ in range(3)
)


def sample(
    layout: tuple[int, ...] = (2, 2, 2, 2),
    requests: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    *,
    state: pb.EngineState.ValueType = pb.ENGINE_STATE_RUNNING,
    step: int = 1,
    completed: tuple[int, ...] = (),
    timestamp: float = 100.0,
    has_progress: bool = True,
    groups: dict[str, str] | None = None,  # request id -> its group
    completed_groups: tuple[str, ...] = (),
) -> pb.TelemetrySample:
    return pb.TelemetrySample(
        node="x",
        timestamp=timestamp,
        engine_state=state,
        tp_layout=layout,
        engine=pb.EngineSample(
            requests=[
                pb.RequestProgress(
                    request_id=rid,
                    instance=inst,
                    prompt_tokens=512,
                    generated_tokens=gen,
                    max_tokens=16384,
                    group=(groups or {}).get(rid, ""),
                )
                for rid, inst, gen in requests
            ],
            completed_lengths=completed,
            completed_groups=completed_groups,
            step=step,
            has_progress=has_progress,
        ),
    )


def view(node: str, **kw: object) -> s.NodeView:
    got = s.node_view(node, 8, sample(**kw))  # type: ignore[arg-type]
    assert isinstance(got, s.NodeView), got
    return got


def test_node_view_reads_layout_requests_and_step() -> None:
    v = view("g0", requests=[("a", 0, 10), ("b", -1, 0)], completed=(5, 7), step=3)
    assert v.layout == (2, 2, 2, 2)
    assert v.step == 3
    assert v.completed == (5, 7)
    assert v.requests[0] == s.Progress("a", 0, 512, 10, 16384)
    assert v.requests[1].instance == -1


@pytest.mark.parametrize(
    ("smp", "why"),
    [
        (None, "no telemetry yet"),
        (sample(state=pb.ENGINE_STATE_RESHARDING), "engine resharding"),
        (sample(state=pb.ENGINE_STATE_DRAINED), "engine drained"),
        (sample(layout=(2, 2)), "uses 4 GPUs, the wiring says 8"),
        (sample(layout=()), "no usable TP layout"),
        (sample(requests=[("a", 4, 1)]), "request 'a' on instance 4"),
        (sample(requests=[("", 0, 1)]), "request '' on instance 0"),
        (sample(has_progress=False), "without per-request progress"),
    ],
)
def test_node_view_says_why_a_node_is_left_out(smp: pb.TelemetrySample | None, why: str) -> None:
    got = s.node_view("g0", 8, smp)
    assert isinstance(got, str)
    assert why in got


def test_build_state_names_instances_like_the_planner_and_places_requests() -> None:
    a = view("g0", layout=(4, 2, 2), requests=[("r1", 1, 100), ("r2", -1, 0)])
    b = view("g1", layout=(8,), requests=[("r3", 0, 5)])
    snap = s.build_state([b, a])
    ids = [i.id for i in snap.state.instances]
    assert ids == ["g0/tp4-g0", "g0/tp2-g4", "g0/tp2-g6", "g1/tp8-g0"]
    # a descending layout has exactly the planner's canonical instances
    assert snap.state.instances_on("g0") == canonical_instances("g0", range(8), (4, 2, 2))
    assert snap.index["g0/tp2-g4"] == ("g0", 1)
    by_id = {r.id: r for r in snap.state.requests}
    assert by_id["r1"].instance == "g0/tp2-g4" and by_id["r1"].running
    assert by_id["r1"].context_tokens == 612
    assert by_id["r2"].instance is None and not by_id["r2"].running
    assert by_id["r3"].instance == "g1/tp8-g0"
    assert snap.max_tokens == 16384
    assert snap.layouts == {"g0": (4, 2, 2), "g1": (8,)}


def test_build_state_gives_each_node_its_measured_reshard_pause() -> None:
    a = view("g0", requests=[("r1", 0, 100)])
    b = view("g1", requests=[("r2", 0, 100)])
    snap = s.build_state([a, b], {"g1": 62.5, "gone": 3.0})
    pauses = {n.name: n.reshard_pause_s for n in snap.state.nodes}
    assert pauses == {"g0": 0.0, "g1": 62.5}  # g0: none measured (the model's estimate)
    assert s.build_state([a, b]).state.nodes[1].reshard_pause_s == 0.0


@pytest.mark.parametrize(
    ("stages", "pause"),
    [
        ([("export_requests", 0.01), ("stop_instances", 3.0), ("start_instances", 58.5)], 61.51),
        ([("pause", 0.0)], 0.0),
        ([], None),  # nothing was resharded (the layout was already the one asked for)
        ([("pause", -1.0), ("resume", 2.0)], None),  # not a duration: no measurement
        ([("pause", math.nan)], None),
        ([("pause", 1e9)], None),
    ],
)
def test_measured_pause_is_the_sum_of_the_reported_stages(
    stages: list[tuple[str, float]], pause: float | None
) -> None:
    got = s.measured_pause(stages)
    assert got == (pytest.approx(pause) if pause is not None else None)


def test_build_state_keeps_a_request_reported_twice_once() -> None:
    a = view("g0", requests=[("r1", 0, 100)])
    b = view("g1", requests=[("r1", 2, 100)])
    snap = s.build_state([a, b])
    assert [r.instance for r in snap.state.requests] == ["g0/tp2-g0"]
    assert snap.duplicates == ("r1",)


def test_step_tracker_moves_completed_lengths_into_history_on_a_new_step() -> None:
    t = s.StepTracker()
    t = s.observe(t, [view("g0", step=1, completed=(5,)), view("g1", step=1)], 10.0, 2)
    assert (t.step, t.started_at, t.history) == (1, 10.0, ())
    t = s.observe(
        t, [view("g0", step=1, completed=(5, 9)), view("g1", step=1, completed=(3,))], 11, 2
    )
    assert t.completed_lengths == (5, 9, 3)
    assert t.started_at == 10.0
    t = s.observe(t, [view("g0", step=2), view("g1", step=1, completed=(3, 4))], 20.0, 2)
    assert t.step == 2 and t.started_at == 20.0
    assert t.history == ((5, 9, 3),)
    assert t.completed_lengths == ()  # g1 still reports step 1: not this step's
    t = s.observe(t, [view("g0", step=3, completed=(1,))], 30.0, 2)
    t = s.observe(t, [view("g0", step=4)], 40.0, 2)
    # a step that completed nothing adds no history; at most history_steps are kept
    assert t.history == ((5, 9, 3), (1,))
    t = s.observe(t, [view("g0", step=5, completed=(2,))], 50.0, 2)
    t = s.observe(t, [view("g0", step=6)], 60.0, 2)
    assert t.history == ((1,), (2,))


def long_tail() -> tuple[s.Snapshot, s.StepTracker]:
    """Four long requests on one node of 4xTP2, an idle second node: the long tail."""
    a = view("g0", requests=[(f"r{i}", i, 6000) for i in range(4)], completed=HISTORY[0][:200])
    b = view("g1", completed=HISTORY[1][:200])
    t = s.observe(s.StepTracker(history=HISTORY), [a, b], 50.0, 8)
    return s.build_state([a, b]), t


def test_long_tail_replan_merges_instances_and_moves_requests_to_the_idle_node() -> None:
    snap, t = long_tail()
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.mode == "replan" and d.plan is not None
    assert {r.node: r.after for r in d.plan.reshards} == {"g0": (8,), "g1": (8,)}
    assert d.plan.prediction.planned_makespan_s < d.plan.prediction.keep_makespan_s
    reshards, migrations = s.commands_for(d.plan, snap, "t1", 64)
    assert [(r.command_id, r.node, r.layout, r.before) for r in reshards] == [
        ("t1-reshard-g0", "g0", (8,), (2, 2, 2, 2)),
        ("t1-reshard-g1", "g1", (8,), (2, 2, 2, 2)),
    ]
    assert len(migrations) == 1
    m = migrations[0]
    assert (m.source, m.target, m.target_instance, m.recompute) == ("g0", "g1", 0, False)
    assert m.method is MoveMethod.KV_NETWORK and len(m.request_ids) == 2
    # the plan's layout after, by node, as GetSchedule reports it
    assert s.layouts_after(d.plan, snap) == {"g0": (8,), "g1": (8,)}


def test_after_the_plan_is_applied_the_next_round_changes_nothing() -> None:
    snap, t = long_tail()
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.plan is not None
    after = apply_plan(snap.state, d.plan)
    views = []
    for node in ("g0", "g1"):
        insts = after.instances_on(node)
        layout = tuple(i.tp for i in insts)
        reqs = [
            (r.id, [i.id for i in insts].index(r.instance), r.generated_tokens)
            for r in after.requests
            if r.instance is not None and r.instance.startswith(node + "/")
        ]
        views.append(view(node, layout=layout, requests=reqs, timestamp=200.0))
    snap2 = s.build_state(views)
    assert snap2.state.instances == tuple(sorted(after.instances))
    t2 = s.acted(s.planned(t, d, 60.0), 150.0)
    d2 = s.decide(t2, snap2, PM, 61.0, s.SchedulingConfig())
    assert d2.mode == "balance" and d2.plan is not None
    assert d2.plan.empty, d2.plan.explain()


def test_no_decision_on_telemetry_older_than_the_last_action() -> None:
    snap, t = long_tail()
    d = s.decide(s.acted(t, 100.0), snap, PM, 60.0, s.SchedulingConfig())
    assert d.mode == "wait" and d.plan is None
    assert "g0" in d.why and "g1" in d.why


def test_nothing_to_plan_without_requests() -> None:
    snap = s.build_state([view("g0"), view("g1")])
    d = s.decide(s.StepTracker(), snap, PM, 1.0, s.SchedulingConfig())
    assert (d.mode, d.plan) == ("idle", None)


def test_between_replans_only_balancing_runs() -> None:
    snap, t = long_tail()
    config = s.SchedulingConfig(replan=ReplanSchedule(5.0))
    d = s.decide(t, snap, PM, 60.0, config)
    t = s.planned(t, d, 60.0)
    assert d.mode == "replan" and t.last_plan_at == 60.0
    d2 = s.decide(t, snap, PM, 64.9, config)
    assert d2.mode == "balance" and d2.plan is not None
    assert not d2.plan.reshards
    assert s.decide(t, snap, PM, 65.0, config).mode == "replan"


def test_queued_requests_go_to_another_nodes_free_seats() -> None:
    """A full node's queue does not drain to an idle node by itself (an engine admits
    only its own): the plan's dispatch of queued requests elsewhere becomes migrations."""
    running = [(f"r{i}", i % 4, 100) for i in range(8)]  # 4 instances x 2 seats, full
    queued = [(f"q{i}", -1, 0) for i in range(8)]
    a = s.node_view("g0", 8, sample(requests=running + queued), max_num_seqs=2)
    b = s.node_view("g1", 8, sample(requests=[]), max_num_seqs=2)
    assert isinstance(a, s.NodeView) and isinstance(b, s.NodeView)
    snap = s.build_state([a, b])
    assert snap.max_num_seqs == 2 and snap.queued_on == {f"q{i}": "g0" for i in range(8)}
    t = s.observe(s.StepTracker(history=HISTORY), [a, b], 50.0, 8)
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.plan is not None
    _, migrations = s.commands_for(d.plan, snap, "t", 64)
    moved = {rid for m in migrations if m.method is MoveMethod.DISPATCH for rid in m.request_ids}
    assert moved and moved <= {f"q{i}" for i in range(8)}
    assert all(
        (m.source, m.target, m.recompute) == ("g0", "g1", True)
        for m in migrations
        if m.method is MoveMethod.DISPATCH
    )


def full_nodes(free_on_g1: int) -> tuple[s.Snapshot, s.StepTracker]:
    """Two nodes of 4 x TP2 with 2 seats an instance: g0 full with 6 queued, g1 with
    ``free_on_g1`` seats free and one request of its own queued."""
    a_running = [(f"a{i}", i % 4, 100 + i) for i in range(8)]
    b_running = [(f"b{i}", i % 4, 5000 + i) for i in range(8 - free_on_g1)]
    a = s.node_view(
        "g0", 8, sample(requests=a_running + [(f"q{i}", -1, 0) for i in range(6)]),
        max_num_seqs=2,
    )  # fmt: skip
    b = s.node_view("g1", 8, sample(requests=[*b_running, ("p0", -1, 0)]), max_num_seqs=2)
    assert isinstance(a, s.NodeView) and isinstance(b, s.NodeView)
    t = s.observe(s.StepTracker(history=HISTORY), [a, b], 50.0, 8)
    return s.build_state([a, b]), replace(t, last_plan_at=59.0)  # balancing, not re-planning


@pytest.mark.parametrize("free_on_g1", [0, 1, 3])
def test_a_queued_request_moves_only_to_a_free_seat(free_on_g1: int) -> None:
    """Moving a queued request to a full node would only put it in another queue (and,
    as predictions shift, back again: seen on real engines, the same request every
    10 s): it moves only where a seat is free after the plan, its node's own queue
    served first."""
    snap, t = full_nodes(free_on_g1)
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.mode == "balance" and d.plan is not None and not d.plan.reshards
    _, migrations = s.commands_for(d.plan, snap, "t", 64)
    dispatched = [
        (m.target, m.target_instance)
        for m in migrations
        if m.method is MoveMethod.DISPATCH
        for _ in m.request_ids
    ]
    running_after: dict[tuple[str, int], int] = {}
    for rid, inst in d.plan.assignment:
        if rid not in snap.queued_on:
            running_after[snap.index[inst]] = running_after.get(snap.index[inst], 0) + 1
    for where in set(dispatched):
        assert running_after.get(where, 0) + dispatched.count(where) <= 2
    for node in {n for n, _ in dispatched}:
        running = sum(c for (n, _), c in running_after.items() if n == node)
        own_queue = sum(
            1
            for rid, inst in d.plan.assignment
            if snap.queued_on.get(rid) == node == snap.index[inst][0]
        )
        assert running + own_queue + sum(1 for n, _ in dispatched if n == node) <= 8
    if free_on_g1 == 0:
        assert not dispatched
    if free_on_g1 == 3:
        assert dispatched  # the test can see a move at all


def test_moves_of_two_methods_into_one_instance_become_two_commands() -> None:
    """A queued request dispatched and a running one moved with its KV cache into the
    same instance: two commands (sorting them raised TypeError, enum members do not
    order, and the round was lost)."""
    snap, t = full_nodes(8)  # g1 idle: room for both
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.plan is not None
    target = next(inst for rid, inst in d.plan.assignment if rid == "q0")
    assert snap.index[target][0] == "g1"
    source = next(r.instance for r in snap.state.requests if r.id == "a0")
    assert source is not None
    plan = replace(
        d.plan,
        migrations=(Migration("a0", source, target, MoveMethod.KV_NETWORK, 0.1),),
        assignment=tuple((rid, target if rid == "a0" else i) for rid, i in d.plan.assignment),
    )
    _, migrations = s.commands_for(plan, snap, "t", 64)
    into = [
        (m.method, m.request_ids) for m in migrations if m.target_instance == snap.index[target][1]
    ]
    assert (MoveMethod.KV_NETWORK, ("a0",)) in into
    assert any(m is MoveMethod.DISPATCH and "q0" in ids for m, ids in into)
    assert len({m.command_id for m in migrations}) == len(migrations)


def test_migrations_per_round_are_capped() -> None:
    snap, t = long_tail()
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.plan is not None
    _, migrations = s.commands_for(d.plan, snap, "t", 1)
    assert sum(len(m.request_ids) for m in migrations) == 1
    _, none = s.commands_for(d.plan, snap, "t", 0)
    assert none == ()


@pytest.mark.parametrize("value", [0.0, 0.01, -1.0, float("nan"), float("inf"), 1e9])
def test_interval_is_validated(value: float) -> None:
    with pytest.raises(errors.InvalidArgument, match="--compute-interval"):
        s.check_interval(value)
    with pytest.raises(errors.InvalidArgument, match="interval_s"):
        s.SchedulingConfig(interval_s=value)


def test_interval_in_range_is_accepted() -> None:
    assert s.check_interval(0.5) == 0.5


def test_controller_flags_enable_the_loop_and_validate_its_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fabric_controller.main import build_parser

    args = build_parser().parse_args([])
    assert (args.compute_scheduling, args.compute_interval) == ("off", 1.0)
    args = build_parser().parse_args(["--compute-scheduling", "on", "--compute-interval", "0.25"])
    assert (args.compute_scheduling, args.compute_interval) == ("on", 0.25)
    assert args.compute_replan_interval == ReplanSchedule().interval_s
    args = build_parser().parse_args(["--compute-replan-interval", "2.5"])
    assert args.compute_replan_interval == 2.5
    for flag in ("--compute-interval", "--compute-replan-interval"):
        for bad in ("0", "abc", "nan", "1e9"):
            with pytest.raises(SystemExit):
                build_parser().parse_args([flag, bad])
            assert f"{flag}=" in capsys.readouterr().err
    assert build_parser().parse_args([]).compute_repack_tail == 0.5
    assert build_parser().parse_args(["--compute-repack-tail", "0"]).compute_repack_tail == 0.0
    for bad in ("1.5", "-0.1", "abc", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--compute-repack-tail", bad])
        err = capsys.readouterr().err
        assert "--compute-repack-tail" in err and bad in err and "[0, 1]" in err
    with pytest.raises(errors.InvalidArgument, match="tail_fraction"):
        s.SchedulingConfig(tail_fraction=2.0)


def test_orlctl_schedule_show_prints_layouts_plan_and_actions() -> None:
    from fabric_controller.cli import build_parser, describe_schedule
    from orchestrrl.client import ScheduleView

    assert build_parser().parse_args(["schedule", "show", "--json"]).json
    view = ScheduleView(
        enabled=True,
        interval_s=1.0,
        planned_at=1000.0,
        mode="replan",
        reason="reshard 1 node(s)",
        explanation="compute scheduling every 1 s; replan for step 3:\ncompute plan ...",
        acted=True,
        step=3,
        requests=4,
        layouts=[
            {"node": "g0", "before": [2, 2, 2, 2], "after": [8]},
            {"node": "g1", "before": [8], "after": [8]},
        ],
        reshards=[{"node": "g0", "before": [2, 2, 2, 2], "after": [8], "pause_s": 2.3}],
        migrations=[],
        prediction={"gain_s": 9.0},
        actions=[
            {
                "timestamp": 1000.5,
                "kind": "migrate",
                "node": "g0 -> g1",
                "command_id": "c",
                "ok": False,
                "message": "g1 refused 2 request(s)",
                "seconds": 0.04,
                "requests": ["a", "b"],
            }
        ],
        skipped_nodes=[],
    )
    text = describe_schedule(view)
    assert text.startswith("compute scheduling every 1 s; replan for step 3:")
    assert "layouts (2 generation nodes, 4 requests, 1 changing):" in text
    assert "g0             TP2+TP2+TP2+TP2 -> TP8" in text
    assert "g1             TP8\n" in text
    assert "carried out" in text
    assert "FAILED migrate  g0 -> g1: g1 refused 2 request(s) (0.04 s)" in text


def test_requests_moved_a_moment_ago_stay_where_they_are() -> None:
    snap, t = long_tail()
    d = s.decide(t, snap, PM, 60.0, s.SchedulingConfig())
    assert d.plan is not None
    _, migrations = s.commands_for(d.plan, snap, "t", 64)
    moved = {rid for m in migrations for rid in m.request_ids}
    assert moved
    _, again = s.commands_for(d.plan, snap, "t", 64, settled=frozenset(moved))
    assert again == ()


def test_node_view_reads_the_groups_of_requests_and_completions() -> None:
    v = view(
        "g0",
        requests=[("r0", 0, 10), ("r1", -1, 0)],
        groups={"r0": "prompt-7"},
        completed=(5, 9),
        completed_groups=("prompt-7", ""),
    )
    assert [p.group for p in v.requests] == ["prompt-7", ""]
    assert v.completed_groups == ("prompt-7", "")
    snap = s.build_state([v])
    assert {r.id: r.group for r in snap.state.requests} == {"r0": "prompt-7", "r1": None}


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"completed": (5, 9), "completed_groups": ("a",)}, "1 completed_groups for 2"),
        ({"completed": (5,), "completed_groups": ("x" * 129,)}, "longer than 128"),
        ({"requests": [("r0", 0, 1)], "groups": {"r0": "x" * 129}}, "group of 129 characters"),
    ],
)
def test_node_view_leaves_out_a_node_with_malformed_groups(kw: dict[str, object], why: str) -> None:
    got = s.node_view("g0", 8, sample(**kw))  # type: ignore[arg-type]
    assert isinstance(got, str) and why in got


def test_a_finished_steps_groups_are_remembered_for_their_next_epoch() -> None:
    t = s.StepTracker()
    a = view("g0", step=1, completed=(100, 300, 1000), completed_groups=("p1", "p1", "p2"))
    b = view("g1", step=1, completed=(50,))  # reports no groups
    t = s.observe(t, [a, b], 10.0, 8)
    assert t.completed_group_list == ("p1", "p1", "p2", "")
    t = s.observe(t, [view("g0", step=2), view("g1", step=2)], 20.0, 8)
    mean = (math.log(100) + math.log(300) + math.log(1000) + math.log(50)) / 4
    assert dict(t.remembered) == {
        "p1": PriorLengths((100, 300), mean),
        "p2": PriorLengths((1000,), mean),
    }
    # p1 again: its newest occurrence replaces the old and is the last to be forgotten
    c = view("g0", step=2, completed=(7, 8), completed_groups=("p3", "p1"))
    t = s.observe(t, [c], 30.0, 8, groups_remembered=2)
    t = s.observe(t, [view("g0", step=3)], 40.0, 8, groups_remembered=2)
    assert list(t.remembered) == ["p3", "p1"]
    assert t.remembered["p1"].lengths == (8,)


def test_remember_keeps_nothing_when_told_to_remember_no_group() -> None:
    assert s.remember({}, (5, 6), ("a", "b"), 0) == {}
    with pytest.raises(errors.InvalidArgument, match="groups_remembered"):
        s.SchedulingConfig(groups_remembered=-1)


def test_the_loops_forecast_uses_siblings_and_the_previous_epoch() -> None:
    """Two prompts: p-long's finished siblings ran long, p-short's short; the forecast
    the controller plans with scales each group's running samples accordingly. The
    earlier epoch alone (no sibling finished yet) does the same."""
    running = [(f"l{i}", i % 4, 50) for i in range(4)] + [(f"s{i}", i % 4, 50) for i in range(4)]
    groups = {rid: ("p-long" if rid[0] == "l" else "p-short") for rid, _, _ in running}
    siblings = view(
        "g0",
        requests=running,
        groups=groups,
        completed=(4000, 5000, 6000, 200, 250, 300),
        completed_groups=("p-long",) * 3 + ("p-short",) * 3,
    )
    t = s.observe(s.StepTracker(history=HISTORY), [siblings], 50.0, 8)
    fc = s.forecast_for(t, s.build_state([siblings]), s.SchedulingConfig())
    assert fc.group_log_scale["p-long"] > 0.5 > -0.5 > fc.group_log_scale["p-short"]

    # next epoch: the same prompts again, nothing finished yet in this step
    t = s.observe(t, [view("g0", step=2, requests=running, groups=groups)], 60.0, 8)
    fresh = view("g0", step=2, requests=running, groups=groups)
    fc = s.forecast_for(t, s.build_state([fresh]), s.SchedulingConfig())
    assert fc.group_log_scale["p-long"] > 0 > fc.group_log_scale["p-short"]
    # without groups the forecast has no group scales
    plain = view("g0", step=2, requests=running)
    assert not s.forecast_for(t, s.build_state([plain]), s.SchedulingConfig()).group_log_scale


def test_replan_now_makes_the_next_decision_a_replan() -> None:
    views = [view("g0", requests=[("a", 0, 10)]), view("g1")]
    snap = s.build_state(views)
    config = s.SchedulingConfig(replan=ReplanSchedule(60.0))
    tracker = s.observe(s.StepTracker(), views, 100.0, 8)
    first = s.decide(tracker, snap, PM, 100.0, config)
    assert first.mode == "replan"
    tracker = s.planned(tracker, first, 100.0)
    assert s.decide(tracker, snap, PM, 101.0, config).mode == "balance"  # not due for 60 s
    assert s.decide(s.replan_now(tracker), snap, PM, 101.0, config).mode == "replan"

"""The gateway's pure core: events in, actions out, no tasks and no clock.

A tiny synchronous "shell" (:class:`Shell`) performs the core's actions the way
:class:`node_agent.gateway.engine.GatewayEngine` does, with calls that continue any prefix
by the scripted rule of ``sim_backends.token_engine`` (like greedy decoding of one model).
So every test, and the hypothesis state machine at the end, checks the gateway's promise:
whatever happens on the way, a request that finishes has exactly the output one
uninterrupted call gives, no call ever exceeds its instance's seats, and every request is
in exactly one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from structlog.testing import capture_logs

from node_agent.engine import Destination, EngineState
from node_agent.engines.base import Placement, Sampling
from node_agent.gateway.core import (
    Action,
    CancelCall,
    CancelFollow,
    CheckInstance,
    CoreConfig,
    GatewayCore,
    Instance,
    QueueFull,
    RestartInstance,
    StartCall,
    StartFollow,
    StopInstance,
)
from node_agent.gateway.requests import Where, parse_engine_state, staleness
from orchestrrl import errors
from orchestrrl.checkpoint import version_count
from sim_backends.token_engine import greedy, next_token

pytestmark = pytest.mark.unit

GREEDY = Sampling(temperature=0.0)


def prompt(i: int) -> tuple[int, ...]:
    return (1 + i, 2 + i, 3)


def placements(layout: tuple[int, ...]) -> list[Placement]:
    out, first = [], 0
    for k, tp in enumerate(layout):
        out.append(Placement(k, tp, tuple(range(first, first + tp)), "cpu", 9000 + first))
        first += tp
    return out


@dataclass
class Shell:
    """Performs a core's actions synchronously and records them."""

    core: GatewayCore
    seats: int = 2
    calls: dict[str, StartCall] = field(default_factory=dict)  # started, not ended
    cancelled: set[str] = field(default_factory=set)  # cancelled, not ended yet
    restarts: list[RestartInstance] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)
    follows: dict[str, StartFollow] = field(default_factory=dict)
    log: list[Action] = field(default_factory=list)
    produced: dict[str, list[int]] = field(default_factory=dict)  # call -> its tokens

    def act(self, actions: list[Action]) -> None:
        for a in actions:
            self.log.append(a)
            if isinstance(a, StartCall):
                assert a.call_id not in self.calls
                self.calls[a.call_id] = a
            elif isinstance(a, CancelCall):
                if a.call_id in self.calls:
                    self.cancelled.add(a.call_id)
            elif isinstance(a, RestartInstance):
                self.restarts.append(a)
            elif isinstance(a, CheckInstance):
                self.checks.append(a.instance)
            elif isinstance(a, StopInstance):
                self.stops.append(a.instance)
            elif isinstance(a, StartFollow):
                self.follows[a.request_id] = a
            elif isinstance(a, CancelFollow):
                self.follows.pop(a.request_id, None)

    def instance(self, p: Placement) -> Instance:
        return self.core.new_instance(p, self.seats, can_pause=False)

    def start(self) -> list[Instance]:
        insts = [self.instance(p) for p in placements(self.core.layout)]
        for inst in insts:
            self.act(self.core.started(inst))
        self.act(self.core.adopt(insts, self.core.layout))
        return insts

    def submit(
        self,
        i: int,
        n: int,
        rid: str | None = None,
        group: str = "",
        *,
        max_staleness: int | None = None,
        update_policy: str = "",
    ) -> str:
        rid = rid or f"r{i}"
        _, actions = self.core.submit(
            0.0,
            rid,
            prompt(i),
            n,
            GREEDY,
            group,
            max_staleness=max_staleness,
            update_policy=update_policy,
        )
        self.act(actions)
        return rid

    def update(self, version: str, policy: str = "resume") -> list[Action]:
        """A whole weight update to ``version`` as the shell runs it: begin, the calls
        taken off and the finishing ones end, then the new weights land; the actions of
        the landing."""
        self.act(self.core.begin_update(version, policy))
        self.end_cancelled()
        self.run_to_completion()
        landed = self.core.end_update(ok=True)
        self.act(landed)
        self.end_cancelled()
        return landed

    def step(self, call_id: str, k: int = 1) -> bool:
        """Stream ``k`` tokens of a call (the scripted continuation of its submission),
        finishing it when its cap is reached; ends the call when the core says so."""
        a = self.calls[call_id]
        seq = list(a.submission.prompt)
        owed = a.submission.max_tokens
        produced = self.produced.setdefault(call_id, [])
        tokens: list[int] = []
        for _ in range(k):
            if len(produced) + len(tokens) >= owed:
                break
            tokens.append(next_token([*seq, *produced, *tokens]))
        produced.extend(tokens)
        finish = "length" if len(produced) >= owed else None
        going = self.core.call_tokens(call_id, tuple(tokens), finish)
        if not going:
            self.end(call_id)
        return going

    def end(self, call_id: str) -> None:
        self.calls.pop(call_id, None)
        self.cancelled.discard(call_id)
        self.produced.pop(call_id, None)
        self.act(self.core.call_ended(call_id))

    def fail(self, call_id: str, *, retry: bool = True, unreachable: bool = False) -> None:
        self.act(
            self.core.call_failed(
                call_id, "boom", retry=retry, unreachable=unreachable, server_alive=True
            )
        )
        self.end(call_id)

    def end_cancelled(self) -> None:
        for cid in sorted(self.cancelled):
            self.end(cid)

    def live_calls(self) -> list[str]:
        return sorted(c for c in self.calls if c not in self.cancelled)

    def run_to_completion(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            self.end_cancelled()
            live = self.live_calls()
            if not live:
                return
            self.step(live[0], 1000)
        raise AssertionError("calls never ended")


def make(layout: tuple[int, ...] = (1, 1), seats: int = 2, **config: object) -> Shell:
    core = GatewayCore("scripted", sum(layout), layout, node="a", config=CoreConfig(**config))  # type: ignore[arg-type]
    shell = Shell(core, seats)
    shell.start()
    return shell


def check_invariants(core: GatewayCore) -> None:
    queued = core.queued_ids()
    assert len(queued) == len(set(queued))
    seqs = [core.requests[r].seq for r in queued]
    assert seqs == sorted(seqs)
    for rid, req in core.requests.items():
        assert req.id == rid
        assert len(req.output) <= req.max_tokens
        assert (rid in queued) == (req.where is Where.QUEUED), (rid, req.where)
        assert core.has_live_call(rid) == (req.where is Where.RUNNING), (rid, req.where)
        if req.where is Where.RUNNING:
            assert 0 <= req.instance < len(core.instances)
    for inst in core.instances:
        assert len(inst.calls) <= inst.max_num_seqs


# -- admission -------------------------------------------------------------------------------


def test_requests_fill_the_instance_with_most_free_seats_then_queue_in_order() -> None:
    shell = make((1, 1), seats=2)
    ids = [shell.submit(i, 5) for i in range(6)]
    started = [a for a in shell.log if isinstance(a, StartCall)]
    assert [a.request_id for a in started] == ids[:4]
    assert sorted(a.instance for a in started) == sorted(
        [shell.core.instances[0].key] * 2 + [shell.core.instances[1].key] * 2
    )
    assert shell.core.queued_ids() == ids[4:]
    # a finished call frees its seat only when its task ended, then the oldest waiter runs
    first = started[0].call_id
    assert shell.core.call_tokens(first, (1, 2, 3, 4, 5), None) is False
    assert shell.core.requests[ids[0]].where is Where.FINISHED
    assert shell.core.queued_ids() == ids[4:]
    shell.end(first)
    assert shell.core.queued_ids() == ids[5:]
    check_invariants(shell.core)


def test_every_request_finishes_with_the_uninterrupted_output() -> None:
    shell = make((2,), seats=3)
    ids = [shell.submit(i, 12) for i in range(7)]
    shell.run_to_completion()
    for i, rid in enumerate(ids):
        req = shell.core.requests[rid]
        assert req.where is Where.FINISHED and req.output == greedy(prompt(i), 12)
    assert sorted(shell.core.progress().completed_lengths) == [12] * 7


def test_bad_submissions_change_nothing() -> None:
    shell = make((1,), seats=1, max_queue=1)
    with pytest.raises(errors.InvalidArgument, match="max_tokens=0"):
        shell.core.submit(0.0, "x", prompt(0), 0, GREEDY)
    with pytest.raises(errors.InvalidArgument, match="prompt"):
        shell.core.submit(0.0, "x", (), 3, GREEDY)
    with pytest.raises(errors.InvalidArgument, match="group"):
        shell.core.submit(0.0, "x", prompt(0), 3, GREEDY, "g" * 500)
    assert shell.core.requests == {}
    shell.submit(0, 3, "a")  # runs
    shell.submit(1, 3, "b")  # waits
    with pytest.raises(errors.InvalidArgument, match="request_id='b'"):
        shell.core.submit(0.0, "b", prompt(0), 3, GREEDY)
    with pytest.raises(QueueFull, match="queue is full"):
        shell.core.submit(0.0, "c", prompt(0), 3, GREEDY)
    assert set(shell.core.requests) == {"a", "b"}


def test_drain_holds_the_queue_until_resume_and_pause_takes_calls_off() -> None:
    shell = make((1,), seats=2)
    shell.core.drain()
    rid = shell.submit(0, 4)
    assert shell.calls == {} and shell.core.engine_state is EngineState.DRAINED
    shell.act(shell.core.resume())
    (cid,) = shell.calls
    shell.step(cid, 2)
    in_place, actions = shell.core.pause()
    assert in_place == [] and actions == [CancelCall(cid)]
    shell.act(actions)
    shell.end_cancelled()
    assert shell.core.requests[rid].where is Where.QUEUED and shell.calls == {}
    _, actions = shell.core.unpause()
    shell.act(actions)
    shell.run_to_completion()
    assert shell.core.requests[rid].output == greedy(prompt(0), 4)


def test_late_events_of_a_cancelled_call_change_nothing() -> None:
    shell = make((1,), seats=1)
    rid = shell.submit(0, 50)
    (cid,) = shell.calls
    shell.step(cid, 3)
    unknown, actions = shell.core.abort([rid, "nope"], "aborted by the client")
    assert unknown == ["nope"] and actions == [CancelCall(cid)]
    assert shell.core.call_tokens(cid, (9, 9), "stop") is False
    assert shell.core.call_failed(cid, "x", retry=True, unreachable=True, server_alive=True) == []
    assert rid not in shell.core.requests  # aborted and forgotten
    assert len(shell.core.instances[0].calls) == 1  # the seat is held until the call ended
    shell.act(actions)
    shell.end_cancelled()
    assert shell.core.instances[0].calls == set()


# -- failures ----------------------------------------------------------------------------------


def test_calls_that_fail_are_retried_then_the_request_fails() -> None:
    shell = make((1,), seats=1)
    rid = shell.submit(0, 5)
    for _ in range(2):
        shell.fail(shell.live_calls()[0])
    assert shell.core.requests[rid].where is Where.RUNNING
    shell.fail(shell.live_calls()[0])
    req = shell.core.requests[rid]
    assert req.where is Where.FAILED and "failed 3 times" in req.error
    rid = shell.submit(1, 5)
    shell.fail(shell.live_calls()[0], retry=False)
    assert shell.core.requests[rid].refused
    assert "refused request" in shell.core.requests[rid].error


def test_an_unreachable_instance_is_checked_and_its_request_runs_elsewhere() -> None:
    shell = make((1, 1), seats=1)
    a = shell.submit(0, 8)
    b = shell.submit(1, 8)
    ca = next(c for c, s in shell.calls.items() if s.request_id == a)
    key = shell.calls[ca].instance
    shell.fail(ca, unreachable=True)
    assert shell.checks == [key]
    assert shell.core.instance(key).health == "restarting"  # type: ignore[union-attr]
    assert shell.core.requests[a].failures == 0  # not the request's fault
    c = shell.submit(2, 8)
    assert shell.core.requests[c].where is Where.QUEUED  # the other instance is full
    shell.act(shell.core.healthy(key))
    shell.run_to_completion()
    assert [shell.core.requests[r].output for r in (a, b, c)] == [
        greedy(prompt(i), 8) for i in range(3)
    ]
    assert shell.core.hung(key) == [StopInstance(key)]


def test_an_exited_instance_is_restarted_with_backoff_then_fails_its_requests() -> None:
    shell = make((2,), seats=2, restart_backoff_s=(0.1, 0.5))
    rid = shell.submit(0, 30)
    shell.step(shell.live_calls()[0], 4)
    key = shell.core.instances[0].key
    shell.act(shell.core.exited(key, -9))
    assert shell.restarts == [RestartInstance(key, 0.1)]
    assert shell.core.requests[rid].where is Where.QUEUED
    assert shell.core.wants_restart(key) and shell.core.failures == 1
    shell.act(shell.core.restart_failed(key, "no"))
    assert shell.restarts[-1] == RestartInstance(key, 0.5)
    shell.act(shell.core.restart_failed(key, "no again"))
    req = shell.core.requests[rid]
    assert req.where is Where.FAILED
    assert "exited with status -9 and did not restart" in req.error
    assert len(req.output) == 4  # what was delivered stays delivered
    assert shell.core.instance_health()[0].startswith("failed:")
    assert not shell.core.wants_restart(key)


def test_a_restart_resumes_the_requests() -> None:
    shell = make((1,), seats=2)
    ids = [shell.submit(i, 20) for i in range(2)]
    for cid in shell.live_calls():
        shell.step(cid, 5)
    inst = shell.core.instances[0]
    shell.act(shell.core.exited(inst.key, 1))
    shell.end_cancelled()
    assert shell.live_calls() == []
    shell.act(shell.core.started(inst))
    shell.run_to_completion()
    assert [shell.core.requests[r].output for r in ids] == [greedy(prompt(i), 20) for i in range(2)]


def test_an_exit_while_stopping_is_not_a_crash() -> None:
    shell = make((1,))
    inst = shell.core.instances[0]
    shell.core.stopping([inst])
    assert shell.core.exited(inst.key, 0) == [] and shell.core.failures == 0


# -- reshard ---------------------------------------------------------------------------------------


def test_a_reshard_keeps_unchanged_instances_and_requeues_the_rest() -> None:
    shell = make((2, 1, 1), seats=2)
    ids = [shell.submit(i, 40) for i in range(6)]
    for cid in shell.live_calls():
        shell.step(cid, 3)
    kept = shell.core.instances[0]
    on_kept = {s.request_id for c, s in shell.calls.items() if s.instance == kept.key}
    layout = (2, 2)
    plan = shell.core.plan_reshard(layout, placements(layout), shell.instance)
    assert plan.keep == {0: kept}
    assert [i.placement.tp for i in plan.leaving] == [1, 1]
    assert list(plan.fresh) == [1]
    moved, actions = shell.core.begin_reshard(plan)
    assert moved == 4 - 0 and all(isinstance(a, CancelCall) for a in actions)
    shell.act(actions)
    shell.end_cancelled()
    assert shell.core.engine_state is EngineState.RESHARDING
    with pytest.raises(errors.Aborted, match="reshard"):
        shell.core.hold(ids[:1])
    for inst in plan.fresh.values():
        shell.act(shell.core.started(inst))
    assert {s.request_id for s in shell.calls.values()} == on_kept  # nothing dispatched yet
    shell.act(shell.core.end_reshard(plan.instances(), layout))
    assert shell.core.layout == layout
    assert [i.placement.tp for i in shell.core.instances] == [2, 2]
    shell.run_to_completion()
    assert [shell.core.requests[r].output for r in ids] == [greedy(prompt(i), 40) for i in range(6)]
    # the requests on the kept instance were never interrupted
    assert all(shell.core.requests[r].calls == 1 for r in on_kept)


def test_reshard_refusals() -> None:
    shell = make((1, 1))
    with pytest.raises(errors.InvalidArgument, match="tp_layout"):
        shell.core.check_reshard((3,))
    assert shell.core.check_reshard((2,)) == (2,)


# -- weight updates ----------------------------------------------------------------------------


def test_an_update_finishes_or_resumes_each_request_by_its_policy() -> None:
    shell = make((1, 1), seats=2)
    finish = shell.submit(0, 40)
    resume = shell.submit(1, 40)
    shell.core.requests[resume].update_policy = "resume"
    follows_call = shell.submit(2, 40)  # no policy of its own: the update's
    for cid in shell.live_calls():
        shell.step(cid, 5)
    actions = shell.core.begin_update("v1", "finish")
    cancelled = {shell.calls[a.call_id].request_id for a in actions if isinstance(a, CancelCall)}
    assert cancelled == {resume}
    shell.act(actions)
    shell.end_cancelled()
    late = shell.submit(3, 10)  # waits for the new weights
    assert shell.core.requests[late].where is Where.QUEUED
    with pytest.raises(errors.Aborted, match="'v1' are being loaded"):
        shell.core.begin_update("v2", "finish")
    with pytest.raises(errors.Aborted, match="being loaded"):
        shell.core.check_reshard((2,))
    # the finishing ones run to their end on the old weights; then the seats are free
    shell.run_to_completion()
    assert shell.core.seats_taken() == 0
    for inst in shell.core.instances:
        assert inst.version == "0"
    shell.act(shell.core.end_update(ok=True))
    assert all(i.version == "v1" for i in shell.core.instances)
    shell.run_to_completion()
    reqs = shell.core.requests
    assert reqs[finish].versions == [(0, "0")] and reqs[follows_call].versions == [(0, "0")]
    assert reqs[resume].versions == [(0, "0"), (5, "v1")]
    assert reqs[late].versions == [(0, "v1")]


def test_a_failed_update_keeps_the_version_and_bad_updates_change_nothing() -> None:
    shell = make((1,), seats=1)
    with pytest.raises(errors.InvalidArgument, match="in_flight"):
        shell.core.begin_update("v1", "later")
    with pytest.raises(errors.InvalidArgument, match="version"):
        shell.core.begin_update("", "finish")
    assert not shell.core.updating
    shell.core.begin_update("v1", "resume")
    shell.act(shell.core.end_update(ok=False))
    assert shell.core.weight_version == "0" and shell.core.instances[0].version == "0"
    rid = shell.submit(0, 3)
    shell.run_to_completion()
    assert shell.core.requests[rid].versions == [(0, "0")]


# -- the staleness bound ---------------------------------------------------------------------


def test_version_count_and_staleness() -> None:
    assert [version_count(v) for v in ("0", "7", "12")] == [0, 7, 12]
    assert [version_count(v) for v in ("", "v1", "-1", "1.0", "\u00b2", "9" * 19)] == [None] * 6
    assert staleness([(0, "1"), (4, "3")], 6, "5") == 4  # counted from the oldest token
    assert staleness([(0, "3"), (2, "1")], 6, "5") == 4  # the oldest, wherever it is
    assert staleness([], 0, "5") is None  # no token yet: never stale
    assert staleness([(0, "1"), (3, "2")], 3, "5") == 4  # runs beyond the output ignored
    assert staleness([(0, "v1")], 2, "5") is None and staleness([(0, "1")], 2, "v5") is None


@given(
    runs=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    now=st.integers(0, 60),
    extra=st.integers(0, 5),
)
def test_staleness_is_the_lag_of_the_oldest_token(runs: list[int], now: int, extra: int) -> None:
    versions = [(2 * k, str(v)) for k, v in enumerate(runs)]
    length = 2 * len(runs) - 1 + extra
    sizes = [2] * (len(runs) - 1) + [1 + extra]
    per_token = [v for v, size in zip(runs, sizes, strict=True) for _ in range(size)]
    assert staleness(versions, length, str(now)) == now - min(per_token)


def test_an_update_stops_the_requests_beyond_their_bound_and_only_those() -> None:
    shell = make((1, 1), seats=2)
    over = shell.submit(0, 40, max_staleness=0)
    within = shell.submit(1, 40, max_staleness=1)
    unbounded = shell.submit(2, 40)
    for cid in shell.live_calls():
        shell.step(cid, 5)
    fresh = shell.submit(3, 10, max_staleness=0)  # queued, no token yet: never stale
    with capture_logs() as logs:
        landed = shell.update("1")
    reqs = shell.core.requests
    assert reqs[over].where is Where.FINISHED and reqs[over].finish == "stale"
    assert reqs[over].output == greedy(prompt(0), 40)[:5]  # its tokens so far, kept
    assert not any(isinstance(a, StartCall) and a.request_id == over for a in landed)
    assert shell.core.stale_stopped == 1
    stopped = [e for e in logs if e["event"] == "request_stale_stopped"]
    assert [(e["request"], e["lag"], e["max_staleness"], e["was"]) for e in stopped] == [
        (over, 1, 0, "queued")
    ]
    shell.run_to_completion()
    assert reqs[within].finish == "length" and reqs[within].versions == [(0, "0"), (5, "1")]
    assert reqs[within].output == greedy(prompt(1), 40)
    assert reqs[unbounded].output == greedy(prompt(2), 40)
    assert reqs[fresh].versions == [(0, "1")]
    # the next version leaves ``within`` (done) alone; a running one of lag 2 > 1 stops
    again = shell.submit(4, 40, max_staleness=1)
    shell.step(shell.live_calls()[0], 3)
    shell.update("2")
    assert reqs[again].where is Where.RUNNING  # lag 1 (its oldest token is "1")
    shell.update("3")
    assert reqs[again].finish == "stale" and shell.core.stale_stopped == 2
    assert reqs[again].output == greedy(prompt(4), 40)[: len(reqs[again].output)]
    assert shell.core.seats_taken() == 0 and shell.calls == {}
    check_invariants(shell.core)


def test_a_relabel_stops_running_calls_and_held_requests() -> None:
    shell = make((1,), seats=2)
    running = shell.submit(0, 40, max_staleness=0)
    held = shell.submit(1, 40, max_staleness=2)
    for cid in shell.live_calls():
        shell.step(cid, 3)
    _, _, actions = shell.core.hold([held])
    shell.act(actions)
    shell.end_cancelled()
    actions = shell.core.relabel("3")
    cancelled = {shell.calls[a.call_id].request_id for a in actions if isinstance(a, CancelCall)}
    assert cancelled == {running}  # its call stops, its seat is freed when it ends
    shell.act(actions)
    shell.end_cancelled()
    reqs = shell.core.requests
    assert [reqs[r].finish for r in (running, held)] == ["stale", "stale"]
    assert [len(reqs[r].output) for r in (running, held)] == [3, 3]
    assert shell.core.seats_taken() == 0 and shell.core.stale_stopped == 2
    # the destination's answer comes late: nothing to restore or release any more
    assert shell.core.restore([held]) == ([], [])
    assert shell.core.release([held], Destination("b", "b:1"), True) == ([], [])
    check_invariants(shell.core)


def test_labels_that_are_not_version_counts_are_never_judged() -> None:
    shell = make((1,), seats=1)
    rid = shell.submit(0, 20, max_staleness=0)
    shell.step(shell.live_calls()[0], 4)
    shell.update("v1")
    shell.run_to_completion()
    assert shell.core.requests[rid].finish == "length" and shell.core.stale_stopped == 0


def test_bad_max_staleness_is_refused_and_changes_nothing() -> None:
    shell = make((1,), seats=1)
    for bad in (-1, 65, True, 1.5, "1"):
        with pytest.raises(errors.InvalidArgument, match=r"max_staleness=.*0\.\.64"):
            shell.core.submit(0.0, "r", prompt(0), 5, GREEDY, max_staleness=bad)  # type: ignore[arg-type]
    assert shell.core.requests == {} and shell.calls == {}


def test_the_bound_travels_with_a_migration_and_an_import_too_stale_stops() -> None:
    src = make((1,), seats=1)
    rid = src.submit(0, 30, max_staleness=1)
    src.step(src.live_calls()[0], 4)
    exported, _, actions = src.core.hold([rid])
    src.act(actions)
    src.end_cancelled()
    assert parse_engine_state(exported[0].engine_state, 4).max_staleness == 1
    with pytest.raises(errors.InvalidArgument, match=r"engine_state\.max_staleness"):
        parse_engine_state(b'{"max_staleness": 65}', 0)
    ok = GatewayCore("scripted", 1, (1,), node="b", config=CoreConfig(weight_version="1"))
    dst = Shell(ok, 1)
    dst.start()
    dst.act(dst.core.admit(0.0, exported, 0, True)[1])
    assert dst.core.requests[rid].where is Where.RUNNING  # lag 1: within its bound
    old = GatewayCore("scripted", 1, (1,), node="c", config=CoreConfig(weight_version="2"))
    far = Shell(old, 1)
    far.start()
    result, actions = far.core.admit(0.0, exported, 0, True)
    far.act(actions)
    req = far.core.requests[rid]
    assert result.admitted == (rid,) and req.finish == "stale" and far.calls == {}
    assert far.core.stale_stopped == 1 and req.output == list(exported[0].output_token_ids)


# -- migration -------------------------------------------------------------------------------------


def test_hold_admit_release_follow_and_restore() -> None:
    src = make((1, 1), seats=1)
    dst_core = GatewayCore("scripted", 2, (2,), node="b")
    dst = Shell(dst_core, 1)
    dst.start()
    ids = [src.submit(i, 30) for i in range(3)]
    for cid in src.live_calls():
        src.step(cid, 4)
    exported, missing, actions = src.core.hold([*ids, "nope"])
    assert missing == ["nope"] and len(exported) == 3
    src.act(actions)
    src.end_cancelled()
    assert all(src.core.requests[r].where is Where.HELD for r in ids)
    assert [m.generated_tokens for m in exported] == [4, 4, 0]
    result, actions = dst.core.admit(1.0, exported[:2], 0, True)
    dst.act(actions)
    assert result.admitted == (ids[0], ids[1])
    assert "1 request(s) on instance 0" in result.message and "1 queued" in result.message
    # the third was not admitted: it goes back to work on the source
    restored, actions = src.core.restore([ids[2]])
    src.act(actions)
    assert restored == [ids[2]]
    released, actions = src.core.release(ids[:2], Destination("b", "b:1"), True)
    src.act(actions)
    assert released == ids[:2] and set(src.follows) == set(ids[:2])
    dst.run_to_completion()
    # the source follows: feed it what the destination produced
    for rid in ids[:2]:
        theirs = dst.core.requests[rid]
        mine = src.core.requests[rid]
        rest = tuple(theirs.output[len(mine.output) :])
        assert src.core.follow_tokens(rid, rest, "0", None)
        assert not src.core.follow_tokens(rid, (), "0", "length")
        assert mine.where is Where.FINISHED and mine.hops == ["a", "b"]
    src.run_to_completion()
    assert [src.core.requests[r].output for r in ids] == [greedy(prompt(i), 30) for i in range(3)]


def test_imports_are_checked_and_change_nothing_when_refused() -> None:
    src = make((1,), seats=2)
    rid = src.submit(0, 30)
    src.step(src.live_calls()[0], 3)
    exported, _, actions = src.core.hold([rid])
    src.act(actions)
    dst = make((1, 1))
    with pytest.raises(errors.InvalidArgument, match="each request id once"):
        dst.core.admit(0.0, [exported[0], exported[0]], 0, True)
    with pytest.raises(errors.InvalidArgument, match="instance=5"):
        dst.core.admit(0.0, exported, 5, True)
    dst.core.drain()
    with pytest.raises(errors.FailedPrecondition, match="not admitting"):
        dst.core.admit(0.0, exported, 0, True)
    assert dst.core.requests == {} and dst.calls == {}


def test_a_lost_follow_is_retried_then_resumed_at_the_source() -> None:
    shell = make((1,), seats=1, follow_retries=2)
    rid = shell.submit(0, 30)
    shell.step(shell.live_calls()[0], 5)
    _, _, actions = shell.core.hold([rid])
    shell.act(actions)
    shell.end_cancelled()
    dest = Destination("b", "b:1")
    _, actions = shell.core.release([rid], dest, True)
    shell.act(actions)
    delays = []
    for _ in range(2):
        (follow,) = shell.core.follow_lost(rid, dest, "unreachable", final=False)
        assert isinstance(follow, StartFollow) and follow.start == 5
        delays.append(follow.delay_s)
    assert delays == sorted(delays) and delays[0] > 0
    shell.act(shell.core.follow_lost(rid, dest, "unreachable", final=False))
    req = shell.core.requests[rid]
    assert req.where is Where.RUNNING and req.hops == ["a", "b", "a"]
    shell.run_to_completion()
    assert req.output == greedy(prompt(0), 30)


def test_an_import_nobody_follows_is_aborted_after_the_grace() -> None:
    src = make((1,), seats=1)
    rid = src.submit(0, 100)
    src.step(src.live_calls()[0], 2)
    exported, _, _ = src.core.hold([rid])
    dst = make((1,), seats=1, orphan_grace_s=10.0)
    dst.act(dst.core.admit(100.0, exported, 0, True)[1])
    assert dst.core.reap(105.0) == []
    dst.core.follower_attached(rid)
    dst.core.follower_detached(rid, 106.0)
    assert dst.core.reap(115.0) == []
    actions = dst.core.reap(117.0)
    assert [type(a) for a in actions] == [CancelCall]
    assert rid not in dst.core.requests


def test_the_copy_left_behind_by_a_request_that_migrated_back_is_dropped_quietly() -> None:
    """a -> b -> a: b released its copy to a and follows it there, and a (the origin)
    runs it again and follows nobody. After the grace b drops its copy: an info line
    that says the request goes on at a, not an abort."""
    src = make((1,), seats=1)
    rid = src.submit(0, 100)
    src.step(src.live_calls()[0], 2)
    exported, _, actions = src.core.hold([rid])
    src.act(actions)
    src.end_cancelled()
    dst = Shell(
        GatewayCore("scripted", 1, (1,), node="b", config=CoreConfig(orphan_grace_s=10.0)), 1
    )
    dst.start()
    dst.act(dst.core.admit(100.0, exported, 0, True)[1])
    src.act(src.core.release([rid], Destination("b", "b:1"), True)[1])
    dst.core.follower_attached(rid)  # a follows it on b
    dst.step(dst.live_calls()[0], 3)
    back, _, actions = dst.core.hold([rid])  # ... and the controller moves it back to a
    dst.act(actions)
    dst.end_cancelled()
    src.act(src.core.admit(101.0, back, 0, True)[1])
    dst.act(dst.core.release([rid], Destination("a", "a:1"), True)[1])
    dst.core.follower_detached(rid, 102.0)  # a runs it itself: its follow of b ends
    assert dst.core.requests[rid].where is Where.REMOTE
    assert dst.core.reap(111.0) == []
    with capture_logs() as logs:
        actions = dst.core.reap(113.0)
    assert actions == [CancelFollow(rid)]  # b stops following a
    assert rid not in dst.core.requests
    events = [e["event"] for e in logs]
    assert events == ["request_copy_dropped"], logs
    assert logs[0]["log_level"] == "info" and logs[0]["moved_to"] == "a"
    assert "nothing is lost" in logs[0]["why"]
    mine = src.core.requests[rid]
    assert mine.where is Where.RUNNING and mine.hops == ["a", "b", "a"]


# -- the state machine ---------------------------------------------------------------------------


class GatewayMachine(RuleBasedStateMachine):
    """Random interleavings of every event the shell can report."""

    def __init__(self) -> None:
        super().__init__()
        self.shell = make((1, 1, 2), seats=2, restart_backoff_s=(0.1, 0.2), max_queue=64)
        self.n = 0
        self.caps: dict[str, tuple[int, int]] = {}  # request -> (prompt index, max tokens)
        self.gone: set[str] = set()  # aborted, failed, held
        self.layouts = [(1, 1, 2), (2, 2), (4,), (1, 1, 1, 1), (2, 1, 1)]
        self.versions = ["0"]  # the weights served, in the order they were loaded
        self.update_began = 0  # the shell's log length when the update began

    @property
    def core(self) -> GatewayCore:
        return self.shell.core

    @rule(n=st.integers(1, 25), bound=st.none() | st.integers(0, 2))
    def submit(self, n: int, bound: int | None) -> None:
        if self.core.crashed or len(self.core.queued_ids()) >= 64:
            return
        self.n += 1
        rid = self.shell.submit(self.n, n, f"r{self.n}", max_staleness=bound)
        self.caps[rid] = (self.n, n)

    @precondition(lambda self: self.shell.live_calls())
    @rule(data=st.data(), k=st.integers(1, 6))
    def stream(self, data: st.DataObject, k: int) -> None:
        cid = data.draw(st.sampled_from(self.shell.live_calls()))
        self.shell.step(cid, k)

    @precondition(lambda self: self.shell.cancelled)
    @rule()
    def cancelled_calls_end(self) -> None:
        self.shell.end_cancelled()

    @precondition(lambda self: self.shell.live_calls())
    @rule(data=st.data(), how=st.sampled_from(["retry", "unreachable"]))
    def call_fails(self, data: st.DataObject, how: str) -> None:
        cid = data.draw(st.sampled_from(self.shell.live_calls()))
        rid = self.shell.calls[cid].request_id
        self.shell.fail(cid, unreachable=how == "unreachable")
        if self.core.requests[rid].where is Where.FAILED:
            self.gone.add(rid)

    @rule(data=st.data())
    def instance_exits(self, data: st.DataObject) -> None:
        inst = data.draw(st.sampled_from(self.core.instances))
        self.shell.act(self.core.exited(inst.key, -9))

    @rule(data=st.data())
    def instance_comes_back(self, data: st.DataObject) -> None:
        inst = data.draw(st.sampled_from(self.core.instances))
        if inst.checking:
            self.shell.act(self.core.healthy(inst.key))
        elif self.core.wants_restart(inst.key):
            self.shell.act(self.core.started(inst))

    @precondition(lambda self: not self.core.resharding and not self.core.updating)
    @rule(data=st.data())
    def reshard(self, data: st.DataObject) -> None:
        layout = data.draw(st.sampled_from(self.layouts))
        plan = self.core.plan_reshard(layout, placements(layout), self.shell.instance)
        _, actions = self.core.begin_reshard(plan)
        self.shell.act(actions)
        check_invariants(self.core)
        for inst in plan.fresh.values():
            self.shell.act(self.core.started(inst))
        self.shell.act(self.core.end_reshard(plan.instances(), layout))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r for r, q in self.core.requests.items() if not q.done]
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        _, actions = self.core.abort([rid], "by the test")
        self.shell.act(actions)
        self.gone.add(rid)

    @rule(data=st.data(), back=st.booleans())
    def migrate_away_or_back(self, data: st.DataObject, back: bool) -> None:
        live = [
            r for r, q in self.core.requests.items() if q.where in (Where.QUEUED, Where.RUNNING)
        ]
        if not live or self.core.resharding:
            return
        rid = data.draw(st.sampled_from(live))
        _, missing, actions = self.core.hold([rid])
        assert missing == []
        self.shell.act(actions)
        if back:  # the destination refused: restored
            self.shell.act(self.core.restore([rid])[1])
        else:
            self.gone.add(rid)

    @precondition(lambda self: not self.core.resharding and not self.core.updating)
    @rule(policy=st.sampled_from(["finish", "resume"]))
    def update_begins(self, policy: str) -> None:
        """An update begins; any other event may come before it ends (migrations too)."""
        self.shell.act(self.core.begin_update(f"{len(self.shell.log)}", policy))
        self.update_began = len(self.shell.log)

    @precondition(lambda self: self.core.updating)
    @rule(ok=st.booleans())
    def update_ends(self, ok: bool) -> None:
        # the shell waits for free seats: the finishing requests run to their end and the
        # calls taken off end; then no seat may be left taken
        self.shell.run_to_completion()
        assert self.core.seats_taken() == 0, self.core.seat_holders()
        if ok:
            self.versions.append(self.core.updating)
        self.shell.act(self.core.end_update(ok=ok))
        self.stale_checked()

    @precondition(lambda self: not self.core.updating)
    @rule()
    def relabel(self) -> None:
        """The weights served are relabelled (changed outside the gateway) while calls run."""
        version = f"{len(self.shell.log) + 1}"
        self.versions.append(version)
        self.shell.act(self.core.relabel(version))
        self.stale_checked()

    def stale_checked(self) -> None:
        """Nothing left to generate here is beyond its bound; what stopped kept its tokens."""
        for req in self.core.requests.values():
            lag = staleness(req.versions, len(req.output), self.core.weight_version)
            if req.where in (Where.QUEUED, Where.RUNNING, Where.HELD) and lag is not None:
                assert req.max_staleness is None or lag <= req.max_staleness, req.id
            if req.finish == "stale":
                assert req.max_staleness is not None and req.output

    @rule()
    def pause_and_unpause(self) -> None:
        _, actions = self.core.pause()
        self.shell.act(actions)
        check_invariants(self.core)
        self.shell.act(self.core.unpause()[1])

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.core)
        assert set(self.shell.live_calls()) == {
            c for c in self.shell.calls if c not in self.shell.cancelled
        }
        for cid in self.shell.live_calls():
            assert self.core.has_live_call(self.shell.calls[cid].request_id)
        if self.core.updating:  # no call starts on the old weights once an update began
            started = self.shell.log[self.update_began :]
            assert not [a for a in started if isinstance(a, StartCall)]

    def teardown(self) -> None:
        if self.core.updating:
            self.update_ends(ok=True)
        # bring every instance back, then run everything to its end
        for inst in self.core.instances:
            if inst.checking:
                self.shell.act(self.core.healthy(inst.key))
            elif not inst.up and not inst.failed:
                self.shell.act(self.core.started(inst))
        if self.core.instances and all(i.failed for i in self.core.instances):
            return
        self.shell.run_to_completion()
        for rid, (i, n) in self.caps.items():
            req = self.core.requests.get(rid)
            if rid in self.gone or req is None or req.where is Where.FAILED:
                continue
            assert req.where is Where.FINISHED, (rid, req.where)
            if req.finish == "stale":  # stopped at an update: a prefix, none lost or doubled
                assert req.output == greedy(prompt(i), n)[: len(req.output)], rid
            else:
                assert req.output == greedy(prompt(i), n), rid
            starts = [k for k, _ in req.versions]
            assert starts == sorted(set(starts)) and (not req.output or starts[0] == 0)
            order = [self.versions.index(v) for _, v in req.versions]  # each one loaded
            assert order == sorted(set(order)), (rid, req.versions, self.versions)


TestGatewayMachine = GatewayMachine.TestCase
TestGatewayMachine.settings = settings(
    max_examples=80,
    stateful_step_count=30,
)

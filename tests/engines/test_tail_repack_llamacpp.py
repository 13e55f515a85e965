"""A tail repack on real engines (issue 32): the controller's compute-scheduling loop, in
async mode, moves a running request off one node onto the other and reshards that node
to one wide instance, on llama.cpp gateways behind real node agents.

Two generation nodes (TP1 + TP1 each, two seats an instance) run one request each, with
nothing queued: the tail of a rollout. The requests are endless (``--context-shift``
and a slot of 64K tokens: they run until aborted, and are moved long before a slot is
full) and the engines run below the test while it sets up and the loop decides, so the
state holds however fast or busy the machine is. The test waits until both are long
enough that the perf model predicts the wide instance ends them sooner, its pause
included; one round of the loop then decides and carries out the repack; both requests
go on generating on the wide instance, the moved one's tokens still reaching its client
through the source's gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fabric_controller import scheduling
from fabric_controller.scheduler_loop import ComputeScheduler
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Mode
from orchestrrl.v1 import node_agent_pb2 as pb
from sim_backends.tiny_models import TinyShape, write_gguf_llama
from tests import helpers
from tests.engines.conftest import GREEDY, Nodes, generating_below_the_test, settings_for
from tests.helpers import Agent, eventually, start_agent

pytestmark = pytest.mark.engine

WIRING = Path(__file__).resolve().parents[2] / "examples" / "local-engines.toml"
GEN = ("gen0-n0", "gen0-n1")
ENDLESS = 1 << 24  # the most a request's telemetry may carry; runs until it is aborted
# tokens each request has when the loop decides: with max_tokens unbounded the forecast
# expects as many again, and a TP2 instance (Qwen2.5-14B on H800, the controller's
# default model) ends ~1,200 of them sooner than TP1 by more than two reshard pauses
LONG_ENOUGH = 2000
SLOT = 1 << 16  # a slot's context: a request is moved long before it fills it


@pytest.fixture
def long_model(tmp_path: Path) -> Path:
    """The tests' tiny model with a context of 64K tokens: a slot holds a request far
    longer than it runs here before it is moved (a move recomputes what it generated)."""
    return write_gguf_llama(tmp_path / "long.gguf", TinyShape(layers=1, context=SLOT), seed=7)


@pytest.fixture
async def cluster(
    llama_binary: Path, long_model: Path, tmp_path: Path
) -> AsyncIterator[tuple[ComputeScheduler, Nodes, dict[str, Agent]]]:
    settings = settings_for(
        llama_binary, long_model, tmp_path, seqs=2, context=SLOT, args=("--context-shift",)
    )
    config = scheduling.SchedulingConfig(hold_s=60.0)
    async with helpers.compute_loop(
        wiring_mod.load(WIRING), tmp_path / "state.db", config, deadline_s=5.0,
        agent_timeout_s=60.0,
    ) as loop:  # fmt: skip
        nodes = Nodes("llamacpp", settings)
        agents: dict[str, Agent] = {}
        try:
            for k, name in enumerate(GEN):
                node = await nodes.add(name, (1, 1), cpu_offset=2 * k)
                agents[name] = await start_agent(name, node.engine, 2, loop.address, tmp_path)
            yield loop.scheduler, nodes, agents
        finally:
            for a in agents.values():
                await a.stop()
            await nodes.close()


async def test_the_loop_repacks_a_real_tail_and_reshards_the_node_holding_it(
    cluster: tuple[ComputeScheduler, Nodes, dict[str, Agent]],
) -> None:
    sched, nodes, agents = cluster
    await sched.c.set_mode(Mode.ASYNC, "to-async")
    gw = {n.name: n.engine for n in nodes.nodes}
    reqs = {
        name: gw[name].submit([5 + k, 17, 3 + 2 * k, 99, 42 + k, 7], ENDLESS, GREEDY)
        for k, name in enumerate(GEN)
    }
    before = {name: reqs[name].id for name in GEN}

    def reported_long() -> bool:  # the controller holds telemetry of both, long enough
        recs = {r.name: r for r in sched.c.registry.records()}
        return all(
            recs.get(n) is not None
            and recs[n].telemetry is not None
            and [r.generated_tokens >= LONG_ENOUGH for r in recs[n].telemetry.engine.requests]
            == [True]
            for n in GEN
        )

    # the engines run below the test while it waits and the loop decides and acts: a
    # request cannot run far ahead of the decision however busy the machine is
    with generating_below_the_test([s for n in nodes.nodes for s in n.servers]):
        await eventually(reported_long, within_s=300)
        decision = await sched.round()
    assert decision.mode == "repack" and decision.plan is not None, decision.why
    plan = decision.plan
    assert [(r.node, r.after) for r in plan.reshards] == [("gen0-n1", (2,))], plan.explain()
    assert [(m.request, m.target) for m in plan.migrations] == [
        (before["gen0-n0"], "gen0-n1/tp2-g0")
    ]
    view = sched.view()
    kinds = [(a.kind, a.ok) for a in view.actions]
    assert kinds == [("reshard", True), ("migrate", True), ("repack", True)], view.actions

    # the node that held the tail is one TP2 instance running both; the other is empty
    status = await agents["gen0-n1"].stub.GetStatus(pb.GetStatusRequest(), timeout=30.0)
    assert tuple(status.tp_layout) == (2,)
    progress = gw["gen0-n1"].progress().requests
    assert sorted(r.request_id for r in progress) == sorted(before.values())
    assert {r.instance for r in progress} == {0}
    assert gw["gen0-n0"].progress().requests == ()
    # both go on generating there; the moved one's tokens reach its client through
    # gen0-n0's gateway, which follows it
    lengths = {n: len(reqs[n].output) for n in GEN}
    await eventually(lambda: all(len(reqs[n].output) >= lengths[n] + 50 for n in GEN), within_s=120)
    assert not any(r.done for r in reqs.values())
    for name in GEN:  # each client aborts at its own gateway (gen0-n0's follows its move)
        assert gw[name].abort([before[name]]) == []
    await eventually(lambda: all(r.done for r in reqs.values()), within_s=60)

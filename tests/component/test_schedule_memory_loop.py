"""The compute-scheduling loop keeps what it learnt across a restart: a loop that saw a
step end saves the forecast's history and the groups' lengths in the controller's store
(SQLite here; etcd in test_etcd_store.py), and a new loop on the same store starts from
them, so the groups of the next epoch keep their prior."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fabric_controller import scheduling
from fabric_controller.registry import Health, NodeRecord
from fabric_controller.scheduler_loop import ComputeScheduler
from fabric_controller.store import Store
from orchestrrl import errors
from orchestrrl.model import Mode, Role
from orchestrrl.v1 import node_agent_pb2 as pb

pytestmark = pytest.mark.component

NODE = "gen0-n0"


@dataclass
class WiredNode:
    role: Role = Role.GEN
    gpus: int = 8


@dataclass
class Wiring:
    def node(self, name: str) -> WiredNode:
        return WiredNode()


@dataclass
class StubController:
    """What the loop reads of a controller: its generation nodes and its store."""

    store: Store
    wiring: Wiring = field(default_factory=Wiring)
    sample: pb.TelemetrySample | None = None
    mode: Mode = Mode.PHASED

    def nodes(self) -> list[tuple[NodeRecord, Health, float | None]]:
        record = NodeRecord(NODE, agent_address="127.0.0.1:1", telemetry=self.sample)
        return [(record, Health.UP, 0.0)]


def sample(step: int, groups: list[str], running: list[str], at: float) -> pb.TelemetrySample:
    """A TP8 node in ``step``: one completed response per group in ``groups``, and one
    running request per group in ``running``."""
    s = pb.TelemetrySample(timestamp=at, engine_state=pb.ENGINE_STATE_RUNNING, tp_layout=[8])
    s.engine.has_progress = True
    s.engine.step = step
    s.engine.completed_lengths.extend(1000 + 100 * i for i in range(len(groups)))
    s.engine.completed_groups.extend(groups)
    for i, g in enumerate(running):
        s.engine.requests.add(
            request_id=f"s{step}-r{i}", instance=0, prompt_tokens=100, generated_tokens=10,
            max_tokens=16384, group=g,
        )  # fmt: skip
    return s


def no_agents(node: str, address: str) -> Any:
    raise errors.Unavailable(f"agent {node} at {address}: not in this test")


async def test_a_new_loop_starts_from_what_the_last_one_saved(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    try:
        first = ComputeScheduler(StubController(store), no_agents)
        c = first.c
        assert isinstance(c, StubController)
        c.sample = sample(1, ["p1", "p2", "p3"], ["p9"], 1.0)
        await first.round()
        assert await store.schedule_memory() is None  # no step has ended yet
        c.sample = sample(2, [], ["p1", "p4"], 2.0)  # step 1 ended: p1-p3 are remembered
        await first.round()
        await first.saved()
        assert await store.schedule_memory() is not None
        history, remembered = scheduling.memory_load(await store.schedule_memory() or b"")
        assert history == ((1000, 1100, 1200),)
        assert set(remembered) == {"p1", "p2", "p3"}

        # a restart: a new loop on the same store, in step 2 (p1 met before, p4 not)
        for restore, with_prior in ((False, 0), (True, 1)):
            second = ComputeScheduler(StubController(store), no_agents)
            if restore:
                await second.restore()
            second_c = second.c
            assert isinstance(second_c, StubController)
            second_c.sample = sample(2, [], ["p1", "p4"], 3.0)
            await second.round()
            view = second.view()
            assert (view.groups, view.groups_with_prior) == (2, with_prior), view.explanation()
    finally:
        store.close()


async def test_an_unreadable_memory_is_left_out_and_the_loop_runs(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    try:
        await store.save_schedule_memory(b"garbage, not a saved memory")
        loop = ComputeScheduler(StubController(store), no_agents)
        await loop.restore()  # logged, not raised
        loop_c = loop.c
        assert isinstance(loop_c, StubController)
        loop_c.sample = sample(1, [], ["p1"], 1.0)
        await loop.round()
        assert loop.view().groups_with_prior == 0
    finally:
        store.close()


async def test_the_sqlite_memory_survives_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = Store(path)
    await store.save_schedule_memory(b"first")
    await store.save_schedule_memory(b"second")  # replaces
    store.close()
    again = Store(path)
    try:
        assert await again.schedule_memory() == b"second"
    finally:
        again.close()

"""Request migration in the simulated engine and the agent's export holds."""

from __future__ import annotations

import asyncio
import json

import pytest

from node_agent.engine import MigratingRequest
from node_agent.migration import Exports, check_hold, recompute_from_pb, state_from_pb, state_to_pb
from orchestrrl import errors
from orchestrrl.v1 import node_agent_pb2 as pb
from sim_backends.engine import SimEngineConfig, SimulatedEngine

pytestmark = pytest.mark.unit

QUIET = SimEngineConfig(arrival_rate_per_gpu=0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


STATE = json.dumps({"output_tokens": 9000}).encode()


def request(
    rid: str, instance: int = 0, generated: int = 100, prompt: int = 512
) -> MigratingRequest:
    return MigratingRequest(rid, prompt, generated, 16384, instance, 0, engine_state=STATE)


def engine(clock: Clock) -> SimulatedEngine:
    return SimulatedEngine(8, (2, 2, 2, 2), seed=1, config=QUIET, clock=clock, request_prefix="t")


def where(e: SimulatedEngine) -> dict[str, int]:
    return {r.request_id: r.instance for r in e.progress().requests}


async def test_export_then_import_keeps_progress_and_identity() -> None:
    clock = Clock()
    src, dst = engine(clock), engine(clock)
    await src.import_requests([request("a", 1), request("b", 1)], 1, recompute=False)
    clock.t = 1.0  # decode a while
    before = {r.request_id: r.generated_tokens for r in src.progress().requests}
    assert before["a"] > 100
    exported, missing = await src.export_requests(["a", "zz"])
    assert [m.request_id for m in exported] == ["a"] and missing == ("zz",)
    assert exported[0].source_instance == 1 and exported[0].kv_bytes > 0
    assert where(src) == {"b": 1}
    result = await dst.import_requests(exported, 3, recompute=True)
    assert result.admitted == ("a",) and result.bytes_moved == 0 and result.recomputed_tokens > 0
    got = {r.request_id: r for r in dst.progress().requests}
    assert got["a"].instance == 3 and got["a"].generated_tokens == before["a"]


async def test_import_is_all_or_nothing_and_says_why() -> None:
    e = engine(Clock())
    with pytest.raises(errors.FailedPrecondition, match="has room for"):
        await e.import_requests([request("a", generated=5000, prompt=10**7)], 0, recompute=False)
    with pytest.raises(errors.InvalidArgument, match="instance=4"):
        await e.import_requests([request("a")], 4, recompute=False)
    await e.import_requests([request("a")], 0, recompute=False)
    with pytest.raises(errors.InvalidArgument, match="requests this engine does not have"):
        await e.import_requests([request("a"), request("b")], 1, recompute=False)
    await e.drain()
    with pytest.raises(errors.FailedPrecondition, match="not admitting"):
        await e.import_requests([request("c")], 1, recompute=False)
    assert where(e) == {"a": 0}


async def test_import_admits_each_request_id_once() -> None:
    e = engine(Clock())
    with pytest.raises(errors.InvalidArgument, match=r"requests=\['a'\] .*each request id once"):
        await e.import_requests([request("a"), request("b"), request("a")], 0, recompute=False)
    assert where(e) == {}  # nothing admitted, not even b
    await e.import_requests([request("b")], 0, recompute=False)
    with pytest.raises(errors.InvalidArgument, match=r"requests=\['b'\]"):
        await e.import_requests([request("c"), request("b")], 1, recompute=False)
    assert where(e) == {"b": 0}


async def test_restore_puts_requests_back_on_their_instance_or_queues_them() -> None:
    e = engine(Clock())
    await e.import_requests([request("a", 2)], 2, recompute=False)
    exported, _ = await e.export_requests(["a"])
    await e.reshard((8,))  # the source instance is gone: it lands where it fits
    assert await e.restore_requests(exported) == ("a",)
    assert where(e) == {"a": 0}


async def test_a_hold_is_resolved_once_and_expires_to_a_restore() -> None:
    e = engine(Clock())
    await e.import_requests([request("a"), request("b", 1)], 0, recompute=False)
    holds = Exports(e)
    await holds.export("x", ["a"], 0.05)
    assert holds.held() == {"x": ("a",)}
    with pytest.raises(errors.FailedPrecondition, match="already made"):
        await holds.export("x", ["b"], 1.0)
    await asyncio.sleep(0.2)
    assert holds.held() == {} and "a" in where(e)
    late = await holds.resolve("x", restore=False)
    assert late.restored == ("a",) and late.released == ()
    await holds.export("y", ["b"], 10.0)
    done = await holds.resolve("y", restore=False)
    assert done.released == ("b",) and "b" not in where(e)
    assert await holds.resolve("y", restore=True) == done  # a repeat answers the same
    with pytest.raises(errors.NotFound):
        await holds.resolve("nope", restore=True)
    await holds.close()


def test_bad_export_and_import_input_names_the_field() -> None:
    with pytest.raises(errors.InvalidArgument, match="hold_s"):
        check_hold(-1.0)
    with pytest.raises(errors.InvalidArgument, match="hold_s"):
        check_hold(float("nan"))
    assert check_hold(0.0) > 0
    with pytest.raises(errors.InvalidArgument, match="method"):
        recompute_from_pb(pb.MIGRATION_METHOD_UNSPECIFIED)
    assert recompute_from_pb(pb.MIGRATION_METHOD_RECOMPUTE) is True


def test_a_requests_group_crosses_the_wire_and_is_bounded() -> None:
    moving = MigratingRequest("r1", 5, 3, 100, 0, 0, group="prompt-12")
    assert state_from_pb(state_to_pb(moving)) == moving
    too_long = state_to_pb(MigratingRequest("r1", 5, 3, 100, 0, 0, group="g" * 129))
    with pytest.raises(errors.InvalidArgument, match=r"requests\[\]\.group"):
        state_from_pb(too_long)

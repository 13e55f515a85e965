"""TorchReshardEngine's stages over a fake weight pool and the simulated engine; the flag."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from node_agent.config import parse_args
from node_agent.engine import EngineState, ReshardResult, validate_layout
from node_agent.reshard.engine import (
    STAGES,
    TorchReshardEngine,
    close_engine,
    open_engine,
)
from node_agent.reshard.protocol import (
    InjectedFailure,
    ReshardReport,
    WorkerTransfer,
    tag,
)
from orchestrrl import errors
from sim_backends.engine import SimulatedEngine
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit

TIMEOUT = 5.0


class FakePool:
    """Records what the engine asks; ``fail`` makes reshard fail, ``gate`` holds it."""

    def __init__(self, layout: tuple[int, ...], fail: str | None = None) -> None:
        self.gpus = sum(layout)
        self.layout = layout
        self.backend = "fake"
        self.fail = fail
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.calls: list[tuple[tuple[int, ...], InjectedFailure | None]] = []
        self.stopped = False

    def check(self, new_layout: Sequence[int]) -> tuple[int, ...]:
        return validate_layout(new_layout, self.gpus)

    def reshard(
        self, new_layout: Sequence[int], *, inject: InjectedFailure | None = None
    ) -> ReshardReport:
        self.calls.append((tuple(new_layout), inject))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT)
        if self.fail is not None:
            raise errors.FailedPrecondition(self.fail)
        old, self.layout = self.layout, tuple(new_layout)
        workers = tuple(
            WorkerTransfer(r, 100, 100, 0, 2, 0.01, 0.002, 0.007, 0.001) for r in range(self.gpus)
        )
        return ReshardReport(
            old, self.layout, 100 * self.gpus, 100 * self.gpus, 0.02, 0.005, 0.001, workers,
            {"w": "00"},
        )  # fmt: skip

    def stop(self) -> None:
        self.stopped = True


def make(
    layout: tuple[int, ...] = (2, 2, 2, 2), fail: str | None = None
) -> tuple[TorchReshardEngine, SimulatedEngine, FakePool, FakeClock]:
    clock = FakeClock()
    inner = SimulatedEngine(8, layout, seed=5, clock=clock)
    pool = FakePool(layout, fail)
    return TorchReshardEngine(inner, pool), inner, pool, clock


async def test_reshard_runs_every_stage_and_reports_the_pools_bytes() -> None:
    engine, inner, pool, clock = make()
    clock.now = 30.0  # requests arrive and run
    running = engine.stats().running_requests
    assert running > 0
    result = await engine.reshard([8])
    assert result.old_layout == (2, 2, 2, 2)
    assert result.new_layout == (8,)
    assert [s.stage for s in result.stages] == list(STAGES)
    assert all(s.seconds >= 0 for s in result.stages)
    assert result.bytes_moved == 800
    assert "moved 800 bytes of weight shards over torch.distributed (fake; 8 of 8" in result.message
    assert f"{running} in-flight requests re-placed on the new instances" in result.message
    assert engine.tp_layout == inner.tp_layout == pool.layout == (8,)
    assert engine.state is EngineState.RUNNING
    assert engine.stats().running_requests == running  # none lost


async def test_a_drained_engine_stays_drained() -> None:
    engine, inner, _, _ = make()
    await engine.drain()
    await engine.reshard([4, 4])
    assert inner.state is EngineState.DRAINED
    assert engine.state is EngineState.DRAINED


async def test_the_engine_is_resharding_and_refuses_commands_meanwhile() -> None:
    engine, inner, pool, clock = make()
    clock.now = 10.0  # requests arrive and decode
    assert inner.stats().running_requests > 0
    pool.gate = threading.Event()
    task = asyncio.ensure_future(engine.reshard([4, 4]))
    assert await asyncio.to_thread(pool.entered.wait, TIMEOUT)
    assert engine.state.value == "resharding"  # (`is` would narrow the property for mypy)
    assert inner.paused  # the pause stage: no admissions and no decoding
    held = inner.progress().requests
    clock.now = 20.0
    assert inner.progress().requests[: len(held)] == held  # not a token generated meanwhile
    assert inner.stats().tokens_per_s == 0.0
    for command in (engine.drain(), engine.resume(), engine.reshard([8])):
        with pytest.raises(errors.Aborted, match="reshard from \\[2, 2, 2, 2\\] is in progress"):
            await command
    pool.gate.set()
    assert (await task).new_layout == (4, 4)
    assert engine.state is EngineState.RUNNING
    assert not inner.paused
    clock.now = 21.0
    generated = {r.request_id: r.generated_tokens for r in inner.progress().requests}
    # decoding again (a request that finished meanwhile was decoded too)
    assert any(generated.get(r.request_id, 1 << 30) > r.generated_tokens for r in held)


async def test_a_failed_move_keeps_the_old_layout_and_resumes() -> None:
    engine, inner, pool, clock = make(fail="rank 3: the link went down")
    clock.now = 10.0
    inject = InjectedFailure(rank=3)
    with pytest.raises(errors.FailedPrecondition) as info:
        await engine.reshard([8], inject=inject)
    message = str(info.value)
    assert message.startswith("reshard [2, 2, 2, 2] -> [8] failed while moving weights: rank 3")
    assert message.endswith("the engine serves layout [2, 2, 2, 2] again")
    assert pool.calls == [((8,), inject)]
    assert engine.tp_layout == inner.tp_layout == (2, 2, 2, 2)
    assert engine.state is EngineState.RUNNING
    clock.now = 20.0
    assert engine.stats().running_requests > 0  # admitting and decoding again


class RefusingEngine(SimulatedEngine):
    """A rollout engine whose request side refuses every new layout."""

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        raise errors.Aborted("the scheduler is busy")


async def test_weights_move_back_when_the_requests_cannot_follow() -> None:
    inner = RefusingEngine(8, (2, 2, 2, 2), seed=1, clock=FakeClock())
    pool = FakePool((2, 2, 2, 2))
    engine = TorchReshardEngine(inner, pool)
    with pytest.raises(errors.FailedPrecondition) as info:
        await engine.reshard([8])
    assert str(info.value) == (
        "reshard [2, 2, 2, 2] -> [8] failed placing the in-flight requests: the scheduler is "
        "busy; the weights were moved back to [2, 2, 2, 2]"
    )
    assert [layout for layout, _ in pool.calls] == [(8,), (2, 2, 2, 2)]
    assert engine.tp_layout == inner.tp_layout == (2, 2, 2, 2)
    assert engine.state is EngineState.RUNNING


@pytest.mark.parametrize("layout", [[4, 2], [3, 5], [16]])
async def test_a_bad_layout_is_refused_before_anything_pauses(layout: list[int]) -> None:
    engine, inner, pool, _ = make()
    with pytest.raises(errors.InvalidArgument, match=r"tp_layout=.* is not valid"):
        await engine.reshard(layout)
    assert pool.calls == []
    assert inner.state is EngineState.RUNNING
    assert engine.tp_layout == (2, 2, 2, 2)


async def test_the_same_layout_is_a_no_op() -> None:
    engine, _, pool, _ = make()
    result = await engine.reshard([2, 2, 2, 2])
    assert result.stages == ()
    assert result.bytes_moved == 0
    assert result.message == "layout is already [2, 2, 2, 2]; nothing to do"
    assert pool.calls == []


async def test_pool_and_engine_must_agree_on_the_layout() -> None:
    inner = SimulatedEngine(8, (4, 4), seed=1, clock=FakeClock())
    with pytest.raises(errors.InvalidArgument, match="must hold the engine's layout"):
        TorchReshardEngine(inner, FakePool((2, 2, 2, 2)))


async def test_open_and_close() -> None:
    inner = SimulatedEngine(8, (2, 2, 2, 2), seed=1, clock=FakeClock())
    assert await open_engine("sim", inner) is inner
    await close_engine(inner)  # nothing to stop
    engine, _, pool, _ = make()
    await close_engine(engine)
    assert pool.stopped


def test_the_agent_flag() -> None:
    assert parse_args(["--plaintext", "--engine", "sim", "--node", "n"]).reshard_backend == "sim"
    assert (
        parse_args(
            ["--plaintext", "--engine", "sim", "--node", "n", "--reshard-backend", "torch"]
        ).reshard_backend
        == "torch"
    )


def test_the_agent_flag_rejects_other_backends(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--plaintext", "--engine", "sim", "--node", "n", "--reshard-backend", "nccl"])
    assert info.value.code == 2
    assert "--reshard-backend='nccl' is not valid: expected one of sim, torch" in (
        capsys.readouterr().err
    )


def test_message_tags_are_unique_per_command_and_transfer() -> None:
    assert tag(1, 0) != tag(2, 0) != tag(1, 1)
    assert tag(257, 5) == tag(1, 5)  # sequence numbers wrap after 256 commands
    assert tag(255, (1 << 22) - 1) < 2**31
    with pytest.raises(ValueError, match="exceeds"):
        tag(1, 1 << 22)

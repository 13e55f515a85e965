"""A RolloutEngine whose reshard moves real weight shards between the node's workers.

:class:`TorchReshardEngine` composes the engine that serves requests (the simulated one
here; a vLLM or SGLang adapter on a GPU node) with a :class:`WorkerPool` that holds the
weights. Its reshard runs the stages of the design:

1. ``pause``: the engine stops generating (no admissions, no decoding); running
   requests are held where they are;
2. ``move_weights``: the pool stages the new layout's shards with torch.distributed and
   commits them on every worker (two-phase);
3. ``verify_weights``: the staged full tensors are checked against the checksums of the
   old layout before the commit (the pool refuses to commit otherwise);
4. ``recompute_requests``: the in-flight requests are placed on the new instances; their
   KV cache is recomputed there (the simulated engine recomputes it at no cost, so with
   it this stage times only the re-placement);
5. ``resume``: the engine generates again, admitting if it was running before.

A failure before the commit keeps the old layout on every worker; the engine resumes and
the caller gets FailedPrecondition saying what failed. A bad layout is refused with
InvalidArgument before anything pauses.

This module imports torch only when a pool is opened (``--reshard-backend torch``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from node_agent.engine import (
    Destination,
    EngineProgress,
    EngineState,
    EngineStats,
    ImportResult,
    MigratingRequest,
    ReshardResult,
    RolloutEngine,
    StageTiming,
)
from node_agent.reshard.protocol import InjectedFailure, ReshardReport
from orchestrrl import errors
from orchestrrl.logs import get_logger

if TYPE_CHECKING:
    from node_agent.reshard.plan import ModelSpec

log = get_logger("node_agent.reshard")

ReshardBackend = Literal["sim", "torch"]
RESHARD_BACKENDS: tuple[ReshardBackend, ...] = ("sim", "torch")
STAGES = ("pause", "move_weights", "verify_weights", "recompute_requests", "resume")


class WeightPool(Protocol):
    """What the engine needs from the processes that hold the weights
    (:class:`node_agent.reshard.workers.WorkerPool`). Its methods block."""

    @property
    def gpus(self) -> int: ...

    @property
    def layout(self) -> tuple[int, ...]: ...

    @property
    def backend(self) -> str: ...

    def check(self, new_layout: Sequence[int]) -> tuple[int, ...]:
        """The layout validated for the node and model; InvalidArgument otherwise."""

    def reshard(
        self, new_layout: Sequence[int], *, inject: InjectedFailure | None = None
    ) -> ReshardReport:
        """Move the shards; FailedPrecondition (old layout kept) on failure."""

    def stop(self) -> None: ...


class TorchReshardEngine:
    """``inner`` serves requests; ``pool`` holds the weights. Both start in one layout."""

    def __init__(self, inner: RolloutEngine, pool: WeightPool) -> None:
        if inner.tp_layout != pool.layout or inner.gpus != pool.gpus:
            raise errors.field_error(
                "pool",
                (pool.gpus, list(pool.layout)),
                f"must hold the engine's layout {list(inner.tp_layout)} over {inner.gpus} GPUs",
            )
        self._inner = inner
        self._pool = pool
        self._resharding = False

    @property
    def pool(self) -> WeightPool:
        return self._pool

    # -- RolloutEngine ------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        return self._inner.gpus

    @property
    def state(self) -> EngineState:
        return EngineState.RESHARDING if self._resharding else self._inner.state

    @property
    def tp_layout(self) -> tuple[int, ...]:
        return self._pool.layout

    @property
    def kv_import(self) -> bool:
        return self._inner.kv_import

    @property
    def max_num_seqs(self) -> int:
        return self._inner.max_num_seqs

    def stats(self) -> EngineStats:
        return self._inner.stats()

    def progress(self) -> EngineProgress:
        return self._inner.progress()

    async def pause(self) -> None:
        await self._inner.pause()

    async def unpause(self) -> None:
        await self._inner.unpause()

    async def drain(self) -> None:
        self._refuse_while_resharding("drain")
        await self._inner.drain()

    async def resume(self) -> None:
        self._refuse_while_resharding("resume")
        await self._inner.resume()

    async def reshard(
        self, new_layout: Sequence[int], *, inject: InjectedFailure | None = None
    ) -> ReshardResult:
        """Pause, move the weights, re-place in-flight requests, resume; see the module
        docstring. ``inject`` makes one worker fail mid-move (tests, drills)."""
        layout = self._pool.check(new_layout)  # InvalidArgument before anything pauses
        self._refuse_while_resharding("reshard")
        old = self.tp_layout
        if layout == old:
            return ReshardResult(old, old, (), 0, f"layout is already {list(old)}; nothing to do")
        self._resharding = True
        prior = self._inner.state
        try:
            return await self._reshard(old, layout, prior, inject)
        finally:
            self._resharding = False

    async def export_requests(
        self, request_ids: Sequence[str]
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        self._refuse_while_resharding("export requests")
        return await self._inner.export_requests(request_ids)

    async def import_requests(
        self, requests: Sequence[MigratingRequest], instance: int, recompute: bool
    ) -> ImportResult:
        self._refuse_while_resharding("import requests")
        return await self._inner.import_requests(requests, instance, recompute)

    async def restore_requests(self, requests: Sequence[MigratingRequest]) -> tuple[str, ...]:
        return await self._inner.restore_requests(requests)

    async def release_requests(
        self, requests: Sequence[MigratingRequest], destination: Destination | None
    ) -> tuple[str, ...]:
        return await self._inner.release_requests(requests, destination)

    async def close(self) -> None:
        """Stop the worker pool (blocking work, off the event loop)."""
        await asyncio.to_thread(self._pool.stop)

    # -- stages ---------------------------------------------------------------------------

    async def _reshard(
        self,
        old: tuple[int, ...],
        layout: tuple[int, ...],
        prior: EngineState,
        inject: InjectedFailure | None,
    ) -> ReshardResult:
        t0 = time.perf_counter()
        await self._inner.pause()
        t1 = time.perf_counter()
        try:
            report = await asyncio.to_thread(self._pool.reshard, layout, inject=inject)
        except errors.OrlError as exc:
            await self._restore(prior)
            log.warning(
                "reshard_failed", old_layout=list(old), new_layout=list(layout), error=str(exc)
            )
            raise errors.FailedPrecondition(
                f"reshard {list(old)} -> {list(layout)} failed while moving weights: {exc}; "
                f"the engine serves layout {list(self.tp_layout)} again"
            ) from exc
        except BaseException:
            await self._restore(prior)
            raise
        t2 = time.perf_counter()
        in_flight = self._inner.stats().running_requests
        try:
            await self._inner.reshard(layout)
        except BaseException as exc:
            # the request side refused the layout the weights are in now: move them back
            try:
                await asyncio.to_thread(self._pool.reshard, old)
                undone = f"the weights were moved back to {list(old)}"
            except errors.OrlError as undo:
                undone = f"moving the weights back failed too: {undo}"
            finally:
                await self._restore(prior)
            if isinstance(exc, errors.OrlError):
                raise errors.FailedPrecondition(
                    f"reshard {list(old)} -> {list(layout)} failed placing the in-flight "
                    f"requests: {exc}; {undone}"
                ) from exc
            raise
        t3 = time.perf_counter()
        await self._restore(prior)
        t4 = time.perf_counter()
        stages = (
            StageTiming("pause", t1 - t0),
            StageTiming("move_weights", max(0.0, (t2 - t1) - report.verify_s)),
            StageTiming("verify_weights", report.verify_s),
            StageTiming("recompute_requests", t3 - t2),
            StageTiming("resume", t4 - t3),
        )
        message = (
            f"moved {report.bytes_moved} bytes of weight shards over torch.distributed "
            f"({self._pool.backend}; {report.senders} of {self.gpus} ranks sending); "
            f"checksums of all {len(report.checksums)} full tensors equal before and after; "
            f"{in_flight} in-flight requests re-placed on the new instances, their KV cache "
            f"recomputed by the rollout engine in {t3 - t2:.3f} s"
        )
        return ReshardResult(old, layout, stages, report.bytes_moved, message)

    async def _restore(self, prior: EngineState) -> None:
        """Back to the state before the reshard: generating again, admitting if the engine
        was running."""
        await self._inner.unpause()
        if prior is EngineState.RUNNING and self._inner.state is not EngineState.RUNNING:
            await self._inner.resume()

    def _refuse_while_resharding(self, what: str) -> None:
        if self._resharding:
            raise errors.Aborted(
                f"cannot {what}: a reshard from {list(self.tp_layout)} is in progress; "
                "retry when it finishes"
            )


async def open_engine(
    backend: ReshardBackend,
    inner: RolloutEngine,
    *,
    seed: int = 0,
    model: ModelSpec | None = None,
    memory_bytes: int | None = None,
) -> RolloutEngine:
    """``inner`` itself for ``sim``; for ``torch``, ``inner`` composed with a started
    WorkerPool (torch imported here). Raises Unavailable when the pool cannot start."""
    if backend == "sim":
        return inner
    try:
        from node_agent.reshard.workers import WorkerPool
    except ImportError as exc:
        raise errors.Unavailable(
            f"--reshard-backend torch needs torch ({exc}); install the agent with the "
            "'reshard' extra, or use --reshard-backend sim"
        ) from exc
    pool = WorkerPool(
        inner.gpus, inner.tp_layout, model=model, seed=seed, memory_bytes=memory_bytes
    )
    try:
        await asyncio.to_thread(pool.start)
    except errors.OrlError:
        raise
    except Exception as exc:  # the pool has ended whatever it started
        raise errors.Unavailable(f"the reshard worker pool did not start: {exc!r}") from exc
    return TorchReshardEngine(inner, pool)


async def close_engine(engine: RolloutEngine) -> None:
    """Stop what :func:`open_engine` started (nothing for ``sim``)."""
    if isinstance(engine, TorchReshardEngine):
        await engine.close()

"""The node's weight-holding worker processes, one per GPU rank, and how they reshard.

:class:`WorkerPool` starts G workers (``node_agent.reshard.worker``) from a forkserver
that has imported torch once, so a pool of 8 starts in seconds even on 2 cores. They
join one torch.distributed process group: ``nccl`` when CUDA has a device for every rank,
``gloo`` otherwise, chosen at start and logged. The rendezvous is a TCPStore that the
pool serves on 127.0.0.1 at a port the kernel picks.

:meth:`WorkerPool.reshard` is two-phase. The workers stage the shards of the new layout
next to the current ones (moves from the plan, point-to-point); the pool checks the full
tensors of the staged layout against the checksums of the current one (each composed per
instance from the SHA-256 of every block of every shard, see ``weights``); only then does
it tell every worker to commit. On a failure, a timeout or a checksum mismatch every worker
drops what it staged and the pool keeps the old layout. Only a worker that dies takes its
rank's weights with it: the pool then stops and says so (restart to reload the model).

Every method blocks; call them from a thread (``asyncio.to_thread``) in asyncio code.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Literal, cast

import torch
import torch.distributed as dist

from node_agent.reshard import worker as worker_module
from node_agent.reshard.plan import (
    ModelSpec,
    ReshardPlan,
    Split,
    check_fits,
    instance_ranks,
    plan_reshard,
    synthetic_model,
)
from node_agent.reshard.protocol import (
    INJECTED_EXIT_CODE,
    Abort,
    Checksum,
    Checksums,
    Command,
    Commit,
    Done,
    Failed,
    InjectedFailure,
    Ready,
    Reply,
    Reshard,
    ReshardReport,
    Staged,
    Stop,
    WorkerArgs,
)
from node_agent.reshard.weights import combine
from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.reshard")

BackendChoice = Literal["auto", "gloo", "nccl"]
STORE_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


def choose_backend(gpus: int, requested: BackendChoice = "auto") -> tuple[str, str]:
    """``(backend, reason)``: NCCL when CUDA has a device per rank, gloo otherwise."""
    cuda = torch.cuda.is_available()
    devices = torch.cuda.device_count() if cuda else 0
    if requested == "gloo":
        return "gloo", "requested"
    if requested == "nccl":
        if devices < gpus or not dist.is_nccl_available():
            raise errors.FailedPrecondition(
                f"backend nccl needs {gpus} CUDA devices and a CUDA build of torch; "
                f"found {devices} (torch {torch.__version__}); use gloo or auto"
            )
        return "nccl", "requested"
    if devices >= gpus and dist.is_nccl_available():
        return "nccl", f"{devices} CUDA devices for {gpus} ranks"
    if cuda:
        return "gloo", f"only {devices} CUDA devices for {gpus} ranks"
    return "gloo", "CUDA is not available"


class _StepFailed(Exception):
    """A command did not succeed on every worker; the message says which and why."""


class _WorkerDied(Exception):
    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        how = (
            "exited by an injected failure"
            if exitcode == INJECTED_EXIT_CODE
            else f"exited with code {exitcode}"
        )
        super().__init__(f"worker rank {rank} {how}")


class WorkerPool:
    """G worker processes holding the node's weight shards in a tensor-parallel layout."""

    def __init__(
        self,
        gpus: int,
        layout: Sequence[int],
        *,
        model: ModelSpec | None = None,
        seed: int = 0,
        backend: BackendChoice = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_bytes: int | None = None,
    ) -> None:
        """Describe the pool; :meth:`start` (or ``with``) launches it."""
        if gpus < 1:
            raise errors.field_error("gpus", gpus, "a node has at least one GPU")
        if timeout_s <= 0:
            raise errors.field_error("timeout_s", timeout_s, "must be positive")
        self.gpus = gpus
        self.model = model if model is not None else synthetic_model()
        self.seed = seed
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self._layout = check_fits(self.model, layout, gpus, memory_bytes)
        self._requested_backend = backend
        self.backend = ""
        self._store: dist.TCPStore | None = None
        self._procs: list[BaseProcess] = []
        self._commands: list[Connection] = []
        self._replies: list[Connection] = []
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._reference: dict[str, str] = {}
        self._broken: str | None = None
        self._stopped = False
        self._sent = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, wait until each holds its shard, take reference checksums."""
        with self._lock:
            if self._procs:
                raise errors.FailedPrecondition("the worker pool is already started")
            self.backend, reason = choose_backend(self.gpus, self._requested_backend)
            log.info(
                "torch_distributed_backend",
                backend=self.backend,
                reason=reason,
                ranks=self.gpus,
                torch=torch.__version__,
            )
            t0 = time.perf_counter()
            try:
                self._launch()
                self._collect(0, Ready, self.timeout_s)
                self._reference = self._checksum(self._layout, None)
            except (_StepFailed, _WorkerDied) as exc:
                self._stopped = True
                self._kill()
                raise errors.Unavailable(
                    f"the reshard worker pool did not start: {exc}; nothing is running"
                ) from exc
            except BaseException:
                self._stopped = True
                self._kill()
                raise
            log.info(
                "reshard_workers_started",
                ranks=self.gpus,
                layout=list(self._layout),
                model_bytes=self.model.nbytes,
                pids=self.pids,
                seconds=round(time.perf_counter() - t0, 3),
            )

    def _launch(self) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([worker_module.__name__])
        self._store = dist.TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False)
        for rank in range(self.gpus):
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            reply_read, reply_write = ctx.Pipe(duplex=False)
            args = WorkerArgs(
                rank=rank,
                world_size=self.gpus,
                store_host=STORE_HOST,
                store_port=self._store.port,
                backend=self.backend,
                model=self.model,
                seed=self.seed,
                layout=self._layout,
                timeout_s=self.timeout_s,
            )
            proc = ctx.Process(
                target=worker_module.serve,
                args=(cmd_read, reply_write, args),
                name=f"reshard-worker-{rank}",
                daemon=True,
            )
            proc.start()
            if not self._procs:  # a pool dropped without stop() still ends its workers
                weakref.finalize(self, _kill_processes, self._procs)
            cmd_read.close()
            reply_write.close()
            self._procs.append(proc)
            self._commands.append(cmd_write)
            self._replies.append(reply_read)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ask every worker to leave the group and exit; kill those that do not in time."""
        acquired = self._lock.acquire(timeout=grace_s)  # a running command may finish first
        try:
            if self._stopped:
                return
            self._stopped = True
            with contextlib.suppress(_WorkerDied):
                self._send_all(Stop(next(self._seq)))
            deadline = time.monotonic() + grace_s
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self._kill()
            log.info("reshard_workers_stopped", ranks=self.gpus)
        finally:
            if acquired:
                self._lock.release()

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _kill(self) -> None:
        """End every worker process now (idempotent) and close the pipes and the store."""
        _kill_processes(self._procs)
        for conn in self._commands + self._replies:
            conn.close()
        self._commands, self._replies = [], []
        self._store = None

    # -- queries --------------------------------------------------------------------------

    @property
    def layout(self) -> tuple[int, ...]:
        return self._layout

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def commands_sent(self) -> int:
        """Commands sent to the workers so far (each to all of them)."""
        return self._sent

    @property
    def broken(self) -> str | None:
        """Why the pool can no longer reshard (a worker died), or None."""
        return self._broken

    def check(self, new_layout: Sequence[int]) -> tuple[int, ...]:
        """``new_layout`` validated for this node and model (InvalidArgument otherwise)."""
        return check_fits(self.model, new_layout, self.gpus, self.memory_bytes)

    def plan(self, new_layout: Sequence[int]) -> ReshardPlan:
        return plan_reshard(self.model, self._layout, self.check(new_layout))

    def checksum(self) -> dict[str, str]:
        """The checksum of every full tensor (see ``weights``), composed per instance; every
        instance (and every rank's copy of a replicated tensor) must agree, or
        FailedPrecondition names what differs."""
        with self._lock:
            self._usable()
            try:
                return self._checksum(self._layout, None)
            except _StepFailed as exc:
                self._recover_or_break(exc, self._layout, self._layout)
                raise errors.FailedPrecondition(f"checksum failed: {exc}") from exc
            except _WorkerDied as exc:
                raise self._broke(exc, self._layout, self._layout) from exc

    # -- reshard --------------------------------------------------------------------------

    def reshard(
        self,
        new_layout: Sequence[int],
        *,
        inject: InjectedFailure | None = None,
        timeout_s: float | None = None,
    ) -> ReshardReport:
        """Move the weight shards to ``new_layout``; on any failure keep the old layout.

        Raises InvalidArgument (bad layout: nothing happened) or FailedPrecondition (the
        move failed: the old layout is in place, or the pool is broken and says so).
        ``inject`` makes one worker fail mid-move (tests, drills); ``timeout_s`` bounds
        the move (default: the pool's timeout).
        """
        with self._lock:
            layout = self.check(new_layout)
            self._usable()
            old = self._layout
            if inject is not None and not 0 <= inject.rank < self.gpus:
                raise errors.field_error("inject.rank", inject.rank, f"expected 0..{self.gpus - 1}")
            if timeout_s is not None and timeout_s <= 0:
                raise errors.field_error("timeout_s", timeout_s, "must be positive")
            if layout == old:
                return ReshardReport(old, old, 0, 0, 0.0, 0.0, 0.0, (), dict(self._reference))
            plan = plan_reshard(self.model, old, layout)
            t0 = time.perf_counter()
            try:
                stage = self._send_all_new(lambda seq: Reshard(seq, plan, inject))
                staged = self._collect(stage, Staged, timeout_s or self.timeout_s)
                t1 = time.perf_counter()
                sums = self._checksum(layout, stage)
                t2 = time.perf_counter()
                bad = sorted(n for n in sums if sums[n] != self._reference.get(n))
                if bad:
                    raise _StepFailed(
                        f"the staged tensors {bad[:5]} differ from the old layout's "
                        f"({len(bad)} of {len(sums)} tensors)"
                    )
            except _StepFailed as exc:
                self._recover_or_break(exc, old, layout)
                raise errors.FailedPrecondition(
                    f"reshard {list(old)} -> {list(layout)} failed: {exc}; every worker "
                    f"dropped what it had staged and kept layout {list(old)}"
                ) from exc
            except _WorkerDied as exc:
                raise self._broke(exc, old, layout) from exc
            try:
                commit = self._send_all_new(lambda seq: Commit(seq, stage))
                self._collect(commit, Done, self.timeout_s)
            except (_StepFailed, _WorkerDied) as exc:
                # some workers may have committed: no consistent layout is left
                raise self._broke(exc, old, layout) from exc
            t3 = time.perf_counter()
            self._layout = layout
            self._reference = sums
            workers = tuple(cast(Staged, staged[r]).transfer for r in range(self.gpus))
            return ReshardReport(
                old,
                layout,
                sum(w.sent_bytes for w in workers),
                plan.bytes_moved,
                t1 - t0,
                t2 - t1,
                t3 - t2,
                workers,
                dict(sums),
            )

    # -- internals ------------------------------------------------------------------------

    def _usable(self) -> None:
        if self._broken is not None:
            raise errors.FailedPrecondition(self._broken)
        if self._stopped or not self._procs:
            raise errors.FailedPrecondition("the reshard worker pool is not running")

    def _broke(
        self, exc: BaseException, old: tuple[int, ...], new: tuple[int, ...]
    ) -> errors.FailedPrecondition:
        what = f"reshard {list(old)} -> {list(new)}" if old != new else "checksum"
        self._broken = (
            f"{what} failed: {exc}; the worker pool is stopped and the weights its workers "
            "held are gone: restart the agent to reload the model"
        )
        log.error("reshard_workers_broken", error=self._broken)
        self._kill()
        return errors.FailedPrecondition(self._broken)

    def _checksum(self, layout: tuple[int, ...], staged: int | None) -> dict[str, str]:
        """The checksum of every full tensor, from the block digests of each instance's
        ranks; every instance, and every rank's copy of a replicated tensor, must agree."""
        seq = self._send_all_new(lambda s: Checksum(s, layout, staged))
        replies = self._collect(seq, Checksums, self.timeout_s)
        blocks = {r: cast(Checksums, replies[r]).blocks for r in range(self.gpus)}
        sums: dict[str, str] = {}
        for spec in self.model.tensors:
            per_instance: list[str] = []
            for ranks in instance_ranks(layout):
                if spec.split is Split.REPLICATED:
                    bad = [r for r in ranks if blocks[r][spec.name] != blocks[ranks[0]][spec.name]]
                    if bad:
                        raise _StepFailed(
                            f"tensor {spec.name!r}: ranks {bad} hold a different copy than "
                            f"rank {ranks[0]}"
                        )
                    digests = blocks[ranks[0]][spec.name]
                else:
                    digests = [d for r in ranks for d in blocks[r][spec.name]]
                per_instance.append(combine(digests))
            differ = [i for i, s in enumerate(per_instance) if s != per_instance[0]]
            if differ:
                raise _StepFailed(
                    f"tensor {spec.name!r} differs between instances 0 and {differ} of "
                    f"layout {list(layout)}"
                )
            sums[spec.name] = per_instance[0]
        return sums

    def _recover_or_break(
        self, cause: _StepFailed, old: tuple[int, ...], new: tuple[int, ...]
    ) -> None:
        """Abort the last command everywhere: each worker stops its transfers, drops what it
        staged and joins a fresh process group. A worker that cannot breaks the pool."""
        try:
            seq = self._send_all_new(lambda s: Abort(s, s - 1))
            self._collect(seq, Done, self.timeout_s)
        except (_StepFailed, _WorkerDied) as exc:
            raise self._broke(exc, old, new) from cause
        log.warning("reshard_step_aborted", error=str(cause), layout=list(self._layout))

    def _send_all_new(self, make: Callable[[int], Command]) -> int:
        seq = next(self._seq)
        self._send_all(make(seq))
        return seq

    def _send_all(self, command: Command) -> None:
        self._sent += 1
        # pickled once for every worker (a plan is ~80 KiB: 2-3 ms a pickle), as send would
        payload = ForkingPickler.dumps(command)
        for rank, conn in enumerate(self._commands):
            try:
                conn.send_bytes(payload)
            except OSError:
                proc = self._procs[rank]
                proc.join(1.0)
                raise _WorkerDied(rank, proc.exitcode) from None

    def _collect(self, seq: int, kind: type[Reply], timeout_s: float) -> dict[int, Reply]:
        """The reply of every worker to command ``seq``. Raises _StepFailed at the first
        failure or after ``timeout_s``, _WorkerDied when a worker process ends."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, Reply] = {}
        conn_rank = {id(c): r for r, c in enumerate(self._replies)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(replies) < self.gpus:
            pending = [r for r in range(self.gpus) if r not in replies]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _StepFailed(f"timed out after {timeout_s:g} s waiting for ranks {pending}")
            ready = wait(
                [self._replies[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                timeout=remaining,
            )
            for obj in ready:
                if isinstance(obj, int):
                    continue  # a sentinel: look at the pipe first, it may hold a last reply
                rank = conn_rank[id(obj)]
                try:
                    reply = cast(Reply, self._replies[rank].recv())
                except (EOFError, OSError):
                    self._procs[rank].join(1.0)
                    raise _WorkerDied(rank, self._procs[rank].exitcode) from None
                if reply.seq != seq:
                    continue  # a late reply to a command given up on
                if isinstance(reply, Failed):
                    raise _StepFailed(f"rank {reply.rank}: {reply.error}")
                if not isinstance(reply, kind):
                    raise _StepFailed(f"rank {rank} answered {type(reply).__name__}")
                replies[rank] = reply
            for obj in ready:
                if isinstance(obj, int) and not self._replies[sentinel_rank[obj]].poll():
                    rank = sentinel_rank[obj]
                    self._procs[rank].join(1.0)
                    raise _WorkerDied(rank, self._procs[rank].exitcode)
        return replies


def _kill_processes(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(STOP_GRACE_S)

"""One GPU rank's worker process: holds its weight shards and moves them with
torch.distributed when the WorkerPool (``node_agent.reshard.workers``) says so.

The main thread executes commands one at a time. A reader thread takes commands off the
pipe; when an :class:`~node_agent.reshard.protocol.Abort` arrives while the transfers it
targets are in flight, it aborts the process group, which fails the blocked waits at once
instead of leaving them to the group's timeout. The pool then has every worker join a
fresh group (a new store prefix), since the old one may hold half-done transfers.

A move is two-phase: :class:`Reshard` builds the new shards next to the current ones
(all sends and receives of this rank posted as one batch, the kept bytes copied while
they run; with gloo, sends of pieces that must first be packed contiguous follow the
batch, and pieces received into a temporary are copied into place as each arrives),
:class:`Commit` swaps them in, :class:`Abort` drops them. The current shards are never
written.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from node_agent.reshard.plan import (
    ModelSpec,
    TensorSpec,
    shard_bytes,
    shard_shape,
    shard_span,
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
    Staged,
    Stop,
    WorkerArgs,
    WorkerTransfer,
    tag,
)
from node_agent.reshard.weights import block_digests, generate_shard, torch_dtype

Shards = dict[str, torch.Tensor]
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)


class InjectedError(RuntimeError):
    """The failure a test asked for (InjectedFailure with mode "raise" or "stall")."""


class _Aborted(RuntimeError):
    pass


def serve(commands: Connection, replies: Connection, args: WorkerArgs) -> None:
    """Process entry point: run until Stop or until the parent goes away."""
    # Ctrl-C in a terminal reaches the whole process group: the pool decides when we stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _Worker(commands, replies, args).run()


class _Worker:
    def __init__(self, commands: Connection, replies: Connection, args: WorkerArgs) -> None:
        self.commands = commands
        self.replies = replies
        self.args = args
        self.rank = args.rank
        self.model: ModelSpec = args.model
        self.specs: dict[str, TensorSpec] = {t.name: t for t in args.model.tensors}
        self.device = (
            torch.device("cuda", args.rank) if args.backend == "nccl" else torch.device("cpu")
        )
        self.timeout = datetime.timedelta(seconds=args.timeout_s)
        self.inbox: queue.Queue[Command | None] = queue.Queue()
        self.lock = threading.Lock()
        self.in_flight: int | None = None  # seq of the command whose transfers are posted
        self.aborted_upto = -1  # commands up to this seq are aborted
        self.abort_event = threading.Event()
        self.store: dist.TCPStore | None = None
        self.group: dist.ProcessGroup | None = None
        self.generation = 0
        self.leftover: list[dist.Work] = []  # unfinished work of an aborted group
        self.layout = args.layout
        self.shards: Shards = {}
        self.staged: dict[int, tuple[tuple[int, ...], Shards]] = {}  # seq -> (layout, shards)

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            torch.set_num_threads(1)  # G workers share the node's cores
            if self.device.type == "cpu":
                _keep_freed_memory()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.store = dist.TCPStore(
                self.args.store_host,
                self.args.store_port,
                is_master=False,
                timeout=self.timeout,
            )
            self._join_group()
            self.shards = {
                spec.name: generate_shard(
                    self.model,
                    spec,
                    shard_span(spec, self.layout, self.rank),
                    self.args.seed,
                    self.device,
                )
                for spec in self.model.tensors
            }
        except Exception as exc:
            self._reply(Failed(self.rank, 0, _describe(exc)))
            return
        # torch's many long-lived objects out of the collector's sight: otherwise the first
        # full collection (often while unpickling the first plan) stalls every worker
        gc.freeze()
        threading.Thread(target=self._read, name="reshard-commands", daemon=True).start()
        self._reply(
            Ready(
                self.rank,
                0,
                os.getpid(),
                str(self.device),
                shard_bytes(self.model, self.layout, self.rank),
            )
        )
        while True:
            command = self.inbox.get()
            if command is None or isinstance(command, Stop):
                break
            self._reply(self._handle(command))
        self._leave_group(abort=bool(self.leftover))
        if isinstance(command, Stop):
            self._reply(Done(self.rank, command.seq))

    def _read(self) -> None:
        while True:
            try:
                command: Command = self.commands.recv()
            except (EOFError, OSError):  # the parent is gone: give up whatever is running
                self._abort_transfers(1 << 62)
                self.inbox.put(None)
                return
            if isinstance(command, Abort):
                self._abort_transfers(command.target)
            self.inbox.put(command)

    def _abort_transfers(self, upto: int) -> None:
        with self.lock:
            self.aborted_upto = max(self.aborted_upto, upto)
            self.abort_event.set()
            if self.in_flight is not None and self.in_flight <= upto and self.group is not None:
                # the blocked waits fail now; if the abort itself fails, they time out
                with contextlib.suppress(Exception):
                    self.group.abort()

    def _reply(self, reply: Reply) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: the reader ends the loop
            self.replies.send(reply)

    def _join_group(self) -> None:
        assert self.store is not None
        dist.init_process_group(
            self.args.backend,
            store=dist.PrefixStore(f"generation-{self.generation}", self.store),
            rank=self.rank,
            world_size=self.args.world_size,
            timeout=self.timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.group = dist.group.WORLD
        dist.barrier()  # everyone is connected (and NCCL communicators exist) before use

    def _leave_group(self, abort: bool) -> None:
        if abort and self.group is not None:
            with contextlib.suppress(Exception):  # already failing: destroy it regardless
                self.group.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
        self.leftover.clear()

    # -- commands -------------------------------------------------------------------------

    def _handle(self, command: Command) -> Reply:
        try:
            if isinstance(command, Reshard):
                return self._stage(command)
            if isinstance(command, Checksum):
                return self._checksum(command)
            if isinstance(command, Commit):
                self.layout, self.shards = self.staged.pop(command.target)
                self.staged.clear()
                return Done(self.rank, command.seq)
            if isinstance(command, Abort):
                self.staged.clear()
                # peers may be mid-transfer with us and our own posted work may never
                # finish: abort first, or destroying the group could wait for it
                self._leave_group(abort=True)
                self.generation += 1
                with self.lock:
                    self.abort_event.clear()
                self._join_group()
                return Done(self.rank, command.seq)
            raise TypeError(f"unknown command {command!r}")
        except Exception as exc:
            return Failed(self.rank, command.seq, _describe(exc))

    def _stage(self, command: Reshard) -> Staged:
        t0 = time.perf_counter()
        plan, rank = command.plan, self.rank
        new: Shards = {
            spec.name: torch.empty(
                shard_shape(spec, shard_span(spec, plan.new_layout, rank)),
                dtype=torch_dtype(self.model),
                device=self.device,
            )
            for spec in self.model.tensors
        }
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        copied = 0
        for c in plan.local:
            if c.rank != rank:
                continue
            spec, old = self.specs[c.tensor], self.shards[c.tensor]
            if len(c.src) == old.shape[spec.dim] and len(c.dst) == new[c.tensor].shape[spec.dim]:
                new[c.tensor] = old  # kept whole: share it, nothing writes into it
                continue
            dst = _piece(new[c.tensor], spec, c.dst.start, len(c.dst))
            kept.append((dst, _piece(old, spec, c.src.start, len(c.src))))
            copied += c.nbytes
        inject = command.inject if command.inject and command.inject.rank == rank else None
        # gloo: every send and receive is a work of its own, so pieces that must be packed
        # are packed and sent once the others are under way, and pieces received into a
        # temporary are unpacked as each arrives. NCCL posts one group (a second group
        # could wait on the first's peers: a deadlock), so everything is packed first.
        overlap = self.args.backend == "gloo" and inject is None
        ops: list[dist.P2POp] = []
        late: list[tuple[torch.Tensor, int, int]] = []  # (piece to pack, dst rank, tag)
        unpack: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # op -> (view, target)
        sent = received = 0
        for index, m in plan.moves_of(rank):
            spec = self.specs[m.tensor]
            if m.src_rank == rank:
                piece = _piece(self.shards[m.tensor], spec, m.src.start, len(m.src))
                if overlap and not piece.is_contiguous():
                    late.append((piece, m.dst_rank, tag(command.seq, index)))
                else:
                    ops.append(
                        dist.P2POp(
                            dist.isend,
                            piece.contiguous(),
                            m.dst_rank,
                            self.group,
                            tag(command.seq, index),
                        )
                    )
                sent += m.nbytes
            else:
                view = _piece(new[m.tensor], spec, m.dst.start, len(m.dst))
                target = view if view.is_contiguous() else torch.empty_like(view)
                if target is not view:
                    unpack[len(ops)] = (view, target)
                ops.append(
                    dist.P2POp(dist.irecv, target, m.src_rank, self.group, tag(command.seq, index))
                )
                received += m.nbytes
        t1 = time.perf_counter()
        local_s, unpack_s = self._exchange(command.seq, ops, inject, kept, late, unpack)
        t2 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.staged[command.seq] = (plan.new_layout, new)
        t3 = time.perf_counter()
        transfer = WorkerTransfer(
            rank,
            sent,
            received,
            copied,
            len(ops) + len(late),
            seconds=t3 - t0,
            local_s=t1 - t0 + local_s,
            transfer_s=t2 - t1 - local_s - unpack_s,
            unpack_s=t3 - t2 + unpack_s,
        )
        return Staged(rank, command.seq, transfer)

    def _checksum(self, command: Checksum) -> Checksums:
        t0 = time.perf_counter()
        shards = self.shards if command.staged is None else self.staged[command.staged][1]
        blocks = {
            spec.name: block_digests(
                self.model, spec, shards[spec.name], shard_span(spec, command.layout, self.rank)
            )
            for spec in self.model.tensors
        }
        return Checksums(self.rank, command.seq, blocks, time.perf_counter() - t0)

    def _exchange(
        self,
        seq: int,
        ops: list[dist.P2POp],
        inject: InjectedFailure | None,
        meanwhile: list[tuple[torch.Tensor, torch.Tensor]],
        late: list[tuple[torch.Tensor, int, int]],
        unpack: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[float, float]:
        """Post ``ops`` as one batch, then the ``late`` sends (piece, dst rank, tag), each
        packed first; do the ``meanwhile`` copies (dst, src) while they run; wait for all
        of them, copying each received ``unpack`` target (by op index) into its view once
        it is in (at the end when the backend gives one work for the batch). Abortable by
        the pool. Returns the seconds of the local copies (packing included) and of the
        unpacking."""
        with self.lock:
            if self.aborted_upto >= seq:
                raise _Aborted(f"command {seq} was aborted before its transfers started")
            self.in_flight = seq
        works: list[dist.Work] = []
        try:
            if inject is None:
                if ops:
                    works = dist.batch_isend_irecv(ops)
            else:
                works = self._fail_midway(ops, inject)
            with self.lock:  # an abort that came while posting may have missed some ops
                if self.aborted_upto >= seq:
                    raise _Aborted(f"transfers of command {seq} aborted while being posted")
            t0 = time.perf_counter()
            for piece, dst_rank, op_tag in late:  # (a work keeps its tensor alive)
                packed = piece.contiguous()
                # posted under the lock, after a check: an abort lands either before (no
                # send is posted on an aborted group, whose wait would last until the
                # group's timeout) or after (its group.abort() fails this send's wait)
                with self.lock:
                    if self.aborted_upto >= seq:
                        raise _Aborted(f"transfers of command {seq} aborted while being posted")
                    work = dist.isend(packed, dst_rank, self.group, op_tag)
                if work is None:
                    raise RuntimeError(f"rank {self.rank} is not in its own process group")
                works.append(work)
            for dst, src in meanwhile:
                dst.copy_(src)
            copies_s = time.perf_counter() - t0
            per_op = len(works) == len(ops) + len(late)
            unpack_s = 0.0
            for index, work in enumerate(works):
                work.wait()
                if per_op and index in unpack:
                    t1 = time.perf_counter()
                    view, target = unpack[index]
                    view.copy_(target)
                    unpack_s += time.perf_counter() - t1
            works = []
            if not per_op:
                t1 = time.perf_counter()
                for view, target in unpack.values():
                    view.copy_(target)
                unpack_s = time.perf_counter() - t1
            return copies_s, unpack_s
        except Exception as exc:
            if self.aborted_upto >= seq and not isinstance(exc, InjectedError):
                raise _Aborted(f"transfers of command {seq} aborted: {_describe(exc)}") from exc
            raise
        finally:
            self.leftover.extend(works)  # unfinished: keep their buffers alive
            with self.lock:
                self.in_flight = None

    def _fail_midway(self, ops: list[dist.P2POp], inject: InjectedFailure) -> list[dist.Work]:
        recvs = [op for op in ops if op.op is dist.irecv]
        sends = [op for op in ops if op.op is dist.isend]
        first = recvs + sends[: inject.after_sends]
        works = dist.batch_isend_irecv(first) if first else []
        self.leftover.extend(works)
        if inject.mode == "exit":
            os._exit(INJECTED_EXIT_CODE)
        if inject.mode == "stall":
            self.abort_event.wait()
            raise InjectedError(
                f"injected stall on rank {self.rank} after {len(first) - len(recvs)} of "
                f"{len(sends)} sends, until the pool aborted the move"
            )
        raise InjectedError(
            f"injected failure on rank {self.rank} after {len(first) - len(recvs)} of "
            f"{len(sends)} sends"
        )


def _keep_freed_memory() -> None:
    """Have glibc keep freed shard memory for the next reshard instead of returning it to
    the kernel (what the CUDA caching allocator does for GPU shards): fresh pages cost a
    fault and zeroing each, which made allocation, not copying, the bulk of a CPU move.
    The worker keeps its peak (old and new shards of a move) reserved."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: keep the defaults
        return
    mallopt(M_MMAP_MAX, 0)  # large blocks from the heap, not from mmap ...
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ... and the heap is not trimmed after a free


def _piece(tensor: torch.Tensor, spec: TensorSpec, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(spec.dim, start, length)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")

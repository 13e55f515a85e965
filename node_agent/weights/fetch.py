"""Fetching a checkpoint from another node's agent (CheckpointStore), resumably.

:func:`fetch_checkpoint` asks the source for the checkpoint's manifest, refuses one whose
tensors do not fit the model this node serves (before any weight byte moves), then fetches
the parts :mod:`node_agent.weights.plan` plans over ``streams`` connections at once (each
its own TCP connection, so the fabric spreads them over its circuits) into
``ROOT/.partial-VERSION-CHECKSUM16``. A connection that breaks, or stalls for
``stall_s``, is opened again and the part goes on from its first missing byte; a part
written whole is recorded beside the partial checkpoint, so a fetch cut short altogether
(the agent restarted, the command timed out) resumes where it stopped. Once every part is
in, each file's SHA-256 is checked against the manifest (a file that differs is fetched
again next time, not trusted), the whole checkpoint goes through
:func:`orchestrrl.checkpoint.verify`, and only then is it renamed to
``ROOT/VERSION-CHECKSUM16``: a checkpoint under its final name is always whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from node_agent.weights import plan
from node_agent.weights.plan import Part
from orchestrrl import checkpoint, errors, grpcutil
from orchestrrl.logs import get_logger
from orchestrrl.tls import TlsConfig, addressed_to
from orchestrrl.v1 import checkpoints_pb2 as pb
from orchestrrl.v1 import checkpoints_pb2_grpc as pb_grpc

log = get_logger("node_agent.weights")

PARTIAL_PREFIX = ".partial-"
DEFAULT_STALL_S = 20.0  # a connection that delivers nothing this long is opened again
DEFAULT_ATTEMPTS = 6  # consecutive attempts of a part without a byte before giving up
BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
PROGRESS_EVERY_S = 5.0
# gRPC statuses of a broken or stalled connection (retried); any other is the source's
# answer (not found, refused) and is not
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


@dataclass(frozen=True)
class SourceInfo:
    node: str
    version: str
    checksum: str
    manifest: bytes
    size: int


class CheckpointSource(Protocol):
    """Another node's CheckpointStore."""

    node: str
    address: str

    async def info(self, version: str, checksum: str) -> SourceInfo:
        """The manifest of a checkpoint the source holds (errors.NotFound when it has none,
        errors.Unavailable when it cannot be reached)."""

    def read(
        self, version: str, checksum: str, part: Part, stream: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """``(offset, data)`` chunks of ``part`` in order, over connection ``stream``;
        errors.Unavailable when the connection breaks (the caller resumes)."""

    async def close(self) -> None: ...


class GrpcCheckpointSource:
    """The CheckpointStore of the agent of ``node`` at ``address``: one channel per stream,
    each its own TCP connection, replaced after a failure. With TLS the source's
    certificate must name ``node``."""

    def __init__(
        self,
        node: str,
        address: str,
        tls: TlsConfig | None,
        *,
        chunk_bytes: int = plan.MAX_CHUNK_BYTES,
        timeout_s: float = 30.0,
    ) -> None:
        self.node = node
        self.address = address
        self._tls = tls
        self._chunk = chunk_bytes
        self._timeout_s = timeout_s
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._old: list[grpc.aio.Channel] = []

    def _stub(self, stream: int) -> pb_grpc.CheckpointStoreStub:
        channel = self._channels.get(stream)
        if channel is None:
            channel = self._channels[stream] = grpcutil.channel(
                self.address, self._tls, server_name=self.node, own_connection=True
            )
        return pb_grpc.CheckpointStoreStub(channel)

    def _reset(self, stream: int) -> None:
        channel = self._channels.pop(stream, None)
        if channel is not None:
            self._old.append(channel)

    def _what(self, rpc: str) -> str:
        return f"source {self.node!r} at {self.address}: {rpc}"

    def _error(self, rpc: str, exc: grpc.aio.AioRpcError, stream: int) -> errors.OrlError:
        if exc.code() in TRANSIENT:
            self._reset(stream)
            return errors.Unavailable(f"{self._what(rpc)}: {exc.code().name}: {exc.details()}")
        klass = grpcutil.ERROR_OF.get(exc.code(), errors.Unavailable)
        return klass(f"{self._what(rpc)}: {exc.details()}")

    async def info(self, version: str, checksum: str) -> SourceInfo:
        request = pb.GetCheckpointRequest(version=version, checksum=checksum)
        try:
            r = await self._stub(0).GetCheckpoint(
                request, timeout=self._timeout_s, metadata=addressed_to(self.node)
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error("GetCheckpoint", exc, 0) from None
        return SourceInfo(r.node, r.version, r.checksum, r.manifest, r.size)

    async def read(
        self, version: str, checksum: str, part: Part, stream: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        request = pb.ReadCheckpointRequest(
            version=version,
            checksum=checksum,
            file=part.file,
            offset=part.start,
            length=part.size,
            chunk_bytes=self._chunk,
        )
        call = self._stub(stream).ReadCheckpoint(request, metadata=addressed_to(self.node))
        try:
            async for chunk in call:
                yield chunk.offset, chunk.data
        except grpc.aio.AioRpcError as exc:
            raise self._error("ReadCheckpoint", exc, stream) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._old]:
            await channel.close()
        self._channels.clear()
        self._old.clear()


@dataclass
class FetchStatus:
    """Where a fetch stands (read by the caller when it gives up on it)."""

    stage: str = "not started"
    fetched: int = 0
    of: int = 0

    def describe(self) -> str:
        if self.stage == "parts":
            return f"{self.fetched} of {self.of} bytes fetched"
        return self.stage


@dataclass(frozen=True)
class FetchResult:
    checkpoint: checkpoint.Checkpoint
    bytes_fetched: int  # over the network by this fetch
    fetch_seconds: float  # from the first request to the last byte
    verify_seconds: float  # SHA-256 of every file and checkpoint.verify
    resumes: int  # parts asked for again after a cut or stalled connection
    streams: int
    cached: bool  # the checkpoint was here already: nothing fetched


def partial_dir(root: Path, name: str) -> Path:
    return root / f"{PARTIAL_PREFIX}{name}"


def progress_file(root: Path, name: str) -> Path:
    return root / f"{PARTIAL_PREFIX}{name}.json"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_progress(path: Path, checksum: str, done: Mapping[str, plan.Spans]) -> None:
    tmp = path.with_name(f"{path.name}.{os.urandom(4).hex()}.tmp")
    tmp.write_text(plan.progress_json(checksum, done))
    tmp.replace(path)


def _prepare_staging(staging: Path, manifest_bytes: bytes, m: checkpoint.Manifest) -> None:
    """The partial directory with the manifest and every file at its full size (sparse);
    anything else in it removed."""
    staging.mkdir(parents=True, exist_ok=True)
    listed = {f.name for f in m.files} | {checkpoint.MANIFEST}
    for name in os.listdir(staging):
        if name not in listed:
            target = staging / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
    mpath = staging / checkpoint.MANIFEST
    if not mpath.is_file() or mpath.read_bytes() != manifest_bytes:
        mpath.write_bytes(manifest_bytes)
    for f in m.files:
        path = staging / f.name
        with path.open("ab"):
            pass
        if path.stat().st_size != f.size:
            os.truncate(path, f.size)


def shape_problems(m: checkpoint.Manifest, expected_config: Mapping[str, Any] | None) -> list[str]:
    """The manifest's tensors against the model this node serves (pure)."""
    if expected_config is None:
        return []
    want = checkpoint.LlamaArch.from_config(expected_config, "the served model's config")
    return checkpoint.tensor_problems(m.tensors, want.tensor_shapes())


async def fetch_checkpoint(
    source: CheckpointSource,
    root: Path,
    version: str,
    checksum: str,
    *,
    streams: int = plan.DEFAULT_STREAMS,
    part_bytes: int = plan.DEFAULT_PART_BYTES,
    expected_config: Mapping[str, Any] | None = None,
    stall_s: float = DEFAULT_STALL_S,
    attempts: int = DEFAULT_ATTEMPTS,
    backoff_s: tuple[float, ...] = BACKOFF_S,
    clock: Callable[[], float] = time.monotonic,
    status: FetchStatus | None = None,
) -> FetchResult:
    """Checkpoint ``version`` with ``checksum`` from ``source`` into ``root`` (see the
    module docstring). :class:`orchestrrl.checkpoint.CheckpointError` naming the file and
    its problem when the checkpoint is not the one asked for or not whole; Unavailable
    when the source cannot be reached ``attempts`` times in a row; NotFound when it does
    not hold it. Nothing is left under the final name unless it is whole. ``status`` is
    kept up to date (what a caller that gives up says it was doing)."""
    status = status if status is not None else FetchStatus()
    checkpoint.check_version(version)
    streams = plan.check_streams(streams)
    name = checkpoint.dirname(version, checksum)
    final = root / name
    where = f"{version}-{checksum[:16]} from {source.node}"
    t0 = clock()
    if final.is_dir():
        try:
            held = await asyncio.to_thread(checkpoint.verify, final, expected_config)
        except checkpoint.CheckpointError as exc:
            log.warning("local_checkpoint_corrupt", path=str(final), error=str(exc))
            await asyncio.to_thread(_discard, final)
        else:
            return FetchResult(held, 0, 0.0, clock() - t0, 0, 0, True)
    status.stage = f"asking {source.node} at {source.address} for the manifest (no answer)"
    info = await _info(source, version, checksum, attempts, backoff_s)
    m = checkpoint.parse_manifest(info.manifest)
    if (m.version, m.checksum) != (version, checksum) or checkpoint.checksum_of(
        m.files
    ) != checksum:
        raise checkpoint.CheckpointError(
            where,
            _problems(
                f"{checkpoint.MANIFEST}: the source answered version {m.version!r} with "
                f"checksum {m.checksum[:16]}..., asked for {version!r} {checksum[:16]}..."
            ),
        )
    wrong = shape_problems(m, expected_config)
    if wrong:  # refused before a weight byte moves
        raise checkpoint.CheckpointError(where, _problems(*wrong))
    staging = partial_dir(root, name)
    record = progress_file(root, name)
    await asyncio.to_thread(_prepare_staging, staging, info.manifest, m)
    done = plan.parse_progress(record.read_bytes() if record.is_file() else b"", checksum, m.files)
    parts = plan.plan_parts(m.files, done, part_bytes, streams)
    run = _Run(source, version, checksum, staging, record, done, stall_s, attempts, backoff_s)
    status.stage, status.of = "parts", m.size - plan.done_bytes(done)
    run.status = status
    log.info(
        "checkpoint_fetch_started",
        version=version,
        checksum=checksum[:16],
        source=source.node,
        address=source.address,
        bytes=m.size,
        have=plan.done_bytes(done),
        parts=len(parts),
        streams=streams,
    )
    started = clock()
    await run.all(parts, streams, m.size, clock)
    fetched_s = clock() - started
    status.stage = "checking the fetched files"
    v0 = clock()
    bad = []
    for f in m.files:
        if await asyncio.to_thread(_sha256, staging / f.name) != f.sha256:
            bad.append(f.name)
            run.done = plan.forget_file(run.done, f.name)
    if bad:
        await asyncio.to_thread(_write_progress, record, checksum, run.done)
        raise checkpoint.CheckpointError(
            where,
            _problems(
                *(
                    f"{n}: SHA-256 of the fetched bytes differs from the manifest's (corrupt at "
                    "the source or in transit; fetched again next time)"
                    for n in bad
                )
            ),
        )
    record.unlink(missing_ok=True)
    try:
        await asyncio.to_thread(checkpoint.verify, staging, expected_config, hash_files=False)
    except checkpoint.CheckpointError:
        await asyncio.to_thread(_discard, staging)
        raise
    await asyncio.to_thread(_place, staging, final)
    held = checkpoint.Checkpoint(final, m)
    verify_s = clock() - v0
    log.info(
        "checkpoint_fetched",
        version=version,
        checksum=checksum[:16],
        source=source.node,
        bytes=run.fetched,
        seconds=round(fetched_s, 3),
        mbytes_per_s=round(plan.mbytes_per_s(run.fetched, fetched_s), 2),
        resumes=run.resumes,
        streams=streams,
    )
    return FetchResult(held, run.fetched, fetched_s, verify_s, run.resumes, streams, False)


async def _info(
    source: CheckpointSource,
    version: str,
    checksum: str,
    attempts: int,
    backoff_s: tuple[float, ...],
) -> SourceInfo:
    """The source's manifest, asked ``attempts`` times while it cannot be reached."""
    for attempt in range(1, attempts + 1):
        try:
            return await source.info(version, checksum)
        except errors.Unavailable as exc:
            if attempt == attempts:
                raise errors.Unavailable(f"{exc} (gave up after {attempts} attempts)") from None
            delay = backoff_s[min(attempt - 1, len(backoff_s) - 1)]
            log.warning(
                "checkpoint_source_unreachable",
                source=source.node,
                address=source.address,
                attempt=attempt,
                retry_in_s=delay,
                error=errors.bounded(str(exc), 300),
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # attempts >= 1


def _problems(*items: str) -> errors.Problems:
    p = errors.Problems()
    p.extend(items)
    return p


def _discard(path: Path) -> None:
    trash = path.with_name(f"{PARTIAL_PREFIX}trash-{os.urandom(4).hex()}")
    with contextlib.suppress(FileNotFoundError):
        path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _place(staging: Path, final: Path) -> None:
    """Rename the verified partial directory to its final name (another fetch of the same
    checkpoint may have placed it first: then this one is dropped)."""
    try:
        staging.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        _discard(staging)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Run:
    """The parts of one fetch, fetched by concurrent workers."""

    def __init__(
        self,
        source: CheckpointSource,
        version: str,
        checksum: str,
        staging: Path,
        record: Path,
        done: dict[str, plan.Spans],
        stall_s: float,
        attempts: int,
        backoff_s: tuple[float, ...],
    ) -> None:
        self.source = source
        self.version = version
        self.checksum = checksum
        self.staging = staging
        self.record = record
        self.done = done
        self.stall_s = stall_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.fetched = 0
        self.resumes = 0
        self._fds: dict[str, int] = {}
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._recording = asyncio.Lock()  # one progress record written at a time, newest last
        self.status = FetchStatus()

    async def all(
        self, parts: tuple[Part, ...], streams: int, total: int, clock: Callable[[], float]
    ) -> None:
        queue = list(reversed(parts))
        for name in {p.file for p in parts}:
            self._fds[name] = os.open(self.staging / name, os.O_WRONLY)
        # the file writes run here: a cancelled worker's write still in a thread is waited
        # for before its file is closed
        self._writer = concurrent.futures.ThreadPoolExecutor(max(1, streams), "ckpt-write")
        try:
            async with asyncio.TaskGroup() as tg:
                workers = [
                    tg.create_task(self._worker(queue, k)) for k in range(min(streams, len(parts)))
                ]
                reporter = tg.create_task(self._report(total, clock))
                await asyncio.gather(*workers)
                reporter.cancel()
        except BaseExceptionGroup as group:
            raise _first(group) from None
        finally:
            writer, self._writer = self._writer, None
            await asyncio.to_thread(writer.shutdown, True)
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    async def _report(self, total: int, clock: Callable[[], float]) -> None:
        start = clock()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            log.info(
                "checkpoint_fetch_progress",
                version=self.version,
                source=self.source.node,
                fetched=self.fetched,
                have=plan.done_bytes(self.done),
                of=total,
                mbytes_per_s=round(plan.mbytes_per_s(self.fetched, clock() - start), 2),
            )

    async def _worker(self, queue: list[Part], stream: int) -> None:
        while queue:
            part = queue.pop()
            await self._part(part, stream)
            self.done = plan.record_done(self.done, part)
            async with self._recording:
                await asyncio.to_thread(_write_progress, self.record, self.checksum, self.done)

    async def _part(self, part: Part, stream: int) -> None:
        current = part
        failures = 0
        fd = self._fds[part.file]
        writer = self._writer
        assert writer is not None
        while current.size > 0:
            position = current.start
            try:
                chunks = aiter(self.source.read(self.version, self.checksum, current, stream))
                try:
                    while position < current.end:
                        try:
                            async with asyncio.timeout(self.stall_s):
                                offset, data = await anext(chunks)
                        except StopAsyncIteration:
                            raise errors.Unavailable(
                                f"source {self.source.node!r}: the stream of {part.file} ended "
                                f"at byte {position} of [{current.start}, {current.end})"
                            ) from None
                        except TimeoutError:
                            raise errors.Unavailable(
                                f"source {self.source.node!r}: no bytes of {part.file} for "
                                f"{self.stall_s:g} s at byte {position}"
                            ) from None
                        problem = plan.chunk_problem(current, position, offset, len(data))
                        if problem is not None:
                            raise errors.FailedPrecondition(
                                f"source {self.source.node!r} sent {problem}"
                            )
                        await asyncio.wrap_future(writer.submit(os.pwrite, fd, data, offset))
                        position += len(data)
                        self.fetched += len(data)
                        self.status.fetched = self.fetched
                finally:
                    await _close(chunks)
                return
            except errors.Unavailable as exc:
                written = position - current.start
                failures = 0 if written else failures + 1
                if failures >= self.attempts:
                    raise errors.Unavailable(
                        f"{exc} (gave up after {self.attempts} attempts without a byte)"
                    ) from None
                current = plan.rest_of(current, written)
                self.resumes += 1
                delay = self.backoff_s[min(failures, len(self.backoff_s) - 1)] if failures else 0.0
                log.warning(
                    "checkpoint_fetch_resumed",
                    source=self.source.node,
                    file=part.file,
                    at=current.start,
                    end=current.end,
                    stream=stream,
                    retry_in_s=delay,
                    error=errors.bounded(str(exc), 300),
                )
                if delay:
                    await asyncio.sleep(delay)


async def _close(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a fetch reports: the first that is not a cancellation."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]

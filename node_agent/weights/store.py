"""The checkpoints this node holds (its ``checkpoint_dir``) and the CheckpointStore service
that serves them to other nodes.

A trainer publishes a checkpoint by writing it into the directory with
:func:`orchestrrl.checkpoint.write` (built beside and renamed into place: the store never
sees half a checkpoint); a generation node's agent fetches into its own directory, which it
then serves too. The service reads files only as their manifest lists them (no other path
can be named), checks a checkpoint's sizes and safetensors header before it is offered,
and streams byte ranges in order, from a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from node_agent.weights.plan import MAX_CHUNK_BYTES, chunk_spans
from orchestrrl import checkpoint, errors
from orchestrrl.grpcutil import domain_errors_to_status
from orchestrrl.logs import get_logger
from orchestrrl.tls import check_addressee
from orchestrrl.v1 import checkpoints_pb2 as pb
from orchestrrl.v1 import checkpoints_pb2_grpc as pb_grpc

log = get_logger("node_agent.weights")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
HEX64 = re.compile(r"[0-9a-f]{64}")


def check_checksum(value: str, field: str = "checksum", *, optional: bool = False) -> str:
    if (optional and value == "") or HEX64.fullmatch(value):
        return value
    allowed = "64 lowercase hex digits (a SHA-256)" + (', or "": the newest' if optional else "")
    raise errors.field_error(field, value, allowed)


@dataclass(frozen=True)
class Held:
    """A checkpoint of the store, its manifest read (and, when offered, checked)."""

    path: Path
    manifest: checkpoint.Manifest
    manifest_bytes: bytes


class CheckpointDir:
    """The checkpoints under ``root`` (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # manifests read, by directory and the manifest's (mtime_ns, size): a rewritten
        # checkpoint of the same name is read again
        self._manifests: dict[Path, tuple[tuple[int, int], Held]] = {}

    def versions(self) -> list[str]:
        """``VERSION-CHECKSUM16`` of what the store holds, oldest first."""
        return [p.name for p in checkpoint.find(self.root)]

    def _missing(self, version: str, checksum: str) -> errors.NotFound:
        held = self.versions()
        what = f"{version}" + (f" with checksum {checksum[:16]}..." if checksum else "")
        return errors.NotFound(
            f"no checkpoint {what} in {self.root}; it holds "
            + (errors.listed(held[-8:], ", ") if held else "none")
            + " (a trainer publishes one with orchestrrl.checkpoint.write into this directory)"
        )

    def path_of(self, version: str, checksum: str) -> Path:
        """The directory of ``version`` (``checksum``: that one; "": the newest)."""
        checkpoint.check_version(version)
        if checksum:
            path = self.root / checkpoint.dirname(version, checksum)
            if not path.is_dir():
                raise self._missing(version, checksum)
            return path
        found = checkpoint.find(self.root, version)
        if not found:
            raise self._missing(version, "")
        return found[-1]

    def read(self, path: Path) -> Held:
        """The manifest of the checkpoint at ``path`` (cached while the file is unchanged)."""
        mpath = path / checkpoint.MANIFEST
        try:
            st = mpath.stat()
            key = (st.st_mtime_ns, st.st_size)
            cached = self._manifests.get(path)
            if cached is not None and cached[0] == key:
                return cached[1]
            if st.st_size > checkpoint.MAX_MANIFEST_BYTES:
                raise errors.FailedPrecondition(
                    f"checkpoint {path}: {checkpoint.MANIFEST} is larger than "
                    f"{checkpoint.MAX_MANIFEST_BYTES} bytes"
                )
            data = mpath.read_bytes()
        except FileNotFoundError:
            raise errors.FailedPrecondition(
                f"checkpoint {path}: {checkpoint.MANIFEST}: missing"
            ) from None
        try:
            manifest = checkpoint.parse_manifest(data)
        except errors.InvalidArgument as exc:
            raise errors.FailedPrecondition(f"checkpoint {path}: {exc}") from None
        held = Held(path, manifest, data)
        if len(self._manifests) > 64:
            self._manifests.clear()
        self._manifests[path] = (key, held)
        return held

    def offer(self, version: str, checksum: str) -> Held:
        """The checkpoint to serve, checked without reading every byte (every file of its
        size, the safetensors header equal to the manifest's tensor table, the
        architecture consistent): FailedPrecondition naming the file and the problem when
        it is not whole; the reader checks each file's SHA-256."""
        path = self.path_of(version, checksum)
        try:
            checkpoint.verify(path, hash_files=False)
        except checkpoint.CheckpointError as exc:
            raise errors.FailedPrecondition(f"not served: {exc}") from None
        held = self.read(path)
        if checksum and held.manifest.checksum != checksum:
            raise self._missing(version, checksum)
        return held


def _read_at(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset)


class CheckpointStoreService(pb_grpc.CheckpointStoreServicer):
    """Serves the checkpoints of ``store`` (None: this agent has no checkpoint_dir). Any
    peer the TLS handshake admitted (a certificate the cluster's CA signed) may read."""

    def __init__(self, node: str, store: CheckpointDir | None) -> None:
        self.node = node
        self.store = store

    def _store(self) -> CheckpointDir:
        if self.store is None:
            raise errors.FailedPrecondition(
                f"node {self.node!r} serves no checkpoints: its agent has no checkpoint_dir"
            )
        return self.store

    @domain_errors_to_status
    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: Context
    ) -> pb.CheckpointInfo:
        check_addressee(context, self.node)
        checkpoint.check_version(request.version)
        check_checksum(request.checksum, optional=True)
        store = self._store()
        held = await asyncio.to_thread(store.offer, request.version, request.checksum)
        m = held.manifest
        return pb.CheckpointInfo(
            node=self.node,
            version=m.version,
            checksum=m.checksum,
            manifest=held.manifest_bytes,
            size=m.size,
        )

    @domain_errors_to_status
    async def ReadCheckpoint(
        self, request: pb.ReadCheckpointRequest, context: Context
    ) -> AsyncIterator[pb.CheckpointChunk]:
        check_addressee(context, self.node)
        checkpoint.check_version(request.version)
        check_checksum(request.checksum)
        chunk = request.chunk_bytes or MAX_CHUNK_BYTES
        if chunk > MAX_CHUNK_BYTES:
            raise errors.field_error("chunk_bytes", chunk, f"0 (1 MiB) or 1..{MAX_CHUNK_BYTES}")
        store = self._store()
        held = await asyncio.to_thread(
            lambda: store.read(store.path_of(request.version, request.checksum))
        )
        if held.manifest.checksum != request.checksum:
            raise store._missing(request.version, request.checksum)
        entry = held.manifest.file(request.file)
        if entry is None:
            raise errors.field_error(
                "file",
                request.file,
                "a file of the checkpoint: " + ", ".join(f.name for f in held.manifest.files),
            )
        if request.offset > entry.size:
            raise errors.field_error("offset", request.offset, f"0..{entry.size} (its size)")
        end = entry.size if request.length == 0 else request.offset + request.length
        if end > entry.size:
            raise errors.field_error(
                "length",
                request.length,
                f"at most {entry.size - request.offset} bytes from offset {request.offset} "
                "(0: to the end)",
            )
        path = held.path / entry.name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise errors.FailedPrecondition(
                f"checkpoint {held.path}: {entry.name}: missing"
            ) from None
        try:
            if os.fstat(fd).st_size != entry.size:
                raise errors.FailedPrecondition(
                    f"checkpoint {held.path}: {entry.name}: {os.fstat(fd).st_size} bytes, the "
                    f"manifest says {entry.size} (changed while served)"
                )
            for start, stop in chunk_spans(request.offset, end, chunk):
                data = await asyncio.to_thread(_read_at, fd, start, stop - start)
                if len(data) != stop - start:
                    raise errors.FailedPrecondition(
                        f"checkpoint {held.path}: {entry.name}: ended at byte "
                        f"{start + len(data)}, the manifest says {entry.size} bytes"
                    )
                yield pb.CheckpointChunk(offset=start, data=data)
        finally:
            os.close(fd)

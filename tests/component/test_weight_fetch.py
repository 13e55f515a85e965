"""Fetching a checkpoint from another agent's CheckpointStore over real gRPC: whole,
through a connection cut mid-stream (resumed, not restarted), after a fetch given up
(resumed from the parts it had), and the refusals: a corrupt byte, a truncated file, a
checkpoint the source does not hold, one of another shape (refused before its bytes
move). A checkpoint is under its final name only when whole."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node_agent.weights import plan
from node_agent.weights.fetch import (
    GrpcCheckpointSource,
    fetch_checkpoint,
    partial_dir,
    progress_file,
)
from node_agent.weights.store import SERVICE_NAME, CheckpointDir, CheckpointStoreService
from orchestrrl import checkpoint, errors, grpcutil
from orchestrrl.v1 import checkpoints_pb2, checkpoints_pb2_grpc
from sim_backends.tcp_proxy import TcpProxy
from sim_backends.tiny_models import TinyShape, llama_config, write_checkpoint

pytestmark = pytest.mark.component

SHAPE = TinyShape(layers=2, hidden=64, head_dim=32, intermediate=128, vocab=256)  # ~280 KB
PART = 64 * 1024  # several parts per file
CHUNK = 16 * 1024  # several chunks per part


class RecordingStore(CheckpointStoreService):
    """The real service, remembering every read asked of it."""

    def __init__(self, node: str, store: CheckpointDir) -> None:
        super().__init__(node, store)
        self.reads: list[tuple[str, int, int]] = []

    async def ReadCheckpoint(
        self, request: checkpoints_pb2.ReadCheckpointRequest, context: Any
    ) -> AsyncIterator[checkpoints_pb2.CheckpointChunk]:
        self.reads.append((request.file, request.offset, request.length))
        async for chunk in super().ReadCheckpoint(request, context):
            yield chunk


@dataclass
class Source:
    root: Path
    path: Path  # the checkpoint
    service: RecordingStore
    address: str

    @property
    def checksum(self) -> str:
        return checkpoint.parse_manifest((self.path / checkpoint.MANIFEST).read_bytes()).checksum


@pytest.fixture
async def source(tmp_path: Path) -> AsyncIterator[Source]:
    root = tmp_path / "train"
    path = write_checkpoint(root, "1", SHAPE, seed=1)
    service = RecordingStore("train0-n0", CheckpointDir(root))
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(service, s),
        [SERVICE_NAME],
    )
    try:
        yield Source(root, path, service, server.address)
    finally:
        await server.stop(0.1)


def client(address: str) -> GrpcCheckpointSource:
    return GrpcCheckpointSource("train0-n0", address, None, chunk_bytes=CHUNK)


async def fetch(src: Source, dest: Path, address: str | None = None, **kw: Any) -> Any:
    c = client(address or src.address)
    try:
        return await fetch_checkpoint(c, dest, "1", src.checksum, **{"part_bytes": PART, **kw})
    finally:
        await c.close()


async def test_a_whole_fetch_lands_verified_under_its_name(source: Source, tmp_path: Path) -> None:
    dest = tmp_path / "gen"
    got = await fetch(source, dest, streams=3)
    size = checkpoint.verify(source.path).manifest.size
    assert got.checkpoint.path == dest / source.path.name
    assert (got.bytes_fetched, got.resumes, got.cached, got.streams) == (size, 0, False, 3)
    assert checkpoint.verify(got.checkpoint.path).checksum == source.checksum
    # nothing else is left in the directory (no partial, no progress record)
    assert sorted(p.name for p in dest.iterdir()) == [source.path.name]
    # every byte asked for once, in parts of at most PART
    asked = sum(length for _, _, length in source.service.reads)
    assert asked == size and all(length <= PART for _, _, length in source.service.reads)
    again = await fetch(source, dest)
    assert (again.cached, again.bytes_fetched) == (True, 0)


async def test_a_cut_connection_resumes_the_part_where_it_stopped(
    source: Source, tmp_path: Path
) -> None:
    proxy = await TcpProxy(source.address).start()
    try:
        proxy.cut_after(150_000)  # in the middle of the weights
        got = await fetch(source, tmp_path / "gen", proxy.address, streams=1, part_bytes=1 << 30)
    finally:
        await proxy.stop()
    size = checkpoint.verify(source.path).manifest.size
    assert proxy.cuts >= 1 and got.resumes >= 1
    assert got.bytes_fetched == size  # resumed: no byte fetched twice
    weights = [r for r in source.service.reads if r[0] == checkpoint.WEIGHTS]
    assert weights[0][1] == 0 and weights[-1][1] > 0  # asked again from where it stopped
    assert checkpoint.verify(got.checkpoint.path).checksum == source.checksum


async def test_a_fetch_given_up_resumes_from_the_parts_it_had(
    source: Source, tmp_path: Path
) -> None:
    dest = tmp_path / "gen"
    proxy = await TcpProxy(source.address).start()
    name = source.path.name
    try:
        proxy.cut_after(120_000, refuse=True)  # and the path stays down
        with pytest.raises(errors.Unavailable, match="gave up after 3 attempts"):
            await fetch(source, dest, proxy.address, streams=1, attempts=3, backoff_s=(0.01,))
        had = json.loads(progress_file(dest, name).read_text())
        kept = plan.done_bytes(
            plan.parse_progress(
                json.dumps(had), source.checksum, checkpoint.verify(source.path).manifest.files
            )
        )
        assert 0 < kept < 120_000 and not (dest / name).exists()
        proxy.accept()
        got = await fetch(source, dest, proxy.address, streams=2)
    finally:
        await proxy.stop()
    size = checkpoint.verify(source.path).manifest.size
    assert got.bytes_fetched == size - kept  # only what it did not have
    assert checkpoint.verify(dest / name).checksum == source.checksum
    assert not partial_dir(dest, name).exists() and not progress_file(dest, name).exists()


async def test_a_corrupt_byte_is_found_and_nothing_is_placed(
    source: Source, tmp_path: Path
) -> None:
    weights = source.path / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # in the tensor data: the header (and so the served manifest) intact
    weights.write_bytes(bytes(data))
    dest = tmp_path / "gen"
    with pytest.raises(checkpoint.CheckpointError) as info:
        await fetch(source, dest)
    assert "model.safetensors: SHA-256 of the fetched bytes differs" in str(info.value)
    assert not (dest / source.path.name).exists()
    # the corrupt file is not trusted next time: its parts are no longer recorded as done
    done = plan.parse_progress(
        progress_file(dest, source.path.name).read_bytes(),
        source.checksum,
        checkpoint.parse_manifest((source.path / "manifest.json").read_bytes()).files,
    )
    assert checkpoint.WEIGHTS not in done


async def test_a_truncated_file_is_refused_by_the_source_naming_it(
    source: Source, tmp_path: Path
) -> None:
    weights = source.path / checkpoint.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(errors.FailedPrecondition) as info:
        await fetch(source, tmp_path / "gen")
    assert "model.safetensors" in str(info.value) and "truncated" in str(info.value)


async def test_a_checkpoint_the_source_lacks_is_not_found_naming_what_it_has(
    source: Source, tmp_path: Path
) -> None:
    c = client(source.address)
    try:
        with pytest.raises(errors.NotFound) as info:
            await fetch_checkpoint(c, tmp_path / "gen", "2", "0" * 64)
    finally:
        await c.close()
    assert source.path.name in str(info.value)


async def test_a_checkpoint_of_another_shape_is_refused_before_its_bytes_move(
    source: Source, tmp_path: Path
) -> None:
    served = llama_config(TinyShape(layers=2, hidden=64, head_dim=32, intermediate=256, vocab=256))
    with pytest.raises(checkpoint.CheckpointError) as info:
        await fetch(source, tmp_path / "gen", expected_config=served)
    assert "model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape" in str(
        info.value
    )
    assert not source.service.reads  # no byte was asked for


async def test_bad_reads_name_the_field(source: Source) -> None:
    channel = grpcutil.insecure_channel(source.address)
    stub = checkpoints_pb2_grpc.CheckpointStoreStub(channel)
    cases = {
        "file": checkpoints_pb2.ReadCheckpointRequest(
            version="1", checksum=source.checksum, file="../../etc/passwd"
        ),
        "offset": checkpoints_pb2.ReadCheckpointRequest(
            version="1", checksum=source.checksum, file="config.json", offset=10**9
        ),
        "checksum": checkpoints_pb2.ReadCheckpointRequest(version="1", checksum="abc"),
        "version": checkpoints_pb2.ReadCheckpointRequest(version="../x", checksum="0" * 64),
        "chunk_bytes": checkpoints_pb2.ReadCheckpointRequest(
            version="1", checksum=source.checksum, file="config.json", chunk_bytes=1 << 30
        ),
    }
    try:
        for field, request in cases.items():
            with pytest.raises(errors.InvalidArgument, match=f"^source: {field}="):
                await grpcutil.call("source", _drain(stub.ReadCheckpoint(request)))
    finally:
        await channel.close()


async def _drain(call: Any) -> None:
    async for _ in call:
        pass

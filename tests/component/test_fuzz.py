"""Fuzzing every method of the three services over real gRPC (seeded; about 7 s here).

Each method of FabricController, NodeAgent, OpticalSwitch and CheckpointStore (an agent's
checkpoints) gets random bytes,
truncated and bit-flipped messages, and messages whose fields hold out-of-range numbers,
unknown enum values, huge repeated fields and long strings (built from the descriptors,
so a new field is fuzzed too). Asserted: no server crashes; no UNKNOWN or INTERNAL status
(an exception that escaped project code); every error answer is under 64 KiB, and so is
every answer on this small cluster (ListNodes aside: it carries each node's newest
telemetry sample as the node sent it); a refused request changes no committed state
(the controller's epoch and circuits, the switch's cross-connects); the controller's
committed circuits still equal its switch's table at the end; and every log line is one
JSON object without a traceback.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node_agent.commands import CommandLog
from node_agent.nics import SysfsNics
from node_agent.servicer import SERVICE_NAME as AGENT_SERVICE
from node_agent.servicer import NodeAgentService
from node_agent.telemetry import Collector
from node_agent.weights.store import SERVICE_NAME as STORE_SERVICE
from node_agent.weights.store import CheckpointDir, CheckpointStoreService
from orchestrrl import grpcutil, limits
from orchestrrl.model import Circuit
from orchestrrl.v1 import checkpoints_pb2, fabric_controller_pb2, node_agent_pb2, optical_switch_pb2
from orchestrrl.v1 import checkpoints_pb2_grpc as ck_grpc
from orchestrrl.v1 import node_agent_pb2_grpc as na_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.harness import Fabric
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs
from sim_backends.tiny_models import TinyShape, write_checkpoint

pytestmark = pytest.mark.component

SEED = 14
CASES_PER_METHOD = 40
ANSWER_LIMIT = 64 * 1024
UNARY_TIMEOUT_S = 5.0
STREAM_WINDOW_S = 0.3  # a server stream is read this long (or 3 messages), then cancelled
PROJECT_FAILURES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SERVICES: list[ServiceDescriptor] = [
    fabric_controller_pb2.DESCRIPTOR.services_by_name["FabricController"],
    node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"],
    optical_switch_pb2.DESCRIPTOR.services_by_name["OpticalSwitch"],
    checkpoints_pb2.DESCRIPTOR.services_by_name["CheckpointStore"],
]


# -- payloads ---------------------------------------------------------------------------

LONG = 1_000_000
STRINGS = [
    "",
    "gen0-n0",  # a real node: reaches deeper paths
    "cmd-1",  # an ordinary id
    "cmd-2",
    "127.0.0.1:1",
    "x" * LONG,
    "é" * 5000,
    "\x00\x01",
    "a:b:c:99999",
    "../../etc/passwd",
    "10.0.0.0/8",
]
DOUBLES = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324, 1e-3]
INT_EXTREMES = {
    FieldDescriptor.CPPTYPE_UINT32: [0, 1, 2, 3, 8, 2**31, 2**32 - 1],
    FieldDescriptor.CPPTYPE_INT32: [0, 1, -1, 2, 8, -(2**31), 2**31 - 1],
    FieldDescriptor.CPPTYPE_UINT64: [0, 1, 2**63, 2**64 - 1],
    FieldDescriptor.CPPTYPE_INT64: [0, -1, -(2**63), 2**63 - 1],
}


def scalar(rng: random.Random, f: FieldDescriptor) -> Any:
    kind = f.cpp_type
    if kind == FieldDescriptor.CPPTYPE_STRING:
        if f.type == FieldDescriptor.TYPE_BYTES:
            return rng.choice([b"", rng.randbytes(rng.randrange(1, 64)), b"\xff" * 1000])
        return rng.choice(STRINGS)
    if kind in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return rng.choice(DOUBLES)
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return rng.choice([*known, 99, -5, 2**31 - 1])  # unknown values too (open enums)
    return rng.choice(INT_EXTREMES[kind])


def fill(rng: random.Random, message: Message, depth: int = 0) -> Message:
    """Set a random choice of the message's fields to hostile or ordinary values."""
    for f in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            continue
        if f.is_repeated:
            huge = rng.random() < 0.15
            if f.message_type is not None:
                count = 20_000 if huge else rng.randrange(0, 4)
                container = getattr(message, f.name)
                for _ in range(count):
                    item = container.add()
                    if not huge and depth < 2:
                        fill(rng, item, depth + 1)
            elif f.type == FieldDescriptor.TYPE_BYTES and f.name == "samples":
                # TelemetryBatch: serialized samples, some of them corrupt
                getattr(message, f.name).extend(telemetry_sample(rng) for _ in range(3))
            else:
                count = 200_000 if huge and f.cpp_type != FieldDescriptor.CPPTYPE_STRING else 3
                value = scalar(rng, f)
                getattr(message, f.name).extend(
                    [value] * count if huge else [scalar(rng, f) for _ in range(count)]
                )
        elif f.message_type is not None:
            if depth < 2:
                fill(rng, getattr(message, f.name), depth + 1)
        else:
            setattr(message, f.name, scalar(rng, f))
    return message


def telemetry_sample(rng: random.Random) -> bytes:
    data = fill(rng, node_agent_pb2.TelemetrySample(), 1).SerializeToString()
    return mutate(rng, data) if rng.random() < 0.3 else data


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Truncate, or flip a few bytes of, a serialized message."""
    if not data:
        return rng.randbytes(8)
    if rng.random() < 0.5:
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def payloads(rng: random.Random, request: Descriptor) -> Iterator[bytes]:
    cls = GetMessageClass(request)
    yield rng.randbytes(rng.randrange(1, 64))
    yield b"\xff" * rng.randrange(1, 16)
    yield rng.randbytes(60_000)
    for k in range(CASES_PER_METHOD - 3):
        data = fill(rng, cls()).SerializeToString()
        yield mutate(rng, data) if k % 3 == 2 else data


# -- the servers ------------------------------------------------------------------------


@dataclass
class Target:
    channel: grpc.aio.Channel
    committed: Callable[[], object]  # state a refused request must leave unchanged
    skip_size_check: frozenset[str] = field(default_factory=frozenset)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[str]:
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1, relayout_delay_s=0.0)
    collector = Collector("gen0-n0", SimulatedGpus(8, seed=1), SysfsNics([], root=tmp_path), engine)
    await collector.open()
    commands = CommandLog()
    servicer = NodeAgentService(collector, engine, commands, default_interval_s=0.05)
    root = tmp_path / "checkpoints"
    write_checkpoint(
        root, "1", TinyShape(layers=1, hidden=64, head_dim=32, intermediate=64, vocab=64)
    )
    store = CheckpointStoreService("gen0-n0", CheckpointDir(root))

    def register(server: Any) -> None:
        na_grpc.add_NodeAgentServicer_to_server(servicer, server)
        ck_grpc.add_CheckpointStoreServicer_to_server(store, server)

    running = await grpcutil.start_server("127.0.0.1:0", register, [AGENT_SERVICE, STORE_SERVICE])
    try:
        yield running.address
    finally:
        await running.stop(grace=0)
        await servicer.close()
        await commands.close()


@pytest.fixture
async def switch() -> AsyncIterator[tuple[str, SimulatedOcs]]:
    running, sim = await serve_ocs("127.0.0.1:0", name="ocs-fuzz", port_count=32)
    try:
        yield running.address, sim
    finally:
        await running.stop(grace=0)


# -- calling ----------------------------------------------------------------------------


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    sizes: list[int]  # of every response message


async def call(
    channel: grpc.aio.Channel, method: str, streaming: tuple[bool, bool], payload: bytes
) -> Answer:
    client_streaming, server_streaming = streaming
    sizes: list[int] = []
    try:
        if server_streaming:
            stream = channel.unary_stream(method)(payload, timeout=UNARY_TIMEOUT_S)
            try:
                async with asyncio.timeout(STREAM_WINDOW_S):
                    async for message in stream:
                        sizes.append(len(message))
                        if len(sizes) == 3:
                            break
            except TimeoutError:
                pass
            finally:
                stream.cancel()
            if stream.done() and not stream.cancelled():
                code = await stream.code()
                return Answer(code, await stream.details() or "", sizes)
            return Answer(grpc.StatusCode.OK, "", sizes)
        if client_streaming:
            # two messages: the payload, then a piece of it. A payload over the servers'
            # receive limit goes alone: the server refuses it (RESOURCE_EXHAUSTED) and
            # cancels the call, and grpc's aio client, still writing the second message,
            # would report its own failed write as INTERNAL "Internal error from Core".
            messages = [payload]
            if len(payload) <= limits.MAX_RECEIVE_BYTES:
                messages.append(payload[: len(payload) // 2])
            try:
                reply = await channel.stream_unary(method)(iter(messages), timeout=UNARY_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                # the server may end the call (refusing the first message) while the
                # client still writes the second: grpc's aio client then reports its own
                # failed write as INTERNAL "Internal error from Core" (seen on a loaded
                # machine). The server's verdict is asked again with the payload alone.
                if exc.code() is not grpc.StatusCode.INTERNAL or len(messages) == 1:
                    raise
                reply = await channel.stream_unary(method)(
                    iter(messages[:1]), timeout=UNARY_TIMEOUT_S
                )
        else:
            reply = await channel.unary_unary(method)(payload, timeout=UNARY_TIMEOUT_S)
        return Answer(grpc.StatusCode.OK, "", [len(reply)])
    except grpc.aio.AioRpcError as exc:
        return Answer(exc.code(), exc.details() or "", sizes)


def ocs_table(fabric: Fabric) -> frozenset[Circuit]:
    return frozenset(
        Circuit(name, a, b) for name, sim in fabric.ocs.items() for a, b in sim.cross_connects()
    )


async def test_every_method_of_every_service_survives_hostile_input(
    fabric: Fabric,
    agent: str,
    switch: tuple[str, SimulatedOcs],
    json_log: io.StringIO,
) -> None:
    rng = random.Random(SEED)
    switch_address, sim = switch
    async with (
        grpcutil.insecure_channel(fabric.address) as controller,
        grpcutil.insecure_channel(agent) as node_agent,
        grpcutil.insecure_channel(switch_address) as optical,
    ):

        def committed() -> object:
            cur = fabric.controller.current
            return (cur.epoch, cur.phase, cur.circuits, ocs_table(fabric))

        targets = {
            "FabricController": Target(controller, committed, frozenset({"ListNodes"})),
            "NodeAgent": Target(node_agent, lambda: None),
            "OpticalSwitch": Target(optical, sim.cross_connects),
            "CheckpointStore": Target(node_agent, lambda: None),
        }
        failures: list[str] = []
        calls = 0
        for service in SERVICES:
            target = targets[service.name]
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                streaming = (method.client_streaming, method.server_streaming)
                for payload in payloads(rng, method.input_type):
                    before = target.committed()
                    answer = await call(target.channel, path, streaming, payload)
                    calls += 1
                    where = f"{path} with {len(payload)} bytes {payload[:24]!r}"
                    if answer.code in PROJECT_FAILURES:
                        failures.append(f"{where}: {answer.code.name}: {answer.details[:300]}")
                    if len(answer.details.encode()) >= ANSWER_LIMIT:
                        failures.append(f"{where}: error answer of {len(answer.details)} chars")
                    too_big = [n for n in answer.sizes if n >= ANSWER_LIMIT]
                    if too_big and method.name not in target.skip_size_check:
                        failures.append(f"{where}: answers of {too_big} bytes")
                    if answer.code is not grpc.StatusCode.OK and target.committed() != before:
                        failures.append(f"{where}: refused ({answer.code.name}) yet changed state")
        assert not failures, "\n".join(failures)
        assert calls == CASES_PER_METHOD * sum(len(s.methods) for s in SERVICES)

        # no crash: every server still answers, and the fabric is what the controller says
        for channel in (controller, node_agent, optical):
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert ocs_table(fabric) == fabric.controller.current.circuits
    entries = [json.loads(line) for line in json_log.getvalue().splitlines()]  # all JSON
    tracebacks = [e for e in entries if "exception" in e]
    assert not tracebacks, tracebacks[:3]

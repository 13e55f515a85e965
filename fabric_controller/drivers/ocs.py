"""OCS drivers behind one Protocol, so simulated and real switches are interchangeable."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from orchestrrl import grpcutil
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc

PortPair = tuple[int, int]


@dataclass(frozen=True)
class OcsInfo:
    name: str
    port_count: int
    switching_time_s: float
    backend: str


class OcsDriver(Protocol):
    """What the controller needs from an optical circuit switch."""

    name: str

    async def info(self) -> OcsInfo: ...

    async def cross_connects(self) -> frozenset[PortPair]:
        """The current table, each pair with a < b."""
        ...

    async def snapshot(self) -> tuple[frozenset[PortPair], frozenset[int]]:
        """The table and the ports whose health is not UP, read at one moment."""
        ...

    async def apply(
        self, disconnect: Iterable[PortPair], connect: Iterable[PortPair], request_id: str = ""
    ) -> frozenset[PortPair]:
        """Apply a batch atomically (disconnects, then connects); return the new table."""
        ...

    async def close(self) -> None: ...


class GrpcOcsDriver:
    """Drives any switch that serves the OpticalSwitch gRPC contract (e.g. orl-sim-ocs)."""

    def __init__(
        self, name: str, address: str, timeout_s: float = 10.0, tls: TlsConfig | None = None
    ) -> None:
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpcutil.channel(address, tls)
        self._stub = pb_grpc.OpticalSwitchStub(self._channel)

    def _what(self, rpc: str) -> str:
        return f"OCS {self.name!r} at {self.address}: {rpc}"

    async def info(self) -> OcsInfo:
        r = await grpcutil.call(
            self._what("GetInfo"), self._stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout_s)
        )
        return OcsInfo(r.name, r.port_count, r.switching_time_s, r.backend)

    async def cross_connects(self) -> frozenset[PortPair]:
        r = await grpcutil.call(
            self._what("ListCrossConnects"),
            self._stub.ListCrossConnects(pb.ListCrossConnectsRequest(), timeout=self.timeout_s),
        )
        return frozenset(_norm(x.a, x.b) for x in r.cross_connects)

    async def snapshot(self) -> tuple[frozenset[PortPair], frozenset[int]]:
        r = await grpcutil.call(
            self._what("ListPorts"),
            self._stub.ListPorts(pb.ListPortsRequest(), timeout=self.timeout_s),
        )
        pairs = frozenset(_norm(p.port, p.peer) for p in r.ports if p.peer)
        down = frozenset(p.port for p in r.ports if p.state != pb.PORT_STATE_UP)
        return pairs, down

    async def apply(
        self, disconnect: Iterable[PortPair], connect: Iterable[PortPair], request_id: str = ""
    ) -> frozenset[PortPair]:
        req = pb.ApplyCrossConnectsRequest(
            disconnect=[pb.CrossConnect(a=a, b=b) for a, b in disconnect],
            connect=[pb.CrossConnect(a=a, b=b) for a, b in connect],
            request_id=request_id,
        )
        r = await grpcutil.call(
            self._what("ApplyCrossConnects"),
            self._stub.ApplyCrossConnects(req, timeout=self.timeout_s),
        )
        return frozenset(_norm(x.a, x.b) for x in r.cross_connects)

    async def close(self) -> None:
        await self._channel.close()


def _norm(a: int, b: int) -> PortPair:
    return (a, b) if a < b else (b, a)

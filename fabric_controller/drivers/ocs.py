"""OCS drivers behind one Protocol, so simulated and real switches are interchangeable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import NoReturn, Protocol, TypeVar

import grpc

from orchestrrl import errors, grpcutil
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc

PortPair = tuple[int, int]
T = TypeVar("T")


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
        self,
        disconnect: Iterable[PortPair],
        connect: Iterable[PortPair],
        request_id: str = "",
        fencing_token: int = 0,
    ) -> frozenset[PortPair]:
        """Apply a batch atomically (disconnects, then connects); return the new table.
        ``fencing_token``: the leader's (controller HA); the switch refuses one older
        than the newest it has seen (FailedPrecondition); 0: no HA."""
        ...

    async def close(self) -> None: ...


class GrpcOcsDriver:
    """Drives any switch that serves the OpticalSwitch gRPC contract (e.g. orl-sim-ocs).

    A call that fails with UNAVAILABLE is tried once more on a fresh channel before the
    driver gives up: after an outage, gRPC keeps a channel in reconnect backoff (up to
    two minutes) and fails calls at once with "Connection refused" although the switch
    listens again; a new channel connects at once. A batch is sent again only with its
    request id (the switch answers a repeat with the first answer, changing nothing)."""

    def __init__(
        self, name: str, address: str, timeout_s: float = 10.0, tls: TlsConfig | None = None
    ) -> None:
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._tls = tls
        self._channel = grpcutil.channel(address, tls)
        self._stub = pb_grpc.OpticalSwitchStub(self._channel)
        # the channel replaced last (closed at the next replacement: calls still on it
        # then are long over) and how many times a fresh channel was opened
        self._retired: grpc.aio.Channel | None = None
        self.reconnects = 0

    def _what(self, rpc: str) -> str:
        return f"OCS {self.name!r} at {self.address}: {rpc}"

    async def _reopen(self) -> None:
        if self._retired is not None:
            await self._retired.close()
        self._retired = self._channel
        self._channel = grpcutil.channel(self.address, self._tls, own_connection=True)
        self._stub = pb_grpc.OpticalSwitchStub(self._channel)
        self.reconnects += 1

    async def _call(
        self,
        rpc: str,
        send: Callable[[pb_grpc.OpticalSwitchStub], Awaitable[T]],
        retry: bool = True,
    ) -> T:
        """``send(stub)``; on UNAVAILABLE (and ``retry``) once more on a fresh channel."""
        channel = self._channel
        try:
            return await send(self._stub)
        except grpc.aio.AioRpcError as exc:
            if not retry or exc.code() != grpc.StatusCode.UNAVAILABLE:
                return await grpcutil.call(self._what(rpc), _raise(exc))
        if self._channel is channel:  # (a concurrent call may have replaced it already)
            await self._reopen()
        return await grpcutil.call(self._what(rpc), send(self._stub))

    async def info(self) -> OcsInfo:
        r = await self._call(
            "GetInfo", lambda stub: stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout_s)
        )
        return OcsInfo(r.name, r.port_count, r.switching_time_s, r.backend)

    async def _list(self) -> pb.ListCrossConnectsResponse:
        r: pb.ListCrossConnectsResponse = await self._call(
            "ListCrossConnects",
            lambda stub: stub.ListCrossConnects(
                pb.ListCrossConnectsRequest(packed=True), timeout=self.timeout_s
            ),
        )
        return r

    async def cross_connects(self) -> frozenset[PortPair]:
        return _table(await self._list())

    async def snapshot(self) -> tuple[frozenset[PortPair], frozenset[int]]:
        """One ListCrossConnects: the table and the ports that are not UP (the switch
        reports both at one moment), without listing every port as ListPorts does."""
        r = await self._list()
        return _table(r), frozenset(r.down_ports)

    async def apply(
        self,
        disconnect: Iterable[PortPair],
        connect: Iterable[PortPair],
        request_id: str = "",
        fencing_token: int = 0,
    ) -> frozenset[PortPair]:
        req = pb.ApplyCrossConnectsRequest(
            request_id=request_id,
            fencing_token=fencing_token,
            disconnect_pairs=list(chain.from_iterable(disconnect)),  # packed: no message
            connect_pairs=list(chain.from_iterable(connect)),  # per circuit, both ways
            packed=True,
        )
        r = await self._call(
            "ApplyCrossConnects",
            lambda stub: stub.ApplyCrossConnects(req, timeout=self.timeout_s),
            retry=bool(request_id),
        )
        return _table(r)

    async def close(self) -> None:
        if self._retired is not None:
            await self._retired.close()
            self._retired = None
        await self._channel.close()


async def _raise(exc: BaseException) -> NoReturn:
    raise exc


def _table(r: pb.ListCrossConnectsResponse | pb.ApplyCrossConnectsResponse) -> frozenset[PortPair]:
    """The cross-connects of an answer (packed, or one message each), each with a < b."""
    ports = list(r.pairs)
    if len(ports) % 2:
        raise errors.FailedPrecondition(
            f"the OCS answered an odd number of packed ports ({len(ports)}): not port pairs"
        )
    pairs = list(zip(ports[0::2], ports[1::2], strict=True))
    if not all(map(int.__lt__, ports[0::2], ports[1::2])):
        pairs = [(a, b) if a < b else (b, a) for a, b in pairs]
    pairs += [(x.a, x.b) if x.a < x.b else (x.b, x.a) for x in r.cross_connects]
    return frozenset(pairs)

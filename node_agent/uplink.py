"""The agent's link to the fabric controller: register, then heartbeat and stream telemetry.

Any failure (controller unreachable, stream broken, session unknown after a controller
restart) ends the session; the uplink logs why, backs off with jitter and registers
again. A controller that rejects the registration (node not in its wiring) is retried at
the longest backoff, since an operator may fix the wiring. The agent keeps serving its
own NodeAgent service throughout.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc

from node_agent import convert
from node_agent.telemetry import Collector
from orchestrrl import errors
from orchestrrl.grpcutil import call, channel
from orchestrrl.logs import get_logger
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import fabric_controller_pb2, fabric_controller_pb2_grpc

log = get_logger("node_agent.uplink")


@dataclass(frozen=True)
class UplinkSettings:
    rpc_timeout_s: float = 5.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    min_heartbeat_interval_s: float = 0.05


class Backoff:
    """Exponential backoff with jitter: each delay is drawn from [d/2, d], d doubling."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    def next(self) -> float:
        ceiling = min(self._max_s, self._initial_s * 2.0**self._attempt)
        self._attempt += 1
        return self._jitter(ceiling)

    def longest(self) -> float:
        return self._jitter(self._max_s)

    def reset(self) -> None:
        self._attempt = 0

    def _jitter(self, ceiling: float) -> float:
        return self._rng.uniform(ceiling / 2.0, ceiling)


class RegistrationRejected(errors.OrlError):
    """The controller refused the registration (NOT_FOUND or INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Session:
    controller: str
    session_id: str
    heartbeat_interval_s: float


class Uplink:
    """Keeps a registered session with the controller for as long as :meth:`run` runs."""

    def __init__(
        self,
        collector: Collector,
        agent_address: str,
        controller: str | Callable[[], str],
        telemetry_interval_s: float,
        *,
        settings: UplinkSettings | None = None,
        rng: random.Random | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self._tls = tls
        self._collector = collector
        self._agent_address = agent_address
        self._controller = controller if callable(controller) else (lambda: controller)
        self._telemetry_interval_s = telemetry_interval_s
        self._settings = settings or UplinkSettings()
        self._backoff = Backoff(self._settings.backoff_initial_s, self._settings.backoff_max_s, rng)
        self.session: Session | None = None

    async def run(self) -> None:
        """Register and keep the session alive until cancelled; never returns otherwise."""
        failures = 0
        while True:
            address = self._controller()
            try:
                async with channel(address, self._tls) as ch:
                    stub = cast(
                        "fabric_controller_pb2_grpc.FabricControllerAsyncStub",
                        fabric_controller_pb2_grpc.FabricControllerStub(ch),
                    )
                    session = await self._register(stub, address)
                    await self._keep_alive(stub, session)
            except RegistrationRejected as exc:
                failures += 1
                delay = self._backoff.longest()
                log.error(
                    "controller_rejected_registration",
                    controller=address,
                    reason=str(exc),
                    retry_in_s=round(delay, 3),
                    hint="check that this node is in the controller's wiring file",
                )
            except errors.InvalidArgument as exc:  # our own address check, before any call
                failures += 1
                delay = self._backoff.longest()
                log.error("controller_address_invalid", controller=address, reason=str(exc))
            except Exception as exc:
                failures += 1
                delay = self._backoff.next()
                log.warning(
                    "controller_session_lost" if self.session else "controller_unreachable",
                    controller=address,
                    reason=_reason(exc),
                    failures=failures,
                    retry_in_s=round(delay, 3),
                )
            self.session = None
            await asyncio.sleep(delay)

    async def _register(
        self, stub: fabric_controller_pb2_grpc.FabricControllerAsyncStub, address: str
    ) -> Session:
        request = fabric_controller_pb2.RegisterRequest(
            node=self._collector.node,
            agent_address=self._agent_address,
            status=convert.status_to_pb(self._collector.status()),
        )
        try:
            response = await call(
                f"Register with the controller at {address}",
                stub.Register(request, timeout=self._settings.rpc_timeout_s),
            )
        except (errors.NotFound, errors.InvalidArgument) as exc:
            raise RegistrationRejected(str(exc)) from None
        interval = response.heartbeat_interval_s
        if not (math.isfinite(interval) and interval >= self._settings.min_heartbeat_interval_s):
            log.warning(
                "controller_heartbeat_interval_clamped",
                heartbeat_interval_s=interval,
                using_s=self._settings.min_heartbeat_interval_s,
            )
            interval = self._settings.min_heartbeat_interval_s
        self.session = Session(address, response.session_id, interval)
        log.info(
            "registered",
            controller=address,
            session_id=response.session_id,
            agent_address=self._agent_address,
            heartbeat_interval_s=interval,
            epoch=response.epoch,
        )
        return self.session

    async def _keep_alive(
        self, stub: fabric_controller_pb2_grpc.FabricControllerAsyncStub, session: Session
    ) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats(stub, session))
            tg.create_task(self._report_telemetry(stub))

    async def _heartbeats(
        self, stub: fabric_controller_pb2_grpc.FabricControllerAsyncStub, session: Session
    ) -> None:
        request = fabric_controller_pb2.HeartbeatRequest(
            node=self._collector.node, session_id=session.session_id
        )
        while True:
            await asyncio.sleep(session.heartbeat_interval_s)
            await call("Heartbeat", stub.Heartbeat(request, timeout=self._settings.rpc_timeout_s))
            self._backoff.reset()  # a session that has heartbeated once counts as healthy

    async def _report_telemetry(
        self, stub: fabric_controller_pb2_grpc.FabricControllerAsyncStub
    ) -> None:
        # A long-lived client stream: no deadline; channel keepalives and heartbeats watch it.
        stream = stub.ReportTelemetry(None)
        try:
            async for sample in self._collector.every(self._telemetry_interval_s):
                try:
                    await call("ReportTelemetry", stream.write(convert.telemetry_to_pb(sample)))
                except asyncio.InvalidStateError:
                    raise errors.Unavailable(
                        "ReportTelemetry: the controller closed the telemetry stream"
                    ) from None
        finally:
            stream.cancel()


def _reason(exc: BaseException) -> str:
    """The first leaf of an exception group, rendered for a person."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, errors.OrlError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""The agent's link to the fabric controller: register, then heartbeat and stream telemetry.

Telemetry is sampled at a fixed rate whether or not the controller is there: samples go
into a bounded buffer (:class:`TelemetryBuffer`) and the session sends from its head,
so after an outage the samples taken while away arrive first, oldest first. A full
buffer drops its oldest sample and counts it (logged, and on /metrics).

Samples are uploaded in batches (``ReportTelemetryBatch``): every ``flush_interval_s``
(rounded to a whole number of sampling intervals) the buffered samples go up as one
message, so the per-message cost of gRPC is paid once per flush instead of once per
sample (at 10 Hz and the default 1 s: a tenth). The sample that closes a flush also
carries the engine's per-request progress (``has_progress``; its cost grows with the
requests in flight) and is what the GPU and RDMA gauges of /metrics show (set from it
when scraped). A flush interval of 0 sends every sample as it is taken, each with
progress. A backlog goes up in batches of at most ``UplinkSettings.max_batch_samples``,
each ending on a sample with progress where it has one.

The sources are read at every sampling interval; the readings of an upload are decoded
into samples (NIC counters parsed, rates computed) together, when the upload's last
reading is taken and they go into the buffer (see :class:`~node_agent.telemetry.Collector`).

The telemetry stream counts as liveness at the controller (each upload refreshes the
node's last-seen time), so a heartbeat is sent only when no upload has reached the
controller for a heartbeat interval: a unary call costs about as much CPU here as the
whole second of sampling. The heartbeat waits on a timer that every upload pushes back
(nothing wakes while uploads flow); it is due one heartbeat interval after the last
upload or heartbeat, plus half a sampling interval (at most half a heartbeat interval)
so that uploads as frequent as heartbeats, which complete a few milliseconds either
side of that interval, never race it. Session loss is still noticed: a controller that
lost the session rejects the upload (the stream ends and the agent registers again),
and a wedged one stops taking uploads, so the heartbeats resume and time out.

Any failure (controller unreachable, stream broken, session unknown after a controller
restart) ends the session; the uplink logs why, backs off with jitter and registers
again. A controller that rejects the registration (node not in its wiring) is retried at
the longest backoff, since an operator may fix the wiring. The agent keeps serving its
own NodeAgent service throughout.

The controller may be an HA group: a list of addresses, of which one leads. A standby
answers Register, Heartbeat and the telemetry stream with UNAVAILABLE naming the leader
(:mod:`orchestrrl.leader`); the uplink then registers with that leader at once (at most
``len(addresses) + 2`` such redirects in a row, then it backs off). A controller that
cannot be reached, or a standby that knows no leader, sends the next registration to the
next address of the list, after the usual backoff. Samples stay buffered across all of
it (a sample leaves the buffer only once written to a stream), so a failover loses no
more than an outage of the same length.

A controller that hangs (frozen, partitioned: issue 28) holds the agent about a second
or two, not 20 s: a registration goes to the list's current address first and, when that
fails or has not answered within ``attempt_timeout_s``, to every other address at once
(the first that accepts wins); an attempt gets ``connect_timeout_s`` to connect; and every
connection to a controller is a :func:`orchestrrl.leader.channel`, whose HTTP/2 pings
(after ``keepalive_s`` of silence) close it when the controller stops answering, so an
open telemetry stream to a frozen leader breaks and the agent registers with the new one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from node_agent import convert
from node_agent.metrics import AgentMetrics
from node_agent.nics import NicRates
from node_agent.telemetry import Collector, Reading, Telemetry, set_done, ticks
from orchestrrl import errors, leader
from orchestrrl.leader import call
from orchestrrl.logs import get_logger
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import fabric_controller_pb2, fabric_controller_pb2_grpc

log = get_logger("node_agent.uplink")

DEFAULT_BUFFER_SAMPLES = 600  # 10 minutes at the default 1 s interval
DEFAULT_FLUSH_INTERVAL_S = 1.0
MAX_FLUSH_INTERVAL_S = 60.0


def check_flush_interval(value: float, field: str) -> float:
    """Seconds between uploads: 0 (every sample) .. MAX_FLUSH_INTERVAL_S."""
    if not 0.0 <= value <= MAX_FLUSH_INTERVAL_S:
        raise errors.field_error(
            field,
            value,
            f"must be between 0 (send every sample) and {MAX_FLUSH_INTERVAL_S:g} seconds",
        )
    return value


def samples_per_flush(telemetry_interval_s: float, flush_interval_s: float) -> int:
    """Samples per upload: the flush interval in whole sampling intervals, at least 1."""
    return max(1, round(flush_interval_s / telemetry_interval_s))


@dataclass(frozen=True)
class UplinkSettings:
    # per attempt, well under the controllers' 2 s lease (issue 28): a unary call's
    # deadline, the connect deadline, and when a silent controller's registration is hedged
    rpc_timeout_s: float = 2.0
    connect_timeout_s: float = leader.CONNECT_TIMEOUT_S
    attempt_timeout_s: float = 1.0
    # the telemetry stream to a frozen leader breaks within this plus leader.PING_TIMEOUT_S;
    # the stream is always open, so it pings at this rate: 1 s doubled the agent's wake-ups
    # (bench/agent_overhead.py: 30 -> 59 a second, +0.1 % of a core), 3 s costs a third
    keepalive_s: float = 3.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    min_heartbeat_interval_s: float = 0.05
    max_batch_samples: int = 100  # per TelemetryBatch message when sending a backlog


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


class TelemetryBuffer:
    """Samples waiting for the controller, oldest first; full, it drops the oldest.

    A sample put with ``flush=True`` closes an upload: :meth:`batch` hands out the
    samples up to the newest such one. The ``samples_buffered`` gauge is updated at such
    puts and when samples are sent (once per upload, not at every sample)."""

    def __init__(self, capacity: int, metrics: AgentMetrics | None = None) -> None:
        if capacity < 1:
            raise errors.field_error("telemetry_buffer", capacity, "must be at least 1 sample")
        self.capacity = capacity
        self.dropped = 0  # since the agent started
        self.dropped_unreported = 0  # since the last report (see take_drop_report)
        self._items: collections.deque[Telemetry] = collections.deque()
        self._flush_marks: collections.deque[bool] = collections.deque()  # parallel to _items
        self._flushable = 0  # items up to and including the newest flush mark
        self._ready = asyncio.Event()
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self._items)

    def put(self, sample: Telemetry, flush: bool = True) -> None:
        if len(self._items) >= self.capacity:
            self._pop()
            self.dropped += 1
            self.dropped_unreported += 1
            if self.dropped_unreported == 1:
                log.warning(
                    "telemetry_buffer_full",
                    capacity=self.capacity,
                    effect="dropping the oldest samples until the controller is back",
                )
            if self._metrics is not None:
                self._metrics.samples_dropped.inc()
        self._items.append(sample)
        self._flush_marks.append(flush)
        if flush:  # the gauge follows the uploads: no /metrics work at every sample
            self._flushable = len(self._items)
            self._ready.set()
            self._gauge()

    async def head(self) -> Telemetry:
        """The oldest sample, waiting for one to be flushable; it stays buffered until
        :meth:`sent`."""
        return (await self.batch(1))[0]

    async def batch(self, max_samples: int) -> list[Telemetry]:
        """The oldest samples up to the newest flush mark (waiting for one), at most
        ``max_samples``, cut after the last flush mark among them when there is one; they
        stay buffered until :meth:`sent`."""
        while not self._flushable:
            self._ready.clear()
            await self._ready.wait()
        count = min(max_samples, self._flushable)
        if count < self._flushable:
            marks = self._flush_marks
            last = max((i for i in range(count) if marks[i]), default=-1)
            count = last + 1 if last >= 0 else count
        return [self._items[i] for i in range(count)]

    def sent(self, samples: Telemetry | list[Telemetry]) -> None:
        """``samples`` (from the head) reached the stream; drop those still buffered (the
        oldest may have been dropped meanwhile)."""
        for sample in [samples] if isinstance(samples, Telemetry) else samples:
            if self._items and self._items[0] is sample:
                self._pop()
        self._gauge()

    def _pop(self) -> None:
        self._items.popleft()
        self._flush_marks.popleft()
        self._flushable = max(0, self._flushable - 1)

    def take_drop_report(self) -> int:
        dropped, self.dropped_unreported = self.dropped_unreported, 0
        return dropped

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.samples_buffered.set(len(self._items))


class RegistrationRejected(errors.OrlError):
    """The controller refused the registration (NOT_FOUND, INVALID_ARGUMENT, or
    FAILED_PRECONDITION: another node's agent holds this agent's address)."""


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
        controller: str | Sequence[str] | Callable[[], str | Sequence[str]],
        telemetry_interval_s: float,
        *,
        settings: UplinkSettings | None = None,
        rng: random.Random | None = None,
        tls: TlsConfig | None = None,
        buffer_samples: int = DEFAULT_BUFFER_SAMPLES,
        metrics: AgentMetrics | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    ) -> None:
        self._tls = tls
        self.metrics = metrics or AgentMetrics()
        self.buffer = TelemetryBuffer(buffer_samples, self.metrics)
        self._collector = collector
        self._agent_address = agent_address
        self._controller = controller if callable(controller) else (lambda: controller)
        self._telemetry_interval_s = telemetry_interval_s
        self.flush_interval_s = flush_interval_s  # a new value applies from the next sample
        self._since_flush = 0
        # The session's heartbeat timer (see _heartbeats): every upload re-arms it
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._heartbeat_due: asyncio.Future[None] | None = None
        self._heartbeat_after_s = 0.0  # from the last upload or heartbeat
        self._healthy_at: float | None = None  # loop time from which an upload resets backoff
        self._settings = settings or UplinkSettings()
        self._backoff = Backoff(self._settings.backoff_initial_s, self._settings.backoff_max_s, rng)
        self.session: Session | None = None
        # An HA group of controllers (see the module docstring): the leader a standby named,
        # the redirects followed in a row, and the position in the list of addresses
        self._leader: str | None = None
        self._redirects = 0
        self._index = 0

    @property
    def telemetry_interval_s(self) -> float:
        return self._telemetry_interval_s

    @telemetry_interval_s.setter
    def telemetry_interval_s(self, value: float) -> None:
        """A new interval (config reload) applies from the next sample."""
        self._telemetry_interval_s = value

    async def run(self) -> None:
        """Sample telemetry, and register and keep the session alive, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._sample_forever())
            tg.create_task(self._sessions())

    async def _sample_forever(self) -> None:
        # An upload's readings are decoded together when the last is taken (see Collector)
        readings: list[Reading] = []
        rates = NicRates()
        async for _ in ticks(lambda: self._telemetry_interval_s):
            # the first sample closes an upload, then every samples_per_flush-th
            flush = self._since_flush == 0
            self._since_flush += 1
            if self._since_flush >= samples_per_flush(
                self._telemetry_interval_s, self.flush_interval_s
            ):
                self._since_flush = 0
            try:
                readings.append(await self._collector.read(progress=flush))
            except Exception as exc:  # a broken reading must not stop the agent
                log.warning("telemetry_sample_failed", reason=_reason(exc))
                self._since_flush = 0  # the next sample closes the upload instead
                continue
            if flush:
                self._buffer(readings, rates)
                readings.clear()

    def _buffer(self, readings: list[Reading], rates: NicRates) -> None:
        """Decode ``readings`` into the buffer, the last closing an upload."""
        samples = []
        for reading in readings:
            try:
                samples.append(self._collector.telemetry(reading, rates))
            except Exception as exc:  # a broken reading must not stop the agent
                log.warning("telemetry_sample_failed", reason=_reason(exc))
        if not samples:
            return
        *earlier, last = samples
        for sample in earlier:
            self.buffer.put(sample, flush=False)
        self.buffer.put(last)
        self.metrics.observe_gpus(last.gpus)
        self.metrics.observe_rdma(last.rdma)

    async def _sessions(self) -> None:
        failures = 0
        while True:
            given = self._controller()
            address = given if isinstance(given, str) else ",".join(given)
            addresses: tuple[str, ...] = ()
            try:
                addresses = leader.parse_addresses(given, "controller")
                address = self._leader or addresses[self._index % len(addresses)]
                address, ch, session = await self._register_hedged(address, addresses)
                async with ch:
                    self._redirects = 0
                    stub = cast(
                        "fabric_controller_pb2_grpc.FabricControllerAsyncStub",
                        fabric_controller_pb2_grpc.FabricControllerStub(ch),
                    )
                    await self._keep_alive(stub, session)
            except RegistrationRejected as exc:
                failures += 1
                delay = self._backoff.longest()
                log.error(
                    "controller_rejected_registration",
                    controller=address,
                    reason=str(exc),
                    retry_in_s=round(delay, 3),
                    hint="check that this node is in the controller's wiring file and that "
                    "no other node's agent is configured with this agent's address",
                )
            except errors.InvalidArgument as exc:  # our own address check, before any call
                failures += 1
                delay = self._backoff.longest()
                log.error("controller_address_invalid", controller=address, reason=str(exc))
            except Exception as exc:
                failures += 1
                named = self._redirect_to(exc, address, addresses)
                if named is not None:
                    delay = 0.0
                    log.info(
                        "controller_redirect",
                        standby=address,
                        leader=named,
                        redirects=self._redirects,
                        session_lost=self.session is not None,
                    )
                else:
                    self._leader = None  # the next address of the list, after the backoff
                    self._redirects = 0
                    self._index = (
                        addresses.index(address) if address in addresses else self._index
                    ) + 1
                    delay = self._backoff.next()
                    log.warning(
                        "controller_session_lost" if self.session else "controller_unreachable",
                        controller=address,
                        reason=_reason(exc),
                        failures=failures,
                        retry_in_s=round(delay, 3),
                        next=addresses[self._index % len(addresses)] if addresses else None,
                    )
            if self.session is not None:
                self.metrics.reconnects.inc()
            self.session = None
            self.metrics.registered.set(0)
            await asyncio.sleep(delay)

    async def _register_hedged(
        self, first: str, addresses: tuple[str, ...]
    ) -> tuple[str, grpc.aio.Channel, Session]:
        """Register with ``first``; when it fails or has not answered within the attempt
        timeout, with every other address at once too (a frozen or partitioned leader holds
        the agent no longer: issue 28); a standby naming a leader sends a registration
        there at once. The first controller that accepts wins: its address, its channel
        (the caller closes it) and the session. Raises ``RegistrationRejected`` when a
        controller refuses this node, else the last failure once every address failed."""
        s = self._settings
        loop = asyncio.get_running_loop()
        connect_s = s.connect_timeout_s if len(addresses) > 1 else None
        attempts: dict[asyncio.Task[Any], tuple[str, grpc.aio.Channel]] = {}
        tried: set[str] = set()
        failed: list[BaseException] = []

        def launch(address: str) -> None:
            ch = leader.channel(
                address, self._tls, keepalive_s=s.keepalive_s, watched=len(addresses) > 1
            )
            stub = fabric_controller_pb2_grpc.FabricControllerStub(ch)
            coro = leader.attempt(
                ch,
                f"Register with the controller at {address}",
                stub.Register(self._register_request(), timeout=s.rpc_timeout_s),
                connect_s,
            )
            attempts[asyncio.ensure_future(coro)] = (address, ch)
            tried.add(address)

        launch(first)
        hedge_at = loop.time() + s.attempt_timeout_s
        try:
            while True:
                untried = [a for a in addresses if a not in tried]
                if untried and (not attempts or loop.time() >= hedge_at):
                    log.info(
                        "controller_hedge",
                        silent=", ".join(a for a, _ in attempts.values()) or None,
                        failed=len(failed),
                        next=", ".join(untried),
                    )
                    for a in untried:
                        launch(a)
                    hedge_at = loop.time() + s.attempt_timeout_s
                    untried = []
                if not attempts:
                    break
                timeout = max(0.0, hedge_at - loop.time()) if untried else None
                done, _ = await asyncio.wait(
                    attempts, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    address, ch = attempts.pop(task)
                    try:
                        response = task.result()
                    except (
                        errors.NotFound,  # not in the wiring
                        errors.InvalidArgument,
                        errors.FailedPrecondition,  # another node's agent holds our address
                    ) as exc:
                        await ch.close()
                        raise RegistrationRejected(str(exc)) from None
                    except Exception as exc:
                        await ch.close()
                        named = self._redirect_to(exc, address, addresses)
                        if named is not None and named not in tried:
                            log.info(
                                "controller_redirect",
                                standby=address,
                                leader=named,
                                redirects=self._redirects,
                                session_lost=False,
                            )
                            launch(named)
                        else:
                            failed.append(exc)
                        continue
                    return address, ch, self._registered(address, response)
        finally:
            for task, (_, ch) in attempts.items():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await ch.close()
        self._leader = None  # (every redirect was tried: start from the list again)
        raise failed[-1] if failed else errors.Unavailable("Register: no controller to ask")

    def _redirect_to(
        self, exc: BaseException, address: str, addresses: tuple[str, ...]
    ) -> str | None:
        """The leader to register with next when ``exc`` is a standby's answer naming one
        (and the redirects in a row are within bounds), else None."""
        leaf = _leaf(exc)
        named = leaf.leader if isinstance(leaf, leader.NotLeader) else None
        if named is None or named == address or self._redirects >= len(addresses) + 2:
            return None
        self._redirects += 1
        self._leader = named
        return named

    def _register_request(self) -> fabric_controller_pb2.RegisterRequest:
        return fabric_controller_pb2.RegisterRequest(
            node=self._collector.node,
            agent_address=self._agent_address,
            status=convert.status_to_pb(self._collector.status()),
        )

    def _registered(
        self, address: str, response: fabric_controller_pb2.RegisterResponse
    ) -> Session:
        """The session the controller at ``address`` granted."""
        interval = response.heartbeat_interval_s
        if not (math.isfinite(interval) and interval >= self._settings.min_heartbeat_interval_s):
            log.warning(
                "controller_heartbeat_interval_clamped",
                heartbeat_interval_s=interval,
                using_s=self._settings.min_heartbeat_interval_s,
            )
            interval = self._settings.min_heartbeat_interval_s
        self.session = Session(address, response.session_id, interval)
        self.metrics.registered.set(1)
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
        loop = asyncio.get_running_loop()
        interval = session.heartbeat_interval_s
        self._heartbeat_after_s = interval + min(self._telemetry_interval_s, interval) / 2
        # a session that proved liveness after a heartbeat interval counts as healthy
        self._healthy_at = loop.time() + interval
        try:
            while True:
                due = self._heartbeat_due = loop.create_future()
                self._heartbeat_timer = self._heartbeat_timer_for(due)
                await due  # no upload reached the controller for the interval
                await call(
                    "Heartbeat", stub.Heartbeat(request, timeout=self._settings.rpc_timeout_s)
                )
                self._backoff.reset()  # a session that has heartbeated once counts as healthy
                self._heartbeat_timer.cancel()  # an upload may have re-armed it meanwhile
        finally:
            if self._heartbeat_timer is not None:
                self._heartbeat_timer.cancel()
            self._heartbeat_timer = self._heartbeat_due = None

    def _uploaded(self) -> None:
        """An upload reached the controller: the next heartbeat is due a heartbeat interval
        from now (the timer is moved, so nothing wakes while uploads flow)."""
        timer, due = self._heartbeat_timer, self._heartbeat_due
        if timer is None or due is None:  # no session's heartbeats running
            return
        timer.cancel()
        # (a heartbeat in flight has its future done: this timer then does nothing)
        self._heartbeat_timer = self._heartbeat_timer_for(due)
        if self._healthy_at is not None and asyncio.get_running_loop().time() >= self._healthy_at:
            self._healthy_at = None  # once per session
            self._backoff.reset()

    def _heartbeat_timer_for(self, due: asyncio.Future[None]) -> asyncio.TimerHandle:
        """A timer that completes ``due`` a heartbeat interval from now (see
        ``_heartbeat_after_s``)."""
        return asyncio.get_running_loop().call_later(self._heartbeat_after_s, set_done, due)

    async def _report_telemetry(
        self, stub: fabric_controller_pb2_grpc.FabricControllerAsyncStub
    ) -> None:
        # A long-lived client stream: no deadline; channel keepalives and heartbeats watch it.
        stream = stub.ReportTelemetryBatch(None)
        dropped = self.buffer.take_drop_report()
        usual = samples_per_flush(self._telemetry_interval_s, self.flush_interval_s)
        if dropped or len(self.buffer) > usual:  # more than one upload's worth waited
            log.info(
                "telemetry_backlog_sending",
                buffered=len(self.buffer),
                dropped_while_away=dropped,
                dropped_total=self.buffer.dropped,
            )
        try:
            while True:
                batch = await self.buffer.batch(self._settings.max_batch_samples)
                message = convert.telemetry_batch_to_pb(batch)
                try:
                    await call("ReportTelemetryBatch", stream.write(message))
                except asyncio.InvalidStateError:
                    # the stream has ended: its status says why (a standby names the leader)
                    async with asyncio.timeout(self._settings.rpc_timeout_s):
                        await call("ReportTelemetryBatch", _ended(stream))
                    raise errors.Unavailable(
                        "ReportTelemetryBatch: the controller closed the telemetry stream"
                    ) from None
                self.buffer.sent(batch)
                self._uploaded()
                self.metrics.samples_sent.inc(len(batch))
        finally:
            stream.cancel()


async def _ended(stream: object) -> object:
    """The outcome of an ended client stream: its response, or its status raised."""
    return await cast("asyncio.Future[object]", stream)


def _leaf(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (``exc`` itself when not a group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _reason(exc: BaseException) -> str:
    """The first leaf of an exception group, rendered for a person."""
    exc = _leaf(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, errors.OrlError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""gRPC plumbing shared by the daemons and clients: servers with health and
reflection, readiness handshake, domain-error to status mapping, channels."""

from __future__ import annotations

import asyncio
import functools
import inspect
import ipaddress
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from orchestrrl import errors, limits
from orchestrrl.logs import get_logger
from orchestrrl.tls import TlsConfig

log = get_logger("orchestrrl.grpc")

STATUS_OF: dict[type[errors.OrlError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

ERROR_OF: dict[grpc.StatusCode, type[errors.OrlError]] = {v: k for k, v in STATUS_OF.items()}

# Keep channels healthy across idle periods between RL phases.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


# gRPC core's default soft limit of calls waiting for the server to pick them up.
PENDING_REQUESTS_DEFAULT = 1000


def parse_address(value: str, field: str) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` for IPv6); port 0 means 'any free port'."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise errors.field_error(field, value, "expected HOST:PORT, e.g. 127.0.0.1:50051")
    port = int(port_text)
    if port > 65535:
        raise errors.field_error(field, value, "port must be 0..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise errors.field_error(
                field, value, "bracketed host must be an IPv6 address"
            ) from None
    elif not all(c.isalnum() or c in ".-_" for c in host):
        raise errors.field_error(field, value, "host must be a name or an IP address")
    return host, port


def domain_errors_to_status(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method: domain errors become ``context.abort`` with their message.

    Works for unary methods (coroutines) and server-streaming methods (async generators).
    """

    async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: errors.OrlError) -> None:
        code = next(
            (c for klass, c in STATUS_OF.items() if isinstance(exc, klass)),
            grpc.StatusCode.INTERNAL,
        )
        await context.abort(code, errors.bounded(str(exc)))

    if _is_async_gen(func):

        @functools.wraps(func)
        async def gen_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in func(self, request, context):
                    yield item
            except errors.OrlError as exc:
                await abort(context, exc)

        return gen_wrapper

    @functools.wraps(func)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await func(self, request, context)
        except errors.OrlError as exc:
            await abort(context, exc)

    return wrapper


def _is_async_gen(func: Callable[..., Any]) -> bool:
    return inspect.isasyncgenfunction(func)


T = TypeVar("T")


async def call(what: str, coro: Awaitable[T]) -> T:
    """Await a client call; turn an RpcError into the matching domain error naming ``what``."""
    try:
        return await coro
    except grpc.aio.AioRpcError as exc:
        klass = ERROR_OF.get(exc.code(), errors.Unavailable)
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise errors.Unavailable(f"{what}: {exc.code().name}: {exc.details()}") from None
        raise klass(f"{what}: {exc.details()}") from None


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc's asyncio health servicer, with ``List`` (grpc.health.v1): the library's
    servicer has ``Check`` and ``Watch`` but inherits ``List`` from the generated base, a
    plain function that raises NotImplementedError. Being synchronous it also escaped
    ``guard_handler``, so a request that did not decode got UNKNOWN and a traceback; this
    ``List`` is a coroutine like the others, guarded like them."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # every service set so far, "" included
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in sorted(statuses.items())
            }
        )


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str
    service_names: tuple[str, ...]

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful shutdown: health NOT_SERVING first, then drain in-flight calls."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


# HTTP/2 bandwidth-delay probing (a PING with every burst of data received, to size the
# flow-control window) is for bulk transfers; every message of these services is small (a
# telemetry batch, a command), and on an agent's stream the server's PING per upload woke
# the agent's gRPC threads: without it their CPU halved (about 0.15 -> 0.07 % of one core
# in bench/agent_overhead.py).
SERVER_ONLY_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.http2.bdp_probe", 0),
    # accept the keepalive pings of CHANNEL_OPTIONS (every 30 s, also between calls): with
    # gRPC's default (5 minutes) a server answers the third with GOAWAY "too_many_pings",
    # and the next call of an idle controller->agent channel failed UNAVAILABLE
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def server_options(clients: int) -> list[tuple[str, Any]]:
    """Channel options of a server that ``clients`` peers may call at one instant."""
    options = CHANNEL_OPTIONS + SERVER_ONLY_OPTIONS
    if 2 * clients > PENDING_REQUESTS_DEFAULT:
        options += [
            ("grpc.server.max_pending_requests", 2 * clients),
            ("grpc.server.max_pending_requests_hard_limit", 4 * clients),
        ]
    return options


async def start_server(
    listen: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    tls: TlsConfig | None = None,
    clients: int = 0,
    max_receive_bytes: int = limits.MAX_RECEIVE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
) -> RunningServer:
    """Start a grpc.aio server with the standard health service and reflection;
    mutual TLS when ``tls`` is given, plaintext otherwise.

    ``clients``: how many peers may open calls at one instant (the controller: every
    agent after a restart). gRPC core starts refusing new calls at random (CANCELLED)
    once more than 1000 wait to be picked up by the server (``max_pending_requests``,
    random early detection up to a hard limit of 3000); the asyncio server picks them up
    one at a time, so a storm of a few thousand agents' streams loses some. The limits
    are raised to twice ``clients`` (soft) and four times (hard) when that is above the
    defaults.

    ``max_receive_bytes``: the largest request message accepted (a larger one fails with
    RESOURCE_EXHAUSTED before it is read). Every handler that ``register`` adds is guarded
    (``guard_handler``): a request that does not decode gets INVALID_ARGUMENT.

    ``options``: more server channel options (e.g. ``orchestrrl.leader.SERVER_OPTIONS``)."""
    host, _ = parse_address(listen, "listen")
    merged = dict(server_options(clients))  # an option given twice: the later one
    merged["grpc.max_receive_message_length"] = max_receive_bytes
    merged.update(options)
    server = grpc.aio.server(options=list(merged.items()))
    guarded = _GuardedServer(server)
    register(guarded)
    names = tuple(service_names)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, guarded)
    reflected = (
        *names,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    # as enable_server_reflection does for an asyncio server, but through the guard
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(reflected), guarded
    )
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError as exc:
        raise errors.Unavailable(f"cannot listen on {listen}: {exc}") from None
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health_servicer, f"{host}:{port}", names)


class _Undecodable:
    """What a guarded request deserializer returns for bytes that do not decode."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    """The protobuf message a generated deserializer (``Message.FromString``) parses."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", "")
    return name if isinstance(name, str) and name else "the method's request message"


def guard_handler(method: str, handler: Any) -> Any:
    """``handler`` (an RpcMethodHandler of async behaviours) whose request deserializer
    never raises: bytes that do not decode as the request message answer INVALID_ARGUMENT
    "request could not be decoded as <Message>" and log one bounded warning. (Left alone,
    grpc.aio lets the DecodeError escape: a traceback in the log and UNKNOWN to the caller.)
    Every decoded request (each message of a request stream) is then held to its caps
    (``limits.check_request``): INVALID_ARGUMENT before the servicer sees it.
    Coroutines that answer a stream with ``context.write`` (grpc's health ``Watch``) are
    guarded too. Sync behaviours and handlers without a deserializer are returned
    unchanged: every servicer here is asynchronous (the health servicer's ``List`` is
    made one, ``HealthServicer``)."""
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler
    name = _message_name(deserialize)
    detail = f"request could not be decoded as {name}"

    def safe_deserialize(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, and whatever a parser may raise on garbage
            log.warning(
                "request_undecodable",
                method=method,
                bytes=len(data),
                error=errors.bounded(f"{type(exc).__name__}: {exc}", 200),
            )
            return _Undecodable(detail)

    async def refuse(context: Any, request: Any) -> None:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        try:
            limits.check_request(request)
        except errors.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, errors.bounded(str(exc)))

    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            await refuse(context, request)
            yield request

    behaviors: dict[str, Any] = {}
    if (f := handler.unary_unary) is not None and inspect.iscoroutinefunction(f):

        async def unary_unary(request: Any, context: Any, f: Any = f) -> Any:
            await refuse(context, request)
            return await f(request, context)

        behaviors["unary_unary"] = unary_unary
    if (f := handler.unary_stream) is not None and inspect.isasyncgenfunction(f):

        async def unary_stream(request: Any, context: Any, f: Any = f) -> AsyncIterator[Any]:
            await refuse(context, request)
            async for item in f(request, context):
                yield item

        behaviors["unary_stream"] = unary_stream
    elif f is not None and inspect.iscoroutinefunction(f):  # writes with context.write

        async def unary_stream_writer(request: Any, context: Any, f: Any = f) -> Any:
            await refuse(context, request)
            return await f(request, context)

        behaviors["unary_stream"] = unary_stream_writer
    if (f := handler.stream_unary) is not None and inspect.iscoroutinefunction(f):

        async def stream_unary(requests: Any, context: Any, f: Any = f) -> Any:
            return await f(checked(requests, context), context)

        behaviors["stream_unary"] = stream_unary
    if (f := handler.stream_stream) is not None and inspect.isasyncgenfunction(f):

        async def stream_stream(requests: Any, context: Any, f: Any = f) -> AsyncIterator[Any]:
            async for item in f(checked(requests, context), context):
                yield item

        behaviors["stream_stream"] = stream_stream
    elif f is not None and inspect.iscoroutinefunction(f):  # writes with context.write

        async def stream_stream_writer(requests: Any, context: Any, f: Any = f) -> Any:
            return await f(checked(requests, context), context)

        behaviors["stream_stream"] = stream_stream_writer
    if not behaviors:
        return handler
    return handler._replace(request_deserializer=safe_deserialize, **behaviors)


class _GuardedGenericHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._guarded: dict[str, tuple[Any, Any]] = {}

    def service(self, handler_call_details: Any) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        seen = self._guarded.get(method)
        if seen is None or seen[0] is not handler:
            seen = self._guarded[method] = (handler, guard_handler(method, handler))
        return seen[1]


class _GuardedServer:
    """The server as ``start_server``'s ``register`` sees it: every method handler added
    through it (the generated ``add_*Servicer_to_server`` functions) is guarded."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service, {m: guard_handler(f"/{service}/{m}", h) for m, h in handlers.items()}
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return channel(address, None)


def channel(
    address: str,
    tls: TlsConfig | None,
    *,
    server_name: str | None = None,
    own_connection: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A client channel: mutual TLS when ``tls`` is given, plaintext otherwise.

    ``server_name`` (with TLS): the identity the server's certificate must carry (a DNS
    subject alternative name, or the common name of a certificate without SANs) instead of
    the host of ``address``: the handshake fails unless the server at the address is who
    the caller means (e.g. the node an agent address was registered for).

    ``own_connection``: do not share connections with other channels to the address
    (gRPC pools them process-wide, reconnect backoff included: a fresh channel meant to
    connect at once would otherwise wait out the old one's backoff).

    ``options``: more channel options; each replaces a default of the same name."""
    parse_address(address, "address")
    extra = list(options)
    given = {name for name, _ in extra}
    merged = [o for o in CHANNEL_OPTIONS if o[0] not in given] + extra
    if own_connection:
        merged.append(("grpc.use_local_subchannel_pool", 1))
    if tls is None:
        return grpc.aio.insecure_channel(address, options=merged)
    if server_name:
        merged.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=merged)


def metrics_file(ready_file: Path) -> Path:
    """Where a daemon started with a ready file writes its bound /metrics address."""
    return ready_file.with_name(ready_file.name + ".metrics")


def write_ready_file(path: Path | None, address: str, *, metrics: str = "") -> None:
    """Announce readiness: write the bound address atomically, and tell systemd.
    ``metrics``: the bound HOST:PORT of Prometheus /metrics, written first to
    :func:`metrics_file` (so it is there when the ready file appears)."""
    if path is not None:
        written = [(metrics_file(path), metrics)] if metrics else []
        for target, text in [*written, (path, address)]:
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(target)
    sd_notify(f"READY=1\nSTATUS=serving on {address}")


def sd_notify(message: str) -> None:
    """Send a notification to systemd when running under Type=notify (no-op otherwise)."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(target)
        sock.sendall(message.encode())


async def watchdog() -> None:
    """Ping systemd's watchdog at half its interval while the event loop is healthy
    (runs until cancelled; returns at once when no watchdog is configured)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return
    interval = int(usec) / 2e6
    while True:
        sd_notify("WATCHDOG=1")
        await asyncio.sleep(interval)


@dataclass(frozen=True)
class MetricsServer:
    address: str  # HOST:PORT it listens on (with the port chosen when 0 was asked)
    stop: Callable[[], None]


def serve_metrics(listen: str, registry: Any) -> MetricsServer:
    """Serve Prometheus /metrics on ``listen`` (HOST:PORT, port 0: any free port) from a
    daemon thread."""
    from prometheus_client import start_http_server

    host, port = parse_address(listen, "--metrics-listen")
    try:
        server, thread = start_http_server(port, host.strip("[]"), registry=registry)
    except OSError as exc:
        raise errors.Unavailable(f"cannot serve metrics on {listen}: {exc.strerror}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return MetricsServer(f"{host}:{server.server_port}", stop)


def start_metrics_server(listen: str, registry: Any) -> Callable[[], None]:
    """Serve Prometheus /metrics on ``listen`` (HOST:PORT) from a daemon thread;
    returns a function that stops it."""
    return serve_metrics(listen, registry).stop


def shutdown_signal() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT. Call it before announcing readiness, so a
    signal that arrives right after the ready file is written is never missed."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Callable[[], Awaitable[int]]) -> int:
    """Run a daemon's async main on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(main())  # type: ignore[arg-type]
    return int(uvloop.run(main()))  # type: ignore[arg-type]

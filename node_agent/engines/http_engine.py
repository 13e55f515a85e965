"""What every HTTP engine adapter shares: its process, its HTTP session, its metrics.

An adapter (vLLM, SGLang, llama.cpp) subclasses :class:`HttpEngine` with the engine's
command line and its generate/abort calls; the process, the health wait, Prometheus
scraping and server-sent-event reading are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from node_agent.engines.base import (
    Chunk,
    EngineFailed,
    InstanceLoad,
    PauseMode,
    Placement,
    Submission,
)
from node_agent.engines.checkpoint import check_layout, tensor_table
from node_agent.engines.process import EngineProcess
from orchestrrl import errors

ABORT_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 2.0
CONTROL_TIMEOUT_S = 600.0  # a control call (pause until drained, load weights) at most


@dataclass(frozen=True)
class EngineSettings:
    """How the agent runs its engine instances (from its config)."""

    model: str  # path of the weights the instances start on (a directory or a GGUF file)
    command: str  # the server executable (llama-server) or the Python with the engine
    served_model: str
    max_num_seqs: int = 8  # sequences per instance
    context: int = 4096  # tokens per sequence (prompt + output)
    args: tuple[str, ...] = ()  # more command-line arguments, as given
    env: Mapping[str, str] = field(default_factory=dict)  # more environment variables
    log_dir: Path = Path("engine-logs")
    start_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    seed: int = 0
    cpu_offset: int = 0  # CPU-only node: device i runs on core cpu_offset + i
    gguf_dtype: str = "f32"  # llama.cpp: the GGUF a trainer's checkpoint converts to (or f16)


def cpu_cores(devices: Sequence[int], offset: int = 0) -> tuple[int, ...]:
    """The CPU cores standing in for ``devices`` on a CPU-only node: device i is core
    ``offset + i`` among those this process may run on, wrapping around."""
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed[(offset + d) % len(allowed)] for d in devices)


def base_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def sum_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named sample summed over its label sets (absent names are left out)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, until ``data: [DONE]`` or its end."""
    async for raw in response.content:
        line = raw.strip()
        if not line or not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError as exc:
            raise EngineFailed(f"the engine streamed a non-JSON line: {data[:80]!r}") from exc
        if isinstance(event, dict):
            yield event


def transport_failure(name: str, exc: aiohttp.ClientError) -> EngineFailed:
    """A call that could not reach the instance (refused, reset, cut): the instance's trouble."""
    return EngineFailed(f"{name}: {exc!r}", instance=True)


async def failure(response: aiohttp.ClientResponse, what: str) -> EngineFailed:
    """An EngineFailed for a non-200 answer: 4xx means the engine refused the request."""
    body = (await response.text())[:500]
    return EngineFailed(
        f"{what}: HTTP {response.status}: {body}", retry=not 400 <= response.status < 500
    )


class HttpEngine:
    """An engine instance served over loopback HTTP at ``placement.port``."""

    kind = "http"
    metric_names: Mapping[str, str] = {}  # InstanceLoad field -> Prometheus sample name
    metrics_path = "/metrics"
    health_path = "/health"

    def __init__(self, placement: Placement, settings: EngineSettings) -> None:
        self.placement = placement
        self.settings = settings
        self._model = settings.model  # per instance: a weight update changes it
        self.base = f"http://127.0.0.1:{placement.port}"
        self.name = f"{self.kind}[{placement.index}] TP{placement.tp} on {placement.device} " + (
            ",".join(map(str, placement.devices))
        )
        self.process = EngineProcess(
            self.name,
            self.argv(),
            self.environment(),
            settings.log_dir / f"{self.kind}-port{placement.port}.log",
            self.base + self.health_path,
            start_timeout_s=settings.start_timeout_s,
            stop_grace_s=settings.stop_grace_s,
        )
        self._session: aiohttp.ClientSession | None = None

    # -- for subclasses -------------------------------------------------------------

    def argv(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return base_env(self.settings.env)

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset()

    # -- EngineServer ------------------------------------------------------------------

    @property
    def max_num_seqs(self) -> int:
        return self.settings.max_num_seqs

    @property
    def alive(self) -> bool:
        return self.process.alive

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # a connection per call: engine servers close idle keep-alive connections on
                # their own (llama-server did between two calls), and a request written to
                # such a connection fails
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            )
        return self._session

    @property
    def model(self) -> str:
        return self._model

    def use_model(self, path: str) -> None:
        """The model the next :meth:`start` loads (this instance only: instances the
        factory makes later start on ``EngineSettings.model``)."""
        if not isinstance(path, str) or not path:
            raise errors.field_error("path", path, "a path")
        self._model = path
        self.process.argv = tuple(self.argv())

    async def prepare_model(self, checkpoint: str) -> str:
        """A Hugging Face checkpoint directory, checked: every safetensors file complete
        and, when this instance serves such a directory, the same tensors (names, shapes,
        types) as it."""
        new = Path(checkpoint)
        current = Path(self.model)
        if await asyncio.to_thread(lambda: (current / "config.json").is_file()):
            await asyncio.to_thread(check_layout, current, new)
        else:
            await asyncio.to_thread(tensor_table, new)
        return str(new)

    async def update_weights(self, path: str, *, version: str | None = None) -> None:
        raise NotImplementedError(f"{self.kind} cannot load weights in place: restart it")

    async def start(self) -> None:
        self.process.argv = tuple(self.argv())  # the model may have changed since
        await self.process.start(self.session)

    async def wait_exit(self) -> int:
        return await self.process.wait_exit()

    async def stop(self) -> None:
        try:
            await self.process.stop()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def load(self) -> InstanceLoad:
        try:
            async with self.session.get(
                self.base + self.metrics_path,
                timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S),
            ) as r:
                if r.status != 200:
                    return InstanceLoad()
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return InstanceLoad()
        got = sum_metrics(text, list(self.metric_names.values()))
        values: dict[str, Any] = {k: got.get(name) for k, name in self.metric_names.items()}
        for k in ("running", "waiting"):
            if values.get(k) is not None:
                values[k] = int(values[k])
        return InstanceLoad(**values)

    async def healthy(self) -> bool:
        try:
            async with self.session.get(
                self.base + self.health_path, timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def post_quietly(self, path: str, body: object) -> None:
        """A best-effort control call (an abort): errors are ignored, time is bounded."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.session.post(
                self.base + path, json=body, timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
            ) as r:
                await r.read()

    async def control(
        self, path: str, body: object = None, *, what: str, timeout_s: float = CONTROL_TIMEOUT_S
    ) -> Any:
        """A control call that must succeed: its JSON answer (None when the body is not
        JSON), or EngineFailed (``instance`` when the server could not be reached)."""
        try:
            async with self.session.post(
                self.base + path,
                json=body if body is not None else {},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                if r.status != 200:
                    raise await failure(r, f"{self.name}: {what}")
                text = await r.text()
        except aiohttp.ClientError as exc:
            raise transport_failure(f"{self.name}: {what}", exc) from exc
        except TimeoutError:
            raise EngineFailed(f"{self.name}: {what}: no answer within {timeout_s:g} s") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    async def abort_in_background(self, ids: Sequence[str]) -> None:
        """Abort from a ``finally`` that may run while the caller is being cancelled."""
        await asyncio.shield(self.abort(ids))

    def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        raise NotImplementedError

    async def pause(self, mode: PauseMode = "keep") -> None:
        raise NotImplementedError(f"{self.kind} cannot pause in place")

    async def resume(self) -> None:
        raise NotImplementedError(f"{self.kind} cannot pause in place")

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        raise NotImplementedError

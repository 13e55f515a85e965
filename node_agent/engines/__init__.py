"""Engine adapters: one per engine kind, chosen by the agent's configuration.

``vllm``, ``llamacpp`` and ``sglang`` run real engine servers (see each module); the
simulated engine (``sim``) is not here: it lives in ``sim_backends`` and the daemon
loads it only when the configuration says ``engine = "sim"``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from node_agent.engines.base import EngineServer, Placement
from node_agent.engines.http_engine import EngineSettings, HttpEngine

REAL_ENGINES = ("vllm", "llamacpp", "sglang")


def adapter(kind: str) -> type[HttpEngine]:
    """The adapter class of an engine kind (imported on demand)."""
    if kind == "vllm":
        from node_agent.engines.vllm import VllmServer

        return VllmServer
    if kind == "llamacpp":
        from node_agent.engines.llamacpp import LlamaCppServer

        return LlamaCppServer
    if kind == "sglang":
        from node_agent.engines.sglang import SglangServer

        return SglangServer
    raise ValueError(f"engine {kind!r} is not one of {', '.join(REAL_ENGINES)}")


def server_factory(kind: str, settings: EngineSettings) -> Callable[[Placement], EngineServer]:
    cls = adapter(kind)

    def make(placement: Placement) -> EngineServer:
        return cls(placement, settings)

    return make


def port_picker(port_base: int) -> Callable[[Placement], int]:
    """``port_base + first device`` (stable across restarts), or any free loopback port."""
    if port_base:
        return lambda p: port_base + p.devices[0]

    def free(_: Placement) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port

    return free

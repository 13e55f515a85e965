"""What the gateway needs from one inference-engine instance (a server process).

An instance is one engine server (vLLM, SGLang, llama.cpp's ``llama-server``) serving one
entry of the node's TP layout on a loopback port, pinned to its GPUs (or, on a CPU-only
node, to its CPU cores). Adapters in this package implement :class:`EngineServer`
against each engine's own HTTP API; the gateway (:mod:`node_agent.gateway`) keeps the
per-request state and talks to instances only through this protocol.

Token ids in, token ids out: the gateway never tokenizes. A submission carries the whole
prompt (for a resumed or migrated request: the original prompt followed by the tokens
generated so far) and the number of tokens still to generate. Asked for
(``Submission.logprobs``), every adapter streams the logprob of each sampled token under
the model's raw distribution (log-softmax of the logits, temperature 1, before any
top-k/top-p filter): what an RL trainer recomputes from the same weights.

Weights: an instance serves one model path (``model``: a checkpoint directory, or a GGUF
file for llama.cpp). A trainer's checkpoint becomes a path the engine loads with
:meth:`EngineServer.prepare_model` (checked; for llama.cpp converted to GGUF), and then
either goes into the running engine (``CAP_UPDATE_WEIGHTS``: :meth:`update_weights`), or
is set with :meth:`use_model` and loaded by the next :meth:`start` (a restart).
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from orchestrrl import errors

FinishReason = Literal["length", "stop", "stale"]  # stale: the gateway stopped it (max_staleness)
Device = Literal["cpu", "cuda"]

PauseMode = Literal["keep", "recompute", "wait", "abort"]
"""How :meth:`EngineServer.pause` treats the calls in flight:

- ``keep``: they stay in the engine with their KV cache and continue at resume;
- ``recompute``: they stay in the engine, their KV cache is dropped and recomputed at
  resume (after a weight update: on the new weights);
- ``wait``: the engine finishes them first (new calls wait), then pauses;
- ``abort``: the engine ends them; their streams fail with a retryable EngineFailed, so
  the gateway resubmits them (with their output so far) and they run after the resume.
"""

# Optional capabilities an adapter may have (EngineServer.capabilities).
CAP_PAUSE = "pause"  # pause(mode="keep"): pause generation in place, keeping in-flight state
CAP_PAUSE_RECOMPUTE = "pause:recompute"  # pause(mode="recompute")
CAP_PAUSE_WAIT = "pause:wait"  # pause(mode="wait")
CAP_PAUSE_ABORT = "pause:abort"  # pause(mode="abort")
CAP_UPDATE_WEIGHTS = "update_weights"  # update_weights(): new weights into the running engine
PAUSE_CAPS: dict[PauseMode, str] = {
    "keep": CAP_PAUSE,
    "recompute": CAP_PAUSE_RECOMPUTE,
    "wait": CAP_PAUSE_WAIT,
    "abort": CAP_PAUSE_ABORT,
}


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of a request (OpenAI completions semantics; temperature 0 is
    greedy). ``seed`` makes sampling reproducible on one engine; a resumed request is
    resubmitted with the same seed, so only greedy decoding is guaranteed to continue
    exactly as an uninterrupted run would."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object], field_name: str = "sampling") -> Sampling:
        """The inverse of :meth:`as_dict` (a migrating request's engine state)."""
        try:
            seed = d.get("seed")
            stops = d.get("stop_token_ids", [])
            if not isinstance(stops, list):
                raise TypeError("stop_token_ids")
            out = cls(
                temperature=float(d.get("temperature", 1.0)),  # type: ignore[arg-type]
                top_p=float(d.get("top_p", 1.0)),  # type: ignore[arg-type]
                top_k=int(d.get("top_k", 0)),  # type: ignore[call-overload]
                seed=None if seed is None else int(seed),  # type: ignore[call-overload]
                ignore_eos=bool(d.get("ignore_eos", False)),
                stop_token_ids=tuple(int(t) for t in stops),
            )
        except (TypeError, ValueError) as exc:
            raise errors.field_error(field_name, dict(d), f"sampling settings ({exc})") from None
        out.check(field_name)
        return out

    def check(self, prefix: str = "") -> None:
        """InvalidArgument naming the first bad setting."""
        p = f"{prefix}." if prefix else ""
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= 100:
            raise errors.field_error(f"{p}temperature", self.temperature, "a number in [0, 100]")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise errors.field_error(f"{p}top_p", self.top_p, "a number in (0, 1]")
        if self.top_k < 0 and self.top_k != -1:
            raise errors.field_error(f"{p}top_k", self.top_k, "0 or -1 (off) or a positive count")


@dataclass(frozen=True)
class Submission:
    """One generation call on an instance. ``engine_request_id`` is unique per call (a
    request resubmitted after a migration or reshard gets a new one)."""

    engine_request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    logprobs: bool = False  # stream each sampled token's logprob (Chunk.logprobs)


class Chunk(NamedTuple):
    """Tokens streamed back; ``finish`` is set on the last chunk of a finished call.
    ``logprobs``: when the submission asked for them, the logprob of each token of
    ``token_ids`` (as many) under the raw model distribution (log-softmax of the logits at
    temperature 1, before top-k/top-p); empty otherwise."""

    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load as its engine reports it (Prometheus metrics); None where the
    engine does not report the figure."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None


@dataclass(frozen=True)
class Placement:
    """Where an instance runs: its index in the layout, its TP degree, the devices it is
    pinned to (GPU indices, or CPU core indices on a CPU-only node) and its port."""

    index: int
    tp: int
    devices: tuple[int, ...]
    device: Device
    port: int


class EngineFailed(errors.OrlError):
    """The instance failed a call: its process died or it answered with an error.
    ``retry`` False: the engine refused the call itself (a bad request: token id out of
    the vocabulary, prompt too long), so calling again cannot help. ``instance`` True: the
    instance could not be reached at all (connection refused or cut): the instance is in
    trouble, not the request."""

    def __init__(self, message: str, *, retry: bool = True, instance: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        self.instance = instance


class EngineServer(Protocol):
    """One engine instance: a server process and the calls the gateway makes on it."""

    @property
    def kind(self) -> str: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    @property
    def alive(self) -> bool:
        """The process runs (started and not exited)."""

    @property
    def max_num_seqs(self) -> int:
        """Sequences the instance decodes at once; the gateway admits no more."""

    async def start(self) -> None:
        """Launch the server and wait until it is healthy; Unavailable (with the end of
        its log) when it exits or does not become healthy in time."""

    async def wait_exit(self) -> int:
        """Return the exit status once the process has exited (for crash detection)."""

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period). Idempotent."""

    def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        """Stream the tokens of one call; EngineFailed when the instance fails it.
        Cancelling the iteration aborts the call on the engine."""

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        """Abort calls by id (best effort: an id the engine no longer has is ignored)."""

    async def load(self) -> InstanceLoad:
        """Scrape the engine's metrics."""

    async def healthy(self) -> bool:
        """The server answers its health check."""

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating; in-flight calls as ``mode`` says (the capability
        ``PAUSE_CAPS[mode]`` says the engine has the mode). New calls wait until
        :meth:`resume`."""

    async def resume(self) -> None:
        """Generate again after :meth:`pause`."""

    @property
    def model(self) -> str:
        """The model path this instance serves (or, not started, will load)."""

    def use_model(self, path: str) -> None:
        """The model path the next :meth:`start` loads (a weight update by restart: stop,
        use_model, start). The running process is not touched. A path from
        :meth:`prepare_model`."""

    async def prepare_model(self, checkpoint: str) -> str:
        """The model path this engine loads for a trainer's checkpoint (a Hugging Face
        directory of ``config.json`` and ``*.safetensors``): checked against the model it
        serves (same tensors, shapes and types; files complete), for llama.cpp converted to
        a GGUF (cached beside the checkpoint). CheckpointError naming the file and the
        problem when it cannot serve it; nothing changes on the instance. Runs while the
        instance keeps serving."""

    async def update_weights(self, path: str, *, version: str | None = None) -> None:
        """Load ``path`` (from :meth:`prepare_model`) into the running engine
        (CAP_UPDATE_WEIGHTS), labelled ``version`` where the engine keeps a label. The
        process and its in-flight calls stay; no token after the update is computed
        from a KV cache of the old weights (kept calls are recomputed). Call it paused
        (any mode) for a clean boundary between versions. On return the engine serves the
        new weights and :attr:`model` is ``path`` (a later restart loads it). When
        the engine refuses or fails the load: EngineFailed, the engine still serving the
        old weights (it reloads them), or stopped when even that failed (never a
        half-loaded model)."""

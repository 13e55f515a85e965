"""An in-process stand-in for an engine instance (implements node_agent.engines.base.EngineServer).

:class:`ScriptedEngine` generates tokens by a fixed rule of the whole sequence so far
(prompt and output), like greedy decoding of a fixed model: the same prefix always
continues the same way, on any instance of any TP degree. So a request that is cut off
and resubmitted with its output so far continues exactly as an uninterrupted run,
which is what the gateway's tests check, fast and without an engine process. Faults are
injected by hand: :meth:`ScriptedEngine.crash` (the process dies), ``fail_starts``
(the next starts fail), ``fail_calls`` (calls answer with an error). A :class:`Hold`
stops its instances' calls at a position of their sequences until the test releases
them, so a test observes a running request that cannot finish while it looks.

:class:`LocalPeers` lets gateways in one process follow each other's requests (what the
agents do over gRPC).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from node_agent.engine import Destination
from node_agent.engines.base import (
    CAP_UPDATE_WEIGHTS,
    Chunk,
    EngineFailed,
    InstanceLoad,
    PauseMode,
    Placement,
    Submission,
)
from node_agent.gateway.engine import FollowChunk, GatewayEngine
from orchestrrl import errors

VOCAB = 1000


def _hash(sequence: Sequence[int], weights: int) -> int:
    h = 17 + 7919 * weights
    for t in sequence:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h


def next_token(sequence: Sequence[int], vocab: int = VOCAB, weights: int = 0) -> int:
    """The rule: a hash of the whole sequence (order matters) under ``weights`` (a
    different model continues differently)."""
    return _hash(sequence, weights) % vocab


def logprob(sequence: Sequence[int], weights: int = 0) -> float:
    """The "log-probability" the scripted model reports for the token it appends to
    ``sequence``: a fixed function of the sequence and the weights, in (-10, 0)."""
    return -((_hash(sequence, weights) // VOCAB) % 997 + 1) / 100.0


def greedy(prompt: Sequence[int], n: int, eos: int | None = None, weights: int = 0) -> list[int]:
    """What an uninterrupted call of :class:`ScriptedEngine` returns."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = next_token(seq, weights=weights)
        seq.append(t)
        out.append(t)
        if t == eos:
            break
    return out


def greedy_logprobs(
    prompt: Sequence[int], output: Sequence[int], weights: Sequence[int] | int = 0
) -> list[float]:
    """The logprobs the scripted engine reports for ``output`` after ``prompt``; with a
    list, token ``i`` was generated under ``weights[i]``."""
    per = [weights] * len(output) if isinstance(weights, int) else list(weights)
    seq = list(prompt)
    out = []
    for t, w in zip(output, per, strict=True):
        out.append(logprob(seq, w))
        seq.append(t)
    return out


def weights_of(model: str) -> int:
    """The scripted weights a model path names: ``.../scripted-<n>`` (else 0)."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    head, _, tail = name.rpartition("-")
    return int(tail) if head.endswith("scripted") and tail.isdigit() else 0


class Hold:
    """Calls of the instances that share it stop before generating the token at sequence
    position ``at`` (prompt and output so far: the same point of a request on any
    instance it runs on) until :meth:`release`, or until ``at`` is moved on. A held call
    still counts as running, and the gateway can still cancel it (an abort, an export)."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.held: set[str] = set()  # the engine request ids of the calls it holds now
        self._changed = asyncio.Event()

    def holds(self, position: int) -> bool:
        return self.at is not None and position >= self.at

    def until(self, at: int | None) -> None:
        """Hold calls at position ``at`` from now on (None: hold nothing)."""
        self.at = at
        self._changed.set()
        self._changed = asyncio.Event()

    def release(self) -> None:
        self.until(None)

    async def wait(self, call: str) -> None:
        """Until something changed (the hold moved, or :meth:`poke`); the caller looks again."""
        changed = self._changed
        self.held.add(call)
        try:
            await changed.wait()
        finally:
            self.held.discard(call)

    def poke(self) -> None:
        """Wake the held calls to look again (their instance crashed, a call was aborted)."""
        self.until(self.at)


@dataclass
class EngineRecord:
    """What the stand-ins of one test did (shared by every instance a factory made)."""

    started: list[Placement] = field(default_factory=list)
    stopped: list[Placement] = field(default_factory=list)
    submissions: list[tuple[Placement, Submission]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)


class ScriptedEngine:
    """One instance; ``token_delay_s`` per decode iteration (all its calls advance together)."""

    kind = "scripted"

    def __init__(
        self,
        placement: Placement,
        record: EngineRecord | None = None,
        *,
        max_num_seqs: int = 4,
        token_delay_s: float = 0.002,
        start_delay_s: float = 0.0,
        eos: int | None = None,
        fail_starts: int = 0,
        model: str = "scripted-0",
        in_place_updates: bool = False,
        hold: Hold | None = None,
    ) -> None:
        self.placement = placement
        self.record = record or EngineRecord()
        self.max_num_seqs = max_num_seqs
        self.token_delay_s = token_delay_s
        self.start_delay_s = start_delay_s
        self.eos = eos
        self.fail_starts = fail_starts
        self.hold = hold
        self.fail_calls = 0  # the next calls answer with an error (the process stays up)
        self.hung = False  # calls cannot connect and health checks fail, the process runs
        self.bug: Exception | None = None  # the next call raises this (not an EngineFailed)
        self.capabilities: frozenset[str] = (
            frozenset({CAP_UPDATE_WEIGHTS}) if in_place_updates else frozenset()
        )
        self._model = model  # loaded at the next start
        self.weights = weights_of(model)  # what it serves now
        self.updates: list[str] = []  # in-place updates made
        self.fail_updates = 0  # the next in-place updates fail (the old weights stay)
        self._exit: asyncio.Future[int] | None = None
        self._calls: dict[str, asyncio.Event] = {}
        self.generated = 0

    @property
    def alive(self) -> bool:
        return self._exit is not None and not self._exit.done()

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay_s)
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise errors.Unavailable(f"scripted instance {self.placement.index}: start failed")
        if not self._model.startswith("missing"):
            self.weights = weights_of(self._model)
        else:
            raise errors.Unavailable(f"scripted instance {self.placement.index}: no {self._model}")
        self._exit = asyncio.get_running_loop().create_future()
        self.record.started.append(self.placement)

    async def wait_exit(self) -> int:
        if self._exit is None:
            raise errors.FailedPrecondition("not started")
        return await asyncio.shield(self._exit)

    async def stop(self) -> None:
        if self.alive:
            assert self._exit is not None
            self._exit.set_result(0)
            self.record.stopped.append(self.placement)
            if self.hold is not None:
                self.hold.poke()

    def crash(self, status: int = -9) -> None:
        """The process dies: every call fails, wait_exit returns ``status``."""
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(status)
        if self.hold is not None:
            self.hold.poke()

    async def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        if not self.alive:
            raise EngineFailed(f"instance {self.placement.index} is not running", instance=True)
        if self.hung:
            raise EngineFailed(
                f"instance {self.placement.index}: connection refused", instance=True
            )
        if self.fail_calls > 0:
            self.fail_calls -= 1
            raise EngineFailed(f"instance {self.placement.index}: HTTP 500 (injected)")
        if self.bug is not None:
            bug, self.bug = self.bug, None
            raise bug
        self.record.submissions.append((self.placement, submission))
        abort = self._calls[submission.engine_request_id] = asyncio.Event()
        seq = list(submission.prompt)
        stops = set(submission.sampling.stop_token_ids)
        if self.eos is not None and not submission.sampling.ignore_eos:
            stops.add(self.eos)
        try:
            for n in range(submission.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                while (
                    self.hold is not None
                    and self.hold.holds(len(seq))
                    and self.alive
                    and not abort.is_set()
                ):
                    await self.hold.wait(submission.engine_request_id)
                if not self.alive:
                    raise EngineFailed(f"instance {self.placement.index} exited", instance=True)
                if abort.is_set():
                    raise EngineFailed("aborted")
                lp = (logprob(seq, self.weights),) if submission.logprobs else ()
                t = next_token(seq, weights=self.weights)
                seq.append(t)
                self.generated += 1
                last = n + 1 == submission.max_tokens
                if t in stops:
                    yield Chunk((t,), "stop", lp)
                    return
                yield Chunk((t,), "length" if last else None, lp)
        finally:
            self._calls.pop(submission.engine_request_id, None)

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        for rid in engine_request_ids:
            self.record.aborted.append(rid)
            call = self._calls.get(rid)
            if call is not None:
                call.set()
        if self.hold is not None:
            self.hold.poke()

    async def load(self) -> InstanceLoad:
        return InstanceLoad(
            running=len(self._calls),
            waiting=0,
            kv_usage=len(self._calls) / self.max_num_seqs,
            generation_tokens_total=float(self.generated),
        )

    async def healthy(self) -> bool:
        return self.alive and not self.hung

    @property
    def model(self) -> str:
        return self._model

    def use_model(self, path: str) -> None:
        self._model = path

    async def prepare_model(self, checkpoint: str) -> str:
        return checkpoint  # the scripted weights are named by the path itself

    async def update_weights(self, path: str, *, version: str | None = None) -> None:
        if CAP_UPDATE_WEIGHTS not in self.capabilities:
            raise NotImplementedError("this scripted engine restarts to change weights")
        await asyncio.sleep(self.start_delay_s)
        if self.fail_updates > 0:
            self.fail_updates -= 1
            raise EngineFailed(f"scripted instance {self.placement.index}: cannot load {path}")
        if self._calls:
            raise EngineFailed(f"{len(self._calls)} call(s) in flight during a weight update")
        self._model = path
        self.weights = weights_of(path)
        self.updates.append(path)

    async def pause(self, mode: PauseMode = "keep") -> None:
        raise NotImplementedError("the scripted engine cannot pause in place")

    async def resume(self) -> None:
        raise NotImplementedError("the scripted engine cannot pause in place")


class LocalPeers:
    """Gateways in this process, by node name: what the agents' FollowRequest does."""

    def __init__(self, gateways: Mapping[str, GatewayEngine] | None = None) -> None:
        self.gateways: dict[str, GatewayEngine] = dict(gateways or {})
        self.down: set[str] = set()  # nodes that cannot be reached

    async def follow(
        self, destination: Destination, request_id: str, start: int
    ) -> AsyncIterator[FollowChunk]:
        if destination.node in self.down or destination.node not in self.gateways:
            raise errors.Unavailable(f"node {destination.node!r} cannot be reached")
        async for chunk in self.gateways[destination.node].follow(request_id, start):
            if destination.node in self.down:
                raise errors.Unavailable(f"node {destination.node!r} went away")
            yield chunk

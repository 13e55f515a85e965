"""One generation request as the gateway keeps it, and readers that stream its tokens.

The gateway is the request's source of truth: its prompt ids, every output id delivered
so far (with the weight version that produced it), its output cap and sampling settings,
and where it is now. An instance or a remote node only ever continues it: a call
submits the prompt followed by the output so far and asks for the tokens still owed, so
whatever happens to the call (aborted for a migration or a reshard, its engine crashed),
the gateway can resubmit it and the reader sees one uninterrupted response.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from node_agent.engines.base import FinishReason, Sampling
from orchestrrl import errors
from orchestrrl.checkpoint import version_count


class Where(enum.Enum):
    QUEUED = "queued"  # waiting at the gateway for a seat on an instance
    RUNNING = "running"  # a call on one of this node's instances generates it
    HELD = "held"  # exported for a migration, not resolved yet: nothing generates it
    REMOTE = "remote"  # released to another node; this node follows its tokens there
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


DONE = frozenset({Where.FINISHED, Where.FAILED, Where.ABORTED})

# What a request does when new weights are loaded while it runs (GatewayEngine.update_weights)
FINISH, RESUME = "finish", "resume"  # finish on the old weights / abort, resume on the new
UPDATE_POLICIES = (FINISH, RESUME)

# A request's staleness bound (``max_staleness``): it stops, finish reason STALE, once the
# weights served are more than this many versions newer than its oldest token's
MAX_STALENESS = 64
STALE: FinishReason = "stale"


def staleness(versions: Sequence[tuple[int, str]], output_len: int, version: str) -> int | None:
    """How many versions ``version`` is newer than the oldest of ``output_len`` tokens in
    runs ``versions`` (``(first index, label)``); None when there is no token yet (its
    first will come from ``version``) or a label is not a version count."""
    now = version_count(version)
    labels = [v for start, v in versions if start < output_len]
    if now is None or not labels:
        return None
    counts = [version_count(v) for v in labels]
    if any(c is None for c in counts):
        return None
    return now - min(c for c in counts if c is not None)


class RequestFailed(errors.OrlError):
    """The request ended without finishing: it failed (engine trouble) or was aborted."""

    def __init__(self, message: str, *, aborted: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.aborted = aborted
        self.refused = refused  # the engine refused it (a bad request, not a fault)


@dataclass(eq=False)
class Request:
    id: str
    seq: int  # arrival order at this gateway (queue order)
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    created: float
    origin: bool = True  # a client of this gateway submitted it (else: imported)
    source_node: str = ""  # imported: the node that exported it here (its follower)
    group: str = ""  # its sample group (GRPO: the prompt); "" = none
    want_logprobs: bool = False  # the client asked for the sampled tokens' logprobs
    update_policy: str = ""  # FINISH or RESUME at a weight update ("": the update's own)
    max_staleness: int | None = None  # stop it (STALE) beyond this lag (None: no bound)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # parallel to output (if wanted)
    versions: list[tuple[int, str]] = field(default_factory=list)  # (first index, version)
    where: Where = Where.QUEUED
    instance: int = -1  # index into the layout while RUNNING (or the import's target)
    finish: FinishReason | None = None
    error: str = ""
    refused: bool = False  # FAILED because the engine refused it (a bad request)
    remote: str = ""  # REMOTE: the node it runs on
    calls: int = 0  # calls made on engines (for unique engine request ids)
    failures: int = 0  # calls that failed while their instance stayed up
    hops: list[str] = field(default_factory=list)  # the nodes it ran on, in order
    hop_starts: list[int] = field(default_factory=list)  # output length on arriving at each
    created_wall: float = field(default_factory=time.time)  # seconds since the Unix epoch
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.hop_starts) != len(self.hops):  # made without them: all from the start
            self.hop_starts = [0] * len(self.hops)

    @property
    def done(self) -> bool:
        return self.where in DONE

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

    def next_call_id(self) -> str:
        self.calls += 1
        return f"{self.id}-c{self.calls}"

    def append(self, tokens: Sequence[int], version: str, logprobs: Sequence[float] = ()) -> None:
        """Tokens generated under weights ``version``, with their logprobs when the client
        wants them (ValueError, nothing appended, when they do not match the tokens)."""
        if not tokens:
            return
        if self.want_logprobs:
            if len(logprobs) != len(tokens):
                raise ValueError(
                    f"{len(tokens)} token(s) came with {len(logprobs)} logprob(s): "
                    "the engine did not report the sampled tokens' logprobs"
                )
            self.logprobs.extend(logprobs)
        if not self.versions or self.versions[-1][1] != version:
            self.versions.append((len(self.output), version))
        self.output.extend(tokens)
        self.notify()

    def hop(self, node: str) -> None:
        """It goes on on ``node`` from its output so far."""
        self.hops.append(node)
        self.hop_starts.append(len(self.output))

    def version_per_token(self) -> list[str]:
        """The weight version of each output token."""
        out: list[str] = []
        bounds = [*self.versions[1:], (len(self.output), "")]
        for (start, version), (end, _) in zip(self.versions, bounds, strict=True):
            out.extend([version] * (end - start))
        return out

    def end(
        self,
        where: Where,
        finish: FinishReason | None = None,
        error: str = "",
        *,
        refused: bool = False,
    ) -> None:
        self.where = where
        self.finish = finish
        self.error = error
        self.refused = refused
        self.instance = -1
        self.notify()

    def notify(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    def waiter(self) -> asyncio.Future[None]:
        """A future done when tokens are appended or the request changes state (made
        now: nothing that happens after this call is missed)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def changed(self) -> None:
        """Wait until tokens are appended or the request changes state."""
        await self.waiter()

    def raise_if_failed(self) -> None:
        """RequestFailed when it ended without finishing (failed or aborted)."""
        if self.done and self.where is not Where.FINISHED:
            raise RequestFailed(
                self.error or f"request {self.id!r} {self.where.value}",
                aborted=self.where is Where.ABORTED,
                refused=self.refused,
            )

    async def tokens(self, start: int = 0) -> AsyncIterator[tuple[int, ...]]:
        """Output ids from index ``start`` on, as they come, until the request ends;
        RequestFailed when it fails or is aborted."""
        pos = start
        while True:
            if len(self.output) > pos:
                chunk = tuple(self.output[pos:])
                pos += len(chunk)
                yield chunk
                continue
            if self.done:
                self.raise_if_failed()
                return
            await self.changed()

    # -- migration state (RequestState.engine_state) ------------------------------------

    def engine_state(self) -> bytes:
        doc: dict[str, object] = {
            "sampling": self.sampling.as_dict(),
            "versions": [list(v) for v in self.versions],
            "hops": self.hops,
            "hop_starts": self.hop_starts,
        }
        if self.want_logprobs:
            doc["logprobs"] = self.logprobs
        if self.update_policy:
            doc["update_policy"] = self.update_policy
        if self.max_staleness is not None:
            doc["max_staleness"] = self.max_staleness
        return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ImportedState:
    sampling: Sampling
    versions: tuple[tuple[int, str], ...]
    hops: tuple[str, ...]
    logprobs: tuple[float, ...] | None = None  # None: the client did not ask for them
    hop_starts: tuple[int, ...] = ()  # parallel to hops (older senders: none)
    update_policy: str = ""
    max_staleness: int | None = None


def parse_engine_state(data: bytes, output_len: int) -> ImportedState:
    """The gateway's part of a migrating request (InvalidArgument when malformed)."""
    if not data:
        return ImportedState(Sampling(), ((0, ""),) if output_len else (), ())
    try:
        doc = json.loads(data.decode())
        if not isinstance(doc, dict):
            raise TypeError("not an object")
        sampling = Sampling.from_dict(doc.get("sampling") or {}, "engine_state.sampling")
        versions = tuple((int(i), str(v)) for i, v in doc.get("versions") or [])
        hops = tuple(str(h) for h in doc.get("hops") or [])
        hop_starts = tuple(int(i) for i in doc.get("hop_starts") or [])
        raw = doc.get("logprobs")
        logprobs = None if raw is None else tuple(float(x) for x in raw)
        policy = str(doc.get("update_policy") or "")
        bound = doc.get("max_staleness")
    except errors.InvalidArgument:
        raise
    except (ValueError, TypeError, UnicodeDecodeError, AttributeError) as exc:
        raise errors.field_error(
            "engine_state", data[:80], f"the gateway's JSON request state ({exc})"
        ) from None
    starts = [i for i, _ in versions]
    if starts != sorted(set(starts)) or any(i < 0 or i > output_len for i in starts):
        raise errors.field_error(
            "engine_state.versions", list(versions), f"increasing indices in 0..{output_len}"
        )
    if logprobs is not None and (
        len(logprobs) != output_len or not all(math.isfinite(x) and x <= 0 for x in logprobs)
    ):
        raise errors.field_error(
            "engine_state.logprobs",
            list(logprobs[:5]),
            f"{output_len} finite log-probabilities <= 0, one per output token",
        )
    if policy and policy not in UPDATE_POLICIES:
        raise errors.field_error("engine_state.update_policy", policy, " or ".join(UPDATE_POLICIES))
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= MAX_STALENESS
    ):
        raise errors.field_error(
            "engine_state.max_staleness", bound, f"an integer in 0..{MAX_STALENESS}"
        )
    if hop_starts and (
        len(hop_starts) != len(hops)
        or list(hop_starts) != sorted(hop_starts)
        or any(i < 0 or i > output_len for i in hop_starts)
    ):
        raise errors.field_error(
            "engine_state.hop_starts",
            list(hop_starts[:5]),
            f"one non-decreasing output index in 0..{output_len} per hop",
        )
    return ImportedState(
        sampling,
        versions,
        hops,
        logprobs=logprobs,
        update_policy=policy,
        hop_starts=hop_starts,
        max_staleness=bound,
    )

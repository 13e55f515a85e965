"""A client for RL loops: rollouts through the node agents' generation gateways.

Point it at the gateways of the generation nodes (``orlctl nodes`` lists them) and ask
for groups of samples; every sample comes back with its token ids, the logprob of each
sampled token and the weight version that produced each token::

    from orchestrrl.rollout import Rollout

    with Rollout(["http://10.0.0.5:8100", "http://10.0.0.6:8100"]) as rollout:
        groups = rollout.generate(prompt_ids, n=8, max_tokens=512, temperature=1.0)
        for group in groups:
            for s in group.samples:
                s.completion_ids, s.logprobs, s.versions, s.finish_reason

A group (the ``n`` samples of one prompt, GRPO's unit) goes to one gateway as one
``/v1/completions`` call with ``n``, so the node's compute scheduler sees the siblings
together; groups are spread over the gateways by their outstanding samples. A gateway
that cannot be reached gets no more groups from this call and its groups go to the
others; a full gateway (429) is waited for; any other error fails the call with the
gateway's own message. :meth:`AsyncRollout.update_weights` loads new weights into every
gateway's engines (clusters run by a controller push them with the weight-sync phase
instead: ``Client.set_phase("weight-sync", ...)``).

``AsyncRollout`` for asyncio code; ``Rollout`` runs it on a private event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp

from orchestrrl import errors, partial_rollout
from orchestrrl.logs import get_logger

log = get_logger("orchestrrl.rollout")

MAX_N = 64  # the gateways' cap on samples per prompt
RETRY_FULL_S = (0.05, 0.2, 0.5, 1.0)  # a full gateway (429) is asked again after these


class RolloutError(errors.OrlError):
    """A gateway refused or failed a request (its message says why)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sample:
    """One response: its tokens, their logprobs (None when not asked), the weight version
    of each token, and where it ran."""

    request_id: str
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    versions: tuple[str, ...]  # one per token
    finish_reason: str  # "length", "stop" or "stale" (the gateway stopped it: max_staleness)
    nodes: tuple[str, ...]  # the nodes that generated it, in order
    gateway: str
    node_starts: tuple[int, ...] = ()  # its output length on arriving at each node

    @property
    def moved_running(self) -> int:
        """Tokens it had generated when it first moved to another node while running (0:
        it never did)."""
        return next((s for s in self.node_starts[1:] if s > 0), 0)

    @property
    def weight_versions(self) -> tuple[str, ...]:
        """The distinct versions of its tokens, in order."""
        out: list[str] = []
        for v in self.versions:
            if not out or out[-1] != v:
                out.append(v)
        return tuple(out)


@dataclass(frozen=True)
class Group:
    """The samples of one prompt."""

    prompt_ids: tuple[int, ...]
    group_id: str
    samples: tuple[Sample, ...]


def _versions(runs: object, length: int) -> tuple[str, ...]:
    """Per-token versions from the gateway's runs ``[[first index, version], ...]``."""
    if not isinstance(runs, list) or not runs:
        return ("",) * length
    bounds = [*runs[1:], [length, ""]]
    out: list[str] = []
    for (start, version), (end, _) in zip(runs, bounds, strict=True):
        out.extend([str(version)] * (int(end) - int(start)))
    return tuple(out[:length])


def parse_choice(choice: Mapping[str, Any], gateway: str) -> Sample:
    """A sample from one ``choices[]`` entry of a gateway's whole answer."""
    tokens = tuple(int(t) for t in choice["token_ids"])
    lp = choice.get("logprobs")
    logprobs = None if lp is None else tuple(float(x) for x in lp["token_logprobs"])
    orl = choice.get("orl") or {}
    return Sample(
        str(orl.get("request_id", "")),
        tokens,
        logprobs,
        _versions(orl.get("weight_versions"), len(tokens)),
        str(choice.get("finish_reason") or ""),
        tuple(str(n) for n in orl.get("nodes") or ()),
        gateway,
        tuple(int(i) for i in orl.get("node_starts") or ()),
    )


MAX_STALENESS = 64  # the gateways' bound on a request's max_staleness


def _check_max_staleness(value: object) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STALENESS
    ):
        raise errors.field_error(
            "max_staleness", value, f"an integer in 0..{MAX_STALENESS}, or None (no bound)"
        )


def _check_prompts(prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    out = []
    for k, p in enumerate(prompts):
        ids = tuple(p)
        if not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise errors.field_error(f"prompts[{k}]", ids, "a non-empty list of token ids (>= 0)")
        out.append(ids)
    return out


class AsyncRollout:
    """Rollouts over ``gateways`` (``http://HOST:PORT`` each); see the module docstring."""

    def __init__(
        self,
        gateways: Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 3600.0,
        max_in_flight: int = 1024,
    ) -> None:
        if not gateways:
            raise errors.field_error("gateways", [], "at least one gateway URL")
        for g in gateways:
            if not isinstance(g, str) or not g.startswith(("http://", "https://")):
                raise errors.field_error("gateways", g, "URLs such as http://10.0.0.5:8100")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise errors.field_error("timeout_s", timeout_s, "seconds > 0")
        if max_in_flight < 1:
            raise errors.field_error("max_in_flight", max_in_flight, "an integer >= 1")
        self.gateways = tuple(g.rstrip("/") for g in gateways)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._outstanding = dict.fromkeys(self.gateways, 0)
        self._where: dict[str, str] = {}  # request id -> gateway (until its answer)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncRollout:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: bool = True,
        group_ids: Sequence[str] | None = None,
        on_weight_update: str | None = None,
        max_staleness: int | None = None,
    ) -> list[Group]:
        """``n`` samples of each prompt, as groups in the prompts' order. ``group_ids``
        name the groups (e.g. the prompts' dataset indices: the controller remembers a
        prompt's lengths across epochs by it); ``seed`` ``s`` gives prompt ``k`` the seeds
        ``s + k*n ...``; ``on_weight_update``: "finish" or "resume" (see the gateway);
        ``max_staleness``: a gateway stops a sample (``finish_reason`` "stale", its tokens
        so far) when it loads weights more versions than this newer than the sample's
        oldest token (None: no bound)."""
        checked = _check_prompts(prompts)
        _check_max_staleness(max_staleness)
        if not 1 <= n <= MAX_N:
            raise errors.field_error("n", n, f"an integer in 1..{MAX_N}")
        if group_ids is not None and len(group_ids) != len(checked):
            raise errors.field_error(
                "group_ids", f"{len(group_ids)} ids", f"one per prompt ({len(checked)})"
            )
        call = uuid.uuid4().hex[:12]
        body: dict[str, Any] = {
            "max_tokens": max_tokens,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": ignore_eos,
            "logprobs": 0 if logprobs else None,
        }
        if on_weight_update is not None:
            body["on_weight_update"] = on_weight_update
        if max_staleness is not None:
            body["max_staleness"] = max_staleness
        down: set[str] = set()

        async def one(k: int, prompt: tuple[int, ...]) -> Group:
            gid = group_ids[k] if group_ids is not None else f"{call}-{k}"
            this = {**body, "prompt": list(prompt), "group": gid}
            if seed is not None:
                this["seed"] = seed + k * n
            async with self._slots:
                choices, gateway = await self._complete(this, f"{call}-{k}", n, down)
            return Group(prompt, gid, tuple(parse_choice(c, gateway) for c in choices))

        return list(await asyncio.gather(*(one(k, p) for k, p in enumerate(checked))))

    def partial(
        self,
        groups_per_step: int,
        *,
        n: int,
        over_provision: float = 1.5,
        max_staleness: int = 1,
        end: str = "groups",
        token_budget: int = 0,
        time_budget_s: float = 0.0,
        **sampling: Any,
    ) -> PartialRollout:
        """A :class:`PartialRollout` over these gateways: steps of ``groups_per_step``
        complete groups of ``n`` samples, ``over_provision`` x as many started, the
        unfinished ones carried into the next step (see :class:`PartialRollout`);
        ``sampling``: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``stop_token_ids``, ``ignore_eos``, ``logprobs`` as for :meth:`generate`."""
        rule = partial_rollout.partial_rule(
            over_provision=over_provision,
            max_staleness=max_staleness,
            end=end,
            token_budget=token_budget,
            time_budget_s=time_budget_s,
        )
        return PartialRollout(self, rule, groups_per_step, n=n, **sampling)

    async def stream(
        self,
        body: dict[str, Any],
        rid: str,
        n: int,
        on_start: Callable[[str, list[str]], None],
        on_choice: Callable[[Mapping[str, Any]], None],
        *,
        max_staleness: int | None = None,
    ) -> str:
        """Stream one completion (``n`` samples, request id ``rid``) from the least-loaded
        reachable gateway: ``on_start(gateway, request ids)`` as it is sent (again on a
        retry, with other ids),
        ``on_choice(choice)`` for each choice chunk as it arrives; returns the gateway
        once every sample has ended. A gateway that cannot be reached before anything
        arrived is left for the others, a full one (429) waited for; a call cut off
        after its first chunk fails (RolloutError: retrying it would repeat tokens).
        ``max_staleness``: sent as the body's field (see :meth:`generate`)."""
        _check_max_staleness(max_staleness)
        if max_staleness is not None:
            body = {**body, "max_staleness": max_staleness}
        down: set[str] = set()
        attempt = 0
        full = 0
        while True:
            gateway, this_id, ids = self._place(rid, attempt, n, down)
            attempt += 1
            started = False
            on_start(gateway, ids)
            try:
                async with self.session.post(
                    gateway + "/v1/completions",
                    json={**body, "n": n, "request_id": this_id, "stream": True},
                ) as r:
                    if r.status != 200:
                        status, message = r.status, _message(_json(await r.text()))
                    else:
                        started = True
                        async for event in _events(r.content):
                            if "error" in event:
                                raise RolloutError(
                                    f"{gateway}: request {this_id!r}: {_message(event)}"
                                )
                            for choice in event.get("choices") or ():
                                on_choice(choice)
                        return gateway
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                if started:
                    raise RolloutError(
                        f"{gateway}: the stream of request {this_id!r} was cut off: {exc!r}"
                    ) from exc
                log.warning("gateway_unreachable", gateway=gateway, error=repr(exc))
                down.add(gateway)
                continue
            except TimeoutError:
                raise errors.Unavailable(
                    f"{gateway}: no answer for request {this_id!r} within {self._timeout.total:g} s"
                ) from None
            finally:
                self._unplace(gateway, ids, n)
            if status == 429 and full < len(RETRY_FULL_S):
                await asyncio.sleep(RETRY_FULL_S[full])
                full += 1
                continue
            raise RolloutError(f"{gateway}: HTTP {status}: {message}", status)

    def _place(self, rid: str, attempt: int, n: int, down: set[str]) -> tuple[str, str, list[str]]:
        """The least-loaded reachable gateway for attempt ``attempt`` of call ``rid``, the
        attempt's id and its samples' ids, counted as outstanding there until
        :meth:`_unplace`."""
        live = [g for g in self.gateways if g not in down]
        if not live:
            raise errors.Unavailable(f"no gateway could be reached ({', '.join(self.gateways)})")
        gateway = min(live, key=lambda g: self._outstanding[g])
        this_id = rid if attempt == 0 else f"{rid}-r{attempt}"
        ids = [this_id] if n == 1 else [f"{this_id}-{i}" for i in range(n)]
        self._outstanding[gateway] += n
        for i in ids:
            self._where[i] = gateway
        return gateway, this_id, ids

    def _unplace(self, gateway: str, ids: list[str], n: int) -> None:
        self._outstanding[gateway] -= n
        for i in ids:
            self._where.pop(i, None)

    async def _complete(
        self, body: dict[str, Any], rid: str, n: int, down: set[str]
    ) -> tuple[list[dict[str, Any]], str]:
        """Send one completion to the least-loaded reachable gateway: its choices."""
        attempt = 0
        full = 0
        while True:
            gateway, this_id, ids = self._place(rid, attempt, n, down)
            attempt += 1
            try:
                async with self.session.post(
                    gateway + "/v1/completions", json={**body, "request_id": this_id}
                ) as r:
                    answer = _json(await r.text())
                    status = r.status
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError) and not isinstance(
                    exc, aiohttp.ServerTimeoutError
                ):
                    raise errors.Unavailable(
                        f"{gateway}: no answer for request {this_id!r} within "
                        f"{self._timeout.total:g} s"
                    ) from None
                log.warning("gateway_unreachable", gateway=gateway, error=repr(exc))
                down.add(gateway)
                continue
            finally:
                self._unplace(gateway, ids, n)
            if status == 200:
                return list(answer["choices"]), gateway
            message = _message(answer)
            if status == 429 and full < len(RETRY_FULL_S):
                await asyncio.sleep(RETRY_FULL_S[full])
                full += 1
                continue
            raise RolloutError(f"{gateway}: HTTP {status}: {message}", status)

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort requests of calls in progress (their ``generate`` fails for them); the
        ids that were not in flight."""
        by_gateway: dict[str, list[str]] = {}
        unknown = []
        for rid in request_ids:
            g = self._where.get(rid)
            if g is None:
                unknown.append(rid)
            else:
                by_gateway.setdefault(g, []).append(rid)
        for g, ids in by_gateway.items():
            async with self.session.post(g + "/orl/v1/abort", json={"request_ids": ids}) as r:
                if r.status == 404:  # some finished meanwhile
                    unknown += ids
                elif r.status != 200:
                    text = await r.text()
                    raise RolloutError(f"{g}: abort: HTTP {r.status}: {_message(_json(text))}")
        return unknown

    async def update_weights(
        self,
        path: str,
        version: str,
        in_flight: str = "finish",
        *,
        drain_timeout_s: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Load the weights at ``path`` (on each gateway's node) as ``version`` into
        every gateway's engines, concurrently; each gateway's answer. RolloutError naming
        every gateway that failed (they keep their old version)."""

        async def one(g: str) -> tuple[str, int, dict[str, Any]]:
            body: dict[str, Any] = {"path": path, "version": version, "in_flight": in_flight}
            if drain_timeout_s is not None:
                body["drain_timeout_s"] = drain_timeout_s
            try:
                async with self.session.post(g + "/orl/v1/update_weights", json=body) as r:
                    return g, r.status, _json(await r.text())
            except aiohttp.ClientError as exc:
                return g, 0, {"error": {"message": f"cannot be reached: {exc!r}"}}

        answers = await asyncio.gather(*(one(g) for g in self.gateways))
        failed = [f"{g}: {_message(a)}" for g, status, a in answers if status != 200]
        if failed:
            raise RolloutError(
                f"weight update to {version!r} failed on {len(failed)} of "
                f"{len(self.gateways)} gateway(s): " + errors.listed(failed)
            )
        return {g: a for g, _, a in answers}


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent event stream (``data: {...}`` lines; ``[DONE]``
    and other lines skipped), however long a line is."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.strip()
            if text.startswith(b"data: {"):
                event = json.loads(text[6:])
                if isinstance(event, dict):
                    yield event


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text[:2048]


def _message(answer: object) -> str:
    if isinstance(answer, dict):
        err = answer.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))[:2048]
    return str(answer)[:2048]


class Rollout:
    """Synchronous :class:`AsyncRollout` (for TRL's rollout_func and other sync code)."""

    def __init__(self, gateways: Sequence[str], **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._async = self._runner.run(_make(gateways, kwargs))

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> list[Group]:
        result: list[Group] = self._runner.run(self._async.generate(prompts, **kwargs))
        return result

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        result: list[str] = self._runner.run(self._async.abort(request_ids))
        return result

    def update_weights(self, path: str, version: str, **kwargs: Any) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = self._runner.run(
            self._async.update_weights(path, version, **kwargs)
        )
        return result

    def close(self) -> None:
        try:
            self._runner.run(self._async.close())
        finally:
            self._runner.close()

    def __enter__(self) -> Rollout:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _make(gateways: Sequence[str], kwargs: dict[str, Any]) -> AsyncRollout:
    return AsyncRollout(gateways, **kwargs)


# -- partial rollout -----------------------------------------------------------------------


@dataclass(frozen=True)
class CarriedResponse:
    """A response that was in flight at a step's end: its group and its tokens per
    weight version (oldest first)."""

    request_id: str
    group_id: str
    tokens_by_version: tuple[tuple[str, int], ...]

    @property
    def tokens(self) -> int:
        return sum(t for _, t in self.tokens_by_version)


@dataclass(frozen=True)
class PartialStep:
    """What one step of a :class:`PartialRollout` gives and keeps.

    ``groups``: the complete groups for the trainer, in training order (oldest first
    token first); ``started``: fresh groups this step started; ``carried``: the responses
    still in flight, carried into the next step, with their tokens so far per version
    (a token counts for the version the rollout was told of when it arrived);
    ``carried_groups`` their groups; ``waiting``: complete groups kept for the next
    batch; ``resumed``: the trained responses that had been carried out of an earlier
    step, with their exact tokens per version; ``dropped``: groups dropped as too stale
    (their ``dropped_responses`` aborted or discarded, ``dropped_tokens`` generated);
    ``tokens_by_version``: the trained tokens per version; ``step_tokens``: tokens
    received during the step."""

    version: str
    groups: tuple[Group, ...]
    started: int
    carried: tuple[CarriedResponse, ...]
    carried_groups: tuple[str, ...]
    waiting: tuple[str, ...]
    resumed: tuple[CarriedResponse, ...]
    dropped: tuple[str, ...]
    dropped_responses: int
    dropped_tokens: int
    tokens_by_version: tuple[tuple[str, int], ...]
    step_tokens: int
    elapsed_s: float

    @property
    def trained_tokens(self) -> int:
        return sum(t for _, t in self.tokens_by_version)

    @property
    def offpolicy_tokens(self) -> int:
        """Trained tokens made by an older version than the step's."""
        return sum(t for v, t in self.tokens_by_version if v != self.version)

    @property
    def offpolicy_share(self) -> float:
        return partial_rollout.offpolicy_share(self.tokens_by_version, self.version)


@dataclass
class _Open:
    """A group started and not yet handed to the trainer nor dropped (shell state)."""

    group_id: str
    prompt: tuple[int, ...]
    order: int
    n: int
    logprobs: bool
    ids: list[str] = field(default_factory=list)
    gateway: str = ""
    tokens: list[list[int]] = field(default_factory=list)
    lps: list[list[float]] = field(default_factory=list)
    counts: list[dict[int, int]] = field(default_factory=list)  # version index -> tokens
    finals: list[Mapping[str, Any] | None] = field(default_factory=list)
    # of a finished response, once the rollout knows its versions (at the next step)
    pieces: list[tuple[partial_rollout.Piece, ...] | None] = field(default_factory=list)
    task: asyncio.Task[str] | None = None

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.n)]
        self.lps = [[] for _ in range(self.n)]
        self.counts = [{} for _ in range(self.n)]
        self.finals = [None] * self.n
        self.pieces = [None] * self.n

    def rid(self, i: int) -> str:
        return self.ids[i] if self.ids else f"{self.group_id}#{i}"  # (not sent yet)

    def sample(self, i: int) -> Sample:
        final = self.finals[i]
        assert final is not None
        orl = final.get("orl") or {}
        tokens = tuple(self.tokens[i])
        return Sample(
            str(orl.get("request_id", self.rid(i))),
            tokens,
            tuple(self.lps[i]) if self.logprobs else None,
            _versions(orl.get("weight_versions"), len(tokens)),
            str(final.get("finish_reason") or ""),
            tuple(str(x) for x in orl.get("nodes") or ()),
            self.gateway,
            tuple(int(x) for x in orl.get("node_starts") or ()),
        )


class PartialRollout:
    """Partial rollout across RL steps over an :class:`AsyncRollout`'s gateways (Kimi
    k1.5's partial rollout, APRIL's over-provisioning, AReaL's interruptible rollout).

    Each :meth:`step` runs on one weight version: it starts fresh groups (one streamed
    ``/v1/completions`` call of ``n`` samples each, every request marked
    ``on_weight_update: "resume"``) so that the groups open are ``over_provision x
    groups_per_step`` (:meth:`to_start` says how many prompts it needs), and returns when
    the rule is met (``end``: ``groups_per_step`` complete groups; a token budget; a time
    budget; or nothing left in flight), handing over only complete groups. The
    unfinished calls stay open: the engines go on generating them, and a weight update
    with ``in_flight="resume"`` (:meth:`AsyncRollout.update_weights`, or the controller's
    weight-sync phase) continues them on the new weights, so the next step finds them
    further on, each token tagged with its version. A group that would be trained more
    than ``max_staleness`` versions after its oldest token is dropped whole (its
    unfinished responses aborted on their gateways) and counted. The decisions are
    :mod:`orchestrrl.partial_rollout`'s (the simulator's rule, :mod:`scheduler.rollout`).

    A call that fails fails the step (RolloutError naming the group; the others stay
    in flight). :meth:`close` aborts everything still in flight."""

    def __init__(
        self,
        rollout: AsyncRollout,
        rule: partial_rollout.RolloutRule,
        groups_per_step: int,
        *,
        n: int,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: bool = True,
    ) -> None:
        self.rule = partial_rollout.check_rule(rule)
        if (
            isinstance(groups_per_step, bool)
            or not isinstance(groups_per_step, int)
            or not (1 <= groups_per_step <= 100_000)
        ):
            raise errors.field_error("groups_per_step", groups_per_step, "an integer 1..100000")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise errors.field_error("n", n, f"an integer in 1..{MAX_N}")
        self.rollout = rollout
        self.groups_per_step = groups_per_step
        self.n = n
        self.seed = seed
        self.logprobs = logprobs
        self._body: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": ignore_eos,
            "logprobs": 0 if logprobs else None,
            "on_weight_update": "resume",
        }
        self.versions: tuple[str, ...] = ()  # every version stepped on, oldest first
        self._open: dict[str, _Open] = {}
        self._started = 0  # groups ever started (their arrival order, and seeds)
        self._carried: set[str] = set()  # response ids in flight at some step's end
        self._received = 0  # tokens received in all
        self._changed = asyncio.Event()
        self.dropped_responses = 0  # in all steps
        self.dropped_groups = 0

    @property
    def open_groups(self) -> int:
        """Groups started and neither trained nor dropped (in flight, or complete and
        waiting for a batch)."""
        return len(self._open)

    def to_start(self) -> int:
        """Fresh prompts the next step starts: up to ``over_provision x groups_per_step``
        groups open."""
        return partial_rollout.groups_to_start(self.rule, self.groups_per_step, len(self._open))

    def in_flight(self) -> list[str]:
        """The request ids still generating."""
        return [g.rid(i) for g in self._open.values() for i in range(g.n) if g.finals[i] is None]

    async def step(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        version: str,
        group_ids: Sequence[str] | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> PartialStep:
        """Run one step on weight ``version`` (the version the gateways serve now:
        the first step's, or the one just pushed), starting ``prompts`` (exactly
        :meth:`to_start` of them; ``group_ids`` name them, distinct from the groups open)."""
        checked = _check_prompts(prompts)
        need = self.to_start()
        if len(checked) != need:
            raise errors.field_error(
                "prompts",
                f"{len(checked)} prompts",
                f"{need} (to_start(): {self.rule.over_provision:g} x {self.groups_per_step} "
                f"groups open, {len(self._open)} open now)",
            )
        ids = (
            list(group_ids)
            if group_ids is not None
            else [f"g{self._started + k}-{uuid.uuid4().hex[:8]}" for k in range(need)]
        )
        if len(ids) != need or len(set(ids)) != need or set(ids) & set(self._open):
            raise errors.field_error(
                "group_ids", ids, f"{need} distinct ids, none of a group open ({len(self._open)})"
            )
        order = partial_rollout.version_order(self.versions, version)
        self.versions = order
        current = len(order) - 1
        t0 = now()
        tokens0 = self._received
        for gid, prompt in zip(ids, checked, strict=True):
            self._start(gid, prompt)
        while True:
            self._changed.clear()
            self._raise_failed()
            states = self._states()
            elapsed = max(0.0, now() - t0)
            p = partial_rollout.progress(
                self.rule, current, states, elapsed_s=elapsed, tokens=self._received - tokens0
            )
            if partial_rollout.step_done(self.rule, self.groups_per_step, p):
                break
            timeout = None
            if self.rule.end is partial_rollout.StepEnd.TIME:
                timeout = max(0.0, self.rule.time_budget_s - elapsed)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
        closed = partial_rollout.close_step(self.rule, current, self.groups_per_step, states)
        return await self._close_step(closed, need, version, now() - t0, tokens0)

    async def close(self) -> list[str]:
        """Abort every response still in flight and forget the open groups; the ids
        aborted."""
        groups = list(self._open.values())
        self._open.clear()
        return await self._drop(groups)

    # -- the shell's bookkeeping --

    def _start(self, gid: str, prompt: tuple[int, ...]) -> None:
        k = self._started
        self._started += 1
        g = _Open(gid, prompt, k, self.n, self.logprobs)
        body = {**self._body, "prompt": list(prompt), "group": gid}
        if self.seed is not None:
            body["seed"] = self.seed + k * self.n

        def on_start(gateway: str, ids: list[str]) -> None:
            g.gateway, g.ids = gateway, list(ids)

        def on_choice(choice: Mapping[str, Any]) -> None:
            i = int(choice["index"])
            tokens = [int(t) for t in choice.get("token_ids") or ()]
            if tokens:
                g.tokens[i] += tokens
                lp = choice.get("logprobs")
                if lp is not None:
                    g.lps[i] += [float(x) for x in lp["token_logprobs"]]
                v = len(self.versions) - 1
                g.counts[i][v] = g.counts[i].get(v, 0) + len(tokens)
                self._received += len(tokens)
            if choice.get("finish_reason") is not None:
                g.finals[i] = choice
            self._changed.set()

        g.task = asyncio.get_running_loop().create_task(
            self.rollout.stream(body, f"{gid}-{uuid.uuid4().hex[:6]}", self.n, on_start, on_choice)
        )
        g.task.add_done_callback(lambda _: self._changed.set())
        self._open[gid] = g

    def _states(self) -> list[partial_rollout.GroupState]:
        out = []
        for g in self._open.values():
            responses = []
            for i in range(g.n):
                final = g.finals[i]
                if final is None:
                    pieces = partial_rollout.pieces_from_counts(g.counts[i])
                elif (known := g.pieces[i]) is not None:
                    pieces = known
                else:  # exact, from the gateway's version runs (computed once)
                    orl = final.get("orl") or {}
                    labels = _versions(orl.get("weight_versions"), len(g.tokens[i]))
                    pieces = g.pieces[i] = partial_rollout.pieces_of(labels, self.versions)
                responses.append((g.rid(i), final is not None, pieces))
            out.append(partial_rollout.group_state(g.group_id, g.n, g.order, responses))
        return out

    def _raise_failed(self) -> None:
        for gid, g in list(self._open.items()):
            if g.task is None or not g.task.done():
                continue
            exc = None if g.task.cancelled() else g.task.exception()
            if exc is None and all(f is not None for f in g.finals):
                continue
            del self._open[gid]
            if exc is None:
                exc = RolloutError(f"the call ended before {g.n - sum(1 for f in g.finals if f)} "
                                   "of its samples did")  # fmt: skip
            raise RolloutError(f"group {gid!r} failed: {exc}") from exc

    async def _drop(self, groups: Sequence[_Open]) -> list[str]:
        """Abort the unfinished responses of ``groups`` on their gateways and end their
        calls; the ids aborted."""
        aborted: list[str] = []
        for g in groups:
            ids = [g.rid(i) for i in range(g.n) if g.finals[i] is None and g.ids]
            if ids and not await self.rollout.abort(ids):  # all or none
                aborted += ids
                continue
            for rid in ids:  # some ended meanwhile: the others one by one
                if not await self.rollout.abort([rid]):
                    aborted.append(rid)
        for g in groups:
            if g.task is not None and not g.task.done():
                g.task.cancel()
        await asyncio.gather(
            *(g.task for g in groups if g.task is not None), return_exceptions=True
        )
        return aborted

    async def _close_step(
        self,
        closed: partial_rollout.StepClose,
        started: int,
        version: str,
        elapsed_s: float,
        tokens0: int,
    ) -> PartialStep:
        dropped = [self._open.pop(gid) for gid in closed.dropped]
        await self._drop(dropped)
        self.dropped_groups += len(dropped)
        self.dropped_responses += closed.dropped_responses
        trained = [self._open.pop(gid) for gid in closed.trained]
        groups = tuple(
            Group(g.prompt, g.group_id, tuple(g.sample(i) for i in range(g.n))) for g in trained
        )
        # their calls end (every sample had its final event)
        await asyncio.gather(*(g.task for g in trained if g.task), return_exceptions=True)
        resumed = tuple(
            CarriedResponse(s.request_id, grp.group_id, _runs(s.versions))
            for grp in groups
            for s in grp.samples
            if s.request_id in self._carried
        )
        self._carried -= {s.request_id for grp in groups for s in grp.samples}
        carried: list[CarriedResponse] = []
        for gid in closed.carried_groups:
            g = self._open[gid]
            for i in range(g.n):
                if g.finals[i] is None:
                    rid = g.rid(i)
                    self._carried.add(rid)
                    counts = sorted(g.counts[i].items())
                    carried.append(
                        CarriedResponse(rid, gid, tuple((self.versions[v], t) for v, t in counts))
                    )
        for g in dropped:
            self._carried -= {g.rid(i) for i in range(g.n)}
        return PartialStep(
            version=version,
            groups=groups,
            started=started,
            carried=tuple(carried),
            carried_groups=closed.carried_groups,
            waiting=closed.waiting,
            resumed=resumed,
            dropped=closed.dropped,
            dropped_responses=closed.dropped_responses,
            dropped_tokens=closed.dropped_tokens,
            tokens_by_version=partial_rollout.tokens_by_version(
                s.versions for grp in groups for s in grp.samples
            ),
            step_tokens=self._received - tokens0,
            elapsed_s=elapsed_s,
        )


def _runs(versions: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """Per-token labels as (version, tokens) runs."""
    out: list[tuple[str, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)

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
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from orchestrrl import errors
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
    finish_reason: str  # "length" or "stop"
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
    ) -> list[Group]:
        """``n`` samples of each prompt, as groups in the prompts' order. ``group_ids``
        name the groups (e.g. the prompts' dataset indices: the controller remembers a
        prompt's lengths across epochs by it); ``seed`` ``s`` gives prompt ``k`` the seeds
        ``s + k*n ...``; ``on_weight_update``: "finish" or "resume" (see the gateway)."""
        checked = _check_prompts(prompts)
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

    async def _complete(
        self, body: dict[str, Any], rid: str, n: int, down: set[str]
    ) -> tuple[list[dict[str, Any]], str]:
        """Send one completion to the least-loaded reachable gateway: its choices."""
        attempt = 0
        full = 0
        while True:
            live = [g for g in self.gateways if g not in down]
            if not live:
                raise errors.Unavailable(
                    f"no gateway could be reached ({', '.join(self.gateways)})"
                )
            gateway = min(live, key=lambda g: self._outstanding[g])
            this_id = rid if attempt == 0 else f"{rid}-r{attempt}"
            attempt += 1
            ids = [this_id] if n == 1 else [f"{this_id}-{i}" for i in range(n)]
            self._outstanding[gateway] += n
            for i in ids:
                self._where[i] = gateway
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
                self._outstanding[gateway] -= n
                for i in ids:
                    self._where.pop(i, None)
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

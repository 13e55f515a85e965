"""Requests handed between gateways: what a migrating request carries, how an import is
checked, and who follows a request on another node.

Pure: the gateway's core calls these; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from node_agent.engine import ImportResult, MigratingRequest, StageTiming
from node_agent.gateway.requests import ImportedState, Request, Where, parse_engine_state
from orchestrrl import errors

DONE_KEPT_S = 300.0  # a finished imported request is kept this long for its follower


def exported(req: Request, instance: int) -> MigratingRequest:
    """``req``'s state for ExportRequests (``instance``: where it ran, -1: queued)."""
    return MigratingRequest(
        request_id=req.id,
        prompt_tokens=len(req.prompt),
        generated_tokens=len(req.output),
        max_tokens=req.max_tokens,
        source_instance=instance,
        kv_bytes=0,
        prompt_token_ids=req.prompt,
        output_token_ids=tuple(req.output),
        engine_state=req.engine_state(),
        group=req.group,
    )


def check_imports(
    requests: Sequence[MigratingRequest], known: Mapping[str, Request]
) -> list[tuple[MigratingRequest, ImportedState]]:
    """Each request with its parsed state; InvalidArgument naming the first bad one. A
    request ``known`` here may come home (followed elsewhere) or move between this node's
    instances (held here), with the output it had here as a prefix; nothing else."""
    if not requests:
        raise errors.field_error("requests", [], "at least one request to import")
    counts = collections.Counter(m.request_id for m in requests)
    dup = sorted(i for i, n in counts.items() if n > 1)
    if dup:
        raise errors.field_error("requests", dup, "each request id once per import")
    out = []
    for k, m in enumerate(requests):
        f = f"requests[{k}]"
        if not m.prompt_token_ids:
            raise errors.field_error(
                f"{f}.prompt_token_ids", [], "the prompt's token ids (a gateway export)"
            )
        if m.max_tokens < 1 or len(m.output_token_ids) > m.max_tokens:
            raise errors.field_error(
                f"{f}.max_tokens",
                m.max_tokens,
                f"an output cap >= 1 and >= the {len(m.output_token_ids)} tokens generated",
            )
        have = known.get(m.request_id)
        if have is not None and not (
            have.where in (Where.REMOTE, Where.HELD)
            and tuple(m.output_token_ids[: len(have.output)]) == tuple(have.output)
            and have.prompt == m.prompt_token_ids
        ):
            raise errors.field_error(
                f"{f}.request_id",
                m.request_id,
                f"a request this node does not have yet (it is {have.where.value} here)",
            )
        out.append((m, parse_engine_state(m.engine_state, len(m.output_token_ids))))
    return out


def import_result(
    admitted: Sequence[str], tokens: int, seated: int, instance: int, what: str, note: str
) -> ImportResult:
    """What an import answers: the ids admitted (``seated`` of them on ``instance``, the
    rest queued for the node's next free seat), resubmitted: their KV is recomputed."""
    waiting = len(admitted) - seated
    return ImportResult(
        tuple(admitted),
        instance,
        0,
        tokens,
        (StageTiming("admit", 0.0),),
        f"{seated} request(s) on instance {instance} ({what})"
        + (f", {waiting} queued for this node's next free seat" if waiting else "")
        + ": resubmitted with their output so far, the engine recomputes their KV cache"
        + (f" ({note})" if note else ""),
    )


class Followers:
    """Who follows which request: imported requests are followed by their source (its
    client reads them there); one that loses its follower is aborted after a grace
    period, a finished one forgotten after ``DONE_KEPT_S``. Also the failed tries of
    this node's follows of requests it released elsewhere."""

    def __init__(self, orphan_grace_s: float, retries: int) -> None:
        self.orphan_grace_s = orphan_grace_s
        self.retries = retries
        self._count: collections.Counter[str] = collections.Counter()
        # imported request -> when it lost its follower (None: timed from the next reap)
        self._since: dict[str, float | None] = {}
        self._tries: dict[str, int] = {}

    def followed(self, request_id: str) -> bool:
        return self._count[request_id] > 0

    def attached(self, request_id: str) -> None:
        self._count[request_id] += 1
        self._since.pop(request_id, None)

    def detached(self, request_id: str) -> bool:
        """A follower went away; True when it was the last."""
        self._count[request_id] -= 1
        if self._count[request_id] > 0:
            return False
        del self._count[request_id]
        return True

    def orphaned(self, request_id: str, now: float | None) -> None:
        """Nobody follows it (yet): the grace starts at ``now`` (None: at the next reap,
        unless it started already)."""
        if now is None:
            self._since.setdefault(request_id, None)
        else:
            self._since[request_id] = now

    def forget(self, request_id: str) -> None:
        self._since.pop(request_id, None)

    def due(self, now: float, requests: Mapping[str, Request]) -> list[Request]:
        """The unfollowed requests whose grace is over (to forget when done, to abort
        otherwise), no longer watched."""
        out = []
        for rid, since in list(self._since.items()):
            req = requests.get(rid)
            if req is None:
                del self._since[rid]
                continue
            if since is None:
                self._since[rid] = since = now
            if now - since >= (DONE_KEPT_S if req.done else self.orphan_grace_s):
                del self._since[rid]
                out.append(req)
        return out

    # -- this node following a request on another node --

    def start_following(self, request_id: str) -> None:
        self._tries[request_id] = 0

    def following(self, request_id: str) -> bool:
        return request_id in self._tries

    def progressed(self, request_id: str) -> None:
        if request_id in self._tries:
            self._tries[request_id] = 0

    def retry(self, request_id: str, final: bool) -> int | None:
        """After a lost follow: the try number to make (None: give up, stop following)."""
        tries = self._tries.get(request_id, 0) + 1
        if final or tries > self.retries:
            self._tries.pop(request_id, None)
            return None
        self._tries[request_id] = tries
        return tries

    def stop_following(self, request_id: str) -> None:
        self._tries.pop(request_id, None)

"""Request migration on the source node: exported requests are held until resolved.

A migration is orchestrated by the controller in three idempotent steps (each with its
own ``command_id``):

1. ``ExportRequests`` on the source: the engine takes the requests off their instances
   (they stop decoding) and the agent *holds* their state under the export's id;
2. ``ImportRequests`` on the destination: all of them are admitted on one instance (KV
   moved or recomputed), or none;
3. ``ResolveExport`` on the source: ``restore=False`` forgets the held requests (the
   destination has them), ``restore=True`` puts them back where they were.

Nothing is lost when a step fails or the controller goes away: a hold that is not
resolved within its ``hold_s`` restores the requests on the source by itself, and so
does closing the agent. (A controller that dies *after* a successful import and before
resolving leaves the request on both nodes once the hold expires: at-least-once, said
in the log; a duplicate is preferred over a lost rollout.)
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from node_agent.engine import Destination, MigratingRequest, RolloutEngine, check_group
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.v1 import node_agent_pb2

log = get_logger("node_agent.migration")

DEFAULT_HOLD_S = 60.0
MAX_HOLD_S = 3600.0
_RESOLVED_KEPT = 1024


@dataclass(frozen=True)
class Resolution:
    restored: tuple[str, ...]
    released: tuple[str, ...]
    message: str


@dataclass
class _Hold:
    requests: tuple[MigratingRequest, ...]
    timer: asyncio.Task[None] | None = None


def check_hold(hold_s: float) -> float:
    """``hold_s`` of an ExportRequests (0: the default)."""
    if not math.isfinite(hold_s) or hold_s < 0 or hold_s > MAX_HOLD_S:
        raise errors.field_error(
            "hold_s", hold_s, f"seconds in (0, {MAX_HOLD_S:g}], or 0 for the default"
        )
    return hold_s or DEFAULT_HOLD_S


class Exports:
    """The requests this node exported and has not resolved yet, by export command id."""

    def __init__(self, engine: RolloutEngine) -> None:
        self._engine = engine
        self._holds: dict[str, _Hold] = {}
        self._resolved: collections.OrderedDict[str, Resolution] = collections.OrderedDict()

    def held(self) -> dict[str, tuple[str, ...]]:
        """Request ids held per export id (for status and tests)."""
        return {k: tuple(m.request_id for m in h.requests) for k, h in self._holds.items()}

    async def export(
        self, export_id: str, request_ids: Sequence[str], hold_s: float
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        hold = check_hold(hold_s)
        ids = list(request_ids)
        if not ids:
            raise errors.field_error("request_ids", ids, "at least one request id")
        if len(set(ids)) != len(ids):
            raise errors.field_error("request_ids", ids, "distinct request ids")
        if export_id in self._holds or export_id in self._resolved:
            raise errors.FailedPrecondition(f"export {export_id!r} was already made")
        exported, missing = await self._engine.export_requests(ids)
        if exported:
            entry = _Hold(exported)
            entry.timer = asyncio.ensure_future(self._expire_after(export_id, hold))
            self._holds[export_id] = entry
        log.info(
            "requests_exported",
            export=export_id,
            requests=[m.request_id for m in exported],
            missing=list(missing),
            hold_s=hold,
        )
        return exported, missing

    async def resolve(
        self, export_id: str, restore: bool, destination: Destination | None = None
    ) -> Resolution:
        """Restore the held requests here, or release them to ``destination`` (the engine
        follows them there when its clients read them here)."""
        done = self._resolved.get(export_id)
        if done is not None:
            return done
        entry = self._holds.pop(export_id, None)
        if entry is None:
            raise errors.NotFound(
                f"export {export_id!r}: no requests held under this id "
                "(never exported here, or it exported none)"
            )
        if entry.timer is not None:
            entry.timer.cancel()
        ids = tuple(m.request_id for m in entry.requests)
        if restore:
            restored = await self._engine.restore_requests(entry.requests)
            result = Resolution(restored, (), f"{len(restored)} request(s) restored on this node")
        else:
            await self._engine.release_requests(entry.requests, destination)
            to = f"to {destination.node}" if destination is not None else "to the destination"
            result = Resolution((), ids, f"{len(ids)} request(s) released {to}")
        self._remember(export_id, result)
        log.info("export_resolved", export=export_id, restore=restore, requests=list(ids))
        return result

    async def close(self) -> None:
        """Restore every held request (shutdown): nothing exported is lost."""
        for export_id in list(self._holds):
            await self._restore_expired(export_id, "the agent is stopping")

    async def _expire_after(self, export_id: str, hold_s: float) -> None:
        await asyncio.sleep(hold_s)
        await self._restore_expired(export_id, f"not resolved within {hold_s:g} s")

    async def _restore_expired(self, export_id: str, why: str) -> None:
        entry = self._holds.pop(export_id, None)
        if entry is None:
            return
        if entry.timer is not None and entry.timer is not asyncio.current_task():
            entry.timer.cancel()
        restored = await self._engine.restore_requests(entry.requests)
        log.warning("export_expired_restored", export=export_id, why=why, requests=list(restored))
        self._remember(
            export_id,
            Resolution(
                restored,
                (),
                f"{len(restored)} request(s) restored on this node: export {why} "
                "(if the destination admitted them too, they now run on both)",
            ),
        )

    def _remember(self, export_id: str, result: Resolution) -> None:
        self._resolved[export_id] = result
        while len(self._resolved) > _RESOLVED_KEPT:
            self._resolved.popitem(last=False)


# -- protobuf mapping -------------------------------------------------------------------


def state_to_pb(m: MigratingRequest) -> node_agent_pb2.RequestState:
    return node_agent_pb2.RequestState(
        request_id=m.request_id,
        prompt_tokens=m.prompt_tokens,
        generated_tokens=m.generated_tokens,
        max_tokens=m.max_tokens,
        source_instance=m.source_instance,
        kv_bytes=m.kv_bytes,
        prompt_token_ids=m.prompt_token_ids,
        output_token_ids=m.output_token_ids,
        engine_state=m.engine_state,
        group=m.group,
    )


def state_from_pb(p: node_agent_pb2.RequestState) -> MigratingRequest:
    if not p.request_id:
        raise errors.field_error("requests[].request_id", p.request_id, "a non-empty id")
    return MigratingRequest(
        request_id=p.request_id,
        prompt_tokens=p.prompt_tokens,
        generated_tokens=p.generated_tokens,
        max_tokens=p.max_tokens,
        source_instance=p.source_instance,
        kv_bytes=p.kv_bytes,
        prompt_token_ids=tuple(p.prompt_token_ids),
        output_token_ids=tuple(p.output_token_ids),
        engine_state=p.engine_state,
        group=check_group(p.group, "requests[].group"),
    )


def recompute_from_pb(method: node_agent_pb2.MigrationMethod.ValueType) -> bool:
    if method == node_agent_pb2.MIGRATION_METHOD_KV:
        return False
    if method == node_agent_pb2.MIGRATION_METHOD_RECOMPUTE:
        return True
    raise errors.field_error("method", method, "MIGRATION_METHOD_KV or MIGRATION_METHOD_RECOMPUTE")

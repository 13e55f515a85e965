"""Weight sync as a phase that moves bytes: the controller's decisions (pure, no I/O).

``orlctl phase set weight-sync --checkpoint V --from NODE`` (``SetPhase`` with a
``checkpoint``) runs in this order (the shell: :mod:`fabric_controller.weight_sync_runner`):

1. the request is checked (:func:`check_spec`) and the source's agent is asked for the
   checkpoint (its checksum and size) before anything changes: a source that is down or
   does not hold it changes no circuit;
2. the weight-sync epoch is planned, programmed and committed as any phase change;
3. still holding the phase lock (no other phase change moves the circuits under the
   bytes), every generation node of the wiring that is up gets ``UpdateWeights`` at once
   (:func:`targets`; each with a command id that a retried request repeats,
   :func:`command_id`, so an agent answers a retry with its first result); a node that is
   down is reported without a command;
4. the answer (:func:`build_report`) says, per node, the bytes, the seconds, MB/s, the
   circuits between the source's pod and its pod, the version it serves now and why it
   did not take the new one; and when every generation node runs the new version.

What the controller does when a node fails: the epoch stays committed (its circuits are
the weight-sync phase's whatever the bytes did); the failed node keeps the version it had
(its agent loads all or nothing), the report names it and the error, and the answer is
not an error status: the caller (``orlctl``, the Python client) turns an incomplete sync
into a failure it can act on, typically by retrying the same request id, which re-sends
the commands (nodes that took the version answer with their first result at once).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrrl import checkpoint, errors
from orchestrrl.model import Circuit, Phase, Role, Wiring

IN_FLIGHT = ("finish", "resume")
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 86400.0
DEFAULT_STREAMS = 4
MAX_STREAMS = 16
CHECKSUM_DIGITS = 64


@dataclass(frozen=True)
class SyncSpec:
    """A checked weight-sync request."""

    version: str
    source: str  # the node whose agent serves the checkpoint
    checksum: str  # "" until the source names it
    in_flight: str  # finish | resume
    timeout_s: float  # per node, fetch and load
    streams: int  # connections per node


def check_spec(
    wiring: Wiring,
    phase: Phase,
    version: str,
    source: str,
    checksum: str = "",
    in_flight: str = "",
    timeout_s: float = 0.0,
    streams: int = 0,
) -> SyncSpec:
    """InvalidArgument naming the field (``checkpoint.version``, ...) and what is allowed."""
    if phase is not Phase.WEIGHT_SYNC:
        raise errors.field_error(
            "checkpoint",
            f"version {version!r}",
            f"only with phase {Phase.WEIGHT_SYNC.value} (the phase asked for is {phase.value})",
        )
    checkpoint.check_version(version, "checkpoint.version")
    if not source:
        raise errors.field_error(
            "checkpoint.source_node", source, "the node whose agent serves the checkpoint"
        )
    names = [n.name for n in wiring.nodes]
    if source not in names:
        raise errors.field_error(
            "checkpoint.source_node",
            source,
            "a node of the wiring: " + errors.listed(names, ", "),
        )
    if checksum and not (
        len(checksum) == CHECKSUM_DIGITS and all(c in "0123456789abcdef" for c in checksum)
    ):
        raise errors.field_error(
            "checkpoint.checksum", checksum, '64 lowercase hex digits, or "": the newest'
        )
    if in_flight not in ("", *IN_FLIGHT):
        raise errors.field_error(
            "checkpoint.in_flight",
            in_flight,
            '"finish" (in-flight requests end on the old weights; the default) or "resume"',
        )
    if timeout_s == 0:
        timeout_s = DEFAULT_TIMEOUT_S
    elif not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise errors.field_error(
            "checkpoint.timeout_s", timeout_s, f"seconds in (0, {MAX_TIMEOUT_S:g}], 0: default"
        )
    if streams == 0:
        streams = DEFAULT_STREAMS
    elif not 1 <= streams <= MAX_STREAMS:
        raise errors.field_error(
            "checkpoint.streams", streams, f"1..{MAX_STREAMS}, 0: {DEFAULT_STREAMS}"
        )
    return SyncSpec(version, source, checksum, in_flight or "finish", timeout_s, streams)


@dataclass(frozen=True)
class Source:
    """The checkpoint as its source's agent described it."""

    node: str
    address: str  # where the generation nodes fetch from (its checkpoint_listen, or agent)
    checksum: str
    size: int


@dataclass(frozen=True)
class NodeSeen:
    """What the registry knows of a node: health, agent address, served version."""

    node: str
    up: bool
    address: str
    version: str  # from its newest telemetry ("" unknown)
    why_not: str = ""  # why it is not up


def targets(
    wiring: Wiring, seen: Iterable[NodeSeen]
) -> tuple[tuple[NodeSeen, ...], tuple[NodeSeen, ...]]:
    """The generation nodes of the wiring, in wiring order: those that get the command
    (up, with an agent address) and those reported without one."""
    by_name = {s.node: s for s in seen}
    send: list[NodeSeen] = []
    skip: list[NodeSeen] = []
    for n in wiring.nodes:
        if n.role is not Role.GEN:
            continue
        s = by_name.get(n.name) or NodeSeen(n.name, False, "", "", "never registered")
        (send if s.up and s.address else skip).append(s)
    return tuple(send), tuple(skip)


def command_id(request_id: str, nonce: str, spec: SyncSpec, checksum: str, node: str) -> str:
    """The node's UpdateWeights command id: the same for a retried request (same
    ``request_id``, version and checksum), so the agent answers the retry with its first
    result; ``nonce`` (random) when the request has no id. At most 40 characters."""
    key = f"{request_id or nonce}|{spec.version}|{checksum}|{node}"
    return "ws-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def circuits_between(wiring: Wiring, circuits: Iterable[Circuit], a: str, b: str) -> int:
    """Circuits of the epoch between the pods of nodes ``a`` and ``b`` (0: same pod, whose
    traffic stays on its ToR, or no circuit)."""
    pa, pb = wiring.node(a).pod, wiring.node(b).pod
    if pa == pb:
        return 0
    return sum(1 for c in circuits if set(wiring.circuit_pods(c)) == {pa, pb})


@dataclass(frozen=True)
class NodeOutcome:
    node: str
    ok: bool
    version: str  # served now (after a failure: the old one, as last reported)
    previous: str = ""
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    load_seconds: float = 0.0
    seconds: float = 0.0
    error: str = ""
    how: str = ""
    resumes: int = 0
    cached: bool = False
    circuits: int = 0
    finished_at: float = 0.0  # seconds since the Unix epoch
    streams: int = 0

    @property
    def mbytes_per_s(self) -> float:
        if self.bytes_fetched <= 0 or self.fetch_seconds <= 0:
            return 0.0
        return self.bytes_fetched / self.fetch_seconds / 1e6


@dataclass(frozen=True)
class SyncReport:
    version: str
    checksum: str
    source: str
    source_address: str
    checkpoint_bytes: int
    epoch: int
    nodes: tuple[NodeOutcome, ...]
    seconds: float
    complete: bool
    completed_at: float
    message: str


def build_report(
    spec: SyncSpec,
    source: Source,
    epoch: int,
    outcomes: Sequence[NodeOutcome],
    seconds: float,
    note: str = "",
) -> SyncReport:
    """The answer: complete when every generation node runs the version (a wiring without
    generation nodes is not: there is nothing to run it); ``completed_at`` is then when the
    last one said so. ``note``: what the phase change said (a kept topology)."""
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    complete = bool(outcomes) and not failed
    completed_at = max(o.finished_at for o in ok) if complete else 0.0
    moved = sum(o.bytes_fetched for o in outcomes)
    if not outcomes:
        message = "no generation node in the wiring: nothing runs the new version"
    elif complete:
        message = (
            f"version {spec.version} serves on all {len(ok)} generation node(s): "
            f"{moved} bytes fetched from {source.node} in {seconds:.2f} s"
        )
    else:
        why = errors.listed((f"{o.node}: {o.error}" for o in failed), "; ")
        message = (
            f"version {spec.version} serves on {len(ok)} of {len(outcomes)} generation "
            f"node(s); {len(failed)} kept the version they had: {why}"
        )
    if note:
        message += f" ({note})"
    return SyncReport(
        spec.version,
        source.checksum,
        source.node,
        source.address,
        source.size,
        epoch,
        tuple(outcomes),
        seconds,
        complete,
        completed_at,
        errors.bounded(message, 1500),
    )

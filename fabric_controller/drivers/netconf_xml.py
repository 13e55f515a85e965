"""The pure part of the NETCONF OCS driver: the YANG module's XML, both ways.

No I/O: :mod:`fabric_controller.drivers.netconf` sends what these functions build and
hands them what the switch answered. The module is ours,
``fabric_controller/drivers/yang/orchestrrl-optical-switch@2026-12-06.yang``, modelled on
Polatis's ``optical-switch`` (opsw) module; the mapping, in one place:

- a circuit ``(a, b)`` of the controller (bidirectional, ``a < b``) is the two
  cross-connect pairs ``ingress a -> egress b`` and ``ingress b -> egress a``
  (``/cross-connects/pair``, keyed by ingress, opsw's list);
- the table the driver reports holds every circuit whose two pairs are present, and a
  pair without its reverse (a half circuit, written by someone else) as the circuit of its
  two ports with both ports counted as down: the controller then removes it and plans
  around the ports until it is gone;
- a port is down (not usable for a new circuit) when its ``admin-state`` is
  ``disabled``, when the switch reports an ``oper-state`` other than ``up``, or when it
  carries a half circuit; ports the switch does not list are its business (a batch that
  uses one is refused by the server's leafref check);
- every batch also writes ``/controller/last-batch`` (the batch's id, with
  :confirmed-commit:1.1 the persist-id of its confirmed commit) and, under controller
  HA, ``/controller/fencing-token``, in the same commit.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from xml.sax.saxutils import escape

from orchestrrl import errors

PortPair = tuple[int, int]

NS = "urn:orchestrrl:yang:optical-switch"
MODULE = "orchestrrl-optical-switch"
REVISION = "2026-12-06"
NC_NS = "urn:ietf:params:xml:ns:netconf:base:1.0"
CAP_CANDIDATE = "urn:ietf:params:netconf:capability:candidate:1.0"
CAP_CONFIRMED_COMMIT_11 = "urn:ietf:params:netconf:capability:confirmed-commit:1.1"
CAP_WRITABLE_RUNNING = "urn:ietf:params:netconf:capability:writable-running:1.0"
CAP_ROLLBACK_ON_ERROR = "urn:ietf:params:netconf:capability:rollback-on-error:1.0"
MAX_PORT = 65535  # the module's port-id range
MAX_BATCH_ID = 128  # /controller/last-batch length

# The <get> subtree filter (one element each) for everything the driver reads: ports
# (with their states), cross-connects and the controller's leaves.
STATE_FILTER = (
    f'<ports xmlns="{NS}"/>',
    f'<cross-connects xmlns="{NS}"/>',
    f'<controller xmlns="{NS}"/>',
)
CONTROLLER_FILTER = (f'<controller xmlns="{NS}"/>',)


def yang_file() -> Path:
    """The module file shipped with the package (load it into the switch's server)."""
    return Path(__file__).parent / "yang" / f"{MODULE}@{REVISION}.yang"


def module_capability(capabilities: Iterable[str]) -> str | None:
    """The server's capability URI announcing our module (any revision), or None."""
    for cap in capabilities:
        if cap.startswith(f"{NS}?") and f"module={MODULE}" in cap:
            return cap
    return None


@dataclass(frozen=True)
class SwitchState:
    """What one read of the switch shows: the directed pairs (ingress -> egress), the
    port inventory, ports disabled by their admin-state, ports whose reported
    oper-state is not ``up``, and the controller's leaves."""

    pairs: frozenset[PortPair] = frozenset()
    ports: frozenset[int] = frozenset()
    disabled: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    fencing_token: int = 0
    last_batch: str = ""
    # ports whose oper-state the switch reported at all (none: netconfd without a SIL)
    oper_reported: frozenset[int] = field(default=frozenset(), compare=False)

    @cached_property
    def egress(self) -> dict[int, int]:
        """ingress -> egress."""
        return dict(self.pairs)

    @cached_property
    def ingress(self) -> dict[int, int]:
        """egress -> ingress."""
        return {b: a for a, b in self.pairs}

    @cached_property
    def half(self) -> frozenset[int]:
        """Ports of pairs without their reverse."""
        out: set[int] = set()
        for a, b in self.pairs:
            if self.egress.get(b) != a:
                out.update((a, b))
        return frozenset(out)

    def table(self) -> frozenset[PortPair]:
        """The controller's view: one ``(a, b)``, ``a < b``, per circuit or half circuit."""
        return frozenset((a, b) if a < b else (b, a) for a, b in self.pairs)

    def down(self) -> frozenset[int]:
        """Ports not usable for a new circuit (see the module docstring)."""
        return self.disabled | self.failed | self.half

    def port_note(self, port: int) -> str:
        """Where ``port`` stands, for a message."""
        out, into = self.egress.get(port), self.ingress.get(port)
        if out is None and into is None:
            return f"port {port} is free"
        parts = []
        if out is not None:
            parts.append(f"{port}->{out}")
        if into is not None and into != out:
            parts.append(f"{into}->{port}")
        return f"port {port} carries {' and '.join(parts)}"


def parse_state(data_xml: str | bytes) -> SwitchState:
    """The ``<data>`` of a ``<get>`` with ``STATE_FILTER`` as a SwitchState; a reply that
    does not follow the module is a ``FailedPrecondition`` naming what is wrong."""
    try:
        root = ET.fromstring(data_xml)
    except ET.ParseError as exc:
        raise errors.FailedPrecondition(
            f"the switch answered XML that does not parse: {exc}"
        ) from None
    pairs: set[PortPair] = set()
    seen_ingress: set[int] = set()
    for pair in root.iter(f"{{{NS}}}pair"):
        a = _port(pair, "ingress", "cross-connects/pair/ingress")
        b = _port(pair, "egress", f"cross-connects/pair[ingress={a}]/egress")
        if a in seen_ingress:
            raise errors.FailedPrecondition(
                f"the switch answered two cross-connect pairs with ingress {a}"
            )
        seen_ingress.add(a)
        pairs.add((a, b))
    ports: set[int] = set()
    disabled: set[int] = set()
    failed: set[int] = set()
    reported: set[int] = set()
    for port in root.iter(f"{{{NS}}}port"):
        p = _port(port, "port-id", "ports/port/port-id")
        ports.add(p)
        admin = (port.findtext(f"{{{NS}}}admin-state") or "enabled").strip()
        if admin != "enabled":
            disabled.add(p)
        oper = port.findtext(f"{{{NS}}}oper-state")
        if oper is not None:
            reported.add(p)
            if oper.strip() != "up":
                failed.add(p)
    token_text = root.findtext(f".//{{{NS}}}controller/{{{NS}}}fencing-token")
    try:
        token = int(token_text.strip()) if token_text else 0
    except ValueError:
        raise errors.FailedPrecondition(
            f"the switch answered controller/fencing-token={errors.shown(token_text)}: "
            "not an integer"
        ) from None
    last = root.findtext(f".//{{{NS}}}controller/{{{NS}}}last-batch") or ""
    return SwitchState(
        frozenset(pairs),
        frozenset(ports),
        frozenset(disabled),
        frozenset(failed),
        token,
        last.strip(),
        frozenset(reported),
    )


def _port(parent: ET.Element, leaf: str, where: str) -> int:
    text = parent.findtext(f"{{{NS}}}{leaf}")
    try:
        value = int((text or "").strip())
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PORT:
        raise errors.FailedPrecondition(
            f"the switch answered {where}={errors.shown(text)}: not a port id (1..{MAX_PORT})"
        )
    return value


def batch_problems(
    state: SwitchState, disconnect: Sequence[PortPair], connect: Sequence[PortPair]
) -> list[str]:
    """Why the batch cannot apply to ``state`` (empty: it can): the checks of the
    simulated OCS (a disconnect names a circuit that is there; a connect uses ports that
    are free after the disconnects, enabled, distinct, listed once). Ports missing from
    the inventory are left to the switch, whose leafref check refuses them."""
    problems = errors.Problems()
    gone: set[PortPair] = set()  # directed pairs the disconnects remove
    listed: dict[PortPair, str] = {}
    for i, (a, b) in enumerate(disconnect):
        where = f"disconnect[{i}]"
        key = (min(a, b), max(a, b))
        if key in listed:
            problems.add(f"{where}={key}: already listed as {listed[key]}")
            continue
        listed[key] = where
        if state.egress.get(a) != b and state.egress.get(b) != a:
            problems.add(
                f"{where}={key}: ports {a} and {b} are not cross-connected "
                f"({state.port_note(a)}, {state.port_note(b)})"
            )
            continue
        gone.update(p for p in ((a, b), (b, a)) if state.egress.get(p[0]) == p[1])
    busy = {x for pair in state.pairs - gone for x in pair}
    claimed: dict[int, str] = {}
    for i, (a, b) in enumerate(connect):
        where = f"connect[{i}]"
        if a == b:
            problems.add(f"{where}=({a}, {b}): a port cannot connect to itself")
            continue
        for port in (a, b):
            why = ""
            if port in claimed:
                why = f"port {port} is already used by {claimed[port]} of this batch"
            elif port in busy:
                why = f"{state.port_note(port)}; disconnect it first"
            elif port in state.disabled:
                why = f"port {port} is disabled (admin-state); enable it or pick another port"
            elif port in state.failed:
                why = f"port {port} is not up (oper-state); pick another port"
            if why:
                problems.add(f"{where}=({a}, {b}): {why}")
        claimed.setdefault(a, where)
        claimed.setdefault(b, where)
    return problems.shown + (
        [f"and {problems.count - len(problems.shown)} more"]
        if problems.count > len(problems.shown)
        else []
    )


def directed_ops(
    state: SwitchState, disconnect: Iterable[PortPair], connect: Iterable[PortPair]
) -> dict[int, int | None]:
    """ingress -> its new egress (None: delete the pair) for a valid batch: the pairs of
    each disconnected circuit that are there go, both pairs of each connected one come."""
    ops: dict[int, int | None] = {}
    for a, b in disconnect:
        for x, y in ((a, b), (b, a)):
            if state.egress.get(x) == y:
                ops[x] = None
    for a, b in connect:
        ops[a] = b
        ops[b] = a
    return ops


def edit_config(
    state: SwitchState,
    ops: Mapping[int, int | None],
    batch_id: str,
    fencing_token: int = 0,
) -> str:
    """The ``<config>`` of an ``<edit-config>`` that applies ``ops`` to a candidate equal
    to ``state``: ``delete`` for a pair that goes, ``create`` for a new ingress,
    ``replace`` for an ingress that moves to another egress; and the controller leaves."""
    if len(batch_id) > MAX_BATCH_ID:
        raise errors.field_error("batch_id", batch_id, f"at most {MAX_BATCH_ID} characters")
    parts = []
    for ingress in sorted(ops):
        egress = ops[ingress]
        if egress is None:
            parts.append(f'<pair nc:operation="delete"><ingress>{ingress}</ingress></pair>')
            continue
        op = "replace" if ingress in state.egress else "create"
        parts.append(
            f'<pair nc:operation="{op}"><ingress>{ingress}</ingress>'
            f"<egress>{egress}</egress></pair>"
        )
    token = f"<fencing-token>{fencing_token}</fencing-token>" if fencing_token else ""
    return (
        f'<config xmlns:nc="{NC_NS}">'
        f'<cross-connects xmlns="{NS}">{"".join(parts)}</cross-connects>'
        f'<controller xmlns="{NS}">{token}<last-batch>{escape(batch_id)}</last-batch>'
        "</controller></config>"
    )


def revert_ops(before: SwitchState, ops: Mapping[int, int | None]) -> dict[int, int | None]:
    """The ops that put back every ingress that ``ops`` touched as it was in ``before``
    (for a server without :confirmed-commit:1.1, whose batch failed its read-back)."""
    return {ingress: before.egress.get(ingress) for ingress in ops}


def landed_problems(after: SwitchState, ops: Mapping[int, int | None], batch_id: str) -> list[str]:
    """What the read-back after a commit shows wrong (empty: the batch landed)."""
    problems = errors.Problems()
    for ingress in sorted(ops):
        want, got = ops[ingress], after.egress.get(ingress)
        if want != got:
            problems.add(
                f"pair ingress {ingress}: expected "
                + ("none" if want is None else f"egress {want}")
                + ", read "
                + ("none" if got is None else f"egress {got}")
            )
    if after.last_batch != batch_id:
        problems.add(
            f"controller/last-batch: expected {errors.shown(batch_id)}, read "
            f"{errors.shown(after.last_batch)}"
        )
    return [problems.text()] if problems else []


def batch_landed(
    state: SwitchState, disconnect: Iterable[PortPair], connect: Iterable[PortPair]
) -> bool:
    """``state`` shows the batch applied: both pairs of every connected circuit, neither
    pair of a disconnected one (unless the batch connects it again)."""
    on = {(x, y) for a, b in connect for x, y in ((a, b), (b, a))}
    if not on <= state.pairs:
        return False
    off = {(x, y) for a, b in disconnect for x, y in ((a, b), (b, a))} - on
    return not off & state.pairs


@dataclass(frozen=True)
class RpcErrorInfo:
    """One ``<rpc-error>`` as the server sent it."""

    tag: str
    message: str
    path: str = ""
    info: str = ""  # the <error-info> element as XML ("" : none)
    severity: str = "error"


def describe_errors(rpc_errors: Sequence[RpcErrorInfo], limit: int = 600) -> str:
    """The server's ``<rpc-error>``s as one bounded line: ``tag: message at path
    (detail=...)`` each, the first few named and the rest counted."""
    shown = []
    for e in rpc_errors:
        text = f"{e.tag or 'error'}: {e.message or '(no message)'}"
        if e.path:
            text += f" at {e.path}"
        details = _info_details(e.info)
        if details:
            text += f" ({details})"
        shown.append(errors.bounded(text, limit))
    text = errors.listed(shown) or "(the server sent no error details)"
    return errors.bounded(text, 4 * limit)


def error_info_value(rpc_errors: Sequence[RpcErrorInfo], name: str) -> str:
    """The first ``<error-info>`` leaf called ``name`` (e.g. ``session-id``, the
    session holding a lock), or ""."""
    for e in rpc_errors:
        for key, value in _info_leaves(e.info):
            if key == name:
                return value
    return ""


def _info_leaves(info: str) -> list[tuple[str, str]]:
    if not info.strip():
        return []
    try:
        root = ET.fromstring(info)
    except ET.ParseError:
        return []
    return [
        (el.tag.rpartition("}")[2], (el.text or "").strip())
        for el in root.iter()
        if el is not root and not len(el) and (el.text or "").strip()
    ]


def _info_details(info: str) -> str:
    """``name=value`` of each leaf of an ``<error-info>`` (session-id, non-unique,
    bad-element, ...), without the server's internal error number."""
    if not info.strip():
        return ""
    try:
        ET.fromstring(info)
    except ET.ParseError:
        return errors.shown(info, 200)
    return ", ".join(f"{k}={v}" for k, v in _info_leaves(info) if k != "error-number")

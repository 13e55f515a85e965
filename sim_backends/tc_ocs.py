"""The testbed's optical circuit switch: circuits as tc redirects in a namespace.

An OCS of the testbed is a network namespace whose ports 1..N are veth ends named
``<prefix><port>`` (``p1``, ``p2``, ...); their peers are the ToR uplinks. A circuit
``a <-> b`` is the pair of ingress redirects ``a -> b`` and ``b -> a``
(``orchestrrl.tc``): a true port-to-port path that carries whatever the ToRs send,
ARP included, and nothing else.

- :class:`TcCircuits` programs and reads back those redirects, and reports and sets the
  link state of the ports. It knows nothing of validation.
- :class:`NetnsOcs` is the data plane behind ``orl-sim-ocs --netns``: the pure
  ``SimulatedOcs`` validates a batch (and injects faults), then the redirects are
  programmed; if the kernel refuses any of them the batch is undone in the kernel and
  in the table, and the caller gets ``FailedPrecondition`` naming the reason. Port
  health is the link state of the port's veth: a port whose veth (or its ToR end) is
  down is DOWN.
- :class:`NetnsOcsDriver` offers the same to the controller in-process, behind the
  ``OcsDriver`` protocol of ``fabric_controller.drivers.ocs``.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from fabric_controller.drivers.ocs import OcsInfo
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.tc import Tc
from sim_backends.ocs import REPLAY_CACHE_SIZE, ApplyResult, Pair, SimulatedOcs

DEFAULT_DEVICE_PREFIX = "p"
DEVICE_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,9}$")

log = get_logger("sim_backends.tc_ocs")


def _norm(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class Programmed:
    """What the kernel holds: circuits (both directions present) and stray one-way
    redirects ``{from_port: to_port}`` (a half-programmed or foreign filter)."""

    circuits: frozenset[Pair]
    stray: dict[int, int]


class TcCircuits:
    """The redirects and port links of one OCS namespace."""

    def __init__(
        self, netns: str, port_count: int, device_prefix: str = DEFAULT_DEVICE_PREFIX
    ) -> None:
        if not DEVICE_PREFIX_RE.match(device_prefix):
            raise errors.field_error(
                "device_prefix",
                device_prefix,
                "1-10 characters: a letter, then letters, digits, '_' or '-'",
            )
        if len(f"{device_prefix}{port_count}") > 15:
            raise errors.field_error(
                "device_prefix", device_prefix, f"too long for {port_count} ports (15 chars)"
            )
        self.netns = netns
        self.port_count = port_count
        self.device_prefix = device_prefix
        self._tc = Tc(netns)

    def device(self, port: int) -> str:
        return f"{self.device_prefix}{port}"

    def port(self, device: str) -> int | None:
        rest = device.removeprefix(self.device_prefix)
        if rest == device or not rest.isdigit() or rest.startswith("0"):
            return None
        port = int(rest)
        return port if 1 <= port <= self.port_count else None

    async def open(self) -> TcCircuits:
        """Open the namespace and give every port an ingress qdisc; every port device must
        exist (they are created with the namespace, by the testbed)."""
        await self._tc.open()
        try:
            links = await self._tc.links()
            missing = [self.device(p) for p in self.ports() if self.device(p) not in links]
            if missing:
                shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
                raise errors.FailedPrecondition(
                    f"OCS namespace {self.netns!r} lacks {len(missing)} of its "
                    f"{self.port_count} port devices ({shown}); create them "
                    f"(`orl-testbed up`) or fix --ports / --port-device-prefix"
                )
            await self._tc.add_ingress(self.device(p) for p in self.ports())
        except BaseException:
            await self._tc.close()
            raise
        return self

    async def close(self) -> None:
        await self._tc.close()

    def ports(self) -> range:
        return range(1, self.port_count + 1)

    async def connect(self, pairs: Iterable[Pair]) -> None:
        for a, b in pairs:
            await self._tc.redirect(self.device(a), self.device(b))
            await self._tc.redirect(self.device(b), self.device(a))

    async def disconnect(self, pairs: Iterable[Pair]) -> None:
        await self.clear(p for pair in pairs for p in pair)

    async def clear(self, ports: Iterable[int]) -> None:
        """Remove the redirects out of these ports (whatever they point at)."""
        for port in ports:
            await self._tc.clear(self.device(port))

    async def program(self, disconnect: Sequence[Pair], connect: Sequence[Pair]) -> None:
        """Disconnects, then connects; on a refusal, what was done is undone (reverse
        order) and the error re-raised, saying whether the undo worked too."""
        done: list[tuple[str, Pair]] = []
        try:
            for pair in disconnect:
                done.append(("disconnect", pair))
                await self.disconnect([pair])
            for pair in connect:
                done.append(("connect", pair))
                await self.connect([pair])
        except errors.OrlError as exc:
            try:
                for op, pair in reversed(done):
                    if op == "connect":
                        await self.disconnect([pair])
                    else:
                        await self.connect([pair])
            except errors.OrlError as undo_exc:
                raise errors.FailedPrecondition(
                    f"{exc}; undoing the batch failed too ({undo_exc}): the redirects in "
                    f"{self.netns!r} are partly changed"
                ) from exc
            raise

    async def programmed(self) -> Programmed:
        """Read the redirects back from the kernel."""
        redirects: dict[int, int] = {}
        for source, target in (await self._tc.redirects()).items():
            a, b = self.port(source), self.port(target)
            if a is not None and b is not None:
                redirects[a] = b
        circuits = frozenset(
            _norm(a, b) for a, b in redirects.items() if a != b and redirects.get(b) == a
        )
        paired = {p for c in circuits for p in c}
        stray = {a: b for a, b in redirects.items() if a not in paired}
        return Programmed(circuits, stray)

    async def port_health(self) -> dict[int, bool]:
        """Port -> link works (the veth and its ToR end both up); a missing device is down."""
        links = await self._tc.links()
        return {
            p: bool((link := links.get(self.device(p))) and link.admin_up and link.oper_up)
            for p in self.ports()
        }

    async def set_port_up(self, port: int, up: bool) -> None:
        if not 1 <= port <= self.port_count:
            raise errors.field_error("port", port, f"port must be 1..{self.port_count}")
        await self._tc.set_up(self.device(port), up)


class NetnsOcs:
    """A simulated OCS whose circuits are also real paths (see the module docstring)."""

    def __init__(self, ocs: SimulatedOcs, circuits: TcCircuits) -> None:
        if circuits.port_count != ocs.port_count:
            raise errors.field_error(
                "port_count", circuits.port_count, f"must equal the switch's {ocs.port_count}"
            )
        self.ocs = ocs
        self.circuits = circuits
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[str, tuple[tuple[Pair, ...], tuple[Pair, ...], ApplyResult]]
        self._answers = OrderedDict()
        self._log = log.bind(ocs=ocs.name, netns=circuits.netns)

    async def open(self) -> NetnsOcs:
        """Adopt the circuits the namespace already holds (a restarted switch keeps its
        optics), clear stray one-way redirects, and read the port health."""
        await self.circuits.open()
        try:
            async with self._lock:
                held = await self.circuits.programmed()
                await self.circuits.clear(sorted(held.stray))
                await self._refresh()
                self._force(held.circuits)
        except BaseException:
            await self.circuits.close()
            raise
        if held.circuits or held.stray:
            self._log.info(
                "ocs.adopted",
                circuits=len(held.circuits),
                stray_redirects_cleared=len(held.stray),
            )
        return self

    async def close(self) -> None:
        await self.circuits.close()

    async def refresh_health(self) -> None:
        async with self._lock:
            await self._refresh()

    async def _refresh(self) -> None:
        for port, up in (await self.circuits.port_health()).items():
            self.ocs.set_port_health(port, up)

    def _force(self, table: frozenset[Pair]) -> None:
        """Make the table exactly ``table`` (health and faults do not apply)."""
        current = self.ocs.cross_connects()
        if current == table:
            return
        down = {s.port for s in self.ocs.port_states() if not s.up}
        for port in down:
            self.ocs.set_port_health(port, True)
        try:
            for _ in range(2):  # a fault injected meanwhile is consumed by the first try
                try:
                    self.ocs.apply(sorted(current - table), sorted(table - current))
                    return
                except errors.FailedPrecondition:
                    continue
        finally:
            for port in down:
                self.ocs.set_port_health(port, False)

    async def apply(
        self,
        disconnect: Iterable[Pair],
        connect: Iterable[Pair],
        *,
        request_id: str = "",
        fencing_token: int = 0,
    ) -> ApplyResult:
        """Validate against the table (and the links' health), program the redirects,
        and only then answer; a refused batch changes neither the table nor the kernel.
        A ``fencing_token`` older than the newest seen is refused first (0: no HA); only
        a batch carried out that lists a change makes it the newest."""
        d, c = tuple(disconnect), tuple(connect)
        async with self._lock:
            self.ocs.fencing.check(fencing_token)
            if request_id and (seen := self._answers.get(request_id)) is not None:
                if seen[:2] != (d, c):
                    raise errors.field_error(
                        "request_id", request_id, "was already used for a different batch"
                    )
                self._answers.move_to_end(request_id)
                if d or c:
                    self.ocs.fencing.record(fencing_token)
                return replace(seen[2], replayed=True)
            await self._refresh()
            before = self.ocs.cross_connects()
            newest = self.ocs.fencing.newest
            # the table's own apply checks the token again (an HA switch refuses token 0)
            # and records it; InvalidArgument / injected fault: nothing changed
            result = self.ocs.apply(d, c, fencing_token=fencing_token)
            if result.added or result.removed:
                try:
                    await self.circuits.program(sorted(result.removed), sorted(result.added))
                except errors.OrlError as exc:
                    self._force(before)
                    self.ocs.fencing.newest = newest  # a batch undone records no token
                    self._log.error("ocs_program_failed", error=str(exc))
                    raise errors.FailedPrecondition(
                        f"OCS {self.ocs.name}: programming the circuits in namespace "
                        f"{self.circuits.netns!r} failed, the batch was undone: {exc}"
                    ) from None
            if request_id:
                self._answers[request_id] = (d, c, result)
                if len(self._answers) > REPLAY_CACHE_SIZE:
                    self._answers.popitem(last=False)
            return result

    async def set_port_health(self, port: int, up: bool) -> None:
        """Fault injection in the data plane: set the port's veth down (or up)."""
        async with self._lock:
            await self.circuits.set_port_up(port, up)
            await self._refresh()


class NetnsOcsDriver:
    """The controller's ``OcsDriver`` for a testbed OCS, in-process (no gRPC)."""

    def __init__(self, backend: NetnsOcs) -> None:
        self.name = backend.ocs.name
        self._backend = backend

    async def info(self) -> OcsInfo:
        ocs = self._backend.ocs
        return OcsInfo(ocs.name, ocs.port_count, ocs.switching_time_s, "netns")

    async def cross_connects(self) -> frozenset[Pair]:
        return self._backend.ocs.cross_connects()

    async def snapshot(self) -> tuple[frozenset[Pair], frozenset[int]]:
        await self._backend.refresh_health()
        ocs = self._backend.ocs
        down = frozenset(s.port for s in ocs.port_states() if not s.up)
        return ocs.cross_connects(), down

    async def apply(
        self,
        disconnect: Iterable[Pair],
        connect: Iterable[Pair],
        request_id: str = "",
        fencing_token: int = 0,
    ) -> frozenset[Pair]:
        result = await self._backend.apply(
            disconnect, connect, request_id=request_id, fencing_token=fencing_token
        )
        if result.changed and self._backend.ocs.switching_time_s:
            await asyncio.sleep(self._backend.ocs.switching_time_s)
        return result.cross_connects

    async def close(self) -> None:
        await self._backend.close()

"""ConfigureRoce: MTU, DSCP trust, PFC, ECN and the RoCE traffic class of RDMA NICs.

Each setting is applied and then read back:

- MTU through netlink (``orchestrrl.netlink``); 0 leaves it unchanged.
- DSCP trust through iproute2's ``dcb`` APP table. Trusting DSCP installs the standard
  DSCP-to-priority map (priority = DSCP >> 3) with ``dcb app replace dev IF dscp-prio
  ...``; mlx5 switches its trust state to DSCP while DSCP entries exist, and back to PCP
  when they are flushed (``dcb apptrust`` would say it directly but needs iproute2 >= 6.2).
- PFC with ``dcb pfc set dev IF prio-pfc 0:off ... 3:on ...`` (all eight priorities).
- ECN through the mlx5 sysfs knobs ``/sys/class/net/IF/ecn/roce_np/enable/<prio>``
  (notification point) and ``.../roce_rp/enable/<prio>`` (reaction point), for all
  eight priorities.
- The RoCE traffic class through ``/sys/class/infiniband/<dev>/tc/1/traffic_class``
  (MLNX_OFED), where ``<dev>`` is found under ``/sys/class/net/IF/device/infiniband``;
  0 leaves it unchanged.

The request is desired state: ``dscp_trust`` false, no PFC priorities and ``ecn`` false
mean "off" and are applied as such. Nothing is skipped silently: ``applied`` is true
only when every setting was set and read back equal, and ``unsupported`` names each
capability the NIC lacks with the reason (on a veth: "dcb app: Operation not
supported", "dcb pfc: Operation not supported", "ecn sysfs: /sys/class/net/veth0/ecn
missing"). The sysfs root, the dcb command and the link control are injectable.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.netlink import LinkInfo, Netlink
from orchestrrl.routing import check_ifname
from orchestrrl.v1 import node_agent_pb2

log = get_logger("node_agent.roce")

SYSFS = Path("/sys")
PRIORITIES = tuple(range(8))
DSCP_PRIO = {dscp: dscp >> 3 for dscp in range(64)}
MAX_TRAFFIC_CLASS = 255
COMMAND_TIMEOUT_S = 10.0
_DCB_PREFIX = re.compile(r"^(Attribute (read|write)|Error when attempting to set attribute): ")


@dataclass(frozen=True)
class RoceSettings:
    interface: str
    mtu: int = 0  # 0: leave unchanged
    dscp_trust: bool = False
    pfc_priorities: tuple[int, ...] = ()
    ecn: bool = False
    traffic_class: int = 0  # 0: leave unchanged


@dataclass(frozen=True)
class RoceResult:
    interface: str
    applied: bool
    read_back: RoceSettings
    unsupported: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], Awaitable[CommandResult]]


async def run_command(argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> CommandResult:
    """Run a command without a shell; a missing binary is exit status 127, not an exception."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found (install iproute2)")
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return CommandResult(124, "", f"{argv[0]}: no answer within {timeout_s:g}s")
    return CommandResult(proc.returncode or 0, out.decode(), err.decode())


class LinkControl(Protocol):
    async def links(self) -> Mapping[str, LinkInfo]: ...

    async def set_mtu(self, name: str, mtu: int) -> LinkInfo: ...


class HostLinks:
    """LinkControl of the agent's own namespace through the netlink adapter."""

    async def links(self) -> Mapping[str, LinkInfo]:
        async with Netlink() as netlink:
            return await netlink.links()

    async def set_mtu(self, name: str, mtu: int) -> LinkInfo:
        async with Netlink() as netlink:
            return await netlink.set_mtu(name, mtu)


def settings_from_pb(nics: Iterable[node_agent_pb2.RoceSettings]) -> list[RoceSettings]:
    return [
        RoceSettings(
            interface=n.interface,
            mtu=n.mtu,
            dscp_trust=n.dscp_trust,
            pfc_priorities=tuple(n.pfc_priorities),
            ecn=n.ecn,
            traffic_class=n.traffic_class,
        )
        for n in nics
    ]


def _settings_to_pb(s: RoceSettings) -> node_agent_pb2.RoceSettings:
    return node_agent_pb2.RoceSettings(
        interface=s.interface,
        mtu=s.mtu,
        dscp_trust=s.dscp_trust,
        pfc_priorities=s.pfc_priorities,
        ecn=s.ecn,
        traffic_class=s.traffic_class,
    )


def results_to_pb(
    command_id: str, results: Sequence[RoceResult]
) -> node_agent_pb2.ConfigureRoceResponse:
    return node_agent_pb2.ConfigureRoceResponse(
        command_id=command_id,
        results=[
            node_agent_pb2.RoceResult(
                interface=r.interface,
                applied=r.applied,
                read_back=_settings_to_pb(r.read_back),
                unsupported=r.unsupported,
                message=r.message,
            )
            for r in results
        ],
    )


def check_settings(nics: Sequence[RoceSettings], links: Mapping[str, LinkInfo]) -> None:
    """Refuse the whole request before any change; errors name the entry and the value."""
    if not nics:
        raise errors.field_error("nics", [], "name at least one NIC to configure")
    seen: set[str] = set()
    for i, nic in enumerate(nics):
        where = f"nics[{i}]"
        check_ifname(nic.interface, f"{where}.interface")
        if nic.interface in seen:
            raise errors.field_error(f"{where}.interface", nic.interface, "each NIC once")
        seen.add(nic.interface)
        link = links.get(nic.interface)
        if link is None:
            raise errors.field_error(
                f"{where}.interface",
                nic.interface,
                f"no such interface on this node (it has: {', '.join(sorted(links))})",
            )
        low, high = link.min_mtu or 68, link.max_mtu or 65535
        if nic.mtu and not low <= nic.mtu <= high:
            raise errors.field_error(
                f"{where}.mtu", nic.mtu, f"0 (unchanged) or {low}..{high} for {nic.interface}"
            )
        bad = [p for p in nic.pfc_priorities if p not in PRIORITIES]
        if bad or len(set(nic.pfc_priorities)) != len(nic.pfc_priorities):
            raise errors.field_error(
                f"{where}.pfc_priorities",
                list(nic.pfc_priorities),
                "distinct priorities in 0..7",
            )
        if not 0 <= nic.traffic_class <= MAX_TRAFFIC_CLASS:
            raise errors.field_error(
                f"{where}.traffic_class",
                nic.traffic_class,
                f"0 (unchanged) or 1..{MAX_TRAFFIC_CLASS}, e.g. 106 for DSCP 26 with ECT",
            )


@dataclass
class _Report:
    """What happened to one NIC, step by step."""

    done: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def message(self, name: str) -> str:
        parts = []
        if self.done:
            parts.append("set and read back " + ", ".join(self.done))
        if self.unsupported:
            parts.append("unsupported: " + "; ".join(self.unsupported))
        if self.failed:
            parts.append("failed: " + "; ".join(self.failed))
        return f"{name}: " + (". ".join(parts) if parts else "nothing to do")


class RoceConfigurator:
    def __init__(
        self,
        links: LinkControl | None = None,
        *,
        sysfs: Path = SYSFS,
        dcb: Sequence[str] = ("dcb",),
        run: Runner = run_command,
    ) -> None:
        self._links: LinkControl = links if links is not None else HostLinks()
        self._sysfs = sysfs
        self._dcb_argv = tuple(dcb)
        self._run = run
        self._lock = asyncio.Lock()

    async def configure(self, nics: Sequence[RoceSettings]) -> list[RoceResult]:
        async with self._lock:
            links = await self._links.links()
            check_settings(nics, links)
            results = [await self._configure(nic, links[nic.interface]) for nic in nics]
        for r in results:
            log.info(
                "roce_configured",
                interface=r.interface,
                applied=r.applied,
                unsupported=list(r.unsupported),
                message=r.message,
            )
        return results

    async def _configure(self, want: RoceSettings, link: LinkInfo) -> RoceResult:
        name = want.interface
        report = _Report()
        mtu = await self._mtu(want, link, report)
        trust = await self._dscp_trust(name, want.dscp_trust, report)
        pfc = await self._pfc(name, tuple(sorted(want.pfc_priorities)), report)
        ecn = await asyncio.to_thread(self._ecn, name, want.ecn, report)
        tclass = await asyncio.to_thread(self._traffic_class, name, want.traffic_class, report)
        read_back = RoceSettings(name, mtu, trust, pfc, ecn, tclass)
        applied = not report.unsupported and not report.failed
        return RoceResult(name, applied, read_back, tuple(report.unsupported), report.message(name))

    # -- MTU (netlink) --------------------------------------------------------------------

    async def _mtu(self, want: RoceSettings, link: LinkInfo, report: _Report) -> int:
        if not want.mtu:
            return link.mtu
        try:
            mtu = (await self._links.set_mtu(want.interface, want.mtu)).mtu
        except errors.OrlError as exc:
            report.failed.append(f"mtu {want.mtu}: {exc}")
            return link.mtu
        if mtu == want.mtu:
            report.done.append(f"mtu {mtu}")
        else:
            report.failed.append(f"mtu reads back {mtu}, not {want.mtu}")
        return mtu

    # -- dcb (DSCP trust, PFC) ------------------------------------------------------------

    async def _dcb(self, *args: str) -> CommandResult:
        return await self._run([*self._dcb_argv, *args])

    async def _dscp_map(self, name: str) -> dict[int, int] | str:
        """The DSCP->priority APP entries, or why they cannot be read."""
        result = await self._dcb("-j", "app", "show", "dev", name, "dscp-prio")
        if result.returncode:
            return _reason(result)
        try:
            pairs = json.loads(result.stdout or "{}").get("dscp_prio", [])
            return {int(dscp): int(prio) for dscp, prio in pairs}
        except (ValueError, TypeError, AttributeError):
            return f"unexpected output {result.stdout.strip()!r}"

    async def _dscp_trust(self, name: str, want: bool, report: _Report) -> bool:
        wanted = DSCP_PRIO if want else {}
        current = await self._dscp_map(name)
        if isinstance(current, str):
            report.unsupported.append(f"dcb app: {current}")
            return False
        if current != wanted:
            if want:
                pairs = [f"{dscp}:{prio}" for dscp, prio in DSCP_PRIO.items()]
                result = await self._dcb("app", "replace", "dev", name, "dscp-prio", *pairs)
            else:
                result = await self._dcb("app", "flush", "dev", name, "dscp-prio")
            if result.returncode:
                _write_failed(report, "dcb app", _reason(result))
                return bool(current)
            current = await self._dscp_map(name)
            if isinstance(current, str):
                report.failed.append(f"dcb app: cannot read back: {current}")
                return False
        if current == wanted:
            report.done.append("dscp trust" if want else "pcp trust")
        else:
            report.failed.append(
                f"dcb app: reads back {len(current)} DSCP entries, wanted {len(wanted)}"
            )
        return bool(current)

    async def _pfc_enabled(self, name: str) -> tuple[int, ...] | str:
        result = await self._dcb("-j", "pfc", "show", "dev", name, "prio-pfc")
        if result.returncode:
            return _reason(result)
        try:
            flags = json.loads(result.stdout or "{}")["prio_pfc"]
            if isinstance(flags, dict):
                flags = [flags[str(p)] for p in PRIORITIES]
            return tuple(p for p, on in zip(PRIORITIES, flags, strict=True) if on in (True, "on"))
        except (ValueError, TypeError, KeyError):
            return f"unexpected output {result.stdout.strip()!r}"

    async def _pfc(self, name: str, want: tuple[int, ...], report: _Report) -> tuple[int, ...]:
        current = await self._pfc_enabled(name)
        if isinstance(current, str):
            report.unsupported.append(f"dcb pfc: {current}")
            return ()
        if current != want:
            mapping = [f"{p}:{'on' if p in want else 'off'}" for p in PRIORITIES]
            result = await self._dcb("pfc", "set", "dev", name, "prio-pfc", *mapping)
            if result.returncode:
                _write_failed(report, "dcb pfc", _reason(result))
                return current
            current = await self._pfc_enabled(name)
            if isinstance(current, str):
                report.failed.append(f"dcb pfc: cannot read back: {current}")
                return ()
        if current == want:
            report.done.append(f"pfc {list(want)}")
        else:
            report.failed.append(f"dcb pfc: reads back {list(current)}, wanted {list(want)}")
        return current

    # -- sysfs (ECN, traffic class); blocking, run in a worker thread ---------------------

    def _ecn(self, name: str, want: bool, report: _Report) -> bool:
        base = self._sysfs / "class" / "net" / name / "ecn"
        if not base.is_dir():
            report.unsupported.append(f"ecn sysfs: {base} missing")
            return False
        knobs = [
            base / point / "enable" / str(p) for point in ("roce_np", "roce_rp") for p in PRIORITIES
        ]
        missing = [k for k in knobs if not k.is_file()]
        if missing:
            report.unsupported.append(f"ecn sysfs: {missing[0]} missing")
            return False
        value = "1" if want else "0"
        try:
            for knob in knobs:
                if knob.read_text().strip() != value:
                    knob.write_text(value)
            states = {knob.read_text().strip() for knob in knobs}
        except OSError as exc:
            report.failed.append(f"ecn sysfs: {exc}")
            return False
        if states == {value}:
            report.done.append("ecn on" if want else "ecn off")
        else:
            report.failed.append(f"ecn sysfs: knobs read back {sorted(states)}, wanted {value}")
        return states == {"1"}

    def _traffic_class(self, name: str, want: int, report: _Report) -> int:
        ib_dir = self._sysfs / "class" / "net" / name / "device" / "infiniband"
        devices = sorted(p.name for p in ib_dir.iterdir()) if ib_dir.is_dir() else []
        if not devices:
            if want:
                report.unsupported.append(f"traffic class: no RDMA device ({ib_dir} missing)")
            return 0
        knob = self._sysfs / "class" / "infiniband" / devices[0] / "tc" / "1" / "traffic_class"
        if not knob.is_file():
            if want:
                report.unsupported.append(
                    f"traffic class: {knob} missing (needs the MLNX_OFED tc sysfs)"
                )
            return 0
        try:
            current = _parse_tclass(knob.read_text())
            if want and current != want:
                knob.write_text(str(want))
                current = _parse_tclass(knob.read_text())
        except OSError as exc:
            report.failed.append(f"traffic class: {knob}: {exc}")
            return 0
        if want and current == want:
            report.done.append(f"traffic class {want}")
        elif want:
            report.failed.append(f"traffic class: reads back {current}, not {want}")
        return current


def _parse_tclass(text: str) -> int:
    """``106``, ``Global tclass=106`` or empty (not set: 0)."""
    match = re.search(r"(\d+)", text)
    return int(match.group(1)) if match else 0


def _reason(result: CommandResult) -> str:
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    if not lines:
        return f"exit status {result.returncode}"
    return _DCB_PREFIX.sub("", lines[-1])


def _write_failed(report: _Report, what: str, reason: str) -> None:
    if "not supported" in reason.lower():
        report.unsupported.append(f"{what}: {reason}")
    else:
        report.failed.append(f"{what}: {reason}")

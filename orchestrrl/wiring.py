"""Load and validate the cluster wiring file (TOML).

Validation collects every problem, each naming the field, the value and what is
allowed, so ``orlctl config check`` can print them all at once. One mistake is one
problem: a reference to an entry that is defined but has problems of its own (an OCS
whose ``ports`` is a string) is not reported again at every use, and a pod without a
ToR is named once rather than at every NIC of its nodes. A valid file becomes a frozen
:class:`orchestrrl.model.Wiring`.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AnyStr

from orchestrrl import errors
from orchestrrl.grpcutil import parse_address
from orchestrrl.model import (
    OCS_DRIVERS,
    NetconfSettings,
    Nic,
    Node,
    Ocs,
    Pod,
    Role,
    Tor,
    Uplink,
    Wiring,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
IFNAME_RE = re.compile(r"^[^/:\s]{1,15}$")
NAME_RULE = "1-63 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"
MAX_OCS_PORTS = 4096
MAX_GPUS = 64

SECTIONS = {"cluster", "ocs", "pod", "tor", "node"}
KEYS = {
    "cluster": ({"name"}, {"controller"}),
    "ocs": ({"name", "address", "ports"}, {"switching_time_ms", "driver", "netconf"}),
    "netconf": (
        {"username"},
        {
            "key_file",
            "password_file",
            "known_hosts",
            "host_key_check",
            "timeout_s",
            "retries",
            "confirm_timeout_s",
        },
    ),
    "pod": ({"name"}, {"prefix"}),
    "tor": ({"name", "pod"}, {"uplinks", "netns"}),
    "uplink": ({"port", "ocs", "ocs_port"}, {"device", "ip"}),
    "node": ({"name", "pod", "role", "agent", "gpus"}, {"nics"}),
    "nic": ({"name", "tor", "tor_port"}, {"gbps"}),
}
DEFAULT_CONTROLLER = "127.0.0.1:50051"
DEFAULT_SWITCHING_TIME_MS = 10.0  # 3D MEMS, the paper's simulator assumption
DEFAULT_NIC_GBPS = 400.0  # H800 nodes: 8 x 400 Gb/s RDMA NICs
USERNAME_RE = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._@-]{0,63}$")
NETCONF_EXAMPLE = (
    'netconf = { username = "orl", key_file = "/etc/orchestrrl/ocs0.key", '
    'known_hosts = "/etc/orchestrrl/known_hosts" }'
)
# The largest wiring file read: a 2048-node wiring (8 NICs each) is 1.5 MB, so 16 MiB holds
# about ten times the largest cluster studied; a larger file (or a device such as
# /dev/zero) is refused after reading at most this many bytes and one more.
MAX_WIRING_BYTES = 16 * 1024 * 1024
# The deepest nesting of arrays and inline tables (a wiring needs 2: uplinks = [{ ... }]);
# deeper text is refused with its position before the TOML parser recurses into it.
MAX_NESTING = 64


class WiringError(errors.InvalidArgument):
    """Every problem found in one wiring file. ``problems`` holds them all; the message
    names the first ``errors.MAX_LISTED``, counts the rest and is at most
    ``errors.MAX_MESSAGE_BYTES`` long, as an RPC's error is: a file of twenty thousand
    mistakes prints a screenful, not megabytes (fix those, check again)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = [f"  - {p}" for p in problems[: errors.MAX_LISTED]]
        if len(problems) > errors.MAX_LISTED:
            lines.append(f"  - and {len(problems) - errors.MAX_LISTED} more")
        text = "\n".join(lines)
        super().__init__(
            errors.bounded(f"{source}: {len(problems)} problem(s) in the wiring:\n{text}")
        )


@dataclass
class _Checker:
    problems: list[str]

    def add(self, where: str, value: object, allowed: str) -> None:
        self.problems.append(f"{where} = {errors.shown(value)}: {allowed}")

    def table(self, where: str, value: object, kind: str) -> Mapping[str, Any] | None:
        if not isinstance(value, Mapping):
            self.add(where, value, "expected a table")
            return None
        required, optional = KEYS[kind]
        for key in sorted(set(value) - required - optional):
            allowed = ", ".join(sorted(required | optional))
            self.problems.append(f"{where}.{key}: unknown key (allowed: {allowed})")
        for key in sorted(required - set(value)):
            self.problems.append(f"{where}.{key}: missing (required)")
        return value

    def name(self, where: str, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not NAME_RE.match(value):
            self.add(where, value, NAME_RULE)
            return None
        return value

    def integer(self, where: str, value: object, lo: int, hi: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.add(where, value, f"an integer from {lo} to {hi}{_quoted(value)}")
            return None
        return value

    def number(self, where: str, value: object, lo_exclusive: float, hi: float) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            allowed = f"a number greater than {lo_exclusive} and at most {hi}{_quoted(value)}"
            self.add(where, value, allowed)
            return None
        if not lo_exclusive < float(value) <= hi:
            self.add(where, value, f"a number greater than {lo_exclusive} and at most {hi}")
            return None
        return float(value)

    def address(self, where: str, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            self.add(where, value, "HOST:PORT")
            return None
        try:
            parse_address(value, where)
        except errors.InvalidArgument as exc:
            self.problems.append(str(exc))
            return None
        return value

    def ref(
        self,
        where: str,
        value: object,
        known: Iterable[str],
        kinds: str,
        declared: Iterable[str] = (),
    ) -> str | None:
        """A name that must refer to something defined elsewhere in the file
        (``kinds``: singular and plural, e.g. "pod/pods"). A name in ``declared`` (an
        entry that is defined but has problems, reported at the entry) gives None
        without a problem of its own."""
        one, many = kinds.split("/")
        name = self.name(where, value)
        names = list(known)
        if name and name not in names:
            if name not in declared:
                defined = errors.listed(names, ", ") or "none"
                self.add(where, value, f"no such {one}; defined {many}: {defined}")
            return None
        return name

    def prefix(self, where: str, value: object) -> str | None:
        if value is None:
            return None
        try:
            net = ipaddress.ip_network(str(value), strict=True)
        except ValueError:
            self.add(where, value, "a CIDR prefix without host bits, e.g. 10.0.1.0/24")
            return None
        if not isinstance(value, str):
            self.add(where, value, 'a CIDR prefix as a string, e.g. "10.0.1.0/24"')
            return None
        return str(net)

    def disjoint(self, where: str, prefixes: Mapping[str, str]) -> None:
        nets = sorted(
            ((ipaddress.ip_network(p), name) for name, p in prefixes.items()),
            key=lambda t: (t[0].version, int(t[0].network_address), t[0].prefixlen),
        )
        for (a, na), (b, nb) in itertools.pairwise(nets):
            if a.version == b.version and a.overlaps(b):
                self.problems.append(f"{where}: {na!r} ({a}) overlaps {nb!r} ({b})")

    def interface(self, where: str, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not IFNAME_RE.match(value):
            self.add(where, value, "a Linux interface name: 1-15 characters, no '/', ':' or space")
            return None
        return value

    def ip(self, where: str, value: object, used: dict[str, str]) -> str | None:
        if value is None:
            return None
        try:
            addr = str(ipaddress.ip_address(str(value)))
        except ValueError:
            self.add(where, value, "an IP address, e.g. 172.16.0.1")
            return None
        if addr in used:
            self.add(where, value, f"address already used by {used[addr]}")
            return None
        used[addr] = where
        return addr

    def array(self, where: str, value: object) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.add(where, value, "expected an array of tables")
            return []
        return value

    def unique(self, where: str, names: list[str | None]) -> None:
        for name, count in sorted(Counter(n for n in names if n).items()):
            if count > 1:
                self.problems.append(f"{where}: name {name!r} is defined {count} times")


def _netconf(c: _Checker, where: str, driver: object, raw: object) -> NetconfSettings | None:
    """The ``netconf`` table of an OCS (None, with the problems added, if it is wrong)."""
    if driver != "netconf":
        if raw is not None and driver is not None:
            c.add(f"{where}.netconf", raw, 'only with driver = "netconf"; remove it')
        return None
    if raw is None:
        c.problems.append(
            f'{where}.netconf: missing (required with driver = "netconf"), e.g. {NETCONF_EXAMPLE}'
        )
        return None
    bad = len(c.problems)
    t = c.table(f"{where}.netconf", raw, "netconf")
    if t is None:
        return None
    at = f"{where}.netconf"
    username = t.get("username")
    if username is not None and (not isinstance(username, str) or not USERNAME_RE.match(username)):
        allowed = "an SSH user name: 1-64 letters, digits, '.', '_', '@' or '-'"
        c.add(f"{at}.username", username, allowed)
    paths: dict[str, str] = {}
    for key in ("key_file", "password_file", "known_hosts"):
        value = t.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
            c.add(f"{at}.{key}", value, "an absolute path, e.g. /etc/orchestrrl/ocs0.key")
        else:
            paths[key] = value
    given = [k for k in ("key_file", "password_file") if k in t]
    if len(given) != 1:
        c.problems.append(
            f"{at}: credentials: give exactly one of key_file (an SSH private key) or "
            f"password_file (the password on its first line); "
            + ("both are set" if given else "neither is set")
        )
    check = t.get("host_key_check", True)
    if not isinstance(check, bool):
        c.add(f"{at}.host_key_check", check, "true or false (default true)")
    timeout_s = c.number(f"{at}.timeout_s", t.get("timeout_s", 10.0), 0.0, 300.0)
    retries = c.integer(f"{at}.retries", t.get("retries", 2), 0, 10)
    confirm = c.integer(f"{at}.confirm_timeout_s", t.get("confirm_timeout_s", 30), 1, 3600)
    if timeout_s is not None and confirm is not None and confirm <= 2 * timeout_s:
        c.add(
            f"{at}.confirm_timeout_s",
            confirm,
            f"more than twice timeout_s ({timeout_s:g} s): the read-back and the confirming "
            "commit must fit in it",
        )
    if len(c.problems) > bad or timeout_s is None or retries is None or confirm is None:
        return None
    assert isinstance(username, str) and isinstance(check, bool)
    return NetconfSettings(
        username=username,
        key_file=paths.get("key_file", ""),
        password_file=paths.get("password_file", ""),
        known_hosts=paths.get("known_hosts", ""),
        host_key_check=check,
        timeout_s=timeout_s,
        retries=retries,
        confirm_timeout_s=confirm,
    )


def _quoted(value: object) -> str:
    """The hint for a number written as a string ('32' for 32)."""
    return ", not a string: write it without quotes" if isinstance(value, str) else ""


def load(path: str | Path, max_bytes: int = MAX_WIRING_BYTES) -> Wiring:
    """Read and validate a wiring file; raise :class:`WiringError` listing every problem.

    At most ``max_bytes`` + 1 bytes are read, whatever the file is (a device, a pipe, a
    file still growing): a longer one is refused by its size. Text that is not UTF-8 is
    refused naming its line, column and byte."""
    p = Path(path)
    source = str(p)
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise errors.InvalidArgument(
            f"wiring file {errors.shown(source)}: cannot read: {exc.strerror}"
        ) from None
    if len(data) > max_bytes:
        raise WiringError(
            source,
            [
                f"larger than {max_bytes:,} bytes, the most a wiring file may hold (a "
                "2048-node wiring is about 1.5 MB): is it the right file?"
            ],
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _position(data, exc.start, b"\n")
        raise WiringError(
            source,
            [
                f"not UTF-8 text at line {line}, column {column} (byte {exc.start}: "
                f"0x{data[exc.start]:02x}): a wiring file is TOML, written in UTF-8"
            ],
        ) from None
    return parse(text, source=source)


def parse(text: str, source: str = "<wiring>") -> Wiring:
    """Parse and validate wiring text; ``source`` names it in every problem."""
    deep = _too_deep(text, MAX_NESTING)
    if deep is not None:
        line, column = _position(text, deep, "\n")
        raise WiringError(
            source,
            [
                f"not valid TOML: arrays or inline tables nested more than {MAX_NESTING} "
                f"deep (at line {line}, column {column}); a wiring needs 2"
            ],
        )
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WiringError(source, [f"not valid TOML: {errors.bounded(str(exc), 400)}"]) from None
    except RecursionError:  # not expected: the scan above refuses deeper nesting first
        raise WiringError(source, ["not valid TOML: nested too deeply to parse"]) from None
    return validate(doc, source)


# What may hold a bracket that opens nothing: strings (multi-line ones first; their closing
# delimiter may carry one or two quotes of the content) and comments. Then the brackets.
_NESTING_TOKENS = re.compile(
    r'"""(?:[^"\\]|\\.|""?(?!"))*"{3,5}'
    r"|'''(?:[^']|''?(?!'))*'{3,5}"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*"
    r"|[\[\]{}]",
    re.DOTALL,
)


def _too_deep(text: str, limit: int) -> int | None:
    """The offset of the first bracket that opens a value nested deeper than ``limit``
    (table headers count too, harmlessly: they close on their own line), or None."""
    if text.count("[") + text.count("{") <= limit:
        return None
    depth = 0
    for m in _NESTING_TOKENS.finditer(text):
        token = m.group()
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return m.start()
        elif token in ("]", "}"):
            depth = max(0, depth - 1)
    return None


def _position(text: AnyStr, offset: int, newline: AnyStr) -> tuple[int, int]:
    """The line and the column (both from 1) of ``offset`` in ``text``."""
    start = text.rfind(newline, 0, offset) + 1
    return text.count(newline, 0, offset) + 1, offset - start + 1


def validate(doc: Mapping[str, Any], source: str = "<wiring>") -> Wiring:
    c = _Checker([])
    for key in sorted(set(doc) - SECTIONS):
        c.problems.append(f"{key}: unknown section (allowed: {', '.join(sorted(SECTIONS))})")

    cluster = c.table("cluster", doc.get("cluster", {"name": "cluster"}), "cluster") or {}
    cluster_name = c.name("cluster.name", cluster.get("name")) or "cluster"
    controller = c.address("cluster.controller", cluster.get("controller", DEFAULT_CONTROLLER))

    # OCSes
    ocses: list[Ocs] = []
    ocs_ports: dict[str, int] = {}
    declared_ocses: set[str] = set()  # valid names, whatever the rest of their entry
    for i, raw in enumerate(c.array("ocs", doc.get("ocs"))):
        t = c.table(f"ocs[{i}]", raw, "ocs")
        if t is None:
            continue
        where = f"ocs[{i}]"
        name = c.name(f"{where}.name", t.get("name"))
        declared_ocses.add(name or "")
        where = f"ocs {name!r}" if name else where
        address = c.address(f"{where}.address", t.get("address"))
        ports = c.integer(f"{where}.ports", t.get("ports"), 2, MAX_OCS_PORTS)
        switching_ms = c.number(
            f"{where}.switching_time_ms",
            t.get("switching_time_ms", DEFAULT_SWITCHING_TIME_MS),
            0.0,
            60_000.0,
        )
        driver = t.get("driver", "grpc")
        if driver not in OCS_DRIVERS:
            c.add(f"{where}.driver", driver, f"one of {', '.join(map(repr, OCS_DRIVERS))}")
            driver = None
        netconf = _netconf(c, where, driver, t.get("netconf"))
        netconf_ok = driver != "netconf" or netconf is not None
        if name and address and ports and switching_ms is not None and driver and netconf_ok:
            ocses.append(Ocs(name, address, ports, switching_ms / 1000.0, driver, netconf))
            ocs_ports[name] = ports
    c.unique("ocs", [o.name for o in ocses])

    # Pods
    pod_names: list[str] = []
    prefixes: dict[str, str] = {}
    for i, raw in enumerate(c.array("pod", doc.get("pod"))):
        t = c.table(f"pod[{i}]", raw, "pod")
        if t is None:
            continue
        name = c.name(f"pod[{i}].name", t.get("name"))
        if name:
            pod_names.append(name)
            prefix = c.prefix(f"pod {name!r}.prefix", t.get("prefix"))
            if prefix:
                prefixes[name] = prefix
    c.disjoint("pod prefixes", prefixes)
    c.unique("pod", list(pod_names))

    def pod_ref(where: str, value: object) -> str | None:
        return c.ref(where, value, pod_names, "pod/pods")

    # ToRs and their uplinks
    tors: list[Tor] = []
    used_ocs_ports: dict[tuple[str, int], str] = {}
    used_ips: dict[str, str] = {}
    declared_tors: set[str] = set()  # valid names, whatever the rest of their entry
    pods_with_tor: set[str] = set()  # named by a ToR entry, valid or not
    for i, raw in enumerate(c.array("tor", doc.get("tor"))):
        t = c.table(f"tor[{i}]", raw, "tor")
        if t is None:
            continue
        name = c.name(f"tor[{i}].name", t.get("name"))
        declared_tors.add(name or "")
        if isinstance(t.get("pod"), str):
            pods_with_tor.add(t["pod"])
        where = f"tor {name!r}" if name else f"tor[{i}]"
        pod = pod_ref(f"{where}.pod", t.get("pod"))
        netns = c.name(f"{where}.netns", t.get("netns")) or ""
        uplinks: list[Uplink] = []
        raw_uplinks = c.array(f"{where}.uplinks", t.get("uplinks"))
        if not raw_uplinks and t.get("uplinks") in (None, []):
            c.problems.append(
                f"{where}.uplinks: none; a ToR needs at least one uplink cabled to an OCS "
                'port, e.g. uplinks = [{ port = "up0", ocs = "ocs0", ocs_port = 1 }]'
            )
        for j, uraw in enumerate(raw_uplinks):
            uwhere = f"{where}.uplinks[{j}]"
            u = c.table(uwhere, uraw, "uplink")
            if u is None:
                continue
            port = c.name(f"{uwhere}.port", u.get("port"))
            ocs = c.ref(
                f"{uwhere}.ocs", u.get("ocs"), ocs_ports, "OCS/OCSes", declared=declared_ocses
            )
            limit = ocs_ports.get(ocs or "", MAX_OCS_PORTS)
            ocs_port = u.get("ocs_port")
            if ocs is not None and ocs_port is not None:
                ocs_port = c.integer(f"{uwhere}.ocs_port", ocs_port, 1, limit)
            elif ocs_port is not None:
                ocs_port = c.integer(f"{uwhere}.ocs_port", ocs_port, 1, MAX_OCS_PORTS)
            if ocs and isinstance(ocs_port, int):
                owner = used_ocs_ports.get((ocs, ocs_port))
                if owner:
                    c.add(
                        f"{uwhere}.ocs_port",
                        ocs_port,
                        f"port {ocs_port} of OCS {ocs!r} is already cabled to {owner}",
                    )
                else:
                    used_ocs_ports[(ocs, ocs_port)] = uwhere
                    device = c.interface(f"{uwhere}.device", u.get("device")) or ""
                    ip = c.ip(f"{uwhere}.ip", u.get("ip"), used_ips) or ""
                    if port:
                        uplinks.append(Uplink(port, ocs, ocs_port, device, ip))
        if name and pod:
            tors.append(Tor(name, pod, tuple(uplinks), netns))
    c.unique("tor", [t.name for t in tors])
    tor_pod = {t.name: t.pod for t in tors}
    tor_ports_used: dict[tuple[str, str], str] = {
        (t.name, u.port): f"tor {t.name!r} uplink" for t in tors for u in t.uplinks
    }
    for tor_entry in tors:
        for port, count in Counter(u.port for u in tor_entry.uplinks).items():
            if count > 1:
                c.add(f"tor {tor_entry.name!r}.uplinks", port, "ToR port used by two uplinks")
    torless = [p for p in pod_names if p not in pods_with_tor]
    for pod_name in torless:  # its nodes' NICs are not checked against ToRs (no cascade)
        c.problems.append(
            f"pod {pod_name!r}: has no ToR; every pod needs one: add a [[tor]] with "
            f'pod = "{pod_name}" and its uplinks, and cable the NICs of its nodes to it'
        )

    # Nodes and their NICs
    nodes: list[Node] = []
    agents: dict[str, str] = {}
    pods_referenced: set[str] = set()  # by any node entry, valid or not
    for i, raw in enumerate(c.array("node", doc.get("node"))):
        t = c.table(f"node[{i}]", raw, "node")
        if t is None:
            continue
        name = c.name(f"node[{i}].name", t.get("name"))
        where = f"node {name!r}" if name else f"node[{i}]"
        pod = pod_ref(f"{where}.pod", t.get("pod"))
        pods_referenced.add(str(t.get("pod")))
        role_raw = t.get("role")
        role: Role | None = None
        if role_raw is not None:
            try:
                role = Role(role_raw)
            except ValueError:
                c.add(f"{where}.role", role_raw, "expected 'train' or 'gen'")
        agent = c.address(f"{where}.agent", t.get("agent"))
        if agent and not agent.endswith(":0"):
            if agent in agents:
                c.add(f"{where}.agent", agent, f"address already used by node {agents[agent]!r}")
            else:
                agents[agent] = name or where
        gpus = c.integer(f"{where}.gpus", t.get("gpus"), 0, MAX_GPUS)
        nics: list[Nic] = []
        for j, nraw in enumerate(c.array(f"{where}.nics", t.get("nics"))):
            nwhere = f"{where}.nics[{j}]"
            n = c.table(nwhere, nraw, "nic")
            if n is None:
                continue
            nic_name = c.name(f"{nwhere}.name", n.get("name"))
            tor = (
                None  # the pod's missing ToR is reported once, above
                if pod in torless
                else c.ref(f"{nwhere}.tor", n.get("tor"), tor_pod, "ToR/ToRs", declared_tors)
            )
            if tor and pod and tor_pod[tor] != pod:
                c.add(
                    f"{nwhere}.tor",
                    tor,
                    f"ToR is in pod {tor_pod[tor]!r} but the node is in pod {pod!r}",
                )
                tor = None
            tor_port = c.name(f"{nwhere}.tor_port", n.get("tor_port"))
            gbps = c.number(f"{nwhere}.gbps", n.get("gbps", DEFAULT_NIC_GBPS), 0.0, 3200.0)
            if tor and tor_port:
                user = tor_ports_used.get((tor, tor_port))
                if user:
                    c.add(
                        f"{nwhere}.tor_port",
                        tor_port,
                        f"port {tor_port!r} of ToR {tor!r} is already used by {user}",
                    )
                else:
                    tor_ports_used[(tor, tor_port)] = nwhere
            if nic_name and tor and tor_port and gbps is not None:
                nics.append(Nic(nic_name, tor, tor_port, gbps))
        for nic_name, count in Counter(n.name for n in nics).items():
            if count > 1:
                c.add(f"{where}.nics", nic_name, "NIC name used more than once on this node")
        if name and pod and role and agent and gpus is not None:
            nodes.append(Node(name, pod, role, agent, gpus, tuple(nics)))
    c.unique("node", [n.name for n in nodes])

    # Pods: derived role and membership
    pods: list[Pod] = []
    for pod_name in pod_names:
        members = [n for n in nodes if n.pod == pod_name]
        roles = sorted({n.role.value for n in members})
        if not members:
            if pod_name in pods_referenced:
                continue  # its nodes have problems of their own, reported above
            c.problems.append(f"pod {pod_name!r}: has no nodes (every pod needs at least one)")
            continue
        if len(roles) > 1:
            detail = ", ".join(f"{n.name}={n.role.value}" for n in members)
            c.problems.append(
                f"pod {pod_name!r}: nodes have different roles ({detail}); "
                "all nodes of a pod must share one role"
            )
            continue
        pods.append(
            Pod(
                pod_name,
                members[0].role,
                tuple(n.name for n in members),
                tuple(t.name for t in tors if t.pod == pod_name),
                prefixes.get(pod_name, ""),
            )
        )
    if not doc.get("node"):
        c.problems.append("node: the wiring has no nodes (at least one [[node]] is required)")

    if c.problems:
        raise WiringError(source, c.problems)
    assert controller is not None
    return Wiring(
        cluster=cluster_name,
        controller=controller,
        pods=tuple(pods),
        nodes=tuple(nodes),
        tors=tuple(tors),
        ocses=tuple(ocses),
        source=source,
    )


def to_dict(w: Wiring) -> dict[str, Any]:
    """The normalised wiring as plain data (the shape of the TOML file, defaults filled in)."""
    return {
        "cluster": {"name": w.cluster, "controller": w.controller},
        "ocs": [
            {
                "name": o.name,
                "address": o.address,
                "ports": o.ports,
                "switching_time_ms": round(o.switching_time_s * 1000.0, 6),
                **_driver_dict(o),
            }
            for o in w.ocses
        ],
        "pod": [
            {
                "name": p.name,
                "role": p.role.value,
                "nodes": list(p.nodes),
                "tors": list(p.tors),
                **({"prefix": p.prefix} if p.prefix else {}),
            }
            for p in w.pods
        ],
        "tor": [
            {
                "name": t.name,
                "pod": t.pod,
                **({"netns": t.netns} if t.netns else {}),
                "uplinks": [
                    {
                        "port": u.port,
                        "ocs": u.ocs,
                        "ocs_port": u.ocs_port,
                        **({"device": u.device} if u.device else {}),
                        **({"ip": u.ip} if u.ip else {}),
                    }
                    for u in t.uplinks
                ],
            }
            for t in w.tors
        ],
        "node": [
            {
                "name": n.name,
                "pod": n.pod,
                "role": n.role.value,
                "agent": n.agent,
                "gpus": n.gpus,
                "nics": [
                    {"name": x.name, "tor": x.tor, "tor_port": x.tor_port, "gbps": x.gbps}
                    for x in n.nics
                ],
            }
            for n in w.nodes
        ],
    }


def _driver_dict(o: Ocs) -> dict[str, Any]:
    """The driver keys of an OCS as the file spells them (none for the default, gRPC)."""
    if o.driver == "grpc":
        return {}
    out: dict[str, Any] = {"driver": o.driver}
    if o.netconf is not None:
        n = o.netconf
        out["netconf"] = {
            "username": n.username,
            **({"key_file": n.key_file} if n.key_file else {}),
            **({"password_file": n.password_file} if n.password_file else {}),
            **({"known_hosts": n.known_hosts} if n.known_hosts else {}),
            "host_key_check": n.host_key_check,
            "timeout_s": n.timeout_s,
            "retries": n.retries,
            "confirm_timeout_s": n.confirm_timeout_s,
        }
    return out


def diff(old: Wiring, new: Wiring) -> list[str]:
    """What changed from ``old`` to ``new``, one line per element (pods, nodes, ToRs,
    OCSes by name, then the cluster's own fields): ``node 'gen1-n3' added``,
    ``tor 'tor-gen0' changed``. Empty when the two are the same."""
    out = [
        f"{field} {old_value!r} -> {new_value!r}"
        for field, old_value, new_value in (
            ("cluster", old.cluster, new.cluster),
            ("controller", old.controller, new.controller),
        )
        if old_value != new_value
    ]
    kinds: tuple[tuple[str, Iterable[Any], Iterable[Any]], ...] = (
        ("pod", old.pods, new.pods),
        ("node", old.nodes, new.nodes),
        ("tor", old.tors, new.tors),
        ("ocs", old.ocses, new.ocses),
    )
    for kind, before, after in kinds:
        was = {x.name: x for x in before}
        now = {x.name: x for x in after}
        for name in sorted(was.keys() | now.keys()):
            if name not in now:
                out.append(f"{kind} {name!r} removed")
            elif name not in was:
                out.append(f"{kind} {name!r} added")
            elif was[name] != now[name]:
                out.append(f"{kind} {name!r} changed")
    return out


def default_wiring_path() -> Path:
    """The wiring embedded in the package (the same as examples/local-8node.toml)."""
    return Path(__file__).parent / "data" / "local-8node.toml"


def to_toml(w: Wiring) -> str:
    """The wiring as a TOML file that :func:`parse` reads back to an equal wiring."""

    def q(v: object) -> str:
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    out = [f"[cluster]\nname = {q(w.cluster)}\ncontroller = {q(w.controller)}\n"]
    for o in w.ocses:
        out.append(
            f"[[ocs]]\nname = {q(o.name)}\naddress = {q(o.address)}\nports = {o.ports}\n"
            f"switching_time_ms = {o.switching_time_s * 1000.0!r}\n"
        )
        for key, value in _driver_dict(o).items():
            if isinstance(value, dict):
                items = ", ".join(f"{k} = {_toml_value(v, q)}" for k, v in value.items())
                out[-1] += f"{key} = {{ {items} }}\n"
            else:
                out[-1] += f"{key} = {_toml_value(value, q)}\n"
    out += [
        f"[[pod]]\nname = {q(p.name)}\n" + (f"prefix = {q(p.prefix)}\n" if p.prefix else "")
        for p in w.pods
    ]
    for t in w.tors:
        ups = ",\n".join(
            f"  {{ port = {q(u.port)}, ocs = {q(u.ocs)}, ocs_port = {u.ocs_port}"
            + (f", device = {q(u.device)}" if u.device else "")
            + (f", ip = {q(u.ip)}" if u.ip else "")
            + " }"
            for u in t.uplinks
        )
        netns = f"netns = {q(t.netns)}\n" if t.netns else ""
        out.append(f"[[tor]]\nname = {q(t.name)}\npod = {q(t.pod)}\n{netns}uplinks = [\n{ups}\n]\n")
    for n in w.nodes:
        nics = ",\n".join(
            f"  {{ name = {q(x.name)}, tor = {q(x.tor)}, tor_port = {q(x.tor_port)}, "
            f"gbps = {x.gbps!r} }}"
            for x in n.nics
        )
        out.append(
            f"[[node]]\nname = {q(n.name)}\npod = {q(n.pod)}\nrole = {q(n.role.value)}\n"
            f"agent = {q(n.agent)}\ngpus = {n.gpus}\nnics = [\n{nics}\n]\n"
        )
    return "\n".join(out)


def _toml_value(v: object, q: Callable[[object], str]) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return q(v)

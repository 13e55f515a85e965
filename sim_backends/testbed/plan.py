"""What a testbed is made of, decided from the wiring alone (pure: no I/O).

``make_plan`` turns the user's wiring into a :class:`TestbedPlan`: one namespace per
node, ToR and OCS (named ``<id>-<element>``), the veth pairs between them and the
capacity each is shaped to, the addresses, the daemons to start, and the AUGMENTED
wiring (pod prefixes, ToR namespaces, uplink devices and addresses, agent, OCS and
controller addresses) that the controller loads. ``commands`` renders a plan as the
``ip``/``tc`` batch text that builds it.

The model of the hardware, and where it simplifies:

- one data NIC per node (``eth0`` or the name of the node's first NIC), shaped to the
  sum of the node's NIC speeds: the wiring's 8 x 400 Gb/s become one 3.2 Tb/s link
  (scaled down). The node agent reports it with that unscaled speed;
- a ToR is a Linux bridge of its node ports holding the pod's gateway address (the
  first host of the pod prefix; nodes take the following ones), plus one routed
  interface per uplink with the uplink's own /32; forwarding on, rp_filter off, ECMP
  hashed on ports (L4), so parallel flows spread over a pod pair's circuits;
- one ToR per pod (the pod prefix has to live somewhere);
- capacities: every link is shaped with tbf on both ends to ``gbps * 1000 / scale``
  Mb/s; uplinks (hence circuits) run at ``uplink_gbps`` (the planner's default, 400);
- management: a bridge ``<id>-br`` in the host namespace with the controller's and the
  OCS daemons' address, and one veth per node (``mg0`` inside the node);
- weight sync: every agent keeps checkpoints in ``RUN/checkpoints/NODE`` and serves them on
  its data address (``checkpoint_listen``, port CHECKPOINT_PORT), so a generation node's
  fetch from a training node crosses the ToRs and the OCS circuits like any data.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Node, Ocs, Pod, Tor, Wiring
from scheduler.network import DEFAULT_UPLINK_GBPS

ID_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
ID_RULE = "1-8 characters: a lowercase letter, then lowercase letters or digits (no '-')"
IFNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")
DEFAULT_ID = "orl"
DEFAULT_SCALE = 4000.0  # 400 Gb/s -> 100 Mb/s: what two cores push through several hops
MGMT_POOL = ipaddress.IPv4Network("10.255.0.0/16")
POD_POOL = ipaddress.IPv4Network("10.0.0.0/9")
UPLINK_POOL = ipaddress.IPv4Network("172.16.0.0/12")
CONTROLLER_PORT = 50051
OCS_PORT = 50061  # + index of the OCS
AGENT_PORT = 50101
CHECKPOINT_PORT = 50102  # each agent serves its checkpoints on its data address too
HEARTBEAT_INTERVAL_S = 0.5
RECONCILE_INTERVAL_S = 2.0  # how soon a failed OCS port is noticed and routed around
OCS_DEVICE_PREFIX = "p"
MGMT_DEVICE = "mg0"
TBF_LATENCY_MS = 50
TBF_MIN_BURST_BYTES = 64 * 1024  # at least one GSO packet, or tbf has to split them
MAX_NETNS_NAME = 63  # the wiring's name rule, which ToR namespaces must follow


@dataclass(frozen=True)
class Scale:
    """Emulated rate = real rate / divisor."""

    divisor: float

    def __post_init__(self) -> None:
        if not 1.0 <= self.divisor <= 1e7:
            raise errors.field_error("--scale", self.divisor, "a divisor from 1 to 10000000")

    def mbps(self, gbps: float) -> float:
        return gbps * 1000.0 / self.divisor

    def describe(self, gbps: float = DEFAULT_UPLINK_GBPS) -> str:
        return f"1:{self.divisor:g} ({gbps:g} Gb/s -> {self.mbps(gbps):g} Mb/s)"


@dataclass(frozen=True)
class End:
    netns: str | None  # None: the host namespace
    dev: str


@dataclass(frozen=True)
class Link:
    """A veth pair; ``mbps`` None: not shaped."""

    kind: str  # "data" (node - ToR), "uplink" (ToR - OCS) or "mgmt" (node - host)
    a: End
    b: End
    mbps: float | None


@dataclass(frozen=True)
class NodePlan:
    name: str
    pod: str
    role: str
    netns: str
    device: str  # the data NIC
    ip: str  # data address
    prefixlen: int
    gateway: str  # the ToR's address in the pod prefix
    mgmt_ip: str
    agent: str  # HOST:PORT of its agent
    nic_gbps: float  # real (unscaled) capacity of the data NIC
    nic_mbps: float  # emulated
    tor: str
    gpus: int


@dataclass(frozen=True)
class TorPlan:
    name: str
    pod: str
    netns: str
    bridge: str
    gateway: str  # CIDR on the bridge, e.g. 10.0.1.1/24
    node_ports: tuple[str, ...]
    uplinks: tuple[tuple[str, str], ...]  # (device, ip) in wiring order


@dataclass(frozen=True)
class OcsPlan:
    name: str
    netns: str
    ports: int
    address: str
    switching_time_ms: float


@dataclass(frozen=True)
class Daemon:
    role: str  # "ocs", "controller" or "agent"
    name: str
    netns: str | None  # where it runs (None: the host namespace)
    argv: tuple[str, ...]
    address: str
    ready: str  # the file it writes its bound address to
    log: str

    @property
    def label(self) -> str:
        return self.role if self.name == self.role else f"{self.role} {self.name}"


@dataclass(frozen=True)
class TestbedPlan:
    __test__: ClassVar[bool] = False  # not a pytest test class, despite its name

    id: str
    run_dir: str
    scale: Scale
    uplink_gbps: float
    mgmt_bridge: str
    mgmt_cidr: str  # the bridge's address, e.g. 10.255.0.1/24
    controller: str
    nodes: tuple[NodePlan, ...]
    tors: tuple[TorPlan, ...]
    ocses: tuple[OcsPlan, ...]
    links: tuple[Link, ...]
    daemons: tuple[Daemon, ...]
    wiring: Wiring = field(compare=False)  # the augmented wiring the controller loads
    source: str = ""  # the user's wiring file

    @property
    def prefix(self) -> str:
        """Every namespace and host-namespace interface of the testbed starts with it."""
        return f"{self.id}-"

    def namespaces(self) -> tuple[str, ...]:
        return (
            *(o.netns for o in self.ocses),
            *(t.netns for t in self.tors),
            *(n.netns for n in self.nodes),
        )

    def root_links(self) -> tuple[str, ...]:
        ends = [e.dev for link in self.links for e in (link.a, link.b) if e.netns is None]
        return (self.mgmt_bridge, *ends)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        known = ", ".join(n.name for n in self.nodes)
        raise errors.NotFound(f"node {name!r} is not in testbed {self.id!r} (known: {known})")

    def pod_nodes(self, pod: str) -> tuple[NodePlan, ...]:
        return tuple(n for n in self.nodes if n.pod == pod)


def check_id(testbed_id: str) -> str:
    if not isinstance(testbed_id, str) or not ID_RE.match(testbed_id):
        raise errors.field_error("--id", testbed_id, ID_RULE)
    return testbed_id


def netns_name(testbed_id: str, element: str) -> str:
    return f"{testbed_id}-{element}"


def free_subnet(
    pool: ipaddress.IPv4Network, prefixlen: int, used: Iterable[ipaddress.IPv4Network]
) -> ipaddress.IPv4Network | None:
    """The first /prefixlen of ``pool`` that overlaps none of ``used``."""
    taken = list(used)
    for net in pool.subnets(new_prefix=prefixlen):
        if not any(net.overlaps(u) for u in taken):
            return net
    return None


def prefixlen_for(hosts: int, longest: int = 24) -> int:
    """The longest IPv4 prefix (at most ``longest``) with room for ``hosts`` addresses."""
    length = longest
    while length > 8 and (2 ** (32 - length)) - 2 < hosts:
        length -= 1
    return length


class _Names:
    """Interface names inside one namespace: the preferred one when it is free and valid."""

    def __init__(self, reserved: Iterable[str] = ("lo",)) -> None:
        self._used = set(reserved)

    def take(self, preferred: str, fallback: str) -> str:
        for candidate in (preferred, fallback):
            if candidate and IFNAME_RE.match(candidate) and candidate not in self._used:
                self._used.add(candidate)
                return candidate
        i = 0
        while f"{fallback}{i}" in self._used:
            i += 1
        self._used.add(f"{fallback}{i}")
        return f"{fallback}{i}"


def make_plan(
    w: Wiring,
    *,
    testbed_id: str = DEFAULT_ID,
    run_dir: Path,
    mgmt: ipaddress.IPv4Network,
    scale: Scale = Scale(DEFAULT_SCALE),
    uplink_gbps: float = DEFAULT_UPLINK_GBPS,
    python: str = "python3",
) -> TestbedPlan:
    """The testbed for ``w``; raises ``InvalidArgument`` listing every problem at once."""
    check_id(testbed_id)
    problems: list[str] = []
    if not 0 < uplink_gbps <= 3200:
        problems.append(f"uplink_gbps={uplink_gbps!r}: a speed in Gb/s, more than 0, at most 3200")
    if not mgmt.is_private:
        problems.append(f"management network {mgmt}: must be a private IPv4 network")

    elements = [("OCS", o.name) for o in w.ocses] + [("ToR", t.name) for t in w.tors]
    elements += [("node", n.name) for n in w.nodes]
    seen: dict[str, str] = {}
    for kind, name in elements:
        ns = netns_name(testbed_id, name)
        if len(ns) > MAX_NETNS_NAME:
            problems.append(
                f"{kind} {name!r}: namespace name {ns!r} is longer than {MAX_NETNS_NAME} "
                "characters; shorten the name or the testbed id"
            )
        if name in seen:
            problems.append(
                f"{kind} {name!r}: a {seen[name]} has the same name; the testbed names a "
                "namespace after each element, so node, ToR and OCS names must differ"
            )
        seen[name] = kind

    tors_of: dict[str, list[Tor]] = {p.name: [] for p in w.pods}
    for t in w.tors:
        tors_of[t.pod].append(t)
    for pod in w.pods:
        if len(tors_of[pod.name]) != 1:
            count = len(tors_of[pod.name])
            problems.append(
                f"pod {pod.name!r} has {count} ToRs: the testbed models exactly one ToR per "
                "pod (it holds the pod's gateway address)"
            )
    for n in w.nodes:
        if not n.nics:
            problems.append(
                f"node {n.name!r} has no NICs: the testbed cables a node to its ToR "
                "through its NICs; give it at least one [[node]].nics entry"
            )

    # Addresses: management, pod prefixes, uplink /32s.
    mgmt_hosts = list(mgmt.hosts())
    if len(mgmt_hosts) < len(w.nodes) + 1:
        problems.append(
            f"management network {mgmt} has {len(mgmt_hosts)} addresses; "
            f"{len(w.nodes) + 1} are needed (controller and {len(w.nodes)} agents)"
        )
    user_prefixes: dict[str, ipaddress.IPv4Network] = {}
    for pod in w.pods:
        net = ipaddress.ip_network(pod.prefix) if pod.prefix else None
        if isinstance(net, ipaddress.IPv6Network):
            problems.append(
                f"pod {pod.name!r}.prefix = {pod.prefix!r}: the testbed routes IPv4 only; "
                "give the pod an IPv4 prefix or none (one is then assigned)"
            )
        elif net is not None and net.overlaps(mgmt):
            problems.append(
                f"pod {pod.name!r}.prefix = {pod.prefix!r} overlaps the management {mgmt}"
            )
        elif net is not None:
            user_prefixes[pod.name] = net
    _refuse(w, testbed_id, problems)

    for t in w.tors:
        for u in t.uplinks:
            if not u.ip:
                continue
            address = ipaddress.ip_address(u.ip)
            inside = [str(n) for n in (mgmt, *user_prefixes.values()) if address in n]
            if address.version != 4 or inside:
                where = f"inside {', '.join(inside)}" if inside else "not IPv4"
                problems.append(
                    f"tor {t.name!r} uplink {u.port!r}.ip = {u.ip!r} is {where}: an uplink "
                    "address must be an IPv4 address outside every pod prefix and the "
                    "management network"
                )
    _refuse(w, testbed_id, problems)

    used: list[ipaddress.IPv4Network] = [mgmt, *user_prefixes.values()]
    prefixes: dict[str, ipaddress.IPv4Network] = {}
    for pod in w.pods:
        need = len(pod.nodes) + 1
        if pod.name in user_prefixes:
            net = user_prefixes[pod.name]
            if net.num_addresses - 2 < need:
                problems.append(
                    f"pod {pod.name!r}.prefix = {str(net)!r} has room for "
                    f"{net.num_addresses - 2} hosts; {need} are needed (ToR and nodes)"
                )
            prefixes[pod.name] = net
            continue
        chosen = free_subnet(POD_POOL, prefixlen_for(need), used)
        if chosen is None:
            problems.append(f"pod {pod.name!r}: no free prefix left in {POD_POOL}")
            continue
        prefixes[pod.name] = chosen
        used.append(chosen)
    uplink_ips = _uplink_addresses(w, used)
    _refuse(w, testbed_id, problems)

    run = Path(run_dir)
    bridge_ip = mgmt_hosts[0]
    controller = f"{bridge_ip}:{CONTROLLER_PORT}"
    mgmt_of = {n.name: mgmt_hosts[1 + i] for i, n in enumerate(w.nodes)}
    links: list[Link] = []

    # OCSes: port N is device p<N> in the OCS namespace.
    ocses = tuple(
        OcsPlan(
            o.name,
            netns_name(testbed_id, o.name),
            o.ports,
            f"{bridge_ip}:{OCS_PORT + i}",
            o.switching_time_s * 1000.0,
        )
        for i, o in enumerate(w.ocses)
    )
    ocs_ns = {o.name: o.netns for o in ocses}

    # ToRs: bridge of node ports (gateway address), routed uplinks.
    node_port: dict[str, str] = {}
    tors: list[TorPlan] = []
    new_tors: list[Tor] = []
    for t in w.tors:
        ns = netns_name(testbed_id, t.name)
        names = _Names()
        members = [n for n in w.nodes if n.nics and n.nics[0].tor == t.name]
        ports = []
        for i, n in enumerate(members):
            port = names.take(n.nics[0].tor_port, f"n{i}")
            node_port[n.name] = port
            ports.append(port)
        uplinks = []
        new_uplinks = []
        for j, u in enumerate(t.uplinks):
            dev = names.take(u.device or u.port, f"up{j}")
            ip = uplink_ips[(u.ocs, u.ocs_port)]
            uplinks.append((dev, ip))
            new_uplinks.append(replace(u, device=dev, ip=ip))
            links.append(
                Link(
                    "uplink",
                    End(ns, dev),
                    End(ocs_ns[u.ocs], f"{OCS_DEVICE_PREFIX}{u.ocs_port}"),
                    scale.mbps(uplink_gbps),
                )
            )
        bridge = names.take("br0", "br")
        prefix = prefixes[t.pod]
        gateway = f"{next(prefix.hosts())}/{prefix.prefixlen}"
        tors.append(TorPlan(t.name, t.pod, ns, bridge, gateway, tuple(ports), tuple(uplinks)))
        new_tors.append(replace(t, netns=ns, uplinks=tuple(new_uplinks)))

    # Nodes: one data NIC to the ToR, one management veth to the host's bridge.
    nodes: list[NodePlan] = []
    new_nodes: list[Node] = []
    for i, n in enumerate(w.nodes):
        ns = netns_name(testbed_id, n.name)
        prefix = prefixes[n.pod]
        hosts = prefix.hosts()
        gateway = str(next(hosts))
        index = w.pod(n.pod).nodes.index(n.name)
        ip = str(prefix.network_address + 2 + index)
        names = _Names(("lo", MGMT_DEVICE))
        dev = names.take(n.nics[0].name, "eth0")
        gbps = sum(x.gbps for x in n.nics)
        agent = f"{mgmt_of[n.name]}:{AGENT_PORT}"
        tor = n.nics[0].tor
        nodes.append(
            NodePlan(
                n.name,
                n.pod,
                n.role.value,
                ns,
                dev,
                ip,
                prefix.prefixlen,
                gateway,
                str(mgmt_of[n.name]),
                agent,
                gbps,
                scale.mbps(gbps),
                tor,
                n.gpus,
            )
        )
        new_nodes.append(replace(n, agent=agent))
        links.append(
            Link(
                "data",
                End(ns, dev),
                End(netns_name(testbed_id, tor), node_port[n.name]),
                scale.mbps(gbps),
            )
        )
        links.append(Link("mgmt", End(ns, MGMT_DEVICE), End(None, f"{testbed_id}-m{i}"), None))

    new_pods: list[Pod] = [replace(p, prefix=str(prefixes[p.name])) for p in w.pods]
    new_ocses: list[Ocs] = [
        replace(o, address=p.address) for o, p in zip(w.ocses, ocses, strict=True)
    ]
    augmented = Wiring(
        cluster=w.cluster,
        controller=controller,
        pods=tuple(new_pods),
        nodes=tuple(new_nodes),
        tors=tuple(new_tors),
        ocses=tuple(new_ocses),
        source=str(run / "wiring.toml"),
    )
    # What the controller will read must be a valid wiring file that says the same.
    reread = wiring_mod.parse(wiring_mod.to_toml(augmented), source=augmented.source)
    if reread != augmented:
        raise errors.FailedPrecondition(
            "internal: the augmented wiring does not read back equal; please report this"
        )

    plan = TestbedPlan(
        id=testbed_id,
        run_dir=str(run),
        scale=scale,
        uplink_gbps=uplink_gbps,
        mgmt_bridge=f"{testbed_id}-br",
        mgmt_cidr=f"{bridge_ip}/{mgmt.prefixlen}",
        controller=controller,
        nodes=tuple(nodes),
        tors=tuple(tors),
        ocses=ocses,
        links=tuple(links),
        daemons=(),
        wiring=reread,
        source=w.source,
    )
    return replace(plan, daemons=tuple(_daemons(plan, python)))


def _refuse(w: Wiring, testbed_id: str, problems: list[str]) -> None:
    if problems:
        raise errors.InvalidArgument(
            f"wiring {w.source or w.cluster!r} cannot become testbed {testbed_id!r} "
            "(nothing was created):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _uplink_addresses(w: Wiring, avoid: list[ipaddress.IPv4Network]) -> dict[tuple[str, int], str]:
    """The wiring's uplink addresses, and fresh ones from UPLINK_POOL for the others."""
    given = {(u.ocs, u.ocs_port): u.ip for t in w.tors for u in t.uplinks if u.ip}
    taken = set(given.values())

    def fresh() -> Iterator[str]:
        for address in UPLINK_POOL.hosts():
            text = str(address)
            if text not in taken and not any(address in net for net in avoid):
                yield text

    pool = fresh()
    out = dict(given)
    for t in w.tors:
        for u in t.uplinks:
            if (u.ocs, u.ocs_port) not in out:
                out[(u.ocs, u.ocs_port)] = next(pool)
    return out


def checkpoint_dir(plan: TestbedPlan, node: str) -> Path:
    """The node agent's checkpoint_dir (a trainer publishes into its training node's)."""
    return Path(plan.run_dir) / "checkpoints" / node


def _daemons(plan: TestbedPlan, python: str) -> Iterator[Daemon]:
    run = Path(plan.run_dir)

    def files(role: str, name: str) -> tuple[str, str]:
        return str(run / "ready" / f"{role}-{name}.addr"), str(run / "logs" / f"{role}-{name}.log")

    common = ("--log-format", "json")
    argv: tuple[str, ...]
    for o in plan.ocses:
        ready, log = files("ocs", o.name)
        argv = (
            python, "-m", "sim_backends.ocs_server",
            "--name", o.name,
            "--ports", str(o.ports),
            "--switching-time-ms", f"{o.switching_time_ms:g}",
            "--listen", o.address,
            "--plaintext",  # the management bridge of one machine
            "--netns", o.netns,
            "--port-device-prefix", OCS_DEVICE_PREFIX,
            "--ready-file", ready,
            *common,
        )  # fmt: skip
        yield Daemon("ocs", o.name, None, argv, o.address, ready, log)
    ready, log = files("controller", "controller")
    argv = (
        python, "-m", "fabric_controller.main",
        "--wiring", str(run / "wiring.toml"),
        "--state", str(run / "state.db"),
        "--listen", plan.controller,
        "--heartbeat-interval", f"{HEARTBEAT_INTERVAL_S:g}",
        "--reconcile-interval", f"{RECONCILE_INTERVAL_S:g}",
        "--plaintext",
        "--ready-file", ready,
        *common,
    )  # fmt: skip
    yield Daemon("controller", "controller", None, argv, plan.controller, ready, log)
    for n in plan.nodes:
        ready, log = files("agent", n.name)
        argv = (
            "ip", "netns", "exec", n.netns,
            python, "-m", "node_agent.main",
            "--node", n.name,
            "--listen", n.agent,
            "--controller", plan.controller,
            "--gpu-backend", "sim",
            "--engine", "sim",
            "--gpus", str(max(1, n.gpus)),
            "--nic", f"{n.device}={n.nic_gbps:g}",
            "--checkpoint-dir", str(checkpoint_dir(plan, n.name)),
            "--checkpoint-listen", f"{n.ip}:{CHECKPOINT_PORT}",
            "--plaintext",
            "--ready-file", ready,
            *common,
        )  # fmt: skip
        yield Daemon("agent", n.name, n.netns, argv, n.agent, ready, log)


# -- rendering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Commands:
    """The batches that build a plan, in order. ``ip -batch`` / ``tc -batch`` text."""

    netns: str  # host: `ip -batch`, one `netns add` per namespace
    sysctls: dict[str, tuple[str, ...]]  # namespace -> `sysctl -w` arguments
    host: str  # host: `ip -batch`: the management bridge, every veth pair
    inside: dict[str, str]  # namespace -> `ip -n NS -batch`: addresses, bridges, routes
    shaping: dict[str, str]  # namespace -> `tc -n NS -batch`: tbf on every shaped end


def tbf(mbps: float) -> str:
    """``rate R burst B latency L`` for a tbf that TCP can fill (R in kbit/s)."""
    rate_kbit = max(8, round(mbps * 1000))
    burst = max(TBF_MIN_BURST_BYTES, rate_kbit * 1000 // 8 // 500)  # 2 ms at rate
    return f"rate {rate_kbit}kbit burst {burst} latency {TBF_LATENCY_MS}ms"


def commands(plan: TestbedPlan) -> Commands:
    netns = "".join(f"netns add {ns}\n" for ns in plan.namespaces())
    quiet = ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
    router = (
        "net.ipv4.ip_forward=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
        "net.ipv4.fib_multipath_hash_policy=1",
    )
    sysctls: dict[str, tuple[str, ...]] = {o.netns: quiet for o in plan.ocses}
    sysctls |= {t.netns: (*quiet, *router) for t in plan.tors}
    sysctls |= {n.netns: quiet for n in plan.nodes}

    host = [
        f"link add {plan.mgmt_bridge} type bridge",
        f"addr add {plan.mgmt_cidr} dev {plan.mgmt_bridge}",
        f"link set {plan.mgmt_bridge} up",
    ]
    inside: dict[str, list[str]] = {ns: ["link set lo up"] for ns in plan.namespaces()}
    shaping: dict[str, list[str]] = {}
    for link in plan.links:
        a = f"{link.a.dev}" + (f" netns {link.a.netns}" if link.a.netns else "")
        b = f"{link.b.dev}" + (f" netns {link.b.netns}" if link.b.netns else "")
        host.append(f"link add {a} type veth peer name {b}")
        for end in (link.a, link.b):
            if end.netns is None:
                host.append(f"link set {end.dev} master {plan.mgmt_bridge}")
                host.append(f"link set {end.dev} up")
            else:
                inside[end.netns].append(f"link set {end.dev} up")
                if link.mbps is not None:
                    shaping.setdefault(end.netns, []).append(
                        f"qdisc add dev {end.dev} root tbf {tbf(link.mbps)}"
                    )
    for t in plan.tors:
        lines = inside[t.netns]
        lines.append(f"link add {t.bridge} type bridge")
        lines += [f"link set {port} master {t.bridge}" for port in t.node_ports]
        lines.append(f"addr add {t.gateway} dev {t.bridge}")
        lines.append(f"link set {t.bridge} up")
        lines += [f"addr add {ip}/32 dev {dev}" for dev, ip in t.uplinks]
    mgmt_len = plan.mgmt_cidr.split("/")[1]
    for n in plan.nodes:
        lines = inside[n.netns]
        lines.append(f"addr add {n.ip}/{n.prefixlen} dev {n.device}")
        lines.append(f"addr add {n.mgmt_ip}/{mgmt_len} dev {MGMT_DEVICE}")
        lines.append(f"route add default via {n.gateway} dev {n.device}")
    return Commands(
        netns=netns,
        sysctls=sysctls,
        host="".join(f"{line}\n" for line in host),
        inside={ns: "".join(f"{line}\n" for line in lines) for ns, lines in inside.items()},
        shaping={ns: "".join(f"{line}\n" for line in lines) for ns, lines in shaping.items()},
    )


def describe(plan: TestbedPlan) -> str:
    """A short account of the plan for the terminal."""
    shaped = [link for link in plan.links if link.mbps is not None]
    return (
        f"testbed {plan.id!r}: {len(plan.nodes)} nodes, {len(plan.tors)} ToRs, "
        f"{len(plan.ocses)} OCS(es) -> {len(plan.namespaces())} namespaces, "
        f"{len(plan.links)} veth pairs ({len(shaped)} shaped); "
        f"scale {plan.scale.describe(plan.uplink_gbps)}; controller {plan.controller}"
    )

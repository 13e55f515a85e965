"""The domain model: phases, circuits, and the cluster wiring (frozen values)."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from orchestrrl import errors


class Phase(enum.Enum):
    """A cluster-wide phase of the RL loop; the value is the CLI spelling."""

    GENERATION = "generation"
    TRAINING = "training"
    WEIGHT_SYNC = "weight-sync"
    # the epoch phase of a cluster in asynchronous mode (:class:`Mode`): one standing
    # topology for both roles; entered and left only by a mode change, never by SetPhase
    ASYNC = "async"

    @classmethod
    def parse(cls, value: str, field: str = "phase") -> Phase:
        """One of the synchronous phases (:data:`SYNC_PHASES`) by its CLI spelling."""
        for phase in SYNC_PHASES:
            if value == phase.value or value.replace("_", "-").lower() == phase.value:
                return phase
        allowed = ", ".join(p.value for p in SYNC_PHASES)
        raise errors.field_error(field, value, f"expected one of {allowed}")


# the phases a synchronous job sets one after another (SetPhase; `orlctl phase set`)
SYNC_PHASES = (Phase.GENERATION, Phase.TRAINING, Phase.WEIGHT_SYNC)


class Mode(enum.Enum):
    """How a cluster runs RL: phase by phase (the per-phase API) or asynchronously
    (trainer and rollout at once on one standing topology: epochs of phase
    :attr:`Phase.ASYNC`). The mode is the committed epoch's phase, so it is stored,
    journaled and replicated with it."""

    PHASED = "phased"
    ASYNC = "async"

    @classmethod
    def parse(cls, value: str, field: str = "mode") -> Mode:
        for mode in cls:
            if isinstance(value, str) and value.strip().lower() == mode.value:
                return mode
        raise errors.field_error(field, value, "phased or async")

    @classmethod
    def of(cls, phase: Phase | None) -> Mode:
        """The mode of a cluster whose committed epoch has ``phase``."""
        return cls.ASYNC if phase is Phase.ASYNC else cls.PHASED


class Role(enum.Enum):
    TRAIN = "train"
    GEN = "gen"


class _CircuitFields(NamedTuple):
    ocs: str
    a: int
    b: int


class Circuit(_CircuitFields):
    """A bidirectional circuit between two ports of one OCS; ``a < b`` always.

    A named tuple: planners sort and hash thousands of these per phase change, and
    tuple comparison runs in C."""

    __slots__ = ()

    def __new__(cls, ocs: str, a: int, b: int) -> Circuit:
        if a == b:
            raise errors.InvalidArgument(f"circuit on {ocs} connects port {a} to itself")
        return super().__new__(cls, ocs, a, b) if a < b else super().__new__(cls, ocs, b, a)

    def ports(self) -> tuple[tuple[str, int], tuple[str, int]]:
        return (self.ocs, self.a), (self.ocs, self.b)

    def __str__(self) -> str:
        return f"{self.ocs}:{self.a}<->{self.b}"


@dataclass(frozen=True)
class NetconfSettings:
    """How the controller reaches an OCS over NETCONF (``driver = "netconf"``): SSH user
    and credentials (a private key file or a password file, exactly one), the file of
    trusted host keys ("" : the controller user's ~/.ssh/known_hosts), per-RPC timeout
    and retries, and the confirmed-commit timeout after which the switch rolls back a
    batch its controller did not confirm."""

    username: str
    key_file: str = ""
    password_file: str = ""
    known_hosts: str = ""
    host_key_check: bool = True
    timeout_s: float = 10.0
    retries: int = 2
    confirm_timeout_s: int = 30


OCS_DRIVERS = ("grpc", "netconf")


@dataclass(frozen=True)
class Ocs:
    name: str
    address: str
    ports: int
    switching_time_s: float
    driver: str = "grpc"  # one of OCS_DRIVERS: the OpticalSwitch gRPC contract, or NETCONF
    netconf: NetconfSettings | None = None  # with driver "netconf"


@dataclass(frozen=True)
class Uplink:
    port: str
    ocs: str
    ocs_port: int
    device: str = ""  # interface name on the ToR; "" means the same as ``port``
    ip: str = ""  # the uplink's own address, for routes over circuits ("" : none)

    @property
    def interface(self) -> str:
        return self.device or self.port


@dataclass(frozen=True)
class Tor:
    name: str
    pod: str
    uplinks: tuple[Uplink, ...]
    netns: str = ""  # Linux switch in this network namespace of the controller's host


@dataclass(frozen=True)
class Nic:
    name: str
    tor: str
    tor_port: str
    gbps: float


@dataclass(frozen=True)
class Node:
    name: str
    pod: str
    role: Role
    agent: str
    gpus: int
    nics: tuple[Nic, ...]


@dataclass(frozen=True)
class Pod:
    name: str
    role: Role
    nodes: tuple[str, ...]
    tors: tuple[str, ...]
    prefix: str = ""  # the pod's address block, e.g. 10.0.1.0/24 ("" : not routed)


@dataclass(frozen=True)
class Wiring:
    """A validated cluster wiring. Build it with ``orchestrrl.wiring.load``/``parse``."""

    cluster: str
    controller: str
    pods: tuple[Pod, ...]
    nodes: tuple[Node, ...]
    tors: tuple[Tor, ...]
    ocses: tuple[Ocs, ...]
    source: str = field(default="", compare=False)

    @cached_property
    def _pods(self) -> dict[str, Pod]:
        return {p.name: p for p in self.pods}

    @cached_property
    def _nodes(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def _tors(self) -> dict[str, Tor]:
        return {t.name: t for t in self.tors}

    def tor(self, name: str) -> Tor:
        try:
            return self._tors[name]
        except KeyError:
            raise errors.NotFound(f"ToR {name!r} is not in the wiring") from None

    @cached_property
    def _ocses(self) -> dict[str, Ocs]:
        return {o.name: o for o in self.ocses}

    @cached_property
    def _port_owner(self) -> dict[tuple[str, int], str]:
        tor_pod = {t.name: t.pod for t in self.tors}
        return {(u.ocs, u.ocs_port): tor_pod[t.name] for t in self.tors for u in t.uplinks}

    @cached_property
    def _uplink_at(self) -> dict[tuple[str, int], tuple[Tor, Uplink]]:
        return {(u.ocs, u.ocs_port): (t, u) for t in self.tors for u in t.uplinks}

    def uplink_at(self, ocs: str, port: int) -> tuple[Tor, Uplink] | None:
        """The ToR uplink cabled to this OCS port, or None."""
        return self._uplink_at.get((ocs, port))

    def pod(self, name: str) -> Pod:
        try:
            return self._pods[name]
        except KeyError:
            raise errors.NotFound(f"pod {errors.shown(name)} is not in the wiring") from None

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            known = errors.listed(sorted(self._nodes), ", ") or "none"
            raise errors.NotFound(
                f"node {errors.shown(name)} is not in the wiring (known: {known})"
            ) from None

    def ocs(self, name: str) -> Ocs:
        try:
            return self._ocses[name]
        except KeyError:
            raise errors.NotFound(f"OCS {errors.shown(name)} is not in the wiring") from None

    def pods_with_role(self, role: Role) -> tuple[str, ...]:
        return tuple(p.name for p in self.pods if p.role is role)

    def port_owner(self, ocs: str, port: int) -> str | None:
        """The pod whose ToR uplink is cabled to this OCS port, or None if unused."""
        return self._port_owner.get((ocs, port))

    def uplink_ports(self) -> Iterator[tuple[str, str, int]]:
        """(pod, ocs, port) for every cabled uplink, in wiring order."""
        for tor in self.tors:
            for u in tor.uplinks:
                yield tor.pod, u.ocs, u.ocs_port

    def circuit_pods(self, circuit: Circuit) -> tuple[str, str]:
        return (
            self.port_owner(circuit.ocs, circuit.a) or "",
            self.port_owner(circuit.ocs, circuit.b) or "",
        )

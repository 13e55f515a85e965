"""ConfigureRoce against a fake sysfs tree, a fake dcb that interprets its arguments like
the real one, and fake links: behaviour and read-back, never a silent success."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from node_agent.roce import (
    DSCP_PRIO,
    CommandResult,
    RoceConfigurator,
    RoceResult,
    RoceSettings,
    results_to_pb,
    settings_from_pb,
)
from orchestrrl import errors
from orchestrrl.netlink import LinkInfo
from orchestrrl.v1 import node_agent_pb2 as pb

pytestmark = pytest.mark.unit

UNSUPPORTED = "Attribute read: Operation not supported\n"


class FakeDcb:
    """iproute2's dcb for the commands the configurator uses; NICs not in ``capable``
    answer like a veth (EOPNOTSUPP)."""

    def __init__(self, capable: Sequence[str]) -> None:
        self.app: dict[str, dict[int, int]] = {name: {} for name in capable}
        self.pfc: dict[str, set[int]] = {name: set() for name in capable}
        self.writes: list[list[str]] = []

    async def __call__(self, argv: Sequence[str]) -> CommandResult:
        args = [a for a in argv[1:] if a != "-j"]
        obj, command, _, dev, *rest = args
        if dev not in self.app:
            return CommandResult(1, "", UNSUPPORTED)
        if command in ("replace", "flush", "set"):
            self.writes.append(list(argv))
        if obj == "app" and command == "show":
            pairs = sorted(self.app[dev].items())
            return CommandResult(0, json.dumps({"dscp_prio": pairs} if pairs else {}), "")
        if obj == "app" and command == "replace":
            for pair in rest[1:]:
                dscp, prio = pair.split(":")
                self.app[dev][int(dscp)] = int(prio)
            return CommandResult(0, "", "")
        if obj == "app" and command == "flush":
            self.app[dev].clear()
            return CommandResult(0, "", "")
        if obj == "pfc" and command == "show":
            flags = [p in self.pfc[dev] for p in range(8)]
            return CommandResult(0, json.dumps({"prio_pfc": flags}), "")
        if obj == "pfc" and command == "set":
            for pair in rest[1:]:
                prio, state = pair.split(":")
                (self.pfc[dev].add if state == "on" else self.pfc[dev].discard)(int(prio))
            return CommandResult(0, "", "")
        return CommandResult(1, "", f"What is {command}?")


class FakeLinks:
    def __init__(self, *names: str) -> None:
        self.mtu = dict.fromkeys(names, 1500)

    async def links(self) -> Mapping[str, LinkInfo]:
        return {
            name: LinkInfo(name, i + 2, mtu, 68, 9216, True, "")
            for i, (name, mtu) in enumerate(self.mtu.items())
        }

    async def set_mtu(self, name: str, mtu: int) -> LinkInfo:
        self.mtu[name] = mtu
        return (await self.links())[name]


def mlx5_sysfs(root: Path, netdev: str, ibdev: str) -> None:
    for point in ("roce_np", "roce_rp"):
        knobs = root / "class" / "net" / netdev / "ecn" / point / "enable"
        knobs.mkdir(parents=True)
        for prio in range(8):
            (knobs / str(prio)).write_text("0\n")
    (root / "class" / "net" / netdev / "device" / "infiniband" / ibdev).mkdir(parents=True)
    tc = root / "class" / "infiniband" / ibdev / "tc" / "1"
    tc.mkdir(parents=True)
    (tc / "traffic_class").write_text("")


Fakes = tuple[RoceConfigurator, FakeDcb, FakeLinks, Path]


@pytest.fixture
def fakes(tmp_path: Path) -> Fakes:
    """A ConnectX-like ``mlx0`` (dcb, ECN knobs, RDMA device ``mlx5_0``) and a ``veth0``."""
    mlx5_sysfs(tmp_path, "mlx0", "mlx5_0")
    (tmp_path / "class" / "net" / "veth0").mkdir(parents=True)
    dcb = FakeDcb(["mlx0"])
    links = FakeLinks("mlx0", "veth0")
    return RoceConfigurator(links, sysfs=tmp_path, run=dcb), dcb, links, tmp_path


ROCE = RoceSettings("mlx0", 9000, True, (3,), True, 106)


async def test_a_capable_nic_is_configured_and_read_back(fakes: Fakes) -> None:
    roce, dcb, links, root = fakes
    (result,) = await roce.configure([ROCE])
    assert result.applied, result.message
    assert result.unsupported == ()
    assert result.read_back == ROCE
    assert links.mtu["mlx0"] == 9000
    assert dcb.app["mlx0"] == DSCP_PRIO and dcb.pfc["mlx0"] == {3}
    ecn = root / "class" / "net" / "mlx0" / "ecn"
    assert {p.read_text() for p in ecn.glob("*/enable/*")} == {"1"}
    assert (root / "class/infiniband/mlx5_0/tc/1/traffic_class").read_text() == "106"
    assert "set and read back mtu 9000, dscp trust, pfc [3], ecn on" in result.message


async def test_configuring_twice_writes_nothing_the_second_time(fakes: Fakes) -> None:
    roce, dcb, _, _ = fakes
    await roce.configure([ROCE])
    writes = len(dcb.writes)
    (again,) = await roce.configure([ROCE])
    assert again.applied and len(dcb.writes) == writes


async def test_turning_things_off_is_desired_state_too(fakes: Fakes) -> None:
    roce, dcb, _, root = fakes
    await roce.configure([ROCE])
    (off,) = await roce.configure([RoceSettings("mlx0")])
    assert off.applied, off.message
    assert off.read_back == RoceSettings("mlx0", 9000, False, (), False, 106)
    assert dcb.app["mlx0"] == {} and dcb.pfc["mlx0"] == set()
    ecn = root / "class" / "net" / "mlx0" / "ecn"
    assert {p.read_text() for p in ecn.glob("*/enable/*")} == {"0"}


async def test_a_veth_reports_each_missing_capability_and_is_not_applied(fakes: Fakes) -> None:
    roce, dcb, links, root = fakes
    (result,) = await roce.configure([RoceSettings("veth0", 9000, True, (3,), True, 106)])
    assert not result.applied
    assert result.unsupported == (
        "dcb app: Operation not supported",
        "dcb pfc: Operation not supported",
        f"ecn sysfs: {root}/class/net/veth0/ecn missing",
        f"traffic class: no RDMA device ({root}/class/net/veth0/device/infiniband missing)",
    )
    # what could be done was done and says so
    assert links.mtu["veth0"] == 9000
    assert result.read_back == RoceSettings("veth0", 9000, False, (), False, 0)
    assert result.message.startswith("veth0: set and read back mtu 9000. unsupported: dcb app")
    assert dcb.writes == []


async def test_a_missing_dcb_binary_is_unsupported_not_a_crash(tmp_path: Path) -> None:
    async def no_dcb(argv: Sequence[str]) -> CommandResult:
        return CommandResult(127, "", f"{argv[0]}: command not found (install iproute2)\n")

    mlx5_sysfs(tmp_path, "mlx0", "mlx5_0")
    roce = RoceConfigurator(FakeLinks("mlx0"), sysfs=tmp_path, run=no_dcb)
    (result,) = await roce.configure([ROCE])
    assert not result.applied
    assert result.unsupported[:2] == (
        "dcb app: dcb: command not found (install iproute2)",
        "dcb pfc: dcb: command not found (install iproute2)",
    )
    assert result.read_back.ecn and result.read_back.traffic_class == 106


async def test_a_write_the_driver_refuses_is_a_failure(fakes: Fakes) -> None:
    roce, dcb, _, _ = fakes

    async def refusing(argv: Sequence[str]) -> CommandResult:
        if "set" in argv:
            return CommandResult(
                1, "", "Error when attempting to set attribute: Invalid argument\n"
            )
        return await dcb(argv)

    roce._run = refusing
    (result,) = await roce.configure([ROCE])
    assert not result.applied and result.unsupported == ()
    assert "failed: dcb pfc: Invalid argument" in result.message
    assert result.read_back.pfc_priorities == ()


async def test_the_traffic_class_reads_back_in_the_mlnx_format(fakes: Fakes) -> None:
    roce, _, _, root = fakes
    (root / "class/infiniband/mlx5_0/tc/1/traffic_class").write_text("Global tclass=106\n")
    (result,) = await roce.configure([RoceSettings("mlx0", traffic_class=0)])
    assert result.read_back.traffic_class == 106


@pytest.mark.parametrize(
    ("nics", "message"),
    [
        ([], "nics=[] is not valid"),
        ([RoceSettings("eth9")], "nics[0].interface='eth9' is not valid: no such interface"),
        ([ROCE, ROCE], "nics[1].interface='mlx0' is not valid: each NIC once"),
        ([RoceSettings("mlx0", mtu=20000)], "nics[0].mtu=20000 is not valid: 0 (unchanged) or"),
        ([RoceSettings("mlx0", pfc_priorities=(3, 8))], "nics[0].pfc_priorities=[3, 8]"),
        ([RoceSettings("mlx0", pfc_priorities=(3, 3))], "distinct priorities in 0..7"),
        ([RoceSettings("mlx0", traffic_class=256)], "nics[0].traffic_class=256 is not valid"),
    ],
)
async def test_bad_requests_change_nothing(
    fakes: Fakes, nics: list[RoceSettings], message: str
) -> None:
    roce, dcb, links, _ = fakes
    with pytest.raises(errors.InvalidArgument) as info:
        await roce.configure(nics)
    assert message in str(info.value)
    assert dcb.writes == [] and set(links.mtu.values()) == {1500}


def test_protobuf_conversion_round_trips() -> None:
    request = pb.ConfigureRoceRequest(
        command_id="r1",
        nics=[
            pb.RoceSettings(
                interface="mlx0",
                mtu=9000,
                dscp_trust=True,
                pfc_priorities=[3],
                ecn=True,
                traffic_class=106,
            )
        ],
    )
    (settings,) = settings_from_pb(request.nics)
    assert settings == ROCE
    reply = results_to_pb("r1", [RoceResult("mlx0", False, settings, ("dcb app: x",), "m")])
    assert reply.command_id == "r1"
    assert reply.results[0].read_back == request.nics[0]
    assert list(reply.results[0].unsupported) == ["dcb app: x"]

"""The netlink adapter and the Linux switch driver against a real kernel, in throwaway
network namespaces (root only)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fabric_controller.drivers.electrical import ElectricalDriver, LinuxSwitchDriver
from orchestrrl import errors
from orchestrrl.netlink import Netlink
from orchestrrl.routing import RouteSpec, RuleSpec
from sim_backends import netns
from tests.netns.helpers import GATEWAYS_V4, GATEWAYS_V6, Switch, kernel_routes, owned_routes

pytestmark = pytest.mark.netns

DESIRED = [
    RouteSpec("10.20.0.0/16", GATEWAYS_V4[:1]),
    RouteSpec("10.21.0.0/16", GATEWAYS_V4),  # ECMP over two next hops
    RouteSpec("10.22.0.0/24", device="p1", table=100, metric=5),
    RouteSpec("fd20::/64", GATEWAYS_V6),  # IPv6 ECMP
    RouteSpec("10.23.0.0/16", GATEWAYS_V4[1:], table=70000),  # a table id above 255
]
EXPECTED = {
    ("10.20.0.0/16", GATEWAYS_V4[:1], "p0", "main", 0),
    ("10.21.0.0/16", GATEWAYS_V4, "p0", "main", 0),
    ("10.22.0.0/24", (), "p1", "100", 5),
    ("fd20::/64", GATEWAYS_V6, "p0", "main", 1024),
    ("10.23.0.0/16", GATEWAYS_V4[1:], "p0", "70000", 0),
}


async def test_ensure_adds_routes_with_ecmp_next_hops(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        change = await nl.ensure_routes(DESIRED, prune=False)
        assert (change.added, change.replaced, change.removed, change.unchanged) == (5, 0, 0, 0)
        assert await owned_routes(switch.netns) == EXPECTED
        assert change.routes == await nl.routes()
        assert {r.destination: r.gateways for r in change.routes}["10.21.0.0/16"] == GATEWAYS_V4


async def test_applying_the_same_set_twice_changes_nothing(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        await nl.ensure_routes(DESIRED, prune=True)
        before = await kernel_routes(switch.netns)
        again = await nl.ensure_routes(DESIRED, prune=True)
        assert (again.added, again.replaced, again.removed, again.unchanged) == (0, 0, 0, 5)
        assert await kernel_routes(switch.netns) == before
        assert again.routes == await nl.routes()
        assert (await nl.verify_routes(DESIRED, prune=True)).empty


async def test_changed_next_hops_are_replaced_in_place(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        await nl.ensure_routes(DESIRED, prune=False)
        moved = [RouteSpec("10.21.0.0/16", GATEWAYS_V4[1:]), *DESIRED[2:]]
        change = await nl.ensure_routes(moved, prune=False)
        assert (change.added, change.replaced, change.removed) == (0, 1, 0)
        assert ("10.21.0.0/16", GATEWAYS_V4[1:], "p0", "main", 0) in await owned_routes(
            switch.netns
        )


async def test_prune_removes_only_our_stale_routes(switch: Switch) -> None:
    theirs = ("10.50.0.0/16", GATEWAYS_V4[:1], "p0", "main", 0)
    await netns.run(["ip", "-n", switch.netns, "route", "add", "10.50.0.0/16", "via", "10.9.0.2"])
    async with Netlink(switch.netns) as nl:
        await nl.ensure_routes(DESIRED, prune=False)
        change = await nl.ensure_routes(DESIRED[:1], prune=True)
        assert (change.added, change.removed, change.unchanged) == (0, 4, 1)
        assert await owned_routes(switch.netns) == {
            ("10.20.0.0/16", GATEWAYS_V4[:1], "p0", "main", 0)
        }
        assert theirs in await kernel_routes(switch.netns)
        assert (await nl.ensure_routes([], prune=True)).removed == 1
        assert theirs in await kernel_routes(switch.netns)


async def test_an_unknown_device_is_invalid_and_changes_nothing(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        await nl.ensure_routes(DESIRED[:2], prune=False)
        before = await kernel_routes(switch.netns)
        bad = [*DESIRED, RouteSpec("10.30.0.0/16", GATEWAYS_V4[:1], device="eth9")]
        with pytest.raises(errors.InvalidArgument) as info:
            await nl.ensure_routes(bad, prune=True)
        assert str(info.value).startswith("device='eth9' is not valid: no such interface")
        assert await kernel_routes(switch.netns) == before


async def test_a_refusal_by_the_kernel_rolls_back_the_whole_batch(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        await nl.ensure_routes(DESIRED[:1], prune=False)
        before = await kernel_routes(switch.netns)
        # valid routes first, then one whose gateway is on no connected network
        bad = [*DESIRED, RouteSpec("10.99.0.0/16", ("192.0.2.77",))]
        with pytest.raises(errors.InvalidArgument, match="not on a connected network") as info:
            await nl.ensure_routes(bad, prune=True)
        assert "10.99.0.0/16 via 192.0.2.77" in str(info.value)
        assert "were rolled back" in str(info.value)
        assert await kernel_routes(switch.netns) == before


async def test_a_key_held_by_someone_elses_route_is_refused(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        before = await kernel_routes(switch.netns)
        connected = RouteSpec("10.9.0.0/24", device="p0")  # the kernel's own route
        with pytest.raises(errors.FailedPrecondition, match="OrchestrRL did not install"):
            await nl.ensure_routes([*DESIRED, connected], prune=False)
        assert await kernel_routes(switch.netns) == before


async def test_rules_are_ensured_and_pruned_without_touching_others(switch: Switch) -> None:
    await netns.run(["ip", "-n", switch.netns, "rule", "add", "pref", "300", "table", "300"])
    ours = [
        RuleSpec(200, 100, source="10.20.0.0/16"),
        RuleSpec(201, 100, destination="fd20::/64", input_interface="p1"),
    ]
    async with Netlink(switch.netns) as nl:
        change = await nl.ensure_rules(ours, prune=False)
        assert (change.added, change.unchanged) == (2, 0)
        assert await nl.rules() == frozenset(ours)
        assert (await nl.ensure_rules(ours, prune=True)).unchanged == 2
        assert (await nl.ensure_rules([], prune=True)).removed == 2
        assert await nl.rules() == frozenset()
    shown = await netns.run(["ip", "-n", switch.netns, "rule", "show"])
    assert "300:" in shown.stdout and "200:" not in shown.stdout


async def test_mtu_is_set_and_read_back(switch: Switch) -> None:
    async with Netlink(switch.netns) as nl:
        assert (await nl.set_mtu("p1", 9000)).mtu == 9000
        assert (await nl.links())["p1"].mtu == 9000
        with pytest.raises(errors.InvalidArgument, match="mtu=70000 is not valid"):
            await nl.set_mtu("p1", 70000)


async def test_a_missing_namespace_is_invalid(netns_ready: None) -> None:
    with pytest.raises(errors.InvalidArgument, match="no such network namespace"):
        await Netlink(netns.unique_name("missing")).open()


async def test_the_linux_switch_driver_programs_a_namespace(switch: Switch) -> None:
    driver: ElectricalDriver = LinuxSwitchDriver("tor0", switch.netns)
    try:
        change = await driver.ensure(DESIRED, prune=True)
        assert change.added == 5
        assert await driver.routes() == change.routes
        assert (await driver.verify(DESIRED, prune=True)).empty
        drift = await driver.verify(DESIRED[:1], prune=True)
        assert len(drift.remove) == 4
        assert (await driver.ensure(DESIRED[:1], prune=True)).removed == 4
        assert await owned_routes(switch.netns) == {
            ("10.20.0.0/16", GATEWAYS_V4[:1], "p0", "main", 0)
        }
    finally:
        await driver.close()


async def test_an_ensure_cut_short_converges_when_applied_again(switch: Switch) -> None:
    many = [RouteSpec(f"10.{100 + i // 250}.{i % 250}.0/24", GATEWAYS_V4) for i in range(3000)]
    async with Netlink(switch.netns) as nl:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.02):  # cancelled somewhere mid-way, or not at all
                await nl.ensure_routes(many, prune=True)
        change = await nl.ensure_routes(many, prune=True)
        assert change.added + change.unchanged == 3000
        assert len(await owned_routes(switch.netns)) == 3000
        assert (await nl.verify_routes(many, prune=True)).empty


async def test_a_refusal_inside_a_long_run_of_one_template_names_its_route(
    switch: Switch,
) -> None:
    """Hundreds of routes of one template go out as batches assembled in one piece; the
    kernel's answer to one message in the middle still names that route."""
    routes = [RouteSpec(f"10.40.{i // 256}.{i % 256}/32", GATEWAYS_V4[:1]) for i in range(600)]
    taken = "10.40.1.44/32"  # routes[300]
    async with Netlink(switch.netns) as nl:
        before = await kernel_routes(switch.netns)
        plan = await nl.prepare_routes(routes, prune=False)
        # someone else takes one key between the check and the change
        await netns.run(["ip", "route", "add", taken, "via", GATEWAYS_V4[0]], netns=switch.netns)
        with pytest.raises(errors.Aborted, match="appeared while we were applying") as info:
            await nl.apply_routes(plan)
        assert f"add route {taken} via {GATEWAYS_V4[0]} table 254" in str(info.value)
        assert "the 599 changes already made were rolled back" in str(info.value)
        await netns.run(["ip", "route", "del", taken], netns=switch.netns)
        assert await kernel_routes(switch.netns) == before


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (["route", "del", "10.20.0.0/16", "proto", "77"], "1 missing"),
        (["route", "replace", "10.20.0.0/16", "via", "10.9.0.3", "proto", "77"], "1 different"),
        (["route", "add", "10.24.0.0/16", "via", "10.9.0.3", "proto", "77"], "1 stale"),
        # someone else's route in place of ours: ours is missing
        (["route", "replace", "10.20.0.0/16", "via", "10.9.0.2", "proto", "static"], "1 missing"),
    ],
)
async def test_a_route_changed_behind_our_back_is_caught_by_the_read_back(
    switch: Switch, change: list[str], found: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Netlink(switch.netns, verify_timeout_s=0.05) as nl:
        write = nl._apply

        async def write_then_change(*args: object) -> None:
            await write(*args)  # type: ignore[arg-type]
            await netns.run(["ip", "-n", switch.netns, *change])

        monkeypatch.setattr(nl, "_apply", write_then_change)
        with pytest.raises(errors.Aborted, match=f"did not converge.*{found}"):
            await nl.ensure_routes(DESIRED, prune=True)

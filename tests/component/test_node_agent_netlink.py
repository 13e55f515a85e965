"""NetlinkNics against this machine's kernel: the counters and state sysfs shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.nics import NetlinkNics

pytestmark = pytest.mark.component

SYSFS = Path("/sys/class/net")


def interfaces() -> list[str]:
    return sorted(p.name for p in SYSFS.iterdir() if (p / "statistics").is_dir())[:4]


def operstate(name: str) -> str:
    return (SYSFS / name / "operstate").read_text().strip()


def sysfs_bytes(name: str) -> tuple[int, int]:
    stats = SYSFS / name / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


@pytest.mark.skipif(not (SYSFS / "lo").exists(), reason="no loopback interface in sysfs")
async def test_counters_and_state_match_sysfs() -> None:
    names = interfaces()
    reader = NetlinkNics([(n, None) for n in names] + [("orl-missing0", None)])
    try:
        await reader.open()
        before = {n: sysfs_bytes(n) for n in names}
        samples = await reader.sample()
        after = {n: sysfs_bytes(n) for n in names}
        by_name = {s.name: s for s in samples}
        for n in names:  # counters only grow: the netlink reading lies between the two
            assert before[n][0] <= by_name[n].rx_bytes <= after[n][0], n
            assert before[n][1] <= by_name[n].tx_bytes <= after[n][1], n
            assert by_name[n].oper_up == (operstate(n) == "up"), n
        missing = by_name["orl-missing0"]
        assert (missing.oper_up, missing.rx_bytes, missing.tx_bytes) == (False, 0, 0)
        again = await reader.sample()  # a second reading gives rates (>= 0)
        assert all(s.rx_gbps >= 0 and s.tx_gbps >= 0 for s in again)
    finally:
        reader.close()

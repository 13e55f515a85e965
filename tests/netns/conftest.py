"""Fixtures for tests that need root and network namespaces.

Every namespace and root-namespace link a test creates goes through a
``sim_backends.netns.Testbed`` whose cleanup runs in the fixture's finalizer, also when
the test fails. Without root, or where ``ip netns add`` does not work, the tests are
skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator

import pytest

from sim_backends import netns
from tests.netns.helpers import Switch


@pytest.fixture(scope="session")
def netns_ready() -> None:
    """Skip unless we can create namespaces; remove namespaces left by killed runs."""
    if os.geteuid() != 0:
        pytest.skip(f"netns tests need root (running as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        pytest.skip("netns tests need iproute2's `ip` command")
    probe = netns.unique_name("probe")
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"`ip netns add` failed here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)
    for name in netns.stale_namespaces():
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


@pytest.fixture
async def testbed(netns_ready: None) -> AsyncIterator[netns.Testbed]:
    bed = netns.Testbed()
    try:
        yield bed
    finally:
        await bed.cleanup()


@pytest.fixture
async def switch(testbed: netns.Testbed) -> Switch:
    name = await testbed.netns("sw")
    await testbed.veth("p0", "p1", netns_a=name, netns_b=name)
    await netns.add_address("p0", "10.9.0.1/24", name)
    await netns.add_address("p0", "fd00:9::1/64", name)
    await netns.add_address("p1", "10.8.0.1/24", name)
    return Switch(name)

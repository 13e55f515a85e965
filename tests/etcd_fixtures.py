"""Real etcd clusters for the tests: ``etcd1`` (one member) and ``etcd3`` (three).

A test module uses them with ``pytest_plugins = ["tests.etcd_fixtures"]``. Each test gets
a fresh cluster with its data in the test's temporary directory; it may kill, freeze and
restart members (``sim_backends.etcd_cluster.EtcdCluster``). Skipped, saying how to
install it, where the etcd server is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sim_backends.etcd_cluster import INSTALL, EtcdCluster, etcd_binary


def _cluster(root: Path, size: int) -> Iterator[EtcdCluster]:
    if etcd_binary() is None:
        pytest.skip(f"etcd is not installed: {INSTALL}")
    cluster = EtcdCluster(root, size)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd1(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from _cluster(tmp_path / "etcd", 1)


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from _cluster(tmp_path / "etcd", 3)

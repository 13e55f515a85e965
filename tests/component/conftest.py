"""Fixtures shared by the component tests."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from orchestrrl.client import AsyncClient
from orchestrrl.logs import setup_logging
from orchestrrl.model import Wiring
from sim_backends.harness import Fabric, start_fabric


@pytest.fixture
async def fabric(example_wiring: Wiring, tmp_path: Path) -> AsyncIterator[Fabric]:
    """The controller over simulated OCSes, in process, on ephemeral ports."""
    f = await start_fabric(example_wiring, tmp_path / "state.db", switching_time_s=0.001)
    try:
        yield f
    finally:
        await f.stop()


@pytest.fixture
async def client(fabric: Fabric) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(fabric.address, timeout_s=10) as c:
        yield c


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The process's logging set up as a daemon does (JSON), restored afterwards."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    setup_logging("info", "json", out)
    try:
        yield out
    finally:
        structlog.configure(**config)
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
        root.setLevel(level)

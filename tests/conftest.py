"""Shared fixtures."""

from __future__ import annotations

import pytest

from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Wiring


@pytest.fixture
def example_wiring() -> Wiring:
    return wiring_mod.load(wiring_mod.default_wiring_path())

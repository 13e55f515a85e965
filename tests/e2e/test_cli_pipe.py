"""`orlctl ... | head`: a reader that goes away ends orlctl quietly (exit 0, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

WIRING = Path(__file__).resolve().parents[2] / "examples" / "local-8node.toml"


def test_a_closed_pipe_ends_orlctl_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before orlctl prints anything
    try:
        run = subprocess.run(
            [sys.executable, "-m", "fabric_controller.cli", "config", "check", str(WIRING)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr

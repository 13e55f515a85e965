"""OrchestrRL: dynamic compute and network orchestration for disaggregated RL."""

from __future__ import annotations

import argparse

__version__ = "0.1.0"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: every console script prints ``PROG VERSION`` and exits."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")

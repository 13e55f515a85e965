"""One event-name style in every daemon's logs: ``snake_case`` names, details in fields.

Scans the production packages for structlog calls whose first argument is a literal, so
that a new sentence-style name ("node registered") or a dotted one ("ocs.started") fails
here instead of splitting what operators grep for.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fabric_controller", "node_agent", "orchestrrl", "scheduler", "sim_backends")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
NAME = re.compile(r"[a-z][a-z0-9_]*")


def event_names() -> list[tuple[str, int, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in {"log", "bound", "logger"}
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.args[0].value))
    return found


def test_every_log_event_name_is_snake_case() -> None:
    names = event_names()
    assert len(names) > 100  # the scan sees the daemons' log calls
    bad = [f"{path}:{line}: {name!r}" for path, line, name in names if not NAME.fullmatch(name)]
    assert not bad, "log event names must be snake_case:\n" + "\n".join(bad)

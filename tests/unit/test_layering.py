"""Production code never imports the simulators and test doubles of ``sim_backends``.

They are chosen only by explicit configuration (``--engine sim``, ``--gpu-backend sim``
or ``auto`` without NVML), loaded with ``importlib`` and a log line; a static import
would make every daemon depend on them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("fabric_controller", "node_agent", "orchestrrl", "scheduler")


def static_imports_of_sim_backends() -> list[str]:
    found = []
    for package in PRODUCTION:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                    for name in names
                    if name == "sim_backends" or name.startswith("sim_backends.")
                ]
    return found


def test_production_code_does_not_import_sim_backends() -> None:
    assert static_imports_of_sim_backends() == []

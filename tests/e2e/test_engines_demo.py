"""The compute half end to end on real engines: `orlctl demo-engines` as a user runs it.

A local cluster (simulated OCS, controller, three agents; the two generation agents run
llama.cpp servers with a tiny random model), a step's requests streamed to one gateway,
the controller's compute-scheduling loop deciding reshards and migrations from the
agents' real telemetry, and every output compared with the same request run alone.
Requests of at most 1,200 tokens: a step of ~25 s on two cores, several of the loop's
5 s re-plans long.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


def test_the_loop_migrates_and_reshards_real_engines_and_outputs_stay_exact(
    llama_binary: Path, tmp_path: Path
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fabric_controller.cli", "--json", "demo-engines",
         "--engine", "llamacpp", "--engine-command", str(llama_binary),
         "--max-tokens", "1200", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    doc = json.loads(r.stdout)
    assert doc["matched"] == len(doc["requests"]) == 8
    ok = [a for a in doc["actions"] if a["ok"]]
    assert any(a["kind"] == "reshard" for a in ok), doc["actions"]
    migrations = [a for a in ok if a["kind"] == "migrate"]
    assert migrations, doc["actions"]
    moved = [q for q in doc["requests"] if len(q["nodes"]) > 1]
    assert moved and all(q["matches"] for q in moved)
    assert all(q["tokens"] > 0 for q in doc["requests"])

"""The compute half end to end on real engines: `orlctl demo-engines` as a user runs it.

A local cluster (simulated OCS, controller, three agents; the two generation agents run
llama.cpp servers with a tiny random model), a step's requests streamed to one gateway,
the controller's compute-scheduling loop paused while the longest requests fill the
node's seats and resumed once the longest is 700 tokens in: on that state it reshards and moves
a running request (what the demo shows in every run, whatever the timing). Every output
is compared with the same request run alone. The step of `make demo-engines` (8
requests of 250..2,000 tokens): the shortest of the first four is 1,250 tokens, as the
demo requires (tests/unit/test_demo_engines.py: why).
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
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    doc = json.loads(r.stdout)
    assert doc["shown"] and doc["matched"] == len(doc["requests"]) == 8
    assert doc["resumed_at_tokens"][0] >= 700 and min(doc["resumed_at_tokens"]) >= 20
    ok = [a for a in doc["actions"] if a["ok"]]
    assert doc["reshards"] >= 1 and any(a["kind"] == "reshard" for a in ok), doc["actions"]
    # a running request moved with its output so far: the client had tokens of it
    # before the move began, and the migration recomputed them (not a queued dispatch)
    assert doc["running_migrations"] >= 1, doc["actions"]
    for move in doc["running_moves"]:
        assert move["tokens"] > 0 and move["method"] in ("recompute", "kv")
        [action] = [a for a in ok if a["command_id"] == move["command_id"]]
        assert action["kind"] == "migrate" and move["request_id"] in action["requests"]
        [request] = [q for q in doc["requests"] if q["request_id"] == move["request_id"]]
        assert len(request["nodes"]) > 1 and request["matches"]
    assert all(q["tokens"] > 0 for q in doc["requests"])


def test_a_step_too_short_to_show_a_reshard_is_refused_up_front() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fabric_controller.cli", "demo-engines", "--max-tokens", "1600"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--max-tokens=1600 is not valid: at least 2000 with 8 requests" in r.stderr

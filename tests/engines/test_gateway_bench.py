"""`bench/gateway.py` runs end to end on llama.cpp (small figures; the bench's own run is
`make bench`): its JSON holds every figure of its table, and every migrated and
resharded output equals the uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_the_gateway_bench_runs_and_checks_its_outputs(llama_binary: Path, tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    argv = [sys.executable, str(ROOT / "bench" / "gateway.py"), "--engine-command",
            str(llama_binary), "--rounds", "1", "--tokens", "16", "--trials", "1",
            "--long", "120", "--json", str(out)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tokens/s (median round)" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["overhead"]["outputs_equal"] is True
    assert (
        doc["overhead"]["engine_tokens_per_s"] > 0 and doc["overhead"]["gateway_tokens_per_s"] > 0
    )
    lp = doc["overhead_logprobs"]  # the same requests with each token's logprob on
    assert lp["logprobs"] is True and lp["outputs_equal"] is True
    assert lp["gateway_tokens_per_s"] > 0 and 0 <= lp["logprob_max_abs_diff"] < 1e-3
    assert "logprobs on: tokens/s" in run.stdout
    assert doc["migration"]["outputs_equal"] == doc["migration"]["outputs"] == 2
    assert set(doc["migration"]["stages_ms_p50"]) >= {"export", "import", "release"}
    runs = doc["reshard"]["runs"]
    assert [(r["from"], r["to"]) for r in runs] == [([1, 1], [2]), ([2], [1, 1])]
    assert all("start_instances" in r["stages_ms"] for r in runs)
    assert doc["reshard"]["outputs_equal"] == doc["reshard"]["outputs"] == 4


def test_the_gateway_bench_refuses_bad_arguments() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gateway.py"), "--long", "10"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2 and "--long=10: must be at least" in run.stderr

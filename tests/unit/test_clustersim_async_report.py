"""REPORT section 1d and ``orl-sim async-replay``'s tables
(sim_backends.clustersim.async_report)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sim_backends.clustersim.async_report import (
    ABLATION_HEADER,
    REPLAY_HEADER,
    ablation_rows,
    balance_bound,
    discussion,
    replay_rows,
    section,
)
from sim_backends.clustersim.replay import PUBLISHED, VARIANTS, replay_row
from sim_backends.clustersim.report import _table

pytestmark = pytest.mark.unit


def _variant(speedup: float, split: str = "64/64") -> dict[str, Any]:
    return {
        "speedup": speedup,
        "mean_step_s": 200.0 / speedup,
        "mean_logged_step_s": 199.0 / speedup,
        "mean_train_s": 190.0,
        "mean_wait_s": 9.0,
        "mean_sync_s": 1.0,
        "rollout_idle": 0.5,
        "trainer_idle": 0.05,
        "lag_p99": 1.0,
        "splits": ["64/64", split],
        "reshards": 0,
        "lags": [[0, 1], [1, 1]],
        "warmup": 1,
        "steps": [{"start_s": 0.0}, {"start_s": 200.0}],
    }


def _row(ours: float) -> dict[str, Any]:
    variants = {k: _variant(1.0) for k in VARIANTS}
    variants["orchestrrl"] = _variant(ours, "48/80")
    return {
        "published": {
            "step_s": 150.0,
            "gen_s": 30.0,
            "update_s": 110.0,
            "ref_s": 0.0,
            "split": "64:64",
            "gpus": 128,
            "trainer_idle": 0.2,
        },
        "model": "Qwen2.5-Math-7B",
        "hardware": "H20",
        "train_gpus": 64,
        "gen_gpus": 64,
        "model_step_s": 199.0,
        "error": 199.0 / 150.0 - 1.0,
        "update_error": 190.0 / 110.0 - 1.0,
        "trained_tokens_per_response": 3000.0,
        "variants": variants,
    }


def test_the_replay_table_puts_published_model_and_ours_side_by_side() -> None:
    rows = replay_rows({"rows": {"7b-128": _row(1.25)}})
    assert len(rows) == 1 and len(rows[0]) == len(REPLAY_HEADER)
    r = rows[0]
    assert r[1] == 150.0 and r[2] == 199.0 and r[3] == "+33%"
    assert r[9] == "48/80" and r[10] == "1.250x" and r[11] == "1 / 1"
    table = _table(REPLAY_HEADER, rows)
    assert "verl published s/step" in table and "7b-128 (Qwen2.5-Math-7B, 128 H20, 64:64)" in table


def test_the_ablation_shows_each_mechanism_and_the_balance_bound() -> None:
    rows = ablation_rows({"rows": {"7b-128": _row(1.25)}}, {"stress": _row(0.9)})
    assert [r[0] for r in rows] == ["7b-128", "stress"]
    assert len(rows[0]) == len(ABLATION_HEADER) and rows[0][-2] == "1.250x"
    # (64 x 190 + 64 x 200 x 0.5) / 128 + 1 = 146 s against 200 s
    assert balance_bound(_row(1.0)) == pytest.approx(200.0 / 146.0)


def test_the_discussion_reports_errors_targets_and_lags() -> None:
    lines = discussion({"replay": {"rows": {"7b-128": _row(1.25), "30b-a3b-128": _row(1.5)}}})
    text = "\n".join(lines)
    assert "7b-128 +33%" in text and "within 20 % on no row" in text
    assert "met on 30b-a3b-128, missed on 7b-128" in text
    assert "p99 lag is 7b-128 1 (verl) / 1 (ours)" in text


def test_section_1d_renders_tables_and_plots(tmp_path: Path) -> None:
    plots: list[tuple[str, str]] = []
    fig = {
        "model": "Qwen2.5-32B",
        "weight_bytes": 65.5e9,
        "train_gpus": 64,
        "rollout_gpus": 64,
        "nodes_per_pod": 4,
        "engine_tp": 8,
        "rows": [],
        "leased_s": 0.6,
        "static_s": 1.1,
        "electrical_s": 0.6,
        "ratio": 1.83,
        "ratio_electrical": 1.0,
        "stall_s": 0.23,
        "target_s": 2.0,
        "stall_target_s": 0.2,
    }
    out = {"async": {"replay": {"rows": {"7b-128": _row(1.25)}}, "propagation": fig}}
    md = "\n".join(section(out, _table, tmp_path, plots))
    assert "## 1d. Asynchronous RL" in md and "balance bound" in md
    assert "1.83x longer" in md and "missed: a TP8 shard" in md
    assert {p for p, _ in plots} == {"async-split.png", "async-lag.png"}
    assert (tmp_path / "async-split.png").exists() and (tmp_path / "async-lag.png").exists()
    assert section({}, _table, tmp_path, []) == []


def test_a_quick_replay_row_runs_every_variant_against_the_published_row() -> None:
    pub = next(p for p in PUBLISHED if p.key == "7b-32")
    row = replay_row(pub, quick=True)
    assert set(row["variants"]) == set(VARIANTS)
    assert row["variants"]["verl"]["speedup"] == 1.0
    assert row["published"]["step_s"] == 294.77
    assert row["error"] == pytest.approx(row["model_step_s"] / 294.77 - 1.0)
    assert row["variants"]["circuits"]["lease_s"] > 0
    assert not row["variants"]["verl"]["plan_split"] and row["variants"]["orchestrrl"]["plan_split"]
    # verl's 313.81 s update on 16 H20 at 6 x 7.6e9 FLOPs per token: at most ~2,000 tokens
    implied = row["implied_tokens_per_response"]
    assert implied["at_peak"] == pytest.approx(313.81 * 16 * 148e12 / (6 * 7.6156e9) / 64, rel=1e-3)
    assert implied["at_mfu"] == pytest.approx(0.52 * implied["at_peak"])

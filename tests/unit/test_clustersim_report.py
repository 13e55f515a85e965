"""The reproduction report explains the compute results from the run's own figures."""

from __future__ import annotations

from typing import Any

import pytest

from sim_backends.clustersim.report import (
    E2E_HEADER,
    RL_HEADER,
    STUDY_HEADER,
    SWEEP_HEADER,
    discussion,
    e2e_rows,
    fixed_rows,
    op_rows,
    rl_discussion,
    rl_rows,
    seqs_caps,
    seqs_discussion,
    study_rows,
    sweep_discussion,
    sweep_rows,
)

pytestmark = pytest.mark.unit


def _policy(speedup: float, predicted: float, gen: float, changes: int) -> dict[str, Any]:
    return {
        "speedup": speedup,
        "predicted_at_start_s": predicted,
        "mean_gen_s": gen,
        "layout_changes": changes,
        "reshards": 6 * changes,
        "migrations": 10,
        "steps": [{}, {}, {}],
    }


def _compute(done: dict[str, dict[str, float]], proactive_changes: int) -> dict[str, Any]:
    return {
        "compute": {
            "M": {
                "static_tp": 8,
                "tail_floor_s": 80.0,
                "static_gen_over_floor": 1.5,
                "static": {"mean_gen_s": 120.0},
                "static_done_s": done,
                "static_step_gen_s": {"4": 140.0, "8": 120.0},
                "proactive": _policy(0.98, 100.0, 122.0, proactive_changes),
                "reactive": _policy(1.02, 100.0, 118.0, 0),
                "adaptive": _policy(1.02, 100.0, 118.0, 0),
            }
        }
    }


def test_bulk_lead_prediction_and_dispatch_are_explained_with_the_runs_figures() -> None:
    done = {
        "4": {"0.5": 15.0, "0.75": 29.0, "0.9": 48.0},
        "8": {"0.5": 18.0, "0.75": 32.5, "0.9": 49.0},
    }
    text = "\n".join(discussion(_compute(done, 0)))
    assert "50% / 75% / 90% of the responses are done after TP4 15.0 / 29.0 / 48.0 s" in text
    # the largest lead is TP4's 3.5 s at the 75% point; 120 / (120 - 3.5) = 1.03x
    assert "TP4's, 3.5 s at the 75% point" in text and "(1.03x)" in text
    assert "predicted 100.0 / 100.0 s" in text and "(82% / 85%)" in text
    assert "changed the layout in 0 / 0 of 2 steady step(s)" in text
    assert "`proactive` (0.98x) kept the layout" in text


def test_no_bulk_lead_and_a_proactive_reshard_are_said_as_such() -> None:
    done = {"4": {"0.5": 20.0}, "8": {"0.5": 18.0}}
    text = "\n".join(discussion(_compute(done, 1)))
    assert "No layout gets through the bulk sooner than TP8" in text
    assert "kept the layout" not in text


def _e2e(choose: str) -> dict[str, Any]:
    return {
        "adaptive_speedup": 1.10,
        "oracle_speedup": 1.20,
        "gen_gpus": 48,
        "train_gpus": 16,
        "split_choose": choose,
        "train_s": 90.0,
        "sync_s": 1.0,
        "static_step_s": 111.0,
        "adaptive_step_s": 101.0,
        "oracle_step_s": 92.5,
        "bound_step_s": 91.0,
        "adaptive_e2e_speedup": 111.0 / 101.0,
        "oracle_e2e_speedup": 111.0 / 92.5,
        "bound_e2e_speedup": 111.0 / 91.0,
        "pipeline_bound": {"static": "generation", "adaptive": "generation", "oracle": "mixed"},
    }


def test_e2e_rows_give_both_speedups_the_split_and_the_bound() -> None:
    rows = e2e_rows({"a": _e2e("fixed"), "b": _e2e("auto"), "gen only": {"adaptive_s": 1.0}})
    assert len(rows) == 2 and all(len(r) == len(E2E_HEADER) for r in rows)
    a = dict(zip(E2E_HEADER, rows[0], strict=True))
    assert a["gen/train GPUs"] == "48/16"
    assert (a["adaptive gen"], a["adaptive e2e"]) == ("1.100x", "1.099x")
    assert (a["oracle gen"], a["oracle e2e"]) == ("1.200x", "1.200x")
    assert a["bound by (static/adaptive/oracle)"] == "generation / generation / mixed"
    assert rows[1][1] == "48/16 (auto)"


def _sweep() -> dict[str, Any]:
    def row(gen: int, train: int, step: float, bound: str, e2e: float) -> dict[str, Any]:
        return {
            "train_gpus": train,
            "gen_gpus": gen,
            "static_tp": 4,
            "gen_s": step - 1,
            "train_s": 50.0,
            "sync_s": 1.0,
            "step_s": step,
            "bound": bound,
            "adaptive_gen_s": step - 5,
            "adaptive_step_s": step - 4,
            "adaptive_bound": bound,
            "adaptive_gen_speedup": 1.08,
            "adaptive_e2e_speedup": e2e,
        }

    return {
        "scenario": "s",
        "splits": {
            "56/8": row(56, 8, 120.0, "training", 1.0),
            "48/16": row(48, 16, 100.0, "generation", 1.05),
        },
        "chosen": "48/16",
    }


def test_sweep_rows_mark_autos_choice() -> None:
    rows = sweep_rows(_sweep())
    assert all(len(r) == len(SWEEP_HEADER) for r in rows)
    assert [r[0] for r in rows] == ["56/8", "48/16"]
    assert [r[-1] for r in rows] == ["", "<- auto"]
    assert rows[0][6] == "training" and rows[1][11] == "1.050x"


def test_sweep_discussion_says_where_the_pipeline_turns_generation_bound() -> None:
    (line,) = sweep_discussion({"s": _sweep()})
    assert "56/8 training, 48/16 generation" in line
    assert "generation-bound at 48/16" in line
    assert "auto picks 48/16 (100.0 s a step, generation-bound)" in line
    assert "1.080x in generation and 1.050x end to end" in line
    none = _sweep()
    del none["splits"]["48/16"]
    assert "training-bound or mixed at every split swept" in sweep_discussion({"s": none})[0]


def _ceiling(cap: int, best: float, adaptive: float, oracle: float) -> dict[str, Any]:
    return {
        "max_num_seqs": {"1": cap, "2": cap, "4": cap, "8": cap},
        "best_static_tp": 8,
        "best_static_s": best,
        "adaptive_speedup": best / adaptive,
        "oracle_speedup": best / oracle,
    }


def test_the_cap_on_sequences_per_instance_is_stated_per_scenario() -> None:
    line = seqs_caps(
        {
            "a": _ceiling(256, 100.0, 98.0, 90.0),
            "b": _ceiling(256, 100.0, 98.0, 90.0),
            "c": {**_ceiling(64, 1.0, 1.0, 1.0), "max_num_seqs": {"1": 64, "8": 32}},
        }
    )
    assert "256 at every TP (a, b)" in line and "TP1 64, TP8 32 (c)" in line
    assert seqs_caps({"old": {"best_static_s": 1.0}}) == ""  # rows without caps


def test_the_max_num_seqs_sweep_is_said_with_its_range() -> None:
    (line,) = seqs_discussion(
        {"s": {"256": _ceiling(256, 100.0, 98.0, 90.0), "64": _ceiling(64, 130.0, 120.0, 100.0)}}
    )
    assert line.index("64: best static") < line.index("256: best static")  # by cap
    assert "adaptive policy gains 1.020x-1.083x" in line and "oracle 1.111x-1.300x" in line
    assert seqs_discussion({"s": {}}) == []


def test_the_ceiling_row_shows_the_prompt_oracle_beside_the_oracle_when_it_ran() -> None:
    from sim_backends.clustersim.pipeline import ceilings
    from sim_backends.clustersim.report import CEILING_HEADER, ceiling_rows

    statics = {4: 120.0, 8: 100.0}
    told = ceilings(statics, 98.0, 90.0, 70.0, prompt_oracle_s=95.0)
    assert told["prompt_oracle_speedup"] == pytest.approx(100 / 95)
    # its share of the oracle's gain, as the adaptive policy's
    assert told["prompt_oracle_captured"] == pytest.approx((100 / 95 - 1) / (100 / 90 - 1))
    (row,) = ceiling_rows({"s": told})
    shown = dict(zip(CEILING_HEADER, row, strict=True))
    assert shown["prompt-oracle/best"] == "1.053x (47%)"
    assert shown["captured"] == f"{(100 / 98 - 1) / (100 / 90 - 1):.0%}"
    (bare,) = ceiling_rows({"s": ceilings(statics, 98.0, 90.0, 70.0)})
    assert dict(zip(CEILING_HEADER, bare, strict=True))["prompt-oracle/best"] == "-"
    # an oracle that gains nothing: no share for either
    flat = ceilings(statics, 101.0, 100.0, 70.0, prompt_oracle_s=100.0)
    assert flat["captured"] is None and flat["prompt_oracle_captured"] is None


def test_a_table_where_no_row_ran_the_prompt_oracle_leaves_its_column_out() -> None:
    from sim_backends.clustersim.pipeline import ceilings
    from sim_backends.clustersim.report import ceiling_table

    statics = {4: 120.0, 8: 100.0}
    bare = ceiling_table({"64": ceilings(statics, 98.0, 90.0, 70.0)}, first="max_num_seqs")
    assert bare.startswith("| max_num_seqs |") and "prompt-oracle" not in bare
    told = ceiling_table(
        {"a": ceilings(statics, 98.0, 90.0, 70.0), "b": ceilings(statics, 98.0, 90.0, 70.0, 95.0)}
    )
    assert "| prompt-oracle/best |" in told and "| - |" in told


def _rl_row(speedup: float, static_partial: float, splits: list[str]) -> dict[str, Any]:
    def row(x: float, sp: list[str] | None = None) -> dict[str, Any]:
        return {
            "samples_speedup": x,
            "tokens_speedup": x * 0.9,
            "mean_step_s": 100.0 / x,
            "samples_per_s": 80.0 * x,
            "offpolicy_token_share": 0.35,
            "dropped_share": 0.004,
            "splits": sp or ["48/16"],
        }

    return {
        "best_static_tp": 4,
        "gen_gpus": 48,
        "train_gpus": 16,
        "bound_speedup": 1.5,
        "rows": {
            "baseline": row(1.0),
            "tp": row(1.01),
            "split": row(1.05),
            "partial": row(1.02),
            "partial_split": row(static_partial),
            "adaptive_partial": row(speedup, splits),
            "divided": row(1.02),
        },
    }


def test_rl_rows_give_each_mechanism_and_the_off_policy_and_dropped_shares() -> None:
    results = {
        "dapo": _rl_row(1.342, 1.340, ["48/16", "48/16", "40/24"]),
        "hd": _rl_row(1.031, 1.058, ["48/16"]),
    }
    rows = rl_rows(results)
    assert len(rows[0]) == len(RL_HEADER)
    assert rows[0][1] == "TP4 48/16: 100.0 s, 80.00 samples/s"
    assert rows[0][3] == "1.020x (0.92x)"  # divided rollout alone
    assert rows[0][7] == "1.342x (1.21x)" and rows[0][8] == "35%" and rows[0][9] == "0.4%"
    lines = rl_discussion(results)
    assert "1.031x (hd) to 1.342x" in lines[0]
    assert "behind static TP on hd (1.031x vs 1.058x)" in lines[1]
    assert "ahead on dapo (1.342x vs 1.340x); level on 0" in lines[1]
    level = {"dapo": _rl_row(1.34 * (1 + 1e-12), 1.34, ["48/16"])}
    assert (
        "behind static TP on no scenario; ahead on no scenario; level on 1"
        in (rl_discussion(level)[1])
    )
    assert "moved the split on dapo (48/16 48/16 40/24)" in lines[2]
    assert rl_discussion({}) == []
    sweep = {"rows": {"1.25": results["dapo"]["rows"]["adaptive_partial"]}}
    assert op_rows(sweep)[0][:2] == ["1.25", "48/16 48/16 40/24"]


def test_the_dapo_study_rows_name_each_mechanism_and_the_bounds() -> None:
    rl = _rl_row(1.34, 1.34, ["48/16", "40/24"])
    row = rl["rows"]["partial_split"]
    study = {
        "unit_gpus": 2,
        "best_fixed": "42/22",
        "rows": {
            "granular_plan": row,
            "granular_best": {**row, "samples_speedup": 1.365},
            "divided_8192": row,
            "divided_8192_granular_best": row,
        },
        "fixed": {"40/24": {**row, "mean_gen_s": 90.0, "mean_train_s": 80.0}},
        "balanced_step_s": 70.0,
        "balanced_speedup": 1.374,
        "sync_s": 0.07,
        "best_step_s": 73.0,
    }
    rows = study_rows(study, rl)
    assert all(len(r) == len(STUDY_HEADER) for r in rows)
    names = [r[0] for r in rows]
    assert names[3] == "split by 2 GPUs, the best fixed split (42/22, hindsight)"
    assert rows[3][4] == "1.365x, 1.206x"
    assert "divided rollout, 8192-token chunks, the planner's whole-node split" in names
    assert "divided rollout, 8192-token chunks, the best fixed 2-GPU split (42/22)" in names
    assert rows[-2][4] == "1.374x" and rows[-1][4] == "at most 0.07 s a step"
    assert fixed_rows(study) == [["40/24", row["mean_step_s"], 90.0, 80.0, 107.2, "1.340x, 1.206x"]]

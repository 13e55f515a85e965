"""The reproduction report explains the compute results from the run's own figures."""

from __future__ import annotations

from typing import Any

import pytest

from sim_backends.clustersim.report import discussion

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

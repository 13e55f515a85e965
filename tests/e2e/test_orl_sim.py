"""``orl-sim`` as a user runs it: a scenario, a bad scenario, a quick reproduction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _orl_sim(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "orl-sim"
    cmd = (
        [str(script)] if script.exists() else [sys.executable, "-m", "sim_backends.clustersim.cli"]
    )
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_run_example_scenario_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = _orl_sim("run", "examples/sim/small.toml", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "small-14b: Qwen2.5-14B on 32 GPUs" in proc.stdout
    assert "mean step" in proc.stdout
    data = json.loads(out.read_text())
    assert data["scenario"] == "small-14b" and data["policy"] == "adaptive"
    assert len(data["steps"]) == 3
    for st in data["steps"]:
        assert st["step_s"] == pytest.approx(max(st["gen_s"], st["train_s"]) + st["sync_s"])
    again = tmp_path / "again.json"
    assert _orl_sim("run", "examples/sim/small.toml", "--json", str(again)).returncode == 0
    assert again.read_text() == out.read_text()  # deterministic for the scenario's seed


def test_run_with_split_auto_prints_the_sweep_and_runs_the_chosen_split(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = _orl_sim("run", "examples/sim/split-auto.toml", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert 'split.choose = "auto"' in proc.stdout
    data = json.loads(out.read_text())
    sweep = data["split_sweep"]
    assert [(o["gen_gpus"], o["train_gpus"]) for o in sweep] == [(24, 8), (16, 16), (8, 24)]
    best = min(sweep, key=lambda o: (o["step_s"], -o["gen_gpus"]))
    assert (data["gen_gpus"], data["train_gpus"]) == (best["gen_gpus"], best["train_gpus"])
    chosen = f"{best['gen_gpus']}/{best['train_gpus']}"
    assert any(
        line.split()[0] == chosen and "<- chosen" in line for line in proc.stdout.splitlines()
    )
    assert f"({best['gen_gpus']} generate, {best['train_gpus']} train)" in proc.stdout
    assert data["split_choose"] == "auto" and data["bound"] in {"generation", "training", "mixed"}


def test_run_with_partial_rollout_and_the_step_planner(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = _orl_sim("run", "examples/sim/partial.toml", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "rollout partial: over_provision 1.25, max_staleness 1, step end groups" in proc.stdout
    assert "trained samples/s" in proc.stdout and "step 2: split" in proc.stdout
    data = json.loads(out.read_text())["rollout"]
    assert data["mode"] == "partial" and data["over_provision"] == 1.25
    assert data["samples_per_s"] > 0 and 0 < data["offpolicy_token_share"] < 1
    assert len(data["splits"]) == 5 and len(data["plans"]) == 3


def test_run_an_asynchronous_scenario(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = _orl_sim("run", "examples/sim/async.toml", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "asynchronous RL (staleness bound 0.5), weights relay (pull drain)" in proc.stdout
    assert "version lag p50" in proc.stdout and "propagation" in proc.stdout
    data = json.loads(out.read_text())["async"]
    assert data["versions"] == 6 and data["samples_per_s"] > 0
    assert len(data["steps"]) == 6 and data["repack"] and data["plan_split"]
    again = tmp_path / "again.json"
    assert _orl_sim("run", "examples/sim/async.toml", "--json", str(again)).returncode == 0
    assert again.read_text() == out.read_text()  # deterministic for the scenario's seed


def test_async_replay_quick_prints_the_tables_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    proc = _orl_sim("async-replay", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "verl published s/step" in proc.stdout and "balance bound" in proc.stdout
    assert "version propagation" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["replay"]["rows"]) == {"7b-32", "7b-64", "7b-128", "30b-a3b-128"}
    assert data["propagation"]["ratio"] > 1.0


def test_bad_scenario_is_rejected_before_running(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[cluster]\nnodes = 2\n[split]\ntrain_gpus = 16\ngen_gpus = 8\nchoose = 'best'\n"
        "[workload]\nprompt = 1\n"
    )
    proc = _orl_sim("run", str(bad))
    assert proc.returncode == 2
    assert "workload.prompt=1 is not valid: unknown key" in proc.stderr
    assert "split.choose='best' is not valid: one of fixed, auto" in proc.stderr
    assert "the cluster has 16 GPUs" in proc.stderr
    assert proc.stdout == ""


def test_reproduce_quick_writes_report_plots_and_json(tmp_path: Path) -> None:
    proc = _orl_sim("reproduce", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "] 30/30" in proc.stderr  # the progress bar reached the end
    assert "compute 64 GPUs Qwen2.5-14B" in proc.stdout and "paper" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) >= {"compute", "network", "sensitivity_switching", "sensitivity_split"}
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Assumptions" in report
    # every compute result against its ceilings: static TPs, best, adaptive, oracle, bound
    assert "oracle/best" in report and "bound/best" in report and "captured" in report
    rows = [results["compute"]["Qwen2.5-14B"]["ceilings"], *results["suite"].values()]
    assert set(results["suite"]) == {"default-14b", "dapo-14b"}
    for c in rows:
        assert c["bound_s"] <= c["oracle_s"] <= c["best_static_s"] * 1.0001
        assert c["bound_s"] <= c["adaptive_s"]
        assert c["captured"] is None or isinstance(c["captured"], float)
        assert set(c["static_gen_s"]) == {"1", "2", "4", "8"}
    for c in results["suite"].values():  # the adaptive policy told each prompt's difficulty
        assert c["bound_s"] <= c["prompt_oracle_s"]
        assert c["prompt_oracle_speedup"] == c["best_static_s"] / c["prompt_oracle_s"]
    assert "prompt-oracle/best" in report and "the prompt-oracle's:" in report
    for c in rows:
        # end to end: step times on the split used, both speedups, the bounding side
        assert (c["gen_gpus"], c["train_gpus"]) == (48, 16)
        assert c["adaptive_e2e_speedup"] == c["static_step_s"] / c["adaptive_step_s"]
        assert c["oracle_e2e_speedup"] == c["static_step_s"] / c["oracle_step_s"]
        assert c["bound_step_s"] <= c["oracle_step_s"] + 1e-9
        assert c["static_step_s"] >= max(c["best_static_s"], c["train_s"]) + c["sync_s"] - 1e-9
        assert set(c["pipeline_bound"].values()) <= {"generation", "training", "mixed"}
    assert "End to end" in report and "adaptive e2e" in report and "oracle e2e" in report
    # the split sweep of the default and DAPO-like scenarios, and auto's choice in each
    sweeps = results["sensitivity_split"]
    assert set(sweeps) == {"default-14b", "dapo-14b"}
    for sweep in sweeps.values():
        rows = sweep["splits"]
        assert set(rows) == {"56/8", "48/16"}
        best = min(rows, key=lambda k: (rows[k]["step_s"], -rows[k]["gen_gpus"]))
        assert sweep["chosen"] == best
        for r in rows.values():  # one steady step at --quick: the bound is gen vs train
            assert r["bound"] == ("generation" if r["gen_s"] >= r["train_s"] else "training")
    assert report.count("<- auto") == 2 and "Split sweep dapo-14b" in report
    # the cap on sequences per instance, stated for every scenario and swept on two
    for c in results["suite"].values():
        assert c["max_num_seqs"] == {"1": 256, "2": 256, "4": 256, "8": 256}
    seqs = results["sensitivity_max_num_seqs"]
    assert set(seqs) == {"default-14b", "dapo-14b"}
    for name, rows in seqs.items():
        assert set(rows) == {"64", "256"}
        for cap, r in rows.items():
            assert set(r["max_num_seqs"].values()) == {int(cap)}
            assert r["bound_s"] <= r["oracle_s"] <= r["best_static_s"] * 1.0001
        # the default cap reproduces the suite's own row (results are deterministic)
        assert rows["256"]["adaptive_s"] == results["suite"][name]["adaptive_s"]
        assert rows["256"]["oracle_s"] == results["suite"][name]["oracle_s"]
    assert "## 3c. Sensitivity: sequences per instance" in report
    assert "256 at every TP" in report and "max_num_seqs sweep default-14b" in report
    # the regime map: every workload x placement x fabric, and RFabric's verdicts
    regime = results["regimes"]
    cells = {(r["workload"], r["placement"], r["fabric"]) for r in regime["rows"]}
    assert len(cells) == len(regime["rows"]) == 3 * 2 * 5
    for r in regime["rows"]:
        # MoE rows time generation too: the pipeline's max(generation, training) + sync
        gen = r["gen_s"] or 0.0
        assert r["step_s"] == pytest.approx(max(gen, r["train_s"]) + r["sync_s"])
        if r["bound"] == "training":
            assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_s"] + r["sync_s"])
        assert (r["gen_s"] is not None) == r["workload"].startswith("MoE")
        assert r["algorithm"] in {"ring", "tree", "hierarchical"}
    assert len(regime["verdicts"]) == 6
    assert "## 2b. Regime map" in report and "RFabric / best static" in report
    # RL throughput end to end: every mechanism over the best static full rollout
    rl = results["rl"]
    assert set(rl) == {"default-14b", "dapo-14b"}
    for c in rl.values():
        assert set(c["rows"]) == {
            "baseline",
            "tp",
            "split",
            "partial",
            "partial_split",
            "adaptive_partial",
            "divided",
        }
        assert c["rows"]["baseline"]["samples_speedup"] == 1.0
        # with partial rollout on, adaptive TP never behind static TP (the acceptance line)
        rs = c["rows"]
        assert rs["adaptive_partial"]["samples_speedup"] >= rs["partial_split"][
            "samples_speedup"
        ] * (1 - 1e-9)  # level up to the rounding of decode segments split by re-plans
        for r in c["rows"].values():
            assert {
                "mean_step_s",
                "samples_per_s",
                "offpolicy_token_share",
                "dropped_share",
            } <= set(r)
            assert 0.0 <= r["offpolicy_token_share"] <= 1.0 and 0.0 <= r["dropped_share"] <= 1.0
            assert r["steady_steps"] == [2, 3]
        for key in ("baseline", "tp", "split", "divided"):
            assert c["rows"][key]["offpolicy_token_share"] == 0.0  # full rollout
    assert "## 1b. RL throughput end to end" in report and "adaptive + partial + split" in report
    # the DAPO-like study: the split by GPU pairs, divided rollout, the bounds
    study = results["dapo_study"]["dapo-14b"]
    assert set(study["fixed"]) == {f"{g}/{64 - g}" for g in (36, 38, 40, 42, 44, 46, 48)}
    best = max(study["fixed"].values(), key=lambda r: r["samples_per_s"])
    assert study["rows"]["granular_best"]["samples_per_s"] == best["samples_per_s"]
    assert study["balanced_step_s"] <= study["best_step_s"] + 1e-9
    assert "## 1c. dapo-14b: what moves it toward 1.4x" in report
    assert set(results["sensitivity_over_provision"]) == {"default-14b", "dapo-14b"}
    assert "RL throughput, suite" in proc.stdout
    # the asynchronous mode: verl's published rows replayed, each mechanism alone, the
    # version-propagation figure
    asyn = results["async"]
    assert set(asyn["replay"]["rows"]) == {"7b-32", "7b-64", "7b-128", "30b-a3b-128"}
    for row in asyn["replay"]["rows"].values():
        assert row["variants"]["verl"]["speedup"] == 1.0
        assert {"split", "relay", "repack", "reshard", "circuits", "orchestrrl"} <= set(
            row["variants"]
        )
        assert row["published"]["step_s"] > 0 and "error" in row
    assert asyn["propagation"]["leased_s"] <= asyn["propagation"]["static_s"]
    assert "## 1d. Asynchronous RL" in report and "Version propagation" in report
    assert "async RL: OrchestrRL's mode" in proc.stdout
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "async-split.png" in pngs and "async-lag.png" in pngs
    assert "regime-map.png" in pngs
    assert "perf-cost.png" in pngs and any(p.startswith("timeline-") for p in pngs)
    assert all((tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)

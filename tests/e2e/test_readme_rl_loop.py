"""The RL loop on the README's first screen runs as written: its Python block, executed
against a local cluster (simulated OCS, controller, three agents; the generation agents
run llama-server on the trainer's policy), with the names it leaves to the reader
(``gateways``, ``prompts``, ``steps``, ``trainer``, ``rewards``, ``checkpoint_dir``)
defined as `orlctl demo-rl` defines them; only the controller's address is replaced by
the cluster's. Every step's rollout ran on the weights the trainer held, the trainer's
logprob check passed, and the engines end on the last version."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fabric_controller import demo_rl, local
from orchestrrl.rl.tasks import TargetStop
from orchestrrl.rollout import Rollout
from tests.helpers import local_llamacpp_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def readme_loop() -> str:
    """The first Python block of the README, which must be on its first screen."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match is not None
    assert text[: match.start()].count("\n") < 40, "the RL loop is not on the first screen"
    code = match.group(1)
    assert "Rollout(" in code and "set_phase(" in code
    return code


def test_the_readmes_rl_loop_runs_on_a_local_cluster(
    llama_binary: Path, tmp_path: Path, torch_one_thread: None
) -> None:
    code = readme_loop()
    cfg = demo_rl.RLConfig(vocab=64, hidden=64, max_tokens=64, seats=8)
    run_dir = tmp_path / "run"
    store = local.checkpoint_dir(run_dir, demo_rl.TRAIN_NODE)
    store.mkdir(parents=True)
    trainer, model = demo_rl.build_policy(cfg, store)
    task = TargetStop(cfg.vocab)
    with local_llamacpp_cluster(run_dir, model, llama_binary) as cluster:
        gateways, controller = cluster.gateways, cluster.controller
        assert len(gateways) == 2
        scope: dict[str, Any] = {
            "gateways": gateways,
            "prompts": task.prompts(2, seed=1),
            "steps": STEPS,
            "trainer": trainer,
            "rewards": lambda groups: [
                [task.reward(g.prompt_ids, s.completion_ids) for s in g.samples] for g in groups
            ],
            "checkpoint_dir": store,
        }
        assert code.count('Client("127.0.0.1:50051")') == 1
        exec(code.replace("127.0.0.1:50051", controller), scope)
        scope["orl"].close()
        # the last rollout ran on the weights of the step before; every token says so
        groups = scope["groups"]
        assert len(groups) == 2 and all(len(g.samples) == 8 for g in groups)
        assert {v for g in groups for s in g.samples for v in s.versions} == {str(STEPS - 1)}
        assert trainer.version == STEPS  # each step passed the logprob check (1e-3)
        # the last weight sync reached both engines: a rollout on each runs on it
        with Rollout(gateways) as rollout:
            after = rollout.generate(scope["prompts"], n=2, max_tokens=4)
        assert {s.gateway for g in after for s in g.samples} == set(gateways)
        assert {v for g in after for s in g.samples for v in s.versions} == {str(STEPS)}

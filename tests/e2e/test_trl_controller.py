"""TRL's own ``GRPOTrainer`` (``use_vllm=False``) on a local cluster (simulated OCS,
controller, a training node and two generation nodes running llama-server on the
trainer's policy), every step's weights pushed through the controller as issue 25 item 5
asks: its rollouts go through the generation nodes' gateways
(:func:`orchestrrl.integrations.trl.rollout_generate`), and at each step end
:class:`~orchestrrl.integrations.trl.StepEndCallback` writes the checkpoint where the
training node's agent serves it and :func:`~orchestrrl.integrations.trl.controller_push`
sets ``weight-sync`` with it (every generation node fetches and loads it; the answer
comes when all run it), then ``generation`` again. Each rollout's tokens carry the
version the trainer holds and pass its logprob check (fp32, < 1e-3), and each weight
sync's answer has every generation node running the new version with the bytes it
fetched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fabric_controller import demo_rl, local
from node_agent.engines import gguf_convert
from orchestrrl.client import Client, PhaseChange
from orchestrrl.integrations import trl as orl_trl
from orchestrrl.rl import policy
from orchestrrl.rollout import Rollout
from tests import helpers
from tests.engines.conftest import LOGPROB_TOL
from tests.engines.test_rl_llamacpp_gateway import CONFIG, MAX_TOKENS, TASK, VOCAB, N, versions
from tests.helpers import local_llamacpp_cluster

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.engine,
    pytest.mark.usefixtures("torch_one_thread"),
    # transformers 5.25 deprecates `gradient_checkpointing` for `activation_checkpointing`,
    # and TRL 1.16 itself still calls the old name: their warnings, not ours
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
]

STEPS = 2


def test_trls_grpo_trainer_pushes_each_steps_weights_through_the_weight_sync_phase(
    llama_binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    run_dir = tmp_path / "run"
    store = local.checkpoint_dir(run_dir, demo_rl.TRAIN_NODE)  # the training agent serves it
    model = policy.new_policy(CONFIG, seed=0)
    first = policy.save_policy(model, store, "0", CONFIG)
    gguf = gguf_convert.convert(first.path, tmp_path / "policy-0.gguf")
    tokenizer = orl_trl.id_tokenizer(VOCAB)
    prompts = [" ".join(f"t{t}" for t in p) for p in TASK.prompts(4, seed=1)]
    seen: list[tuple[int, set[str]]] = []  # step, versions of its rollout's tokens
    phases: list[str | None] = []  # the phase each rollout ran in
    changes: list[PhaseChange] = []

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float]:
        return [TASK.reward((), c) for c in completion_ids]

    with (
        local_llamacpp_cluster(run_dir, gguf, llama_binary) as cluster,
        Client(cluster.controller) as client,
        Rollout(cluster.gateways) as rollout,
    ):
        assert len(cluster.gateways) == 2
        generation_nodes = {n.node for n in client.nodes() if n.gateway}
        generate = orl_trl.rollout_generate(rollout, max_tokens=MAX_TOKENS, seed=5)

        def recorded(ids: list[tuple[int, ...]], n: int, trainer: Any) -> Any:
            phases.append(client.get_phase().phase)
            groups = generate(ids, n, trainer)
            seen.append((int(trainer.state.global_step), versions(groups)))
            return groups

        push = orl_trl.controller_push(client, demo_rl.TRAIN_NODE, changes=changes)
        func = orl_trl.RolloutFunc(recorded, tokenizer=tokenizer, tolerance=LOGPROB_TOL)
        trainer = helpers.grpo_trainer(
            tmp_path / "out",
            model=model,
            tokenizer=tokenizer,
            prompts=prompts,
            reward=reward,
            rollout_func=func,
            callback=orl_trl.StepEndCallback(orl_trl.save_checkpoints(store, CONFIG, push)),
            generations=N,
            batch=8,  # 2 prompts x 4 samples per step
            steps=STEPS,
            max_completion=MAX_TOKENS,
        )
        client.set_phase("generation")
        trainer.train()
        # the last weight sync reached both gateways: a rollout on each runs on it
        after = rollout.generate(TASK.prompts(2, seed=7), n=2, max_tokens=4)
        assert {s.gateway for g in after for s in g.samples} == set(cluster.gateways)
        assert {v for g in after for s in g.samples for v in s.versions} == {str(STEPS)}
        assert client.get_phase().phase == "generation"

    # one rollout per step, in the generation phase, on the weights of that step
    assert seen == [(k, {str(k)}) for k in range(STEPS)]
    assert phases == ["generation"] * STEPS
    # the engines' logprobs are the trainer's under those weights
    assert [c.step for c in func.checks] == list(range(STEPS))
    for c in func.checks:
        print(f"step {c.step}: {c.tokens} tokens, |diff| mean {c.mean:.1e} max {c.max:.1e}")
    assert max(c.max for c in func.checks) < LOGPROB_TOL
    # each optimizer step's checkpoint reached every generation node through the phase
    assert [c.phase for c in changes] == ["weight-sync"] * STEPS
    for k, change in enumerate(changes, start=1):
        sync = change.weight_sync
        assert sync is not None and sync.complete and sync.version == str(k)
        assert sync.source_node == demo_rl.TRAIN_NODE
        assert {n.node for n in sync.nodes} == generation_nodes
        for n in sync.nodes:
            assert n.ok and n.version == str(k) and n.previous == str(k - 1), n
            assert n.bytes_fetched > 0 and not n.cached, n
            print(f"v{k} {n.node}: {n.bytes_fetched} B fetched {n.fetch_seconds:.2f} s, "
                  f"loaded {n.load_seconds:.2f} s ({n.how})")  # fmt: skip
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))

"""TRL's repeated prompts become groups and the groups become TRL's answer, in order."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.integrations.trl import (
    controller_push,
    id_tokenizer,
    prompt_ids,
    regroup,
    rollout_generate,
    samples_of,
    to_trl,
)
from orchestrrl.rl.grpo import Sample

pytestmark = pytest.mark.unit


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=6), st.integers(1, 5))
def test_regroup_inverts_trls_repetition(prompts: list[list[int]], n: int) -> None:
    repeated = [p for p in prompts for _ in range(n)]  # what RepeatSampler hands rollout_func
    assert regroup(repeated, n) == prompts  # equal prompts in two rows stay two groups


def test_regroup_refuses_what_is_not_whole_groups() -> None:
    with pytest.raises(
        errors.InvalidArgument, match="prompts='5 entries' is not valid: a multiple"
    ):
        regroup(["a"] * 5, 2)
    with pytest.raises(errors.InvalidArgument, match=r"prompts\[2:4\]=\['b', 'c'\]"):
        regroup(["a", "a", "b", "c"], 2)
    with pytest.raises(errors.InvalidArgument, match="num_generations=0"):
        regroup(["a"], 0)


def s(prompt: int, out: int, version: str = "3") -> Sample:
    return Sample((prompt,), (out, 9), (-0.5, -0.25), "stop", version)


def test_groups_flatten_to_trls_fields_in_order() -> None:
    groups = [[s(1, 10), s(1, 11)], [s(2, 20), s(2, 21, "4")]]
    out = to_trl(groups, 2, extra={"score": [[0.1, 0.2], [0.3, 0.4]]})
    assert out == {
        "prompt_ids": [[1], [1], [2], [2]],
        "completion_ids": [[10, 9], [11, 9], [20, 9], [21, 9]],
        "logprobs": [[-0.5, -0.25]] * 4,
        "weight_version": ["3", "3", "3", "4"],
        "finish": ["stop"] * 4,
        "score": [0.1, 0.2, 0.3, 0.4],
    }
    with pytest.raises(errors.InvalidArgument, match=r"groups\[1\]='1 samples'"):
        to_trl([groups[0], groups[1][:1]], 2)
    with pytest.raises(errors.InvalidArgument, match="extra='logprobs'"):
        to_trl(groups, 2, extra={"logprobs": [[0, 0], [0, 0]]})
    with pytest.raises(errors.InvalidArgument, match=r"extra\['score'\]='3 values'"):
        to_trl(groups, 2, extra={"score": [[0.1, 0.2], [0.3]]})


def test_the_id_tokenizer_spells_each_id_and_reads_it_back() -> None:
    tok = id_tokenizer(16)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 15)
    assert tok.decode([3, 14, 15]) == "t3 t14 </s>"
    assert tok.decode([3, 14, 15], skip_special_tokens=True) == "t3 t14"
    assert prompt_ids("t3 t14 t2", tok) == (3, 14, 2)
    assert prompt_ids([3, 4], None) == (3, 4)
    with pytest.raises(errors.InvalidArgument, match="prompt="):
        prompt_ids("t3", None)
    with pytest.raises(errors.InvalidArgument, match="eos_id=0"):
        id_tokenizer(16, eos_id=0)


def rollout_sample(tokens: tuple[int, ...], versions: tuple[str, ...], finish: str) -> Any:
    from orchestrrl.rollout import Sample as Got

    return Got("r", tokens, tuple(-0.1 * (i + 1) for i in range(len(tokens))), versions,
               finish, ("n0",), "http://g")  # fmt: skip


def test_a_rollouts_groups_become_the_trainers_samples() -> None:
    from orchestrrl.rollout import Group

    groups = [
        Group((5, 6), "g0", (rollout_sample((7, 8, 63), ("2", "2", "2"), "stop"),
                             rollout_sample((9, 9, 9), ("2", "3", "3"), "length"))),
        Group((4,), "g1", (rollout_sample((1,), ("3",), "abort"),
                           rollout_sample((2, 2), ("3", "3"), "error"))),
    ]  # fmt: skip
    out = samples_of(groups)
    assert [[(x.prompt_ids, x.completion_ids, x.finish, x.version) for x in g] for g in out] == [
        [((5, 6), (7, 8, 63), "stop", "2"), ((5, 6), (9, 9, 9), "length", "2,3")],
        [((4,), (1,), "abort", "3"), ((4,), (2, 2), "length", "3")],
    ]
    assert out[0][1].logprobs == pytest.approx((-0.1, -0.2, -0.3))
    assert out[0][1].versions == ("2", "3", "3")  # per token (partial rollout's carried ones)
    # a rollout without logprobs cannot be trained on: refused naming the field
    bare = Group((4,), "g", (dataclasses.replace(groups[1].samples[0], logprobs=None),))
    with pytest.raises(errors.InvalidArgument, match="logprobs='0 values'"):
        samples_of([bare])


def test_rollout_generate_asks_for_each_steps_samples_with_logprobs() -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    class Recorder:
        def generate(self, prompts: Any, **kw: Any) -> list[Any]:
            calls.append((prompts, kw))
            return []

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=2), temperature=0.7)
    generate = rollout_generate(Recorder(), max_tokens=16, seed=5, top_p=0.9)  # type: ignore[arg-type]
    assert generate([(1, 2)], 4, trainer) == []
    assert calls == [
        ([(1, 2)], {"n": 4, "max_tokens": 16, "temperature": 0.7, "seed": 5 + 2 * 100_003,
                    "logprobs": True, "top_p": 0.9}),
    ]  # fmt: skip


class PhaseRecorder:
    """A controller client that records ``set_phase`` calls (and fails weight-sync when told)."""

    def __init__(self, fail_sync: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_sync = fail_sync

    def set_phase(self, phase: str, **kw: Any) -> Any:
        self.calls.append((phase, kw))
        if phase == "weight-sync" and self.fail_sync:
            raise errors.FailedPrecondition("weight sync of version 3 did not reach gen0-n1")
        return SimpleNamespace(phase=phase, **kw)


def test_controller_push_syncs_the_checkpoint_then_sets_generation_again() -> None:
    client = PhaseRecorder()
    changes: list[Any] = []
    push = controller_push(client, "train0-n0", sync_timeout_s=30.0, changes=changes)  # type: ignore[arg-type]
    ckpt = SimpleNamespace(version="3", checksum="ab" * 32)
    change = push(ckpt)  # type: ignore[arg-type]
    sync = {
        "checkpoint": "3",
        "source": "train0-n0",
        "checksum": "ab" * 32,
        "in_flight": "finish",
        "sync_timeout_s": 30.0,
    }
    assert client.calls == [("weight-sync", sync), ("generation", {})]
    assert changes == [change] and change.phase == "weight-sync"
    client = PhaseRecorder()
    controller_push(client, "t", then_phase="", in_flight="resume")(ckpt)  # type: ignore[arg-type]
    assert [(p, kw["in_flight"]) for p, kw in client.calls] == [("weight-sync", "resume")]


def test_a_weight_sync_that_failed_stops_the_trainer_before_the_next_rollout() -> None:
    client = PhaseRecorder(fail_sync=True)
    changes: list[Any] = []
    push = controller_push(client, "train0-n0", changes=changes)  # type: ignore[arg-type]
    with pytest.raises(errors.FailedPrecondition, match="did not reach gen0-n1"):
        push(SimpleNamespace(version="3", checksum=""))  # type: ignore[arg-type]
    assert [p for p, _ in client.calls] == ["weight-sync"] and changes == []

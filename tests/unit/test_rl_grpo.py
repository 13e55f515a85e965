"""GRPO's group arithmetic and the toy task, pure (no torch)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl.rl.grpo import Sample, check_groups, group_advantages, percentile
from orchestrrl.rl.tasks import TargetStop

pytestmark = pytest.mark.unit

rewards = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=8), min_size=1, max_size=6
)


def test_advantages_are_centred_on_the_group_and_scaled_by_its_std() -> None:
    (a, b) = group_advantages([[1.0, 0.0, 0.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    std = math.sqrt(1 / 3)  # Bessel: sum of squares 1.0 over n - 1 = 3
    unit = 0.5 / (std + 1e-4)
    assert a == pytest.approx([unit, -unit, -unit, unit])
    assert b == (0.0, 0.0, 0.0, 0.0)  # all alike: nothing to learn
    assert group_advantages([[1.0, 3.0]], "none") == ((-1.0, 1.0),)
    batch = group_advantages([[0.0, 2.0], [4.0, 4.0]], "batch")
    assert batch[1] == (0.0, 0.0)
    assert batch[0][1] == -batch[0][0] and batch[0][0] == pytest.approx(
        -1.0 / (math.sqrt(11 / 3) + 1e-4)
    )
    assert group_advantages([[0.0, 1e-300]], eps=0.0) == ((0.0, 0.0),)  # std underflows
    with pytest.raises(errors.InvalidArgument, match="eps=-1"):
        group_advantages([[1.0, 2.0]], eps=-1)
    with pytest.raises(errors.InvalidArgument, match="scale='mean' is not valid"):
        group_advantages([[1.0]], "mean")  # type: ignore[arg-type]


@given(rewards)
def test_advantages_sum_to_zero_in_every_group_and_keep_the_order(rs: list[list[float]]) -> None:
    for scale in ("group", "batch", "none"):
        for group, adv in zip(rs, group_advantages(rs, scale), strict=True):  # type: ignore[arg-type]
            assert len(adv) == len(group)
            assert abs(sum(adv)) <= 1e-6 * max(1.0, *(abs(a) for a in adv))
            for i in range(len(group)):
                for j in range(len(group)):
                    if group[i] > group[j]:
                        assert adv[i] >= adv[j]


@given(rewards, st.floats(0.01, 100), st.floats(-50, 50))
def test_group_scaled_advantages_ignore_an_affine_change_of_reward(
    rs: list[list[float]], k: float, c: float
) -> None:
    assume(all(max(g) - min(g) > 1e-3 for g in rs))  # spread well above rounding
    plain = group_advantages(rs, eps=0.0)
    moved = group_advantages([[k * r + c for r in g] for g in rs], eps=0.0)
    for a, b in zip(plain, moved, strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)


def sample(prompt: tuple[int, ...] = (5, 6), out: tuple[int, ...] = (7, 63)) -> Sample:
    return Sample(prompt, out, tuple(-1.0 for _ in out), "stop")


def test_samples_and_groups_are_checked() -> None:
    with pytest.raises(errors.InvalidArgument, match="one per completion token"):
        Sample((1,), (2, 3), (-1.0,))
    with pytest.raises(errors.InvalidArgument, match="finish='eos'"):
        Sample((1,), (2,), (-1.0,), "eos")
    with pytest.raises(errors.InvalidArgument, match=r"prompt_ids=\(\) is not valid"):
        Sample((), (2,), (-1.0,))
    good = [sample(), sample()]
    check_groups([good], [[0.0, 1.0]])
    cases = [
        ([], [], "groups=\\[\\] is not valid"),
        ([good], [[0.0, 1.0], [1.0, 1.0]], "rewards='2 groups'"),
        ([good[:1]], [[0.0]], "groups\\[0\\]='1 samples' is not valid: at least 2"),
        ([good], [[0.0]], "rewards\\[0\\]='1 values'"),
        ([[sample(), sample((9,))]], [[0.0, 1.0]], "mixed prompts"),
        ([good], [[0.0, math.nan]], "finite numbers"),
    ]
    for groups, rs, message in cases:
        with pytest.raises(errors.InvalidArgument, match=message):
            check_groups(groups, rs)


def test_percentile() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0


TASK = TargetStop(64)  # eos 63, target ids 2, 6, 10, ..., 62


def test_the_toy_reward_scores_target_tokens_and_stopping_near_the_target_length() -> None:
    assert TASK.eos == 63 and TASK.is_target(2) and TASK.is_target(62) and not TASK.is_target(3)
    assert not TASK.is_target(63) and not TASK.is_target(1)
    p = (5, 9)
    assert TASK.reward(p, (2, 6, 10, 14, 18, 22, 63)) == 1.0  # six targets, stopped at 6
    assert TASK.reward(p, (2, 6, 10, 14, 18, 22)) == 0.5  # never stopped: no length score
    assert TASK.reward(p, (3, 5, 7, 9, 11, 13, 63)) == 0.5  # right length, no targets
    assert TASK.reward(p, (2, 3, 63)) == pytest.approx(0.5 * 0.5 + 0.5 * (1 - 4 / 6))
    assert TASK.reward(p, (63,)) == pytest.approx(0.5 * 0 + 0.5 * 0)  # empty: 6 away
    assert TASK.reward(p, ()) == 0.0
    assert TASK.reward(p, (2,) * 30 + (63,)) == 0.5  # far too long: no length score


@given(st.lists(st.integers(0, 63), max_size=40))
def test_the_toy_reward_is_between_0_and_1(completion: list[int]) -> None:
    assert 0.0 <= TASK.reward((4,), completion) <= 1.0


def test_toy_prompts_are_content_tokens_and_repeat_for_a_seed() -> None:
    prompts = TASK.prompts(50, seed=4)
    assert prompts == TASK.prompts(50, seed=4) and prompts != TASK.prompts(50, seed=5)
    assert all(3 <= len(p) <= 8 and all(2 <= t <= 62 for t in p) for p in prompts)
    with pytest.raises(errors.InvalidArgument) as e:
        TargetStop(4, target_length=0, length_weight=2)
    assert "vocab_size=4" in str(e.value) and "target_length=0" in str(e.value)
    assert "length_weight=2" in str(e.value)


def test_the_pure_parts_import_without_torch() -> None:
    """A node agent verifies checkpoints, and a loop scores samples, without the rl extra."""
    import subprocess
    import sys

    code = (
        "import sys; import orchestrrl.checkpoint, orchestrrl.rl, orchestrrl.rl.grpo, "
        "orchestrrl.rl.tasks; "
        "heavy = sorted({'torch', 'transformers', 'trl', 'safetensors'} & set(sys.modules)); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

"""A verifiable toy task on token ids, on which a tiny random policy learns in a few
GRPO steps, and whose response lengths drift as it learns (the paper's premise).

:class:`TargetStop`: a prompt is a few random content tokens; a response scores

    reward = (1 - w) * (share of its tokens in the target set)
             + w * (1 - |length - target_length| / target_length, at least 0)  if it stopped

where the target set is every ``every``-th content id, ``length`` counts the tokens
before end-of-sequence, and a response that never stopped (cut at ``max_tokens``) gets no
length score. A random policy over a small vocabulary seldom stops, so responses start
near ``max_tokens`` long; as it learns to stop, lengths fall toward ``target_length``.
Pure: the reward is a function of the token ids alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrrl import errors

FIRST_CONTENT = 2  # ids 0 (padding) and 1 (BOS) are never content


@dataclass(frozen=True)
class TargetStop:
    vocab_size: int
    target_length: int = 6
    every: int = 4
    prompt_min: int = 3
    prompt_max: int = 8
    length_weight: float = 0.5

    def __post_init__(self) -> None:
        p = errors.Problems()
        if not 8 <= self.vocab_size <= 1 << 20:
            p.add(str(errors.field_error("vocab_size", self.vocab_size, "8..1048576")))
        if not 1 <= self.target_length <= 4096:
            p.add(str(errors.field_error("target_length", self.target_length, "1..4096")))
        if not 1 <= self.every <= max(1, self.vocab_size // 2):
            p.add(str(errors.field_error("every", self.every, "1..vocab_size/2")))
        if not 1 <= self.prompt_min <= self.prompt_max <= 4096:
            p.add(
                str(
                    errors.field_error(
                        "prompt_min..prompt_max",
                        (self.prompt_min, self.prompt_max),
                        "1 <= min <= max <= 4096",
                    )
                )
            )
        if not 0 <= self.length_weight <= 1:
            p.add(str(errors.field_error("length_weight", self.length_weight, "0..1")))
        if p:
            raise p.error()

    @property
    def eos(self) -> int:
        return self.vocab_size - 1

    @property
    def content(self) -> range:
        return range(FIRST_CONTENT, self.vocab_size - 1)

    def is_target(self, token: int) -> bool:
        return token in self.content and (token - FIRST_CONTENT) % self.every == 0

    def prompts(self, count: int, seed: int) -> list[tuple[int, ...]]:
        """``count`` prompts, the same for the same seed."""
        rng = random.Random(seed)
        lo, hi = self.content.start, self.content.stop - 1
        return [
            tuple(rng.randint(lo, hi) for _ in range(rng.randint(self.prompt_min, self.prompt_max)))
            for _ in range(count)
        ]

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        stopped = bool(completion) and completion[-1] == self.eos
        body = completion[:-1] if stopped else completion
        share = sum(self.is_target(t) for t in body) / len(body) if body else 0.0
        fit = 0.0
        if stopped:
            fit = max(0.0, 1.0 - abs(len(body) - self.target_length) / self.target_length)
        return (1 - self.length_weight) * share + self.length_weight * fit

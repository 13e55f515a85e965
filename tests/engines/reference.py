"""The trainer's side of the logprob check: recompute, with Hugging Face transformers (what
TRL's trainers run), the logprob of every token an engine generated, under the weights of
a checkpoint, and compare with what the engine reported.

The recomputation is teacher-forced: one forward pass over prompt + completion, the
log-softmax of the float32 logits at temperature 1 (the raw model distribution), the
value at each generated token. That is what an RL trainer computes for the importance
ratio, and what the adapters report (see node_agent/engines/base.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Recomputed:
    logprobs: tuple[float, ...]  # of each completion token
    argmax_gap: tuple[float, ...]  # top logit minus the token's logit, at each position


class Reference:
    """A checkpoint loaded for recomputation (float32, CPU, eval mode)."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        self.model.train(False)

    @torch.no_grad()
    def recompute(self, prompt: Sequence[int], completion: Sequence[int]) -> Recomputed:
        ids = torch.tensor([list(prompt) + list(completion)])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(list(completion))
        chosen = logits.gather(1, target[:, None])[:, 0]
        return Recomputed(
            tuple(lp.gather(1, target[:, None])[:, 0].tolist()),
            tuple((logits.max(dim=-1).values - chosen).tolist()),
        )

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)

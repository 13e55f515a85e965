"""Hugging Face TRL's ``GRPOTrainer`` on top of OrchestrRL (needs the ``rl`` extra).

What TRL 1.16 does (read in ``trl/trainer/grpo_trainer.py``):

- ``rollout_func(prompts, trainer) -> dict`` is called once per *generation batch* (every
  ``steps_per_generation * num_iterations`` micro-steps; one per optimizer step with the
  defaults) with the ``prompt`` column of that batch on this process. TRL's
  ``RepeatSampler`` has already repeated each dataset row ``num_generations`` times in a
  row, so ``prompts`` holds whole groups: ``[a, a, a, a, b, b, b, b, ...]``. It must return
  ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lists of lists, one entry per
  prompt entry, in order); any other key is an extra field, given to the reward
  functions as a keyword argument. Rewards are normalized over consecutive runs of
  ``num_generations`` entries, so the order must be kept.
- With ``use_vllm=False`` the returned logprobs are only kept as
  ``sampling_per_token_logps``: the loss's old logprobs are the trainer's own
  (``per_token_logps.detach()``, i.e. ratio 1 on the first pass), and only the
  off-policy mask (``off_policy_mask_threshold``) reads them. :class:`RolloutFunc` does
  the engines-versus-trainer logprob check itself.
- A ``processing_class`` is required even for token ids: TRL reads ``pad_token_id`` and
  ``eos_token_id`` from it and decodes completions for the reward functions
  (:func:`id_tokenizer` builds a word-level one locally, token ``i`` spelled ``t{i}``).
- Weights change in ``optimizer.step()``; ``on_step_end`` follows at once, before the next
  generation batch: :class:`StepEndCallback` is where weights reach the engines.

Pieces: :func:`regroup` / :func:`to_trl` (TRL's repeated prompts to groups and back),
:class:`RolloutFunc` (a ``rollout_func`` around any group generator, with the logprob
check), :func:`rollout_generate` (a generator over the node agents' gateways through
:class:`orchestrrl.rollout.Rollout`), :func:`torch_generate` (one that samples with plain
torch from the trainer's model: no engine), :class:`StepEndCallback`,
:func:`save_checkpoints` and :func:`controller_push` (each step's checkpoint to every
generation node through the controller's ``weight-sync`` phase).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import PreTrainedTokenizerFast, TrainerCallback

from orchestrrl import checkpoint, errors
from orchestrrl.rl import policy
from orchestrrl.rl.grpo import FINISH, Sample
from orchestrrl.rl.trainer import LogprobMismatch
from orchestrrl.rollout import Group, Rollout

if TYPE_CHECKING:
    from orchestrrl.client import Client, PhaseChange

P = TypeVar("P")
Generate = Callable[[list[tuple[int, ...]], int, Any], Sequence[Sequence[Sample]]]


def regroup(prompts: Sequence[P], num_generations: int) -> list[P]:
    """The prompt of each group in TRL's repeated list (each prompt ``num_generations``
    times in a row), in order. InvalidArgument if the list is not made of such runs."""
    n = num_generations
    if not isinstance(n, int) or n < 1:
        raise errors.field_error("num_generations", n, "an integer >= 1")
    if len(prompts) % n:
        raise errors.field_error(
            "prompts", f"{len(prompts)} entries", f"a multiple of num_generations={n}"
        )
    out = []
    for g in range(len(prompts) // n):
        run = prompts[g * n : (g + 1) * n]
        if any(p != run[0] for p in run):
            raise errors.field_error(
                f"prompts[{g * n}:{(g + 1) * n}]", list(run), "one prompt repeated (a group)"
            )
        out.append(run[0])
    return out


def to_trl(
    groups: Sequence[Sequence[Sample]],
    num_generations: int,
    extra: Mapping[str, Sequence[Sequence[Any]]] | None = None,
) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` answer for ``groups`` (``num_generations`` samples each, in
    the order of :func:`regroup`): ``prompt_ids``, ``completion_ids``, ``logprobs``, plus
    ``weight_version`` and ``finish`` per sample and any ``extra`` (per group, per sample)
    fields, which TRL hands to the reward functions."""
    for g, group in enumerate(groups):
        if len(group) != num_generations:
            raise errors.field_error(
                f"groups[{g}]", f"{len(group)} samples", f"num_generations={num_generations}"
            )
    flat = [s for group in groups for s in group]
    out: dict[str, list[Any]] = {
        "prompt_ids": [list(s.prompt_ids) for s in flat],
        "completion_ids": [list(s.completion_ids) for s in flat],
        "logprobs": [list(s.logprobs) for s in flat],
        "weight_version": [s.version for s in flat],
        "finish": [s.finish for s in flat],
    }
    for key, per_group in (extra or {}).items():
        if key in out:
            raise errors.field_error("extra", key, "a name other than " + ", ".join(out))
        values = [v for group in per_group for v in group]
        if len(values) != len(flat):
            raise errors.field_error(f"extra[{key!r}]", f"{len(values)} values", f"{len(flat)}")
        out[key] = values
    return out


def id_tokenizer(vocab_size: int, *, eos_id: int | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer for a token-id model: id 0 ``<pad>``, 1 ``<s>``, the last
    ``</s>`` (end of sequence), every other id ``i`` the word ``t{i}``; built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if not isinstance(vocab_size, int) or not 3 <= vocab_size <= 1 << 24:
        raise errors.field_error("vocab_size", vocab_size, "an integer 3..16777216")
    eos = vocab_size - 1 if eos_id is None else eos_id
    if not isinstance(eos, int) or not 2 <= eos < vocab_size:
        raise errors.field_error("eos_id", eos_id, f"an id in 2..{vocab_size - 1}")
    names = {0: "<pad>", 1: "<s>", eos: "</s>"}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def prompt_ids(prompt: Any, tokenizer: Any = None) -> tuple[int, ...]:
    """A TRL prompt as token ids: a list of ids as is, a string through ``tokenizer``."""
    if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, str) and tokenizer is not None:
        return tuple(tokenizer.encode(prompt, add_special_tokens=False))
    raise errors.field_error("prompt", prompt, "a list of token ids, or text with a tokenizer")


def _temperature(trainer: Any) -> float:
    return float(getattr(trainer, "temperature", None) or 1.0)


@dataclass(frozen=True)
class LogprobCheck:
    step: int
    tokens: int
    mean: float
    max: float


@dataclass
class RolloutFunc:
    """TRL's ``rollout_func`` around ``generate(prompt_ids, n, trainer) -> groups``: regroups
    TRL's repeated prompts, asks for ``n`` samples of each (``num_generations``, or
    ``num_generations_eval`` in evaluation), flattens the groups back. With
    ``check_logprobs`` it recomputes every sampled token's logprob under the trainer's
    model (the weights pushed at the last step end) and records the engines' difference
    in ``checks``; above ``tolerance`` it raises :class:`LogprobMismatch`."""

    generate: Generate
    tokenizer: Any = None
    check_logprobs: bool = True
    tolerance: float | None = None
    checks: list[LogprobCheck] = field(default_factory=list)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        training = trainer.model.training
        n = trainer.num_generations if training else trainer.num_generations_eval
        ids = [prompt_ids(p, self.tokenizer) for p in regroup(prompts, n)]
        groups = self.generate(ids, n, trainer)
        if len(groups) != len(ids):
            raise errors.field_error("groups", f"{len(groups)} groups", f"{len(ids)} prompts")
        for g, (prompt, group) in enumerate(zip(ids, groups, strict=True)):
            if any(s.prompt_ids != prompt for s in group):
                raise errors.field_error(f"groups[{g}]", "another prompt", "its prompt's samples")
        if self.check_logprobs:
            self._check([s for group in groups for s in group], trainer)
        return to_trl(groups, n)

    def _check(self, samples: list[Sample], trainer: Any) -> None:
        with torch.no_grad():
            now, mask = policy.token_logprobs(
                trainer.model,
                [s.prompt_ids for s in samples],
                [s.completion_ids for s in samples],
                temperature=_temperature(trainer),
            )
        reported = torch.zeros_like(now)
        for i, s in enumerate(samples):
            reported[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        diff = (now - reported).abs()[mask]
        step = int(trainer.state.global_step)
        check = LogprobCheck(
            step,
            int(mask.sum()),
            float(diff.mean()) if diff.numel() else 0.0,
            float(diff.max()) if diff.numel() else 0.0,
        )
        self.checks.append(check)
        if self.tolerance is not None and check.max > self.tolerance:
            raise LogprobMismatch(step, check.mean, check.max, self.tolerance)


def samples_of(groups: Sequence[Group]) -> list[list[Sample]]:
    """The trainer's samples of a rollout's groups: each with the logprobs the engines
    reported and its weight version (the distinct versions of its tokens joined by ",",
    e.g. "3,4" for a sample that spanned an update), and each token's version."""
    return [
        [
            Sample(
                g.prompt_ids,
                s.completion_ids,
                tuple(s.logprobs or ()),
                s.finish_reason if s.finish_reason in FINISH else "length",
                ",".join(s.weight_versions),
                tuple(s.versions),  # per token: the trainer checks each under its weights
            )
            for s in g.samples
        ]
        for g in groups
    ]


def rollout_generate(
    rollout: Rollout, *, max_tokens: int, seed: int = 0, **sampling: Any
) -> Generate:
    """A group generator over the gateways of ``rollout`` (:class:`Rollout`): the ``n``
    samples of each prompt as one group on one gateway, with every token's logprob, at
    the trainer's ``temperature``, seeded by ``seed`` + 100003 x the step (``sampling``:
    more keyword arguments of :meth:`Rollout.generate`, e.g. ``top_p``)."""

    def generate(prompts: list[tuple[int, ...]], n: int, trainer: Any) -> list[list[Sample]]:
        step = int(trainer.state.global_step)
        groups = rollout.generate(
            prompts,
            n=n,
            max_tokens=max_tokens,
            temperature=_temperature(trainer),
            seed=seed + 100_003 * step,
            logprobs=True,
            **sampling,
        )
        return samples_of(groups)

    return generate


def torch_generate(*, max_tokens: int, seed: int = 0) -> Generate:
    """A group generator that samples from the trainer's own model with plain torch (no
    engine) at the trainer's ``temperature``, seeded by ``seed`` + the step: what
    :class:`RolloutFunc` wraps until an engine-backed one replaces it."""

    def generate(prompts: list[tuple[int, ...]], n: int, trainer: Any) -> list[list[Sample]]:
        step = int(trainer.state.global_step)
        return policy.sample(
            trainer.model,
            prompts,
            n=n,
            max_tokens=max_tokens,
            temperature=_temperature(trainer),
            seed=seed + step,
            version=str(step),
        )

    return generate


@dataclass(frozen=True)
class StepEnd:
    """One optimizer step is done: ``model`` holds weight version ``step``.
    ``rollout_next``: the next micro-step generates (TRL generates once every
    ``steps_per_generation * num_iterations`` micro-steps), so the engines need these
    weights now; otherwise no rollout reads them before the next step ends."""

    step: int
    model: Any
    rollout_next: bool


class StepEndCallback(TrainerCallback):
    """Calls ``hook(StepEnd)`` after every optimizer step (and, with ``at_train_begin``,
    once before the first rollout with the initial weights, step 0): the place to set
    the ``weight-sync`` phase, push the new checkpoint and set ``generation`` again."""

    def __init__(self, hook: Callable[[StepEnd], None], *, at_train_begin: bool = False) -> None:
        self.hook = hook
        self.at_train_begin = at_train_begin

    @staticmethod
    def _rollout_next(args: Any, step: int) -> bool:
        every = int(args.steps_per_generation or 1) * int(getattr(args, "num_iterations", 1))
        return (step * int(args.gradient_accumulation_steps)) % every == 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.at_train_begin:
            self.hook(StepEnd(int(state.global_step), kwargs["model"], True))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        self.hook(StepEnd(step, kwargs["model"], self._rollout_next(args, step)))


def save_checkpoints(
    root: Path,
    model_config: Mapping[str, Any],
    then: Callable[[checkpoint.Checkpoint], object] | None = None,
    *,
    only_before_rollouts: bool = True,
) -> Callable[[StepEnd], None]:
    """A :class:`StepEndCallback` hook that writes the model as checkpoint ``str(step)``
    under ``root`` and gives it to ``then`` (push it to the engines); with
    ``only_before_rollouts``, only at step ends that a rollout follows."""

    def hook(event: StepEnd) -> None:
        if only_before_rollouts and not event.rollout_next:
            return
        ckpt = policy.save_policy(event.model, root, str(event.step), model_config)
        if then is not None:
            then(ckpt)

    return hook


def controller_push(
    client: Client,
    source: str,
    *,
    then_phase: str = "generation",
    in_flight: str = "finish",
    sync_timeout_s: float = 600.0,
    changes: list[PhaseChange] | None = None,
) -> Callable[[checkpoint.Checkpoint], PhaseChange]:
    """A ``then`` for :func:`save_checkpoints` that pushes each checkpoint through the
    fabric controller (``client``: :class:`orchestrrl.client.Client`): sets
    ``weight-sync`` with it (the circuits move, every generation node fetches it from the
    agent of ``source``, the training node in whose ``checkpoint_dir`` ``root`` is, checks
    its checksum and loads it into its engines; the call returns when every one runs it
    and raises :class:`orchestrrl.client.WeightSyncIncomplete` when one did not), then sets
    ``then_phase`` again (``""``: leave the phase as it is). ``in_flight`` and
    ``sync_timeout_s`` are :meth:`Client.set_phase`'s; ``changes`` collects the
    weight-sync answers (bytes fetched, time per node)."""

    def push(ckpt: checkpoint.Checkpoint) -> PhaseChange:
        change = client.set_phase(
            "weight-sync",
            checkpoint=ckpt.version,
            source=source,
            checksum=ckpt.checksum,
            in_flight=in_flight,
            sync_timeout_s=sync_timeout_s,
        )
        if changes is not None:
            changes.append(change)
        if then_phase:
            client.set_phase(then_phase)
        return change

    return push

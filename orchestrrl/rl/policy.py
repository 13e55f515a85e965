"""The policy: Hugging Face's ``LlamaForCausalLM``, the model vLLM and llama.cpp serve.

Why transformers' model and not one of our own: it *is* the reference that vLLM's Llama
and the HF->GGUF converters follow (rotary embedding on ``rotate_half`` halves, RMSNorm,
SiLU-gated MLP, the same tensor names), TRL's trainer needs a ``PreTrainedModel``
anyway, and a second implementation would need this one to be tested against. The model
runs in fp32 on the CPU; token ids only (no tokenizer).

Functions: :func:`llama_config` (a config of the same keys as the tiny models the engine
tests build), :func:`new_policy`, :func:`load_policy` / :func:`save_policy` (a verified,
versioned :mod:`orchestrrl.checkpoint`), :func:`token_logprobs` (the logprob of every
sampled token, batched with padding: what the trainer compares with the engines'),
:func:`sample` (groups of samples drawn with plain torch, no engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orchestrrl import checkpoint, errors
from orchestrrl.rl.grpo import Sample

BOS, PAD = 1, 0


def llama_config(
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    num_hidden_layers: int = 2,
    head_dim: int = 64,
    num_key_value_heads: int = 0,
    intermediate_size: int = 0,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.02,
) -> dict[str, Any]:
    """A Llama config (``config.json``) with the keys of ``sim_backends.tiny_models``'
    checkpoints: end of sequence is the last id, BOS 1, padding 0."""
    heads = hidden_size // head_dim
    if heads < 1 or hidden_size % head_dim:
        raise errors.field_error("hidden_size", hidden_size, f"a multiple of head_dim={head_dim}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": num_key_value_heads or heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": PAD,
        "torch_dtype": "float32",
        "initializer_range": initializer_range,
        "use_cache": True,
    }


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` beside a config (greedy by default, as the tiny models)."""
    return {
        "bos_token_id": config.get("bos_token_id", BOS),
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config.get("pad_token_id", PAD),
        "do_sample": False,
    }


def eos_id(model: LlamaForCausalLM) -> int:
    eos: Any = model.config.eos_token_id
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if not isinstance(eos, int):
        raise errors.field_error("eos_token_id", eos, "the model config's end-of-sequence id")
    return eos


def build_model(config: Mapping[str, Any]) -> LlamaForCausalLM:
    """An fp32 ``LlamaForCausalLM`` of ``config`` (checked as a Llama first), randomly
    initialised by transformers (normal, std ``initializer_range``)."""
    checkpoint.LlamaArch.from_config(config)
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
    model = LlamaForCausalLM(cfg)  # float32: torch's default dtype
    model.generation_config.eos_token_id = config["eos_token_id"]
    return model


def new_policy(config: Mapping[str, Any], seed: int) -> LlamaForCausalLM:
    """A random policy, the same for the same config and seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(config)


def load_policy(ckpt: checkpoint.Checkpoint) -> LlamaForCausalLM:
    """The policy of a (verified) checkpoint: every tensor loaded, none missing."""
    from safetensors.torch import load_file

    model = build_model(checkpoint.read_config(ckpt))
    state = load_file(str(ckpt.path / checkpoint.WEIGHTS))
    model.load_state_dict(state, strict=True)
    return model


def policy_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``model`` by their Hugging Face names."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def save_policy(
    model: LlamaForCausalLM, root: Path, version: str, config: Mapping[str, Any]
) -> checkpoint.Checkpoint:
    """``model`` written as checkpoint ``version`` under ``root`` (atomically)."""
    return checkpoint.write(
        root, version, config, policy_tensors(model), generation_config=generation_config(config)
    )


def _batch(
    rows: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and lengths of ``rows`` (positions stay 0..len-1)."""
    lengths = torch.tensor([len(r) for r in rows])
    width = int(lengths.max())
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return ids, mask.long(), lengths


def token_logprobs(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    micro_batch: int = 64,
    pad_id: int = PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, mask)``, both ``[B, T]`` (T: the longest completion): the log
    probability of each completion token given its prompt and the tokens before it,
    under ``model`` at ``temperature`` (logits divided by it), 0 where ``mask`` is 0.
    Differentiable unless called under ``torch.no_grad()``."""
    if len(prompts) != len(completions):
        raise errors.field_error(
            "completions", len(completions), f"{len(prompts)} (one per prompt)"
        )
    if temperature <= 0:
        raise errors.field_error("temperature", temperature, "a number > 0")
    width = max((len(c) for c in completions), default=0)
    parts, masks = [], []
    for start in range(0, len(prompts), micro_batch):
        ps, cs = prompts[start : start + micro_batch], completions[start : start + micro_batch]
        rows = [list(p) + list(c) for p, c in zip(ps, cs, strict=True)]
        ids, attention, _ = _batch(rows, pad_id)
        logits = model(input_ids=ids, attention_mask=attention).logits.float() / temperature
        plen = torch.tensor([len(p) for p in ps])
        clen = torch.tensor([len(c) for c in cs])
        steps = torch.arange(width)
        # completion token j of row b sits at plen[b] + j; the logits before it predict it
        where = (plen[:, None] - 1 + steps[None, :]).clamp(max=ids.shape[1] - 1)
        picked = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1]))
        target = torch.full((len(ps), width), pad_id, dtype=torch.long)
        for i, c in enumerate(cs):
            target[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        logp = picked.gather(-1, target[..., None]).squeeze(-1) - picked.logsumexp(-1)
        mask = steps[None, :] < clen[:, None]
        parts.append(logp * mask)
        masks.append(mask)
    if not parts:
        return torch.zeros(0, width), torch.zeros(0, width, dtype=torch.bool)
    return torch.cat(parts), torch.cat(masks)


@torch.no_grad()
def sample(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    version: str = "",
    pad_id: int = PAD,
) -> list[list[Sample]]:
    """``n`` samples of each prompt from ``model`` in plain torch (no engine, no KV cache:
    every step reruns the whole sequences), each ending at end-of-sequence (``stop``,
    kept as the last token) or after ``max_tokens`` (``length``), with the logprob of
    every sampled token. The same arguments give the same samples."""
    if n < 1 or max_tokens < 1:
        raise errors.field_error("n, max_tokens", (n, max_tokens), "both >= 1")
    if temperature <= 0:
        raise errors.field_error("temperature", temperature, "a number > 0")
    eos = eos_id(model)
    rows = [list(p) for p in prompts for _ in range(n)]
    out: list[list[int]] = [[] for _ in rows]
    logps: list[list[float]] = [[] for _ in rows]
    done = [False] * len(rows)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.train(False)
    try:
        for _ in range(max_tokens):
            active = [i for i, d in enumerate(done) if not d]
            if not active:
                break
            ids, attention, lengths = _batch([rows[i] + out[i] for i in active], pad_id)
            logits = model(input_ids=ids, attention_mask=attention).logits
            last = logits[torch.arange(len(active)), lengths - 1].float() / temperature
            logp = torch.log_softmax(last, dim=-1)
            tokens = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            chosen = logp.gather(1, tokens[:, None]).squeeze(1)
            for i, tok, lp in zip(active, tokens.tolist(), chosen.tolist(), strict=True):
                out[i].append(tok)
                logps[i].append(lp)
                done[i] = tok == eos
    finally:
        model.train(was_training)
    samples = [
        Sample(
            tuple(rows[i]),
            tuple(out[i]),
            tuple(logps[i]),
            "stop" if out[i] and out[i][-1] == eos else "length",
            version,
        )
        for i in range(len(rows))
    ]
    return [samples[k * n : (k + 1) * n] for k in range(len(prompts))]

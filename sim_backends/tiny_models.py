"""Tiny random-weight models that real engines load on a CPU, built locally (no download).

- :func:`write_hf_llama`: a Llama checkpoint directory (``config.json``,
  ``generation_config.json``, ``model.safetensors``) for vLLM and SGLang, served with
  ``--skip-tokenizer-init`` (token ids in and out, no tokenizer files);
- :func:`write_gguf_llama`: a Llama GGUF for llama.cpp's ``llama-server`` whose vocabulary
  has only plain tokens (no byte-fallback tokens: a server holds those back from the
  stream until a UTF-8 character is complete).

The weights are drawn from a seeded generator, so the same arguments give the same bytes.
They are scaled so that greedy decoding wanders over the vocabulary instead of settling on
one token (what the migration and reshard tests need: a cut-off response continued
elsewhere must match token for token, which a constant output would not test), and the
end-of-sequence token's output row is zero, so greedy decoding all but never stops early
(tests also send ``ignore_eos``). Also ``python -m sim_backends.tiny_models``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    hidden: int = 256
    head_dim: int = 64  # vLLM's CPU attention takes 64
    kv_heads: int = 0  # 0: as many as query heads
    intermediate: int = 512
    vocab: int = 1024
    context: int = 4096

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads


EOS_HF = -1  # the last id
BOS, EOS_GGUF = 1, 2


def _tensors(shape: TinyShape, seed: int, std: float) -> dict[str, np.ndarray]:
    """Llama weights by their Hugging Face names (float32)."""
    rng = np.random.default_rng(seed)
    s = shape

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float32)

    out = {"model.embed_tokens.weight": mat(s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = np.ones(s.hidden, np.float32)
        out[p + "self_attn.q_proj.weight"] = mat(s.heads * s.head_dim, s.hidden)
        out[p + "self_attn.k_proj.weight"] = mat(s.kv * s.head_dim, s.hidden)
        out[p + "self_attn.v_proj.weight"] = mat(s.kv * s.head_dim, s.hidden)
        out[p + "self_attn.o_proj.weight"] = mat(s.hidden, s.heads * s.head_dim)
        out[p + "post_attention_layernorm.weight"] = np.ones(s.hidden, np.float32)
        out[p + "mlp.gate_proj.weight"] = mat(s.intermediate, s.hidden)
        out[p + "mlp.up_proj.weight"] = mat(s.intermediate, s.hidden)
        out[p + "mlp.down_proj.weight"] = mat(s.hidden, s.intermediate)
    out["model.norm.weight"] = np.ones(s.hidden, np.float32)
    out["lm_head.weight"] = mat(s.vocab, s.hidden)
    return out


def llama_config(shape: TinyShape | None = None, std: float = 0.2) -> dict[str, object]:
    """The Hugging Face ``config.json`` of the tiny Llama of ``shape``."""
    s = shape or TinyShape()
    eos = s.vocab - 1
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.context,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS,
        "eos_token_id": eos,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "initializer_range": std,
        "use_cache": True,
    }


def write_hf_llama(
    out: Path, shape: TinyShape | None = None, *, seed: int = 0, std: float = 0.2
) -> Path:
    """A Llama checkpoint directory; returns it."""
    from safetensors.numpy import save_file

    s = shape or TinyShape()
    out.mkdir(parents=True, exist_ok=True)
    eos = s.vocab - 1
    tensors = _tensors(s, seed, std)
    tensors["lm_head.weight"][eos] = 0.0
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = llama_config(s, std)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": BOS, "eos_token_id": eos, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def write_checkpoint(
    root: Path, version: str, shape: TinyShape | None = None, *, seed: int = 0, std: float = 0.2
) -> Path:
    """A versioned checkpoint of the tiny Llama under ``root`` (orchestrrl.checkpoint:
    ``root/VERSION-CHECKSUM16`` with its manifest), as a trainer publishes one; returns
    its directory. Another ``seed`` gives other weights (another checksum)."""
    from orchestrrl import checkpoint

    s = shape or TinyShape()
    tensors = _tensors(s, seed, std)
    eos = s.vocab - 1
    return checkpoint.write(
        root,
        version,
        llama_config(s, std),
        tensors,
        generation_config={"bos_token_id": BOS, "eos_token_id": eos, "pad_token_id": 0},
    ).path


def shape_of_size(nbytes: int, vocab: int = 1024, hidden: int = 256) -> TinyShape:
    """A tiny Llama of about ``nbytes`` of float32 weights (at least one layer)."""
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * 2 * hidden + 2 * hidden)
    fixed = 4 * (2 * vocab * hidden + hidden)
    return TinyShape(
        layers=max(1, round((nbytes - fixed) / per_layer)),
        hidden=hidden,
        intermediate=2 * hidden,
        vocab=vocab,
    )


def write_gguf_llama(
    out: Path, shape: TinyShape | None = None, *, seed: int = 0, std: float = 0.2
) -> Path:
    """A Llama GGUF file (float32); returns its path."""
    import gguf

    s = shape or TinyShape()
    out.parent.mkdir(parents=True, exist_ok=True)
    t = _tensors(s, seed, std)
    t["lm_head.weight"][EOS_GGUF] = 0.0
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("orchestrrl-tiny-llama")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s.vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # plain tokens only: 0 <unk>, 1 <s>, 2 </s>, then "t3", "t4", ...
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, s.vocab)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    kinds += [gguf.TokenType.NORMAL] * (s.vocab - 3)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, s.vocab)])
    w.add_token_types(kinds)
    w.add_unk_token_id(0)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS_GGUF)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(s.layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    for hf, array in t.items():
        w.add_tensor(names[hf], array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sim_backends.tiny_models",
        description="write a tiny random-weight Llama for a real engine on a CPU",
    )
    p.add_argument(
        "format",
        choices=["hf", "gguf"],
        help="hf: a directory (vLLM, SGLang); gguf: a file (llama.cpp)",
    )
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=TinyShape.layers, choices=range(1, 9))
    p.add_argument(
        "--hidden", type=int, default=TinyShape.hidden, choices=[64 * k for k in range(1, 33)]
    )
    p.add_argument(
        "--vocab", type=int, default=TinyShape.vocab, choices=range(16, 65537), metavar="N"
    )
    args = p.parse_args(argv)
    writer = write_hf_llama if args.format == "hf" else write_gguf_llama
    shape = TinyShape(args.layers, args.hidden, intermediate=2 * args.hidden, vocab=args.vocab)
    print(writer(args.out, shape, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

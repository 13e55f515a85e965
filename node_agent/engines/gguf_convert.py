"""A trainer's Hugging Face Llama checkpoint as a GGUF file for llama.cpp's ``llama-server``.

llama.cpp cannot load new weights into a running server, so a weight update on a
llama.cpp node is: convert the trainer's checkpoint (a directory of ``config.json`` and
``*.safetensors``, as ``save_pretrained`` writes it) to a GGUF, then restart the
instances on it (:meth:`node_agent.engines.http_engine.HttpEngine.use_model`).

What is converted, following llama.cpp's own ``convert_hf_to_gguf.py`` (``LlamaModel`` in
``conversion/llama.py``, the hyper-parameters in ``conversion/base.py``) for the Llama
family (``LlamaForCausalLM``):

- the tensors, renamed to GGUF's names (``blk.N.attn_q.weight``, ...). The query and key
  projections are permuted: Hugging Face's rotary embedding rotates the two halves of each
  head (``rotate_half``), GGML's Llama rope rotates adjacent pairs, so the rows of each
  head are interleaved (``LlamaModel.permute``; for the keys per key-value head);
- ``f32`` (every tensor float32: what an exact comparison of logprobs needs) or ``f16``
  (2-D weights float16, norms float32, as ``--outtype f16``). The source may be float32,
  float16 or bfloat16; a value that is not finite after the conversion (a NaN in the
  checkpoint, or a float16 overflow) is refused;
- the hyper-parameters (context, sizes, heads, key-value heads, head dimension, RMS-norm
  epsilon, rope base, rope scaling ``linear`` or ``llama3``; the latter as the
  ``rope_freqs`` tensor that llama.cpp's converter computes), from either spelling of
  ``config.json`` (``rope_theta``/``rope_scaling``, or ``rope_parameters`` as
  transformers 5 writes it); tied embeddings (no ``output.weight``: llama.cpp then uses
  the embedding matrix).

The vocabulary: the gateway never tokenizes (token ids in, token ids out), so the GGUF
carries a token-id vocabulary: one plain piece per id (``t42``), with the checkpoint's
begin/end/padding ids as control tokens (the end-of-sequence id, and a second and third
from a list of them as end-of-turn and end-of-message, stop generation). Plain pieces
matter: ``llama-server`` holds a token back from a stream while the text so far ends in an
incomplete UTF-8 character, and a byte-level vocabulary would make it skip ids. The file
cannot tokenize text; a client that sends text must tokenize it itself.

The file is written next to its final name and renamed into place when complete, so a
server never sees a half-written file. Bad checkpoints (a missing or truncated file, a
tensor missing or of the wrong shape or type, an unsupported architecture) are refused
with :class:`CheckpointError` naming the file and the problem, and nothing is written.

Also ``python -m node_agent.engines.gguf_convert CHECKPOINT OUT.gguf [--dtype f16]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from node_agent.engines.checkpoint import (
    SOURCE_DTYPES,
    CheckpointError,
    SourceTensor,
    tensor_table,
)
from orchestrrl import errors

OutType = Literal["f32", "f16"]
OUT_TYPES: tuple[OutType, ...] = ("f32", "f16")
ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters of a Llama checkpoint (its ``config.json``)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    context: int
    rms_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any]  # {} when none
    tied: bool
    bos: int | None
    eos: tuple[int, ...]
    pad: int | None

    @classmethod
    def read(cls, path: Path) -> LlamaConfig:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (a checkpoint needs its config.json)") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        archs = doc.get("architectures") or []
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{path}: architectures={errors.shown(archs)} is not supported: this "
                f"converter writes the Llama family ({', '.join(ARCHITECTURES)})"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if doc.get(flag):
                raise CheckpointError(f"{path}: {flag}=true is not supported by this converter")

        def integer(key: str, default: int | None = None) -> int:
            value = doc.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(
                    f"{path}: {key}={errors.shown(value)} is not valid: a positive integer"
                )
            return value

        def number(value: object, key: str) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CheckpointError(f"{path}: {key}={errors.shown(value)} is not a number")
            if not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"{path}: {key}={value!r} is not a positive number")
            return float(value)

        def token(key: str) -> int | None:
            value = doc.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"{path}: {key}={errors.shown(value)} is not a token id")
            return value

        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        kv_heads = integer("num_key_value_heads", heads)
        head_dim = doc.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(
                f"{path}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise CheckpointError(f"{path}: head_dim={errors.shown(head_dim)} is not an even size")
        # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling
        params = doc.get("rope_parameters")
        if params is not None and not isinstance(params, dict):
            raise CheckpointError(
                f"{path}: rope_parameters={errors.shown(params)} is not an object"
            )
        params = dict(params or {})
        theta = number(params.get("rope_theta", doc.get("rope_theta", 10000.0)), "rope_theta")
        scaling = dict(doc.get("rope_scaling") or {})
        if params.get("rope_type") not in (None, "default"):
            scaling = params
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = {}
        elif kind not in ("linear", "llama3"):
            raise CheckpointError(
                f"{path}: rope scaling {errors.shown(kind)} is not supported: "
                "none, 'linear' or 'llama3'"
            )
        eos_value = doc.get("eos_token_id")
        eos_list = eos_value if isinstance(eos_value, list) else [eos_value]
        eos = tuple(t for t in eos_list if t is not None)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise CheckpointError(f"{path}: eos_token_id={errors.shown(eos_value)} is not valid")
        cfg = cls(
            vocab=integer("vocab_size"),
            hidden=hidden,
            layers=integer("num_hidden_layers"),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=integer("intermediate_size"),
            context=integer("max_position_embeddings", 4096),
            rms_eps=number(doc.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            tied=bool(doc.get("tie_word_embeddings", False)),
            bos=token("bos_token_id"),
            eos=eos,
            pad=token("pad_token_id"),
        )
        for name, tid in (("bos_token_id", cfg.bos), ("pad_token_id", cfg.pad)):
            if tid is not None and not 0 <= tid < cfg.vocab:
                raise CheckpointError(f"{path}: {name}={tid} is outside the vocabulary")
        if any(not 0 <= t < cfg.vocab for t in cfg.eos):
            raise CheckpointError(f"{path}: eos_token_id={eos_value!r} is outside the vocabulary")
        return cfg

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The Hugging Face tensors a checkpoint of this config has, with their shapes."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.up_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.down_proj.weight"] = (h, self.intermediate)
        out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        return out


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
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
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, rest = hf.partition("model.layers.")
    block, _, leaf = rest.partition(".")
    return f"blk.{block}.{GGUF_LAYER_NAMES[leaf]}"


def permute(w: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """Hugging Face's rotate-half row order of a query/key projection to GGML's adjacent
    pairs (llama.cpp ``LlamaModel.permute``): within each head, rows ``[a0..a(d/2-1),
    b0..b(d/2-1)]`` become ``[a0, b0, a1, b1, ...]``."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load(t: SourceTensor, mm: np.memmap[Any, Any]) -> np.ndarray[Any, Any]:
    """The tensor as float32 (bfloat16 widened: its bits are a float32's upper half)."""
    raw = mm[t.begin : t.end].view(SOURCE_DTYPES[t.dtype]).reshape(t.shape)
    if t.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


# -- writing GGUF -------------------------------------------------------------------------


def llama3_rope_factors(cfg: LlamaConfig) -> np.ndarray[Any, Any]:
    """The ``rope_freqs`` tensor of llama3 rope scaling (``LlamaModel.generate_extra_tensors``)."""
    s = cfg.rope_scaling
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(s.get("factor", 8.0))
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def vocabulary(cfg: LlamaConfig) -> tuple[list[str], list[int]]:
    """A token-id vocabulary: control pieces for the special ids, ``t<id>`` for the rest."""
    import gguf

    pieces = [f"t{i}" for i in range(cfg.vocab)]
    kinds = [int(gguf.TokenType.NORMAL)] * cfg.vocab
    specials: list[tuple[int | None, str]] = [(cfg.pad, "<pad>"), (cfg.bos, "<s>")]
    specials += [(t, "</s>" if i == 0 else f"<eos{i}>") for i, t in enumerate(cfg.eos)]
    for tid, piece in specials:  # later entries win: eos over bos over pad
        if tid is not None:
            pieces[tid] = piece
            kinds[tid] = int(gguf.TokenType.CONTROL)
    return pieces, kinds


def convert(checkpoint: Path, out: Path, *, dtype: OutType = "f32") -> Path:
    """Write the GGUF of a Hugging Face Llama checkpoint directory to ``out``; returns it.
    CheckpointError (nothing written) when the checkpoint is not convertible."""
    import gguf

    if dtype not in OUT_TYPES:
        raise errors.field_error("dtype", dtype, "f32 or f16")
    checkpoint = Path(checkpoint)
    cfg = LlamaConfig.read(checkpoint / "config.json")
    found = tensor_table(checkpoint)
    expected = cfg.shapes()
    problems = errors.Problems()
    for name, shape in expected.items():
        t = found.get(name)
        if t is None:
            problems.add(f"tensor {name!r} is missing")
        elif t.shape != shape:
            problems.add(
                f"tensor {name!r} has shape {list(t.shape)}, the config needs {list(shape)}"
            )
        elif t.dtype not in SOURCE_DTYPES:
            problems.add(
                f"tensor {name!r} is {t.dtype}: the converter reads {', '.join(SOURCE_DTYPES)}"
            )
    extra = [
        n
        for n in found
        if n not in expected
        and not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tied and n == "lm_head.weight")
    ]
    problems.extend(f"tensor {n!r} is not part of a Llama model" for n in extra)
    if problems:
        raise CheckpointError(
            f"{checkpoint}: not a checkpoint of its config.json: {problems.text()}"
        )

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own: several processes may convert the same checkpoint at once
    partial = out.with_name(f"{out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    w = gguf.GGUFWriter(str(partial), "llama")
    try:
        write_metadata(w, cfg, checkpoint.name, dtype)
        plan = list(tensor_plan(cfg, dtype))
        for name, _, shape, np_dtype in plan:
            nbytes = math.prod(shape) * np.dtype(np_dtype).itemsize
            w.add_tensor_info(name, shape, np.dtype(np_dtype), nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        maps: dict[Path, np.memmap[Any, Any]] = {}
        for name, array in tensor_data(cfg, plan, found, maps):
            if not np.isfinite(array).all():
                raise CheckpointError(
                    f"{checkpoint}: tensor for {name!r} has values that are not finite "
                    f"as {dtype} (NaN or infinity in the checkpoint, or beyond float16's range)"
                )
            w.write_tensor_data(array)
        w.close()
        with partial.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, out)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    return out


def write_metadata(w: Any, cfg: LlamaConfig, name: str, dtype: OutType) -> None:
    import gguf

    w.add_name(name)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.hidden)
    w.add_block_count(cfg.layers)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden // cfg.heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    pieces, kinds = vocabulary(cfg)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * cfg.vocab)
    w.add_token_types(kinds)
    if cfg.bos is not None:
        w.add_bos_token_id(cfg.bos)
    if cfg.pad is not None:
        w.add_pad_token_id(cfg.pad)
    for i, tid in enumerate(cfg.eos[:3]):
        (w.add_eos_token_id, w.add_eot_token_id, w.add_eom_token_id)[i](tid)
    # token ids in, as given: no begin-of-sequence token is prepended to a prompt
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


Plan = tuple[str, str | None, tuple[int, ...], str]  # gguf name, source, shape, numpy dtype


def tensor_plan(cfg: LlamaConfig, dtype: OutType) -> Iterator[Plan]:
    """The GGUF tensors in file order: (name, source tensor or None, shape, numpy dtype)."""
    if cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "llama3":
        yield "rope_freqs.weight", None, (cfg.head_dim // 2,), "<f4"
    for hf, shape in cfg.shapes().items():
        wide = len(shape) <= 1 or dtype == "f32"  # norms stay float32, as llama.cpp wants
        yield gguf_name(hf), hf, shape, "<f4" if wide else "<f2"


def tensor_data(
    cfg: LlamaConfig,
    plan: Sequence[Plan],
    found: Mapping[str, SourceTensor],
    maps: dict[Path, np.memmap[Any, Any]],
) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    for name, hf, _, np_dtype in plan:
        if hf is None:
            yield name, llama3_rope_factors(cfg)
            continue
        t = found[hf]
        if t.file not in maps:
            maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        array = load(t, maps[t.file])
        if hf.endswith("q_proj.weight"):
            array = permute(array, cfg.heads)
        elif hf.endswith("k_proj.weight"):
            array = permute(array, cfg.kv_heads)
        yield name, np.ascontiguousarray(array.astype(np_dtype))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m node_agent.engines.gguf_convert",
        description="convert a Hugging Face Llama checkpoint directory to a GGUF for llama.cpp",
    )
    p.add_argument("checkpoint", type=Path, help="directory with config.json and *.safetensors")
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--dtype", choices=OUT_TYPES, default="f32")
    args = p.parse_args(argv)
    try:
        print(convert(args.checkpoint, args.out, dtype=args.dtype))
    except errors.OrlError as exc:
        p.exit(2, f"error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

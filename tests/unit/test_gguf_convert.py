"""The Hugging Face -> GGUF converter and the checkpoint checks, without an engine.

That the GGUF computes what the checkpoint computes is checked against a real
``llama-server`` in tests/engines/test_weights.py; here: the query/key permutation turns
Hugging Face's rotary embedding into GGML's, tensors are written as the plan says, and
every broken checkpoint is refused naming the file, with nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.engines import gguf_convert
from node_agent.engines.checkpoint import CheckpointError, check_layout, tensor_table
from node_agent.engines.gguf_convert import LlamaConfig, convert, permute
from sim_backends.tiny_models import TinyShape, write_hf_llama

pytestmark = pytest.mark.unit

SHAPE = TinyShape(layers=1, hidden=128, head_dim=32, kv_heads=2, intermediate=64, vocab=64)


def rope_hf(x: np.ndarray, pos: int, base: float = 10000.0) -> np.ndarray:
    """Hugging Face's rotary embedding of one head: rotate the two halves (rotate_half)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[: d // 2], x[d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin])


def rope_ggml(x: np.ndarray, pos: int, base: float = 10000.0) -> np.ndarray:
    """GGML's Llama rope (LLAMA_ROPE_TYPE_NORM): rotate adjacent pairs."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * cos - b * sin, a * sin + b * cos
    return out


@settings(max_examples=25)
@given(
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4, 8, 16]),
    qpos=st.integers(0, 500),
    kpos=st.integers(0, 500),
    seed=st.integers(0, 2**31),
)
def test_permuted_projections_give_the_same_attention_scores_under_ggml_rope(
    heads: int, head_dim: int, qpos: int, kpos: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    wq = rng.standard_normal((heads * head_dim, 8))
    wk = rng.standard_normal((heads * head_dim, 8))
    x, y = rng.standard_normal(8), rng.standard_normal(8)
    pq, pk = permute(wq, heads), permute(wk, heads)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        hf = rope_hf(wq[rows] @ x, qpos) @ rope_hf(wk[rows] @ y, kpos)
        gg = rope_ggml(pq[rows] @ x, qpos) @ rope_ggml(pk[rows] @ y, kpos)
        assert math.isclose(hf, gg, rel_tol=1e-9, abs_tol=1e-9)


def test_permute_interleaves_the_halves_of_each_head() -> None:
    w = np.arange(8)[:, None].repeat(3, axis=1)  # 2 heads of 4 rows
    assert permute(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def read(path: Path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(str(path))
    return {t.name: np.array(t.data) for t in r.tensors}


def test_a_checkpoint_converts_tensor_for_tensor(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    ckpt = write_hf_llama(tmp_path / "ckpt", SHAPE, seed=3)
    src = load_file(str(ckpt / "model.safetensors"))
    out = convert(ckpt, tmp_path / "m.gguf")
    got = read(out)
    assert got["token_embd.weight"].tolist() == src["model.embed_tokens.weight"].tolist()
    assert np.array_equal(
        got["blk.0.attn_q.weight"], permute(src["model.layers.0.self_attn.q_proj.weight"], 4)
    )
    assert np.array_equal(
        got["blk.0.attn_k.weight"], permute(src["model.layers.0.self_attn.k_proj.weight"], 2)
    )
    assert np.array_equal(got["blk.0.attn_v.weight"], src["model.layers.0.self_attn.v_proj.weight"])
    assert np.array_equal(got["output.weight"], src["lm_head.weight"])
    assert len(got) == 2 + 9 + 1  # embeddings, output, 9 per layer, final norm
    fields = gguf.GGUFReader(str(out)).fields
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == 2
    assert int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == SHAPE.vocab - 1
    assert not list(tmp_path.glob("*.partial"))


def test_f16_keeps_norms_in_f32(tmp_path: Path) -> None:
    ckpt = write_hf_llama(tmp_path / "ckpt", SHAPE, seed=3)
    types = {
        t.name: t.tensor_type
        for t in gguf.GGUFReader(str(convert(ckpt, tmp_path / "h.gguf", dtype="f16"))).tensors
    }
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16


def test_bfloat16_checkpoints_are_widened_exactly(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = write_hf_llama(tmp_path / "ckpt", SHAPE, seed=3)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(ckpt / "model.safetensors").items()}
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    got = read(convert(ckpt, tmp_path / "b.gguf"))
    want = tensors["model.layers.0.mlp.up_proj.weight"].float().numpy()
    assert np.array_equal(got["blk.0.ffn_up.weight"], want)


def test_transformers5_config_and_tied_embeddings(tmp_path: Path) -> None:
    ckpt = write_hf_llama(tmp_path / "ckpt", SHAPE, seed=3)
    config = json.loads((ckpt / "config.json").read_text())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    config["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    cfg = LlamaConfig.read(ckpt / "config.json")
    assert cfg.rope_theta == 500000.0 and cfg.tied and "lm_head.weight" not in cfg.shapes()
    got = read(convert(ckpt, tmp_path / "t.gguf"))  # lm_head.weight is left out
    assert "output.weight" not in got


def broken(tmp_path: Path, how: str) -> Path:
    ckpt = write_hf_llama(tmp_path / "ckpt", SHAPE, seed=3)
    st_file = ckpt / "model.safetensors"
    if how == "truncated":
        data = st_file.read_bytes()
        st_file.write_bytes(data[: len(data) - 100])
    elif how == "no config":
        (ckpt / "config.json").unlink()
    elif how == "not llama":
        config = json.loads((ckpt / "config.json").read_text())
        config["architectures"] = ["GPT2LMHeadModel"]
        (ckpt / "config.json").write_text(json.dumps(config))
    elif how == "wrong shape":
        config = json.loads((ckpt / "config.json").read_text())
        config["intermediate_size"] = 96
        (ckpt / "config.json").write_text(json.dumps(config))
    elif how == "nan":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(st_file))
        tensors["model.norm.weight"][3] = np.nan
        save_file(tensors, str(st_file))
    elif how == "not safetensors":
        st_file.write_bytes(b"\xff" * 64)
    return ckpt


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("truncated", "truncated: tensor"),
        ("no config", "config.json: missing"),
        ("not llama", "architectures=['GPT2LMHeadModel'] is not supported"),
        ("wrong shape", "the config needs [96, 128]"),
        ("nan", "not finite"),
        ("not safetensors", "truncated or not a safetensors file"),
    ],
)
def test_a_broken_checkpoint_is_refused_and_nothing_is_written(
    tmp_path: Path, how: str, says: str
) -> None:
    ckpt = broken(tmp_path, how)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(CheckpointError, match=re.escape(says)) as exc:
        convert(ckpt, out)
    assert str(ckpt) in str(exc.value)
    assert not out.exists() and not list(tmp_path.rglob("*.partial"))


def test_the_layout_check_finds_another_model_and_a_truncated_file(tmp_path: Path) -> None:
    a = write_hf_llama(tmp_path / "a", SHAPE, seed=1)
    b = write_hf_llama(tmp_path / "b", SHAPE, seed=2)
    check_layout(a, b)  # other values, same layout
    c = write_hf_llama(tmp_path / "c", dataclasses.replace(SHAPE, layers=2))
    with pytest.raises(CheckpointError, match="is not in the served model") as exc:
        check_layout(a, c)
    assert "'model.layers.1." in str(exc.value) and "and 4 more" in str(exc.value)
    data = (b / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        check_layout(a, b)
    with pytest.raises(CheckpointError, match="missing"):
        tensor_table(tmp_path / "nowhere")


def test_the_command_line_reports_a_bad_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        gguf_convert.main([str(tmp_path / "nowhere"), str(tmp_path / "x.gguf")])
    assert exc.value.code == 2
    assert "config.json: missing" in capsys.readouterr().err


def test_the_served_gguf_layout_check(tmp_path: Path) -> None:
    from node_agent.engines.llamacpp import check_gguf_layout

    a = convert(write_hf_llama(tmp_path / "a", SHAPE, seed=1), tmp_path / "a.gguf")
    b = convert(write_hf_llama(tmp_path / "b", SHAPE, seed=2), tmp_path / "b.gguf")
    wide = dataclasses.replace(SHAPE, intermediate=96)
    c = convert(write_hf_llama(tmp_path / "c", wide, seed=3), tmp_path / "c.gguf")
    check_gguf_layout(a, b)
    check_gguf_layout(tmp_path / "not-started.gguf", c)  # nothing served yet
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight' has shape \[128, 96\]"):
        check_gguf_layout(a, c)
    (tmp_path / "d.gguf").write_bytes(b"GGUF broken")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        check_gguf_layout(a, tmp_path / "d.gguf")

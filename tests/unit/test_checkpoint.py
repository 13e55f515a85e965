"""Versioned checkpoints: written atomically, named by version and checksum, and every way
of being missing, truncated, corrupt or of the wrong model named by file and problem."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import checkpoint as ck
from orchestrrl import errors
from sim_backends.tiny_models import TinyShape, _tensors, write_hf_llama

pytestmark = pytest.mark.unit

SHAPE = TinyShape(layers=1, hidden=64, intermediate=128, vocab=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    src = write_hf_llama(tmp_path_factory.mktemp("src"), SHAPE, seed=3)
    config = json.loads((src / "config.json").read_text())
    return config, _tensors(SHAPE, 3, 0.2)


def write(
    root: Path, model: tuple[dict[str, Any], dict[str, np.ndarray]], v: str = "0"
) -> ck.Checkpoint:
    config, tensors = model
    return ck.write(root, v, config, tensors, generation_config={"eos_token_id": 31})


def problem(path: Path, **kw: Any) -> str:
    with pytest.raises(ck.CheckpointError) as e:
        ck.verify(path, **kw)
    return str(e.value)


# -- writing -------------------------------------------------------------------------


def test_a_written_checkpoint_verifies_and_is_named_by_version_and_checksum(
    tmp_path: Path, model: Any
) -> None:
    c = write(tmp_path, model, "7")
    assert c.path == tmp_path / f"7-{c.checksum[:16]}"
    assert sorted(os.listdir(c.path)) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
    ]
    assert ck.verify(c.path, model[0], dtype="F32") == c
    m = json.loads((c.path / "manifest.json").read_text())
    assert m["format"] == "orchestrrl-checkpoint/1"
    assert m["version"] == "7"
    assert {f["name"] for f in m["files"]} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    sizes = {f["name"]: f["size"] for f in m["files"]}
    assert sizes["model.safetensors"] == (c.path / "model.safetensors").stat().st_size
    shapes = {t["name"]: t["shape"] for t in m["tensors"]}
    assert shapes["lm_head.weight"] == [32, 64]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [64, 64]
    assert all(t["dtype"] == "F32" for t in m["tensors"])
    assert [p.name for p in tmp_path.iterdir()] == [c.path.name]  # no temporary left


def test_the_same_weights_give_the_same_checkpoint_and_other_weights_another(
    tmp_path: Path, model: Any
) -> None:
    a = write(tmp_path / "a", model)
    b = write(tmp_path / "b", model)
    assert (a.checksum, a.path.name) == (b.checksum, b.path.name)
    again = write(tmp_path / "a", model)
    assert again == a and len(os.listdir(tmp_path / "a")) == 1
    config, tensors = model
    changed = dict(tensors)
    changed["model.norm.weight"] = tensors["model.norm.weight"] * 2
    c = ck.write(tmp_path / "a", "0", config, changed)
    assert c.checksum != a.checksum
    assert ck.find(tmp_path / "a", "0") == [a.path, c.path]


def test_torch_tensors_are_written_like_numpy_arrays(tmp_path: Path, model: Any) -> None:
    import torch

    config, tensors = model
    from_torch = ck.write(
        tmp_path, "0", config, {k: torch.from_numpy(v) for k, v in tensors.items()}
    )
    from_numpy = ck.write(tmp_path / "np", "0", config, tensors)
    assert from_torch.checksum == from_numpy.checksum


def test_writing_tensors_that_do_not_fit_the_config_leaves_nothing(
    tmp_path: Path, model: Any
) -> None:
    config, tensors = model
    wrong = dict(tensors)
    del wrong["lm_head.weight"]
    wrong["model.norm.weight"] = np.ones(63, np.float32)
    with pytest.raises(ck.CheckpointError) as e:
        ck.write(tmp_path, "1", config, wrong)
    assert "model.safetensors: tensor lm_head.weight is missing" in str(e.value)
    assert "tensor model.norm.weight has shape [63], expected [64]" in str(e.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(errors.InvalidArgument, match=r"version='\.\./x' is not valid"):
        ck.write(tmp_path, "../x", config, tensors)


def test_a_corrupt_checkpoint_of_the_same_name_is_replaced(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    (c.path / "model.safetensors").write_bytes(b"junk")
    again = write(tmp_path, model)
    assert again.path == c.path
    assert ck.verify(c.path) == again
    assert [p.name for p in tmp_path.iterdir()] == [c.path.name]


def test_find_lists_checkpoints_not_temporaries(tmp_path: Path, model: Any) -> None:
    a = write(tmp_path, model, "1")
    (tmp_path / ".tmp-2-123-abcd").mkdir()
    (tmp_path / "notes").mkdir()
    assert ck.find(tmp_path) == [a.path]
    assert ck.find(tmp_path, "2") == []
    assert ck.find(tmp_path / "none") == []


# -- verifying: each way of being wrong, named ----------------------------------------


def test_missing_checkpoint_and_missing_manifest(tmp_path: Path, model: Any) -> None:
    assert "not a directory (no such checkpoint)" in problem(tmp_path / "nope")
    c = write(tmp_path, model)
    (c.path / "manifest.json").unlink()
    assert problem(c.path) == f"checkpoint {c.path}: manifest.json: missing"


def test_a_missing_file_is_named(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    (c.path / "config.json").unlink()
    assert problem(c.path) == f"checkpoint {c.path}: config.json: missing"


def test_a_truncated_or_extended_file_is_named_with_its_sizes(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    weights = c.path / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 100)
    assert problem(c.path) == (
        f"checkpoint {c.path}: model.safetensors: {size - 100} bytes, "
        f"the manifest says {size} (truncated)"
    )
    with weights.open("ab") as f:
        f.write(b"\0" * 200)
    assert f"{size + 100} bytes, the manifest says {size} (too long)" in problem(c.path)


def test_a_changed_byte_fails_the_checksum(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    weights = c.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40
    weights.write_bytes(bytes(data))
    assert problem(c.path) == (
        f"checkpoint {c.path}: model.safetensors: SHA-256 differs from the manifest's (corrupt)"
    )
    # without hashing, a same-size change goes unseen (sizes and headers are still read)
    assert ck.verify(c.path, hash_files=False).version == "0"


def test_unlisted_files_and_a_renamed_directory_are_refused(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    (c.path / "extra.safetensors").write_bytes(b"x")
    assert "files not in the manifest: ['extra.safetensors']" in problem(c.path)
    (c.path / "extra.safetensors").unlink()
    renamed = c.path.rename(tmp_path / "9-0123456789abcdef")
    assert "directory name '9-0123456789abcdef' does not match the manifest" in problem(renamed)
    plain = renamed.rename(tmp_path / "fetched")  # a name of another form is not checked
    assert ck.verify(plain).version == "0"


def test_a_tampered_manifest_is_refused(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    mpath = c.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["files"][0]["size"] += 1
    mpath.write_text(json.dumps(doc))
    text = problem(c.path)
    assert "config.json: " in text and "(too long)" not in text and "(truncated)" in text
    assert "manifest.json: checksum does not match its file list" in text
    mpath.write_text("{not json")
    assert "manifest.json: not JSON" in problem(c.path)


def test_manifest_fields_are_each_named(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    mpath = c.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["format"] = "other/9"
    doc["version"] = "../../etc"
    doc["files"][0]["sha256"] = "XYZ"
    doc["tensors"][0]["dtype"] = "F31"
    doc["surprise"] = 1
    mpath.write_text(json.dumps(doc))
    text = problem(c.path)
    for expected in (
        "manifest.json: format='other/9' is not valid",
        "manifest.json: version='../../etc' is not valid",
        "manifest.json: files[0].sha256='XYZ' is not valid",
        "manifest.json: tensors[0].dtype='F31' is not valid",
    ):
        assert expected in text
    assert "and 1 more" in text  # the unknown field, counted past the first five


def test_a_huge_bad_manifest_gives_a_bounded_message(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    mpath = c.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["tensors"] = [{"name": "x" * 200, "dtype": "?", "shape": [-1]}] * 20_000
    mpath.write_text(json.dumps(doc))
    text = problem(c.path)
    assert len(text.encode()) <= errors.MAX_MESSAGE_BYTES
    assert "and 19995 more" in text
    mpath.write_bytes(b" " * (ck.MAX_MANIFEST_BYTES + 1))
    assert problem(c.path).endswith("manifest.json: larger than 8388608 bytes")


def test_the_wrong_model_is_named_by_field_and_tensor(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    config = model[0]
    text = problem(c.path, expected_config=dict(config, hidden_size=128, num_hidden_layers=2))
    assert "config.json: hidden_size=64, expected 128" in text
    assert "config.json: num_hidden_layers=1, expected 2" in text
    small = dict(config, vocab_size=16)
    text = problem(c.path, expected_config=small)
    assert (
        "model.safetensors: tensor model.embed_tokens.weight has shape [32, 64], expected [16, 64]"
        in text
    )
    assert "has dtype F32, expected BF16" in problem(c.path, dtype="BF16")


def test_weights_of_another_shape_than_their_own_config_are_refused(
    tmp_path: Path, model: Any
) -> None:
    config = model[0]
    c = write(tmp_path, model)
    # the checkpoint's own config says something the weights are not
    doc = dict(config, intermediate_size=96)
    (c.path / "config.json").write_text(json.dumps(doc))
    entries = [
        ck.FileEntry(n, (c.path / n).stat().st_size, ck._sha256_file(c.path / n))
        for n in ("config.json", "generation_config.json", "model.safetensors")
    ]
    m = ck.build_manifest("0", entries, c.manifest.tensors)
    (c.path / "manifest.json").write_text(ck.manifest_json(m))
    moved = c.path.rename(tmp_path / m.dirname)
    text = problem(moved)
    assert (
        "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64], expected [96, 64]" in text
    )


def test_a_broken_safetensors_header_is_named(tmp_path: Path, model: Any) -> None:
    c = write(tmp_path, model)
    weights = c.path / "model.safetensors"
    data = weights.read_bytes()
    bad = struct.pack("<Q", 10**12) + data[8:]
    weights.write_bytes(bad)
    entries = [
        ck.FileEntry(n, (c.path / n).stat().st_size, ck._sha256_file(c.path / n))
        for n in ("config.json", "generation_config.json", "model.safetensors")
    ]
    m = ck.build_manifest("0", entries, c.manifest.tensors)
    (c.path / "manifest.json").write_text(ck.manifest_json(m))
    moved = c.path.rename(tmp_path / m.dirname)
    assert "model.safetensors: header length 1000000000000 exceeds" in problem(moved)


# -- the pure parts -------------------------------------------------------------------


def header(entries: dict[str, Any]) -> bytes:
    return json.dumps(entries).encode()


def test_safetensors_headers_must_tile_the_data_exactly() -> None:
    t = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    u = {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}
    table = ck.parse_safetensors_header(header({"b": t, "a": u, "__metadata__": {}}), 24)
    assert table == (ck.TensorEntry("a", "BF16", (4,)), ck.TensorEntry("b", "F32", (2, 2)))
    cases = {
        "needs 16": ({"b": dict(t, data_offsets=[0, 12])}, 12),
        "expected 0": ({"b": dict(t, data_offsets=[4, 20])}, 20),
        "the file has 30": ({"b": t, "a": u}, 30),
        "expected 16": ({"b": t, "a": dict(u, data_offsets=[8, 16])}, 24),
        "unknown dtype": ({"b": dict(t, dtype="F33")}, 16),
        "bad shape": ({"b": dict(t, shape=[-2, -8])}, 16),
        "bad data_offsets": ({"b": dict(t, data_offsets=[16, 0])}, 16),
        "not {dtype, shape, data_offsets}": ({"b": {"dtype": "F32"}}, 16),
    }
    for expected, (doc, size) in cases.items():
        with pytest.raises(ValueError, match=expected.replace("{", r"\{").replace("}", r"\}")):
            ck.parse_safetensors_header(header(doc), size)
    with pytest.raises(ValueError, match="not JSON"):
        ck.parse_safetensors_header(b"\xff{", 0)
    with pytest.raises(ValueError, match="shorter than the 8-byte"):
        ck.header_length(b"\x01")


def test_the_tensor_table_of_a_llama_config_is_what_the_tiny_models_write() -> None:
    config = json.loads(json.dumps({**_config(SHAPE)}))
    arch = ck.LlamaArch.from_config(config)
    assert arch.tensor_shapes() == {k: v.shape for k, v in _tensors(SHAPE, 0, 0.2).items()}
    gqa = ck.LlamaArch.from_config(
        dict(config, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    )
    assert gqa.tensor_shapes()["model.layers.0.self_attn.k_proj.weight"] == (32, 64)
    biased = ck.LlamaArch.from_config(dict(config, attention_bias=True, mlp_bias=True))
    assert biased.tensor_shapes()["model.layers.0.self_attn.o_proj.bias"] == (64,)
    assert biased.tensor_shapes()["model.layers.0.mlp.up_proj.bias"] == (128,)
    tied = ck.LlamaArch.from_config(dict(config, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied.tensor_shapes()
    v5 = dict(config, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    del v5["rope_theta"]
    assert ck.LlamaArch.from_config(v5).rope_theta == 5e5


def _config(shape: TinyShape) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = write_hf_llama(Path(d), shape)
        return dict(json.loads((out / "config.json").read_text()))


def test_a_bad_config_is_named_field_by_field() -> None:
    config = _config(SHAPE)
    bad = dict(
        config,
        model_type="gpt2",
        hidden_size=0,
        num_key_value_heads=3,
        tie_word_embeddings="yes",
        rms_norm_eps=-1,
    )
    with pytest.raises(errors.InvalidArgument) as e:
        ck.LlamaArch.from_config(bad)
    text = str(e.value)
    for expected in (
        "config.json: model_type='gpt2' is not valid: 'llama'",
        "config.json: hidden_size=0 is not valid",
        "config.json: num_key_value_heads=3 is not valid: a divisor of num_attention_heads=1",
        "config.json: tie_word_embeddings='yes' is not valid",
        "config.json: rms_norm_eps=-1 is not valid",
    ):
        assert expected in text


versions = st.from_regex(ck.VERSION_PATTERN, fullmatch=True)
digests = st.text("0123456789abcdef", min_size=64, max_size=64)


@settings(max_examples=50)
@given(versions, digests)
def test_directory_names_parse_back(version: str, checksum: str) -> None:
    assert ck.parse_dirname(ck.dirname(version, checksum)) == (version, checksum[:16])


@settings(max_examples=50)
@given(
    versions,
    st.lists(
        st.tuples(st.sampled_from(ck.ALLOWED_FILES), st.integers(0, 2**40), digests),
        min_size=1,
        max_size=3,
        unique_by=lambda e: e[0],
    ),
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=20),
            st.sampled_from(sorted(ck.DTYPE_BYTES)),
            st.lists(st.integers(0, 4096), max_size=4),
        ),
        min_size=1,
        max_size=5,
        unique_by=lambda e: e[0],
    ),
)
def test_manifests_round_trip_and_their_checksum_ignores_order(
    version: str, files: list[tuple[str, int, str]], tensors: list[tuple[str, str, list[int]]]
) -> None:
    entries = [ck.FileEntry(*f) for f in files]
    if {"config.json", "model.safetensors"} - {f.name for f in entries}:
        entries += [
            ck.FileEntry(n, 1, "0" * 64)
            for n in ("config.json", "model.safetensors")
            if n not in {f.name for f in entries}
        ]
    m = ck.build_manifest(version, entries, [ck.TensorEntry(n, d, tuple(s)) for n, d, s in tensors])
    assert ck.parse_manifest(ck.manifest_json(m)) == m
    assert ck.checksum_of(reversed(entries)) == m.checksum
    changed = [ck.FileEntry(entries[0].name, entries[0].size + 1, entries[0].sha256), *entries[1:]]
    assert ck.checksum_of(changed) != m.checksum


@given(st.text(max_size=80))
def test_version_labels_are_safe_directory_names(label: str) -> None:
    ok = ck.VERSION_PATTERN.fullmatch(label) is not None
    if not ok:
        with pytest.raises(errors.InvalidArgument, match="version="):
            ck.check_version(label)
    else:
        assert ck.check_version(label) == label
        assert "/" not in label and "\0" not in label and not label.startswith((".", "-"))
        assert 1 <= len(label) <= 64

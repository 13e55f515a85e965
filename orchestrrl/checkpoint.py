"""Versioned model checkpoints: one directory per weight version, verified before use.

A checkpoint is a Hugging Face Llama directory (``config.json``, ``model.safetensors``,
optionally ``generation_config.json``: what vLLM and SGLang load, and what a converter
turns into a GGUF for llama.cpp) plus ``manifest.json``::

    {"format": "orchestrrl-checkpoint/1", "model_format": "hf-llama-safetensors",
     "version": "3", "checksum": "<sha256 hex>",
     "files": [{"name": "config.json", "size": 712, "sha256": "..."}, ...],
     "tensors": [{"name": "lm_head.weight", "dtype": "F32", "shape": [1024, 256]}, ...]}

It is named by version and checksum (DESIGN.md): the directory is ``VERSION-CHECKSUM16``,
the first 16 hex digits of ``checksum``, which is the SHA-256 of the canonical JSON of the
``files`` list (so of every byte of the checkpoint). The same weights give the same bytes,
the same checksum and the same name.

:func:`write` builds a checkpoint in a temporary directory beside its destination and
renames it into place, so a reader sees a whole checkpoint or none. :func:`verify` checks
one before it is served or loaded: every listed file present, of its size, of its SHA-256,
nothing unlisted, the safetensors header well formed and equal to the manifest's tensor
table, and (given the model config the reader expects) the architecture and every tensor's
shape and dtype. Its error names each file and its problem, bounded
(:class:`CheckpointError`).

Everything here but the file I/O of :func:`write`, :func:`verify` and :func:`find` is
pure. No torch: a node agent verifies what it fetched without it (safetensors' header is
read here; writing tensors needs the ``safetensors`` package).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrrl import errors

FORMAT = "orchestrrl-checkpoint/1"
MODEL_FORMAT = "hf-llama-safetensors"
MANIFEST = "manifest.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
# Files a checkpoint may hold beside its manifest (an engine loads every *.safetensors
# of a directory, so nothing else is allowed in).
ALLOWED_FILES = (CONFIG, WEIGHTS, GENERATION_CONFIG)
REQUIRED_FILES = (CONFIG, WEIGHTS)

MAX_MANIFEST_BYTES = 8 * 1024 * 1024  # a 1,000-layer model's tensor table fits
MAX_CONFIG_BYTES = 1024 * 1024
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit
MAX_TENSORS = 100_000
CHECKSUM_NAME_DIGITS = 16
VERSION_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DIRNAME = re.compile(r"(?P<version>.+)-(?P<checksum>[0-9a-f]{16})")
_CHUNK = 1 << 20

# safetensors dtypes and their sizes in bytes
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
TORCH_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class CheckpointError(errors.InvalidArgument):
    """A checkpoint is missing, incomplete, corrupt or not the expected model: the message
    names the checkpoint, then each file and its problem (bounded: the first few, counted)."""

    def __init__(self, where: str, problems: errors.Problems) -> None:
        self.where = where
        self.problems = tuple(problems.shown)
        self.count = problems.count
        super().__init__(errors.bounded(f"checkpoint {where}: {problems.text()}"))


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    version: str
    checksum: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    model_format: str = MODEL_FORMAT

    @property
    def dirname(self) -> str:
        return dirname(self.version, self.checksum)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory."""

    path: Path
    manifest: Manifest

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def checksum(self) -> str:
        return self.manifest.checksum


# -- names and checksums (pure) -------------------------------------------------------


def check_version(version: object, field_name: str = "version") -> str:
    """A version label usable as (the head of) a directory name; else a field error."""
    if not isinstance(version, str) or not VERSION_PATTERN.fullmatch(version):
        raise errors.field_error(
            field_name,
            version,
            "1-64 characters of A-Z a-z 0-9 . _ + -, not starting with . + or -",
        )
    return version


def version_count(label: object) -> int | None:
    """A weight version label as the trainer's version count (``"3"`` -> 3), the labels
    an RL loop pushes; None for any other label (its distance to another is unknown)."""
    if isinstance(label, str) and label.isascii() and label.isdigit() and len(label) <= 18:
        return int(label)
    return None


def checksum_of(files: Iterable[FileEntry]) -> str:
    """SHA-256 (hex) of the canonical JSON of the file list, sorted by name."""
    listed = [
        {"name": f.name, "sha256": f.sha256, "size": f.size}
        for f in sorted(files, key=lambda f: f.name)
    ]
    canonical = json.dumps(listed, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def dirname(version: str, checksum: str) -> str:
    return f"{version}-{checksum[:CHECKSUM_NAME_DIGITS]}"


def parse_dirname(name: str) -> tuple[str, str] | None:
    """``(version, checksum prefix)`` of a checkpoint directory's name, or None."""
    m = _DIRNAME.fullmatch(name)
    if m is None or not VERSION_PATTERN.fullmatch(m["version"]):
        return None
    return m["version"], m["checksum"]


# -- the manifest (pure) --------------------------------------------------------------


def build_manifest(
    version: str, files: Iterable[FileEntry], tensors: Iterable[TensorEntry]
) -> Manifest:
    check_version(version)
    entries = tuple(sorted(files, key=lambda f: f.name))
    return Manifest(
        version=version,
        checksum=checksum_of(entries),
        files=entries,
        tensors=tuple(sorted(tensors, key=lambda t: t.name)),
    )


def manifest_json(m: Manifest) -> str:
    doc = {
        "format": FORMAT,
        "model_format": m.model_format,
        "version": m.version,
        "checksum": m.checksum,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in m.files],
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in m.tensors],
    }
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def parse_manifest(text: str | bytes) -> Manifest:
    """The manifest in ``text``; :class:`CheckpointError`-ready problems as InvalidArgument
    (``manifest.json: FIELD=VALUE is not valid: ...``), all found at once, bounded."""
    p = errors.Problems()
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.InvalidArgument(f"{MANIFEST}: not JSON ({errors.shown(str(e))})") from None
    if not isinstance(doc, dict):
        raise errors.InvalidArgument(f"{MANIFEST}: not a JSON object")

    def bad(name: str, value: object, allowed: str) -> None:
        p.add(f"{MANIFEST}: {errors.field_error(name, value, allowed)}")

    if doc.get("format") != FORMAT:
        bad("format", doc.get("format"), repr(FORMAT))
    if doc.get("model_format") != MODEL_FORMAT:
        bad("model_format", doc.get("model_format"), repr(MODEL_FORMAT))
    version = doc.get("version")
    if not isinstance(version, str) or not VERSION_PATTERN.fullmatch(version):
        bad("version", version, "1-64 characters of A-Z a-z 0-9 . _ + -")
    checksum = doc.get("checksum")
    if not isinstance(checksum, str) or not _HEX64.fullmatch(checksum):
        bad("checksum", checksum, "64 lowercase hex digits (SHA-256)")
    files = _parse_files(doc.get("files"), bad)
    tensors = _parse_tensors(doc.get("tensors"), bad)
    unknown = sorted(
        set(doc) - {"format", "model_format", "version", "checksum", "files", "tensors"}
    )
    if unknown:
        bad("fields", unknown, "only format, model_format, version, checksum, files, tensors")
    if p:
        raise p.error()
    assert isinstance(version, str) and isinstance(checksum, str)
    return Manifest(version, checksum, files, tensors)


def _parse_files(raw: object, bad: Any) -> tuple[FileEntry, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > len(ALLOWED_FILES):
        bad("files", raw, f"a list of 1-{len(ALLOWED_FILES)} entries")
        return ()
    out: list[FileEntry] = []
    for i, e in enumerate(raw):
        where = f"files[{i}]"
        if not isinstance(e, dict) or set(e) != {"name", "size", "sha256"}:
            bad(where, e, "an object with exactly name, size, sha256")
            continue
        name, size, digest = e["name"], e["size"], e["sha256"]
        ok = True
        if name not in ALLOWED_FILES:
            bad(f"{where}.name", name, "one of " + ", ".join(ALLOWED_FILES))
            ok = False
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            bad(f"{where}.size", size, "a byte count >= 0")
            ok = False
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            bad(f"{where}.sha256", digest, "64 lowercase hex digits")
            ok = False
        if ok:
            out.append(FileEntry(name, size, digest))
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        bad("files", names, "each file listed once")
    for required in REQUIRED_FILES:
        if out and required not in names:
            bad("files", names, f"a list that includes {required}")
    return tuple(out)


def _parse_tensors(raw: object, bad: Any) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TENSORS:
        bad("tensors", raw, f"a list of 1-{MAX_TENSORS} entries")
        return ()
    out: list[TensorEntry] = []
    for i, e in enumerate(raw):
        where = f"tensors[{i}]"
        if not isinstance(e, dict) or set(e) != {"name", "dtype", "shape"}:
            bad(where, e, "an object with exactly name, dtype, shape")
            continue
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            bad(f"{where}.name", name, "a tensor name of 1-256 characters")
        elif dtype not in DTYPE_BYTES:
            bad(f"{where}.dtype", dtype, "a safetensors dtype (F32, BF16, F16, ...)")
        elif not _is_shape(shape):
            bad(f"{where}.shape", shape, "a list of at most 8 sizes >= 0")
        else:
            out.append(TensorEntry(name, dtype, tuple(shape)))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        bad("tensors", "duplicates", "each tensor listed once")
    return tuple(out)


def _is_shape(shape: object) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) <= 8
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    )


# -- safetensors' header (pure) -------------------------------------------------------


def header_length(prefix: bytes) -> int:
    """The JSON header's length from the first 8 bytes of a safetensors file."""
    if len(prefix) < 8:
        raise ValueError(f"{len(prefix)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_SAFETENSORS_HEADER:
        raise ValueError(f"header length {n} exceeds {MAX_SAFETENSORS_HEADER} bytes")
    return int(n)


def parse_safetensors_header(header: bytes, data_bytes: int) -> tuple[TensorEntry, ...]:
    """The tensors described by a safetensors JSON ``header`` whose data section holds
    ``data_bytes`` bytes: each entry's offsets must hold exactly its dtype x shape, the
    entries must tile the data section without gap or overlap. ValueError otherwise."""
    try:
        doc = json.loads(header)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not JSON ({errors.shown(str(e))})") from None
    if not isinstance(doc, dict):
        raise ValueError("header is not a JSON object")
    doc.pop("__metadata__", None)
    if len(doc) > MAX_TENSORS:
        raise ValueError(f"{len(doc)} tensors, more than {MAX_TENSORS}")
    spans: list[tuple[int, int, str]] = []
    out: list[TensorEntry] = []
    for name, info in doc.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {errors.shown(name)}: not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {errors.shown(name)}: unknown dtype {errors.shown(dtype)}")
        if not _is_shape(shape):
            raise ValueError(f"tensor {errors.shown(name)}: bad shape {errors.shown(shape)}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(
                f"tensor {errors.shown(name)}: bad data_offsets {errors.shown(offsets)}"
            )
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"tensor {name}: {offsets[1] - offsets[0]} bytes for {dtype} {shape} "
                f"(needs {numel * DTYPE_BYTES[dtype]})"
            )
        spans.append((offsets[0], offsets[1], name))
        out.append(TensorEntry(name, dtype, tuple(shape)))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise ValueError(f"tensor {name}: data starts at {begin}, expected {end}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"tensors hold {end} bytes of data, the file has {data_bytes}")
    return tuple(sorted(out, key=lambda t: t.name))


# -- the model's architecture (pure) --------------------------------------------------


@dataclass(frozen=True)
class LlamaArch:
    """What fixes a Llama checkpoint's tensors (resolved from a Hugging Face config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = CONFIG) -> LlamaArch:
        """Resolved and checked (positive sizes, heads divisible by KV heads, a Llama);
        InvalidArgument naming each bad field of ``where`` otherwise."""
        p = errors.Problems()

        def bad(name: str, value: object, allowed: str) -> None:
            p.add(f"{where}: {errors.field_error(name, value, allowed)}")

        if config.get("model_type") != "llama":
            bad("model_type", config.get("model_type"), "'llama'")
        sizes: dict[str, int] = {}
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 24:
                bad(key, value, "an integer 1..16777215")
            else:
                sizes[key] = value
        heads = sizes.get("num_attention_heads", 1)
        kv = config.get("num_key_value_heads") or heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or heads % kv:
            bad("num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}")
            kv = heads
        head_dim = config.get("head_dim") or sizes.get("hidden_size", heads) // heads
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            bad("head_dim", head_dim, "an integer >= 1")
            head_dim = 1
        flags = {}
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            value = config.get(key, False)
            if not isinstance(value, bool):
                bad(key, value, "true or false")
            flags[key] = bool(value)
        rope = config.get("rope_theta")
        if rope is None and isinstance(config.get("rope_parameters"), Mapping):
            rope = config["rope_parameters"].get("rope_theta")
        rope = 10000.0 if rope is None else rope
        eps = config.get("rms_norm_eps", 1e-6)
        for key, value in (("rope_theta", rope), ("rms_norm_eps", eps)):
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                bad(key, value, "a number > 0")
        act = config.get("hidden_act", "silu")
        if not isinstance(act, str):
            bad("hidden_act", act, "a string")
        if p:
            raise p.error()
        return cls(
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            num_hidden_layers=sizes["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            tie_word_embeddings=flags["tie_word_embeddings"],
            attention_bias=flags["attention_bias"],
            mlp_bias=flags["mlp_bias"],
            rms_norm_eps=float(eps),
            rope_theta=float(rope),
            hidden_act=str(act),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint by its Hugging Face name."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
            if self.attention_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
                out[p + "self_attn.o_proj.bias"] = (h,)
            if self.mlp_bias:
                out[p + "mlp.gate_proj.bias"] = (i,)
                out[p + "mlp.up_proj.bias"] = (i,)
                out[p + "mlp.down_proj.bias"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out


def arch_problems(found: LlamaArch, expected: LlamaArch, where: str = CONFIG) -> list[str]:
    """Each field of the architecture that differs: ``config.json: hidden_size=128,
    expected 256``."""
    return [
        f"{where}: {name}={getattr(found, name)!r}, expected {getattr(expected, name)!r}"
        for name in LlamaArch.__dataclass_fields__
        if getattr(found, name) != getattr(expected, name)
    ]


def tensor_problems(
    found: Iterable[TensorEntry],
    expected: Mapping[str, tuple[int, ...]],
    dtype: str | None = None,
    where: str = WEIGHTS,
) -> list[str]:
    """Tensors missing, unexpected, of the wrong shape (or of another dtype than
    ``dtype``), as messages naming the file and the tensor."""
    have = {t.name: t for t in found}
    out = [f"{where}: tensor {n} is missing" for n in expected if n not in have]
    out += [f"{where}: tensor {n} is not part of the model" for n in have if n not in expected]
    for name, shape in expected.items():
        t = have.get(name)
        if t is None:
            continue
        if t.shape != tuple(shape):
            out.append(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            out.append(f"{where}: tensor {name} has dtype {t.dtype}, expected {dtype}")
    return out


# -- I/O: write ------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _json_bytes(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _write_tensors(path: Path, tensors: Mapping[str, Any]) -> None:
    first = next(iter(tensors.values()), None)
    if type(first).__module__.split(".")[0] == "torch":
        from safetensors.torch import save_file as save_torch

        save_torch(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
            str(path),
            metadata={"format": "pt"},
        )
    else:
        from safetensors.numpy import save_file as save_numpy

        save_numpy(dict(tensors), str(path), metadata={"format": "pt"})


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    root: Path,
    version: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    *,
    generation_config: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """Write weights ``tensors`` (Hugging Face names -> torch tensors or numpy arrays) and
    ``config`` as the checkpoint ``version`` under ``root``; returns it, verified.

    Built in ``root/.tmp-*`` and renamed to ``root/VERSION-CHECKSUM16``: a reader never
    sees a partial checkpoint, and a crash leaves only a ``.tmp-*`` directory (removed here
    on an error, ignored by :func:`find`). Writing the same weights again returns the
    existing checkpoint; a corrupt directory of the same name is replaced."""
    check_version(version)
    arch = LlamaArch.from_config(config)
    if not tensors:
        raise errors.field_error("tensors", {}, "the model's tensors")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{version}-{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_bytes(_json_bytes(config))
        if generation_config is not None:
            (tmp / GENERATION_CONFIG).write_bytes(_json_bytes(generation_config))
        _write_tensors(tmp / WEIGHTS, tensors)
        entries = []
        for name in sorted(os.listdir(tmp)):
            path = tmp / name
            _fsync(path)
            entries.append(FileEntry(name, path.stat().st_size, _sha256_file(path)))
        table = read_tensor_table(tmp / WEIGHTS)
        problems = tensor_problems(table, arch.tensor_shapes())
        if problems:
            raise CheckpointError(str(tmp), _problems(problems))
        manifest = build_manifest(version, entries, table)
        (tmp / MANIFEST).write_text(manifest_json(manifest))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        final = root / manifest.dirname
        if final.exists():
            try:
                existing = verify(final)
            except CheckpointError:
                trash = root / f".tmp-trash-{os.urandom(4).hex()}"
                final.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                return existing
        tmp.rename(final)
        _fsync(root)
        return Checkpoint(final, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- I/O: read and verify --------------------------------------------------------------


def read_tensor_table(path: Path) -> tuple[TensorEntry, ...]:
    """The tensor table of a safetensors file (its header only); ValueError if malformed."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8))
        if 8 + n > size:
            raise ValueError(f"header of {n} bytes runs past the end of the file ({size} bytes)")
        header = f.read(n)
    return parse_safetensors_header(header, size - 8 - n)


def _problems(items: Iterable[str]) -> errors.Problems:
    p = errors.Problems()
    p.extend(items)
    return p


def _read_bounded(path: Path, limit: int) -> bytes:
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def verify(
    path: Path,
    expected_config: Mapping[str, Any] | None = None,
    *,
    dtype: str | None = None,
    hash_files: bool = True,
) -> Checkpoint:
    """The checkpoint at ``path``, checked whole; :class:`CheckpointError` naming every
    problem found (bounded) otherwise. ``expected_config``: the model config a reader
    serves (its architecture and every tensor's shape must match); ``dtype``: every
    tensor's safetensors dtype ("F32"); ``hash_files=False`` skips the SHA-256 of the
    files (sizes and headers are still checked)."""
    where = str(path)
    if not path.is_dir():
        raise CheckpointError(where, _problems(["not a directory (no such checkpoint)"]))
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(where, _problems([f"{MANIFEST}: missing"]))
    try:
        manifest = parse_manifest(_read_bounded(mpath, MAX_MANIFEST_BYTES))
    except errors.InvalidArgument as e:
        raise CheckpointError(where, _problems([str(e)])) from None
    except ValueError as e:
        raise CheckpointError(where, _problems([f"{MANIFEST}: {e}"])) from None
    p = errors.Problems()
    intact: set[str] = set()
    for entry in manifest.files:
        fpath = path / entry.name
        if not fpath.is_file():
            p.add(f"{entry.name}: missing")
            continue
        size = fpath.stat().st_size
        if size != entry.size:
            what = "truncated" if size < entry.size else "too long"
            p.add(f"{entry.name}: {size} bytes, the manifest says {entry.size} ({what})")
            continue
        if hash_files and _sha256_file(fpath) != entry.sha256:
            p.add(f"{entry.name}: SHA-256 differs from the manifest's (corrupt)")
            continue
        intact.add(entry.name)
    listed = {f.name for f in manifest.files} | {MANIFEST}
    unlisted = sorted(n for n in os.listdir(path) if n not in listed)
    if unlisted:
        p.add(f"files not in the manifest: {errors.shown(unlisted)}")
    if checksum_of(manifest.files) != manifest.checksum:
        p.add(f"{MANIFEST}: checksum does not match its file list")
    named = parse_dirname(path.name)
    if named is not None and named != (manifest.version, manifest.checksum[:16]):
        p.add(
            f"directory name {path.name!r} does not match the manifest "
            f"({manifest.dirname!r}): version or checksum differs"
        )
    if WEIGHTS in intact:
        try:
            table = read_tensor_table(path / WEIGHTS)
        except ValueError as e:
            p.add(f"{WEIGHTS}: {e}")
        else:
            if table != manifest.tensors:
                p.add(f"{WEIGHTS}: tensors differ from the manifest's tensor table")
            found_arch: LlamaArch | None = None
            if CONFIG in intact:
                try:
                    found_arch = LlamaArch.from_config(_load_json(path / CONFIG))
                except (errors.InvalidArgument, ValueError) as e:
                    p.add(str(e) if str(e).startswith(CONFIG) else f"{CONFIG}: {e}")
            if expected_config is not None:
                want = LlamaArch.from_config(expected_config, "expected config")
                if found_arch is not None:
                    p.extend(arch_problems(found_arch, want))
                p.extend(tensor_problems(table, want.tensor_shapes(), dtype))
            elif found_arch is not None:
                p.extend(tensor_problems(table, found_arch.tensor_shapes(), dtype))
    if p:
        raise CheckpointError(where, p)
    return Checkpoint(path, manifest)


def _load_json(path: Path) -> dict[str, Any]:
    doc = json.loads(_read_bounded(path, MAX_CONFIG_BYTES))
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def read_config(checkpoint: Checkpoint) -> dict[str, Any]:
    return _load_json(checkpoint.path / CONFIG)


def find(root: Path, version: str | None = None) -> list[Path]:
    """Checkpoint directories under ``root`` by their names (not verified), oldest first
    by modification time; only those of ``version`` if given. Temporary directories of
    unfinished writes are not listed."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        named = parse_dirname(entry.name)
        if named is None or not entry.is_dir():
            continue
        if version is None or named[0] == version:
            with contextlib.suppress(OSError):
                found.append((entry.stat().st_mtime_ns, entry.name, entry))
    return [e for _, _, e in sorted(found)]

"""A trainer's checkpoint as files: the tensors of a Hugging Face safetensors checkpoint.

Read from the safetensors headers alone (no tensor data is loaded): each file's header
(an 8-byte little-endian length, then JSON: name -> dtype, shape, byte offsets) is
checked against the file's size, so a truncated file is found before an engine loads it.
:func:`check_layout` compares a new checkpoint with the one an engine serves (the same
tensors, shapes and types), which is what an in-place weight update needs: an engine
given another model's checkpoint would fail half-way through loading it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from orchestrrl import errors

MAX_HEADER_BYTES = 100 * 1024 * 1024  # a safetensors header (JSON) larger than this is broken

# safetensors dtypes read by the GGUF converter (bfloat16 is widened by hand: numpy has none)
SOURCE_DTYPES: dict[str, str] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
ITEM_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


class CheckpointError(errors.InvalidArgument):
    """A checkpoint an engine cannot load: names the file and what is wrong with it."""


@dataclass(frozen=True)
class SourceTensor:
    file: Path
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(path: Path) -> dict[str, SourceTensor]:
    """The tensors of one safetensors file, checked against its size (a truncated file is
    refused here, before anything is converted)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes): no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated or not a safetensors file (a header of {n} bytes "
                    f"in a file of {size})"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, SourceTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry") from None
        if dtype not in ITEM_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has an unknown dtype {dtype!r}")
        want = math.prod(shape) * ITEM_BYTES[dtype]
        if end - begin != want or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} holds {end - begin} bytes, its shape "
                f"{list(shape)} of {dtype} needs {want}"
            )
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + end}, the file has {size}"
            )
        out[name] = SourceTensor(path, dtype, shape, base + begin, base + end)
    return out


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index when sharded)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        return [checkpoint / n for n in names]
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint}: no *.safetensors file (a Hugging Face checkpoint)")
    return files


def tensor_table(checkpoint: Path) -> dict[str, SourceTensor]:
    """Every tensor of a checkpoint directory (all its safetensors files, checked)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(
            f"{checkpoint}: {'not a directory' if checkpoint.exists() else 'missing'} "
            "(a Hugging Face checkpoint is a directory of config.json and *.safetensors)"
        )
    if not (checkpoint / "config.json").is_file():
        raise CheckpointError(f"{checkpoint / 'config.json'}: missing")
    table: dict[str, SourceTensor] = {}
    for f in checkpoint_files(checkpoint):
        table.update(read_header(f))
    return table


def check_layout(current: Path, new: Path) -> None:
    """CheckpointError unless ``new`` has exactly the tensors of ``current`` (names,
    shapes, types) and complete files. ``current`` is only read for its layout."""
    have = tensor_table(current)
    got = tensor_table(new)
    problems = errors.Problems()
    for name, t in have.items():
        n = got.get(name)
        if n is None:
            problems.add(f"tensor {name!r} is missing")
        elif (n.shape, n.dtype) != (t.shape, t.dtype):
            problems.add(
                f"tensor {name!r} is {n.dtype}{list(n.shape)} in {n.file.name}, the served "
                f"model's is {t.dtype}{list(t.shape)}"
            )
    problems.extend(
        f"tensor {name!r} is not in the served model" for name in got if name not in have
    )
    if problems:
        raise CheckpointError(
            f"{new}: not a checkpoint of the served model ({current}): {problems.text()}"
        )

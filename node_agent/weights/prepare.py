"""What each engine kind loads for a fetched checkpoint: the one hook per engine format.

A fetched checkpoint is a directory ``VERSION-CHECKSUM16`` holding a Hugging Face Llama
model (``config.json``, ``model.safetensors``; :mod:`orchestrrl.checkpoint`). Before the
node's engines load it, :func:`for_engine` gives the coroutine that turns it into the path
the engine kind loads:

- ``vllm``, ``sglang``: the directory itself (both load Hugging Face directories);
- ``sim``: the directory itself (the simulated engine reads its tensor table);
- ``llamacpp``: llama.cpp's server loads a GGUF file, so its entry must convert the
  directory (a converter, ``node_agent/engines/gguf_convert.py``, comes with the engine
  adapters) and return the GGUF's path. Until one is wired into :data:`PREPARE`, a weight
  update on a llama.cpp node is refused here, before anything changes, saying so.

A hook runs while the engines keep serving the old weights; an error it raises ends the
update with the node on its old version.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from orchestrrl import errors
from orchestrrl.checkpoint import Checkpoint

Prepare = Callable[[Checkpoint], Awaitable[str]]


async def hf_directory(ck: Checkpoint) -> str:
    """Engines that load a Hugging Face directory load the checkpoint as it is."""
    return str(ck.path)


async def gguf_required(ck: Checkpoint) -> str:
    raise errors.FailedPrecondition(
        f"llama.cpp loads GGUF files and no converter is wired for checkpoint {ck.path.name} "
        "(node_agent/weights/prepare.py: PREPARE['llamacpp']); the node keeps its weights"
    )


PREPARE: dict[str, Prepare] = {
    "vllm": hf_directory,
    "sglang": hf_directory,
    "sim": hf_directory,
    "llamacpp": gguf_required,
}


def for_engine(kind: str) -> Prepare:
    try:
        return PREPARE[kind]
    except KeyError:
        raise errors.field_error("engine", kind, "one of " + ", ".join(sorted(PREPARE))) from None

"""llama.cpp's adapter as an RL loop uses it, straight (no gateway): the GGUF converted from a
trainer's Hugging Face checkpoint computes what the checkpoint computes, the logprobs the
server reports are those the trainer recomputes (tests/engines/reference.py), and a
weight update is a restart on the next checkpoint's GGUF.

One server, started once, serves the tests in order: converted from ``hf_model``, then
restarted on ``hf_model_next``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from node_agent.engines.checkpoint import CheckpointError
from node_agent.engines.llamacpp import LlamaCppServer
from tests.engines.conftest import GREEDY, check_logprobs, cpu_placement, generate, settings_for
from tests.engines.reference import Reference, max_abs_diff

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(3)]
N = 40


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(
    llama_binary: Path, hf_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaCppServer]:
    log_dir = tmp_path_factory.mktemp("llamacpp-weights")
    # the instance's first model is a GGUF of another model: prepare_model converts
    # hf_model and checks it against the served one (same shapes)
    settings = settings_for(llama_binary, Path("unset.gguf"), log_dir, seqs=2)("n")
    srv = LlamaCppServer(cpu_placement(), settings)
    srv.use_model(await srv.prepare_model(str(hf_model)))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def test_logprobs_equal_the_trainers_recomputation(
    server: LlamaCppServer, hf_model: Path
) -> None:
    await check_logprobs(server, Reference(hf_model), PROMPTS, N, "v1")


async def test_a_restart_on_the_next_checkpoint_serves_its_weights(
    server: LlamaCppServer, hf_model: Path, hf_model_next: Path, hf_model_other: Path
) -> None:
    before = server.model
    with pytest.raises(CheckpointError, match="not a checkpoint of the served model"):
        await server.prepare_model(str(hf_model_other))
    assert server.model == before and server.alive  # nothing changed
    gguf = await server.prepare_model(str(hf_model_next))
    assert gguf.endswith("tiny-next.f32.gguf")
    made = (await asyncio.to_thread(Path(gguf).stat)).st_mtime_ns
    assert await server.prepare_model(str(hf_model_next)) == gguf
    assert (await asyncio.to_thread(Path(gguf).stat)).st_mtime_ns == made  # converted once
    await server.stop()
    server.use_model(gguf)
    await server.start()
    _, outs = await check_logprobs(server, Reference(hf_model_next), PROMPTS, N, "v2")
    old = Reference(hf_model)
    assert outs != [old.greedy(p, N) for p in PROMPTS]  # really other weights


async def test_an_f16_gguf_serves_within_half_precision(
    llama_binary: Path, hf_model: Path, tmp_path: Path
) -> None:
    settings = settings_for(llama_binary, Path("unset.gguf"), tmp_path, seqs=1)("n")
    srv = LlamaCppServer(cpu_placement(), dataclasses.replace(settings, gguf_dtype="f16"))
    gguf = await srv.prepare_model(str(hf_model))
    assert gguf.endswith(".f16.gguf")
    srv.use_model(gguf)
    await srv.start()
    try:
        tokens, lps = await generate(srv, PROMPTS[0], N, GREEDY, "h")
    finally:
        await srv.stop()
    rec = Reference(hf_model).recompute(PROMPTS[0], tokens)
    # float16 weights move logits by ~1e-3 relative: the logprobs follow within 0.05
    assert max_abs_diff(lps, rec.logprobs) < 0.05

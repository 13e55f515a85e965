"""The policy is the Llama the engines serve: its logprobs, batched and padded, equal an
independent float64 Llama forward; sampling is reproducible and reports the logprobs the
trainer recomputes; checkpoints round-trip exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orchestrrl import checkpoint as ck
from orchestrrl.rl import policy
from sim_backends.tiny_models import TinyShape, write_hf_llama

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("torch_one_thread")]

# grouped-query attention (2 query heads, 1 KV head), weights as the engine tests draw them
SHAPE = TinyShape(layers=2, hidden=128, kv_heads=1, intermediate=256, vocab=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ck.Checkpoint:
    from safetensors.numpy import load_file

    src = write_hf_llama(tmp_path_factory.mktemp("hf"), SHAPE, seed=5)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    return ck.write(tmp_path_factory.mktemp("ckpt"), "0", config, tensors)


def reference_logprobs(w: dict[str, np.ndarray], cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1 by the Llama equations in float64 (RMSNorm,
    rotary embedding on rotated halves, grouped-query causal attention, SiLU-gated MLP)."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, n = cfg["rms_norm_eps"], len(ids)
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(n), inv)
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g

    def rope(q: np.ndarray) -> np.ndarray:
        half = np.concatenate([-q[..., hd // 2 :], q[..., : hd // 2]], -1)
        return q * cos + half * sin

    x = f["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, f[p + "input_layernorm.weight"])
        q = (h @ f[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd).transpose(1, 0, 2)
        k = (h @ f[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd).transpose(1, 0, 2)
        v = (h @ f[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd).transpose(1, 0, 2)
        k, v = np.repeat(k, heads // kv, 0), np.repeat(v, heads // kv, 0)
        s = rope(q) @ rope(k).transpose(0, 2, 1) / np.sqrt(hd) + causal
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(n, heads * hd)
        x = x + o @ f[p + "self_attn.o_proj.weight"].T
        h = rms(x, f[p + "post_attention_layernorm.weight"])
        gate = h @ f[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (h @ f[p + "mlp.up_proj.weight"].T))
            @ f[p + "mlp.down_proj.weight"].T
        )
    logits = rms(x, f["model.norm.weight"]) @ f["lm_head.weight"].T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.array([logp[t - 1, ids[t]] for t in range(1, n)])


def test_the_config_is_the_tiny_models_config(tmp_path: Path) -> None:
    shape = TinyShape(layers=3, hidden=128, intermediate=256, vocab=96)
    theirs = json.loads((write_hf_llama(tmp_path, shape) / "config.json").read_text())
    ours = policy.llama_config(
        vocab_size=96, hidden_size=128, num_hidden_layers=3, initializer_range=0.2
    )
    assert ours == theirs


def test_batched_padded_logprobs_equal_a_float64_llama(tiny: ck.Checkpoint) -> None:
    from safetensors.numpy import load_file

    model = policy.load_policy(tiny)
    weights = load_file(str(tiny.path / "model.safetensors"))
    config = ck.read_config(tiny)
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(2, 63, size=k).tolist()) for k in (3, 9, 1, 5)]
    completions = [tuple(rng.integers(0, 64, size=k).tolist()) for k in (7, 2, 12, 0)]
    with torch.no_grad():
        got, mask = policy.token_logprobs(model, prompts, completions, micro_batch=3)
    assert got.shape == (4, 12) and mask.sum(1).tolist() == [7, 2, 12, 0]
    worst = 0.0
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        want = reference_logprobs(weights, config, list(p + c))[len(p) - 1 :]
        assert len(want) == len(c)
        worst = max(worst, float(np.abs(got[i, : len(c)].numpy() - want).max(initial=0)))
        assert float(got[i, len(c) :].abs().sum()) == 0.0  # padding is zero
    assert worst < 1e-4  # fp32 against fp64
    # the logprobs are not trivially flat: the weights make a peaked distribution
    assert float(got[mask].min()) < -5


def test_a_temperature_divides_the_logits(tiny: ck.Checkpoint) -> None:
    model = policy.load_policy(tiny)
    with torch.no_grad():
        hot, _ = policy.token_logprobs(model, [(5, 6)], [(7, 8)], temperature=2.0)
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits[0] / 2.0
    want = torch.log_softmax(logits, -1)[[1, 2], [7, 8]]
    assert torch.allclose(hot[0], want, atol=1e-6)


def test_sampling_is_reproducible_and_reports_the_trainers_logprobs(tiny: ck.Checkpoint) -> None:
    model = policy.load_policy(tiny)
    prompts = [(3, 4, 5), (10, 11, 12, 13, 14)]
    groups = policy.sample(model, prompts, n=4, max_tokens=10, seed=7, version="0")
    assert groups == policy.sample(model, prompts, n=4, max_tokens=10, seed=7, version="0")
    assert groups != policy.sample(model, prompts, n=4, max_tokens=10, seed=8, version="0")
    assert [len(g) for g in groups] == [4, 4]
    flat = [s for g in groups for s in g]
    assert all(s.prompt_ids == p for g, p in zip(groups, prompts, strict=True) for s in g)
    for s in flat:
        assert 1 <= len(s.completion_ids) <= 10 and s.version == "0"
        stopped = s.completion_ids[-1] == 63
        assert s.finish == ("stop" if stopped else "length")
        assert 63 not in s.completion_ids[:-1]
        if not stopped:
            assert len(s.completion_ids) == 10
    with torch.no_grad():
        again, mask = policy.token_logprobs(
            model, [s.prompt_ids for s in flat], [s.completion_ids for s in flat]
        )
    reported = torch.zeros_like(again)
    for i, s in enumerate(flat):
        reported[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    assert float((again - reported).abs()[mask].max()) < 1e-5
    assert model.training is True  # sampling restores the mode


def test_the_sampler_stops_at_end_of_sequence(tmp_path: Path) -> None:
    config = policy.llama_config(vocab_size=16, hidden_size=64, num_hidden_layers=1)
    model = policy.new_policy(config, 0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[15] = 1.0  # end of sequence dominates every position
        model.model.norm.weight.fill_(100.0)
    (group,) = policy.sample(model, [(2, 3)], n=3, max_tokens=5, seed=0)
    assert all(s.completion_ids == (15,) and s.finish == "stop" for s in group)


def test_a_policy_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    config = policy.llama_config(vocab_size=32, hidden_size=64, num_hidden_layers=1)
    a = policy.new_policy(config, seed=1)
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            a.state_dict().values(),
            policy.new_policy(config, seed=1).state_dict().values(),
            strict=True,
        )
    )
    saved = policy.save_policy(a, tmp_path, "4", config)
    assert saved.version == "4" and ck.verify(saved.path, config, dtype="F32") == saved
    assert json.loads((saved.path / "generation_config.json").read_text())["eos_token_id"] == 31
    b = policy.load_policy(saved)
    assert policy.policy_tensors(a).keys() == policy.policy_tensors(b).keys()
    assert all(
        torch.equal(x, policy.policy_tensors(b)[k]) for k, x in policy.policy_tensors(a).items()
    )
    assert policy.save_policy(b, tmp_path / "again", "4", config).checksum == saved.checksum
    other = policy.save_policy(policy.new_policy(config, seed=2), tmp_path, "4", config)
    assert other.checksum != saved.checksum

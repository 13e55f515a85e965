"""The trainer side of an RL loop on OrchestrRL: GRPO on a Llama policy in torch.

- :mod:`orchestrrl.rl.grpo`: samples, groups and group-normalized advantages (pure, no torch);
- :mod:`orchestrrl.rl.tasks`: a verifiable toy task on token ids (pure, no torch);
- :mod:`orchestrrl.rl.policy`: the policy, a Hugging Face ``LlamaForCausalLM`` (the model
  vLLM and llama.cpp serve): build, load and save it as a versioned checkpoint
  (:mod:`orchestrrl.checkpoint`), recompute the logprobs of sampled tokens, sample with
  plain torch;
- :mod:`orchestrrl.rl.trainer`: the clipped policy-gradient loss and a trainer that takes
  rollout groups and steps the policy, one weight version per step.

Only ``grpo`` and ``tasks`` import without the ``rl`` extra (torch, transformers): nothing
in the base install imports ``policy`` or ``trainer``.
"""

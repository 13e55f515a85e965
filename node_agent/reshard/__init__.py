"""Tensor-parallel re-layout of the node's rollout weights with torch.distributed.

``plan`` is pure (no torch); ``workers`` and ``worker`` run the transfers in one
process per GPU rank; ``engine`` puts them behind the agent's RolloutEngine Protocol.
Importing this package does not import torch (it is an optional extra of the agent).
"""

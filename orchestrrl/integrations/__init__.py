"""Adapters between OrchestrRL and RL frameworks (each needs its framework installed)."""

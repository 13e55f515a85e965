"""OrchestrRL: dynamic compute and network orchestration for disaggregated RL."""

__version__ = "0.1.0"

"""Simulators and test doubles (simulated OCS, engines, testbed, cluster simulator)."""

from orchestrrl import forksafe as _forksafe  # noqa: F401  (before gRPC is imported)

"""orl-fabric-controller and orlctl: the central controller and its command line."""

from orchestrrl import forksafe as _forksafe  # noqa: F401  (before gRPC is imported)

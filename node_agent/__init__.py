"""orl-node-agent: the per-node daemon (telemetry up to the controller, commands down)."""

from orchestrrl import forksafe as _forksafe  # noqa: F401  (before gRPC is imported)

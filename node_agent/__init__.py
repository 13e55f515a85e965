"""orl-node-agent: the per-node daemon (telemetry up to the controller, commands down)."""

"""Prometheus metrics of the controller (one registry per controller instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stage_seconds = Histogram(
            "orl_reconfiguration_stage_seconds",
            "Wall time of each stage of a reconfiguration",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.reconfiguration_seconds = Histogram(
            "orl_reconfiguration_seconds",
            "Wall time of a whole phase change (committed ones)",
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.epoch = Gauge("orl_epoch", "The committed epoch", registry=self.registry)
        self.epochs = Counter("orl_epochs", "Epochs committed", registry=self.registry)
        self.rollbacks = Counter(
            "orl_rollbacks", "Reconfigurations rolled back", ["stage"], registry=self.registry
        )
        self.gated = Counter(
            "orl_gated", "Phase changes kept back by the slack gate", registry=self.registry
        )
        self.drift_repairs = Counter(
            "orl_drift_repairs", "Switch state repaired to the committed epoch",
            registry=self.registry,
        )  # fmt: skip
        self.circuit_changes = Counter(
            "orl_circuit_changes", "Circuits added or removed", ["op"], registry=self.registry
        )
        self.nodes = Gauge("orl_nodes", "Nodes by health", ["health"], registry=self.registry)
        self.telemetry_samples = Counter(
            "orl_telemetry_samples", "Telemetry samples received", registry=self.registry
        )
        self.telemetry_rejected = Counter(
            "orl_telemetry_rejected",
            "Telemetry samples left out, by reason (undecodable: corrupt bytes; implausible: "
            "figures beyond the plausibility bounds)",
            ["reason"],
            registry=self.registry,
        )
        self.telemetry_lag = Histogram(
            "orl_telemetry_lag_seconds",
            "Age of a telemetry sample when the controller processed it",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )

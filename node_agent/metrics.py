"""Prometheus metrics of one agent (a registry per agent, served by ``--metrics-listen``).

The uplink, the command log and the servicer update these as things happen; GPU and
RDMA gauges are set from each telemetry sample. A reading a GPU cannot report is
absent (its gauge is never set), not 0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from node_agent.gpus import GpuSample
from node_agent.rdma import RdmaSample

RESHARD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples_sent = Counter(
            "orl_agent_telemetry_samples_sent", "Telemetry samples written to the controller",
            registry=r,
        )  # fmt: skip
        self.samples_dropped = Counter(
            "orl_agent_telemetry_samples_dropped",
            "Telemetry samples dropped (oldest first) because the buffer was full while the "
            "controller was away",
            registry=r,
        )
        self.samples_buffered = Gauge(
            "orl_agent_telemetry_samples_buffered", "Telemetry samples waiting to be sent",
            registry=r,
        )  # fmt: skip
        self.reconnects = Counter(
            "orl_agent_uplink_reconnects",
            "Sessions with the controller that ended (each is followed by a new registration)",
            registry=r,
        )
        self.registered = Gauge(
            "orl_agent_registered", "1 while registered with the controller, else 0", registry=r
        )
        self.commands = Counter(
            "orl_agent_commands", "Commands by kind and outcome", ["kind", "outcome"], registry=r
        )
        self.reshard_seconds = Histogram(
            "orl_agent_reshard_seconds", "Wall time of successful reshards",
            buckets=RESHARD_BUCKETS, registry=r,
        )  # fmt: skip
        self.gpu_utilization = Gauge(
            "orl_agent_gpu_utilization", "GPU utilisation 0..1", ["gpu"], registry=r
        )
        self.gpu_sm_clock = Gauge(
            "orl_agent_gpu_sm_clock_mhz", "SM clock in MHz", ["gpu"], registry=r
        )
        self.gpu_pcie = Gauge(
            "orl_agent_gpu_pcie_bytes_per_second", "PCIe throughput", ["gpu", "direction"],
            registry=r,
        )  # fmt: skip
        self.gpu_nvlink = Gauge(
            "orl_agent_gpu_nvlink_bytes_per_second",
            "NVLink data throughput (all links)",
            ["gpu", "direction"],
            registry=r,
        )
        self.gpu_ecc = Gauge(
            "orl_agent_gpu_ecc_errors",
            "Volatile ECC error count since the driver loaded",
            ["gpu", "type"],
            registry=r,
        )
        self.gpu_xid = Gauge(
            "orl_agent_gpu_xid_errors",
            "Critical XID events seen since the agent started",
            ["gpu"],
            registry=r,
        )
        self.gpu_last_xid = Gauge(
            "orl_agent_gpu_last_xid", "Code of the last critical XID event", ["gpu"], registry=r
        )
        self.rdma_bytes = Gauge(
            "orl_agent_rdma_bytes_per_second",
            "RDMA port data rate",
            ["device", "port", "direction"],
            registry=r,
        )
        self.rdma_counter = Gauge(
            "orl_agent_rdma_counter",
            "RDMA port counters as read (port_xmit_data/port_rcv_data in bytes)",
            ["device", "port", "counter"],
            registry=r,
        )
        self.rdma_rate = Gauge(
            "orl_agent_rdma_counter_per_second",
            "Rate of each RDMA port counter",
            ["device", "port", "counter"],
            registry=r,
        )

    def observe_gpus(self, samples: tuple[GpuSample, ...] | list[GpuSample]) -> None:
        for s in samples:
            gpu = str(s.index)
            self.gpu_utilization.labels(gpu).set(s.utilization)
            if s.sm_clock_mhz is not None:
                self.gpu_sm_clock.labels(gpu).set(s.sm_clock_mhz)
            for direction, value in (
                ("tx", s.pcie_tx_bytes_per_s),
                ("rx", s.pcie_rx_bytes_per_s),
            ):
                if value is not None:
                    self.gpu_pcie.labels(gpu, direction).set(value)
            for direction, value in (
                ("tx", s.nvlink_tx_bytes_per_s),
                ("rx", s.nvlink_rx_bytes_per_s),
            ):
                if value is not None:
                    self.gpu_nvlink.labels(gpu, direction).set(value)
            for kind, count in (
                ("corrected", s.ecc_corrected),
                ("uncorrected", s.ecc_uncorrected),
            ):
                if count is not None:
                    self.gpu_ecc.labels(gpu, kind).set(count)
            if s.xid_errors is not None:
                self.gpu_xid.labels(gpu).set(s.xid_errors)
            if s.last_xid is not None:
                self.gpu_last_xid.labels(gpu).set(s.last_xid)

    def observe_rdma(self, samples: tuple[RdmaSample, ...] | list[RdmaSample]) -> None:
        for s in samples:
            port = str(s.port)
            self.rdma_bytes.labels(s.device, port, "tx").set(s.tx_bytes_per_s)
            self.rdma_bytes.labels(s.device, port, "rx").set(s.rx_bytes_per_s)
            for name, value in s.counters.items():
                self.rdma_counter.labels(s.device, port, name).set(value)
            for name, rate in s.rates.items():
                self.rdma_rate.labels(s.device, port, name).set(rate)

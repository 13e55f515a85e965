"""Prometheus metrics of one agent (a registry per agent, served by ``--metrics-listen``).

The uplink, the command log and the servicer update these as things happen. GPU and
RDMA gauges show the sample that closed the latest telemetry upload: the uplink hands
it over (a reference, every flush interval) and the gauges are set from it only when
the registry is collected (a scrape), so an agent nobody scrapes does no per-GPU
Prometheus work. A reading a GPU cannot report is absent (its gauge is never set),
not 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from node_agent.gpus import GpuSample
from node_agent.rdma import RdmaSample

RESHARD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r: CollectorRegistry | None = self.registry
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
        # GPU and RDMA gauges: collected through _LatestReadings (see the module docstring)
        r = None
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

        # the node's gateway's counters, read at collection (watch_gateway)
        self._stale_stopped: Callable[[], int] | None = None
        self.registry.register(_GatewayCounters(self))
        # the latest readings not yet applied to the gauges (replaced whole, never mutated)
        self._pending_gpus: tuple[GpuSample, ...] | list[GpuSample] | None = None
        self._pending_rdma: tuple[RdmaSample, ...] | list[RdmaSample] | None = None
        self.registry.register(
            _LatestReadings(
                self,
                (
                    self.gpu_utilization, self.gpu_sm_clock, self.gpu_pcie, self.gpu_nvlink,
                    self.gpu_ecc, self.gpu_xid, self.gpu_last_xid, self.rdma_bytes,
                    self.rdma_counter, self.rdma_rate,
                ),
            )
        )  # fmt: skip

    def watch_gateway(self, stale_stopped: Callable[[], int]) -> None:
        """Expose the node's gateway's counters (read at each collection)."""
        self._stale_stopped = stale_stopped

    def _set(self, gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
        """Set a labelled gauge; None (not reported) leaves it absent (or as it was)."""
        if value is not None:
            gauge.labels(*labels).set(value)

    def observe_gpus(self, samples: tuple[GpuSample, ...] | list[GpuSample]) -> None:
        """The GPU gauges show ``samples`` from the next collection on."""
        self._pending_gpus = samples

    def observe_rdma(self, samples: tuple[RdmaSample, ...] | list[RdmaSample]) -> None:
        """The RDMA gauges show ``samples`` from the next collection on."""
        self._pending_rdma = samples

    def apply_pending(self) -> None:
        """Set the GPU and RDMA gauges from the latest readings handed over (at collection,
        in the scraping thread; a reference swap keeps it consistent with the uplink)."""
        gpus, self._pending_gpus = self._pending_gpus, None
        rdma, self._pending_rdma = self._pending_rdma, None
        if gpus is not None:
            self._apply_gpus(gpus)
        if rdma is not None:
            self._apply_rdma(rdma)

    def _apply_gpus(self, samples: tuple[GpuSample, ...] | list[GpuSample]) -> None:
        set_ = self._set
        for s in samples:
            gpu = str(s.index)
            set_(self.gpu_utilization, (gpu,), s.utilization)
            set_(self.gpu_sm_clock, (gpu,), s.sm_clock_mhz)
            set_(self.gpu_pcie, (gpu, "tx"), s.pcie_tx_bytes_per_s)
            set_(self.gpu_pcie, (gpu, "rx"), s.pcie_rx_bytes_per_s)
            set_(self.gpu_nvlink, (gpu, "tx"), s.nvlink_tx_bytes_per_s)
            set_(self.gpu_nvlink, (gpu, "rx"), s.nvlink_rx_bytes_per_s)
            set_(self.gpu_ecc, (gpu, "corrected"), s.ecc_corrected)
            set_(self.gpu_ecc, (gpu, "uncorrected"), s.ecc_uncorrected)
            set_(self.gpu_xid, (gpu,), s.xid_errors)
            set_(self.gpu_last_xid, (gpu,), s.last_xid)

    def _apply_rdma(self, samples: tuple[RdmaSample, ...] | list[RdmaSample]) -> None:
        set_ = self._set
        for s in samples:
            port = str(s.port)
            set_(self.rdma_bytes, (s.device, port, "tx"), s.tx_bytes_per_s)
            set_(self.rdma_bytes, (s.device, port, "rx"), s.rx_bytes_per_s)
            for name, value in s.counters.items():
                set_(self.rdma_counter, (s.device, port, name), value)
            for name, rate in s.rates.items():
                set_(self.rdma_rate, (s.device, port, name), rate)


class _LatestReadings:
    """A Prometheus collector for the GPU and RDMA gauges: brings them up to the latest
    readings, then collects them."""

    def __init__(self, metrics: AgentMetrics, gauges: tuple[Gauge, ...]) -> None:
        self._metrics = metrics
        self._gauges = gauges

    def describe(self) -> Iterator[Metric]:
        for gauge in self._gauges:
            yield from gauge.describe()

    def collect(self) -> Iterator[Metric]:
        self._metrics.apply_pending()
        for gauge in self._gauges:
            yield from gauge.collect()


class _GatewayCounters:
    """A Prometheus collector for the gateway's own counters (none without a gateway)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        read = self._metrics._stale_stopped
        if read is not None:
            yield CounterMetricFamily(
                "orl_agent_gateway_stale_stopped",
                "Requests the gateway stopped (finish reason stale) because new weights "
                "landed more than their max_staleness versions past their oldest token",
                value=read(),
            )

"""A spoofed telemetry sample (issue 14): implausible figures are rejected at ingest,
counted and logged, and the compute loop plans as if the sample had never arrived
(before, such a sample made it predict a step of over 100,000 s and act on it).

A real controller over gRPC; the agents are the test, reporting over ReportTelemetryBatch
as an agent does; the compute loop's commands go to a recorder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import structlog

from fabric_controller import scheduling
from fabric_controller.drivers.agents import Resolved
from fabric_controller.scheduler_loop import ComputeScheduler
from orchestrrl.model import Wiring
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from orchestrrl.v1 import node_agent_pb2 as npb
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from sim_backends.harness import Fabric, start_fabric

pytestmark = pytest.mark.component

GEN = ("gen0-n0", "gen0-n1")
NOW = time.time()
PERF = PerfModel(QWEN25_14B, H800)  # the compute loop's default


class Recorder:
    """An AgentClient that records the commands and does them (on nothing)."""

    def __init__(self, node: str, log: list[tuple[str, str]]) -> None:
        self.node = node
        self._log = log

    async def reshard(self, command_id: str, layout: Sequence[int]) -> npb.ReshardResponse:
        self._log.append(("reshard", self.node))
        return npb.ReshardResponse(command_id=command_id, new_layout=list(layout))

    async def export_requests(
        self, command_id: str, request_ids: Sequence[str], hold_s: float
    ) -> npb.ExportRequestsResponse:
        self._log.append(("export", self.node))
        return npb.ExportRequestsResponse(command_id=command_id)

    async def import_requests(
        self,
        command_id: str,
        source_node: str,
        instance: int,
        recompute: bool,
        requests: Sequence[npb.RequestState],
    ) -> npb.ImportRequestsResponse:
        self._log.append(("import", self.node))
        return npb.ImportRequestsResponse(command_id=command_id)

    async def resolve_export(
        self,
        command_id: str,
        export_id: str,
        restore: bool,
        *,
        destination: tuple[str, str] | None = None,
    ) -> Resolved:
        self._log.append(("resolve", self.node))
        return Resolved((), (), "")


def sample(node: str, requests: list[tuple[str, int, int, int, int]]) -> npb.TelemetrySample:
    """A running TP2x4 node's sample; requests: (id, instance, prompt, generated, cap)."""
    s = npb.TelemetrySample(node=node, timestamp=NOW, tp_layout=[2, 2, 2, 2])
    s.engine_state = npb.ENGINE_STATE_RUNNING
    s.engine.has_progress = True
    s.engine.step = 1
    s.engine.running_requests = sum(1 for r in requests if r[1] >= 0)
    s.engine.tokens_per_s = 40.0 * s.engine.running_requests
    for rid, instance, prompt, generated, cap in requests:
        s.engine.requests.add(
            request_id=rid,
            instance=instance,
            prompt_tokens=prompt,
            generated_tokens=generated,
            max_tokens=cap,
        )
    for k in range(8):
        s.gpus.add(
            index=k, utilization=0.5, memory_used_bytes=40 << 30, memory_total_bytes=80 << 30
        )
    return s


# gen0-n0 runs a step's long tail, one request per instance; gen0-n1 is idle
TAIL = [(f"tail-{k}", k, 512, 6000, 16384) for k in range(4)]
SPOOFS = {
    "generated beyond the cap": [("s-0", 0, 512, 3_000_000, 16384)],
    "absurd cap": [("s-0", 0, 512, 100, 4_000_000_000)],
    "NaN": [("s-0", 0, 512, 100, 16384)],
    "more running than seats": [(f"s-{k}", k % 4, 16, 1, 16384) for k in range(8 * 256 + 1)],
}


PROBLEM = {
    "generated beyond the cap": "engine.requests.generated_tokens = 3000000: at most its "
    "max_tokens (16384)",
    "absurd cap": "engine.requests.max_tokens = 4000000000",
    "NaN": "engine.tokens_per_s = nan",
    "more running than seats": "engine.running_requests = 2049: at most 8 GPUs x 256 seats",
}


def spoofed(kind: str) -> npb.TelemetrySample:
    s = sample("gen0-n1", SPOOFS[kind])
    if kind == "NaN":
        s.engine.tokens_per_s = float("nan")
    return s


async def report(address: str, samples: list[npb.TelemetrySample]) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        batches = [npb.TelemetryBatch(samples=[s.SerializeToString()]) for s in samples]
        await stub.ReportTelemetryBatch(iter(batches), timeout=5)


async def start(wiring: Wiring, tmp_path: Path) -> Fabric:
    f = await start_fabric(wiring, tmp_path / "s.db", deadline_s=30.0)
    async with grpc.aio.insecure_channel(f.address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        for k, node in enumerate(GEN):
            status = npb.NodeStatus(node=node, max_num_seqs=256)
            status.gpus.extend(npb.GpuInfo(index=i) for i in range(8))
            await stub.Register(
                pb.RegisterRequest(node=node, agent_address=f"127.0.0.1:{k + 1}", status=status),
                timeout=5,
            )
    await report(f.address, [sample("gen0-n0", TAIL), sample("gen0-n1", [])])
    return f


async def plan_round(f: Fabric) -> tuple[scheduling.Decision, list[tuple[str, str]]]:
    """One round of a fresh compute loop (same clock each time): its decision, its commands."""
    sent: list[tuple[str, str]] = []
    loop = ComputeScheduler(
        f.controller, lambda node, _addr: Recorder(node, sent), wall_clock=lambda: NOW + 1
    )
    return await loop.round(), sent


def predicted(d: scheduling.Decision) -> tuple[float, float]:
    assert d.plan is not None, d.why
    return d.plan.prediction.keep_makespan_s, d.plan.prediction.planned_makespan_s


@pytest.mark.parametrize("kind", sorted(SPOOFS))
async def test_a_spoofed_sample_does_not_change_the_compute_plan(
    example_wiring: Wiring, tmp_path: Path, kind: str
) -> None:
    f = await start(example_wiring, tmp_path)
    metrics = f.controller.metrics.registry
    try:
        before, sent_before = await plan_round(f)
        assert sent_before, before.plan.explain() if before.plan else before.why  # it acts
        stored = {r.name: r.telemetry for r in f.controller.registry.records()}

        # what the spoof would have made the loop do, had it reached the planner
        views = [
            scheduling.node_view(
                n, 8, spoofed(kind) if n == "gen0-n1" else stored[n], max_num_seqs=256
            )
            for n in GEN
        ]
        fooled = [v for v in views if isinstance(v, scheduling.NodeView)]
        assert len(fooled) == len(GEN), views  # the loop would take it as it is
        tracker = scheduling.observe(scheduling.StepTracker(), fooled, NOW + 1, 8)
        config = scheduling.SchedulingConfig()
        decision = scheduling.decide(tracker, scheduling.build_state(fooled), PERF, NOW + 1, config)
        assert predicted(decision) != predicted(before)

        with structlog.testing.capture_logs() as logs:
            await report(f.address, [spoofed(kind)])
            await report(f.address, [spoofed(kind)])  # the warning is rate-limited
        again, sent_again = await plan_round(f)
        assert predicted(again) == predicted(before)
        assert sent_again == sent_before
        after = {r.name: r.telemetry for r in f.controller.registry.records()}
        assert after["gen0-n1"] is stored["gen0-n1"], "the spoofed sample was stored"
        rejected = "orl_telemetry_rejected_total"
        assert metrics.get_sample_value(rejected, {"reason": "implausible"}) == 2
        warnings = [x for x in logs if x["event"] == "telemetry_sample_implausible"]
        assert len(warnings) == 1 and warnings[0]["node"] == "gen0-n1", logs
        assert warnings[0]["problem"].startswith(PROBLEM[kind]), warnings[0]["problem"]
    finally:
        await f.stop()

"""Request-size caps of the gRPC services: what a real cluster needs, with room to spare.

Every request a server built by ``grpcutil.start_server`` decodes is checked against
``REQUEST_CAPS`` before its servicer sees it (``check_request``); a request beyond a cap
is refused with INVALID_ARGUMENT naming the field, its size and the cap, and nothing is
done. So a hostile or broken caller cannot make a daemon build huge structures or huge
messages. Each cap is also stated in the comments of proto/orchestrrl/v1/*.proto: keep
both in step. (Caps that depend on the server, such as the pairs of one
ApplyCrossConnects batch, are checked by the server itself.)
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

from orchestrrl import errors

# Text fields, in characters
MAX_NAME_CHARS = 253  # node names (a DNS name's limit)
MAX_ID_CHARS = 128  # request_id, command_id, session_id: a UUID or a step label fits
MAX_ADDRESS_CHARS = 261  # HOST:PORT: a DNS name, a colon and a port
MAX_TEXT_CHARS = 1024  # free text (FailNextApply's message)
MAX_VERSION_CHARS = 64  # a checkpoint's version (orchestrrl.checkpoint.VERSION_PATTERN)
MAX_CHECKSUM_CHARS = 64  # a checkpoint's checksum: SHA-256 in hex
MAX_FILE_CHARS = 64  # a checkpoint's file name (config.json, model.safetensors, ...)

# Repeated fields, in entries
MAX_TELEMETRY_BATCH_SAMPLES = 1024  # per TelemetryBatch (an agent sends at most 100)
MAX_MIGRATION_REQUESTS = 4096  # request ids per ExportRequests, requests per ImportRequests
MAX_ROUTES = 16384  # routes per ApplyRoutes (a node needs one per destination prefix)
MAX_RULES = 1024  # policy rules per ApplyRoutes
MAX_ROCE_NICS = 64  # NICs per ConfigureRoce
MAX_TP_LAYOUT = 1024  # instances per Reshard (a node has at most one per GPU)
MAX_NODE_GPUS = 1024  # GPUs in a node's status (Register)
MAX_NODE_NICS = 1024  # NICs in a node's status (Register)

# Largest request message a server accepts (gRPC's own default, stated): every valid
# request of these services is far smaller. The simulated switch takes 1 MiB: a batch
# over all of its 4096 ports is about 40 KB.
MAX_RECEIVE_BYTES = 4 * 1024 * 1024
OCS_MAX_RECEIVE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Cap:
    """At most ``limit`` characters (a string field), or entries (a repeated field), in
    the field at ``path`` (dotted, e.g. ``status.gpus``); ``each``: also at most that many
    characters in every entry of a repeated string field."""

    path: str
    limit: int
    what: str  # what the field holds, for the error: "a node name", "samples"
    each: int = 0

    def check(self, message: Any) -> None:
        value = message
        for part in self.path.split("."):
            value = getattr(value, part)
        if isinstance(value, str):
            check_text(self.path, value, self.limit, self.what)
            return
        check_count(self.path, value, self.limit, self.what)
        if self.each:
            for k, entry in enumerate(value):
                check_text(f"{self.path}[{k}]", entry, self.each, "an id")


def _command(*caps: Cap) -> tuple[Cap, ...]:
    return (Cap("command_id", MAX_ID_CHARS, "an id"), *caps)


NAME = "a node name from the wiring file"
REQUEST_CAPS: dict[str, tuple[Cap, ...]] = {
    f"orchestrrl.v1.{name}": caps
    for name, caps in {
        # FabricController
        "RegisterRequest": (
            Cap("node", MAX_NAME_CHARS, NAME),
            Cap("agent_address", MAX_ADDRESS_CHARS, "HOST:PORT"),
            Cap("status.gpus", MAX_NODE_GPUS, "GPUs"),
            Cap("status.nics", MAX_NODE_NICS, "NICs"),
        ),
        "HeartbeatRequest": (
            Cap("node", MAX_NAME_CHARS, NAME),
            Cap("session_id", MAX_ID_CHARS, "a session id"),
        ),
        "TelemetrySample": (Cap("node", MAX_NAME_CHARS, NAME),),  # ReportTelemetry
        "TelemetryBatch": (Cap("samples", MAX_TELEMETRY_BATCH_SAMPLES, "samples"),),
        "SetPhaseRequest": (
            Cap("request_id", MAX_ID_CHARS, "an id"),
            Cap("checkpoint.version", MAX_VERSION_CHARS, "a checkpoint version"),
            Cap("checkpoint.source_node", MAX_NAME_CHARS, NAME),
            Cap("checkpoint.checksum", MAX_CHECKSUM_CHARS, "a SHA-256 in hex"),
            Cap("checkpoint.in_flight", MAX_ID_CHARS, '"finish" or "resume"'),
        ),
        "SetModeRequest": (
            Cap("mode", MAX_ID_CHARS, '"phased" or "async"'),
            Cap("request_id", MAX_ID_CHARS, "an id"),
        ),
        # NodeAgent
        "ReshardRequest": _command(Cap("tp_layout", MAX_TP_LAYOUT, "instances")),
        "ApplyRoutesRequest": _command(
            Cap("routes", MAX_ROUTES, "routes"),
            Cap("rules", MAX_RULES, "rules"),
            Cap("netns", MAX_NAME_CHARS, "a network namespace name"),
        ),
        "ConfigureRoceRequest": _command(Cap("nics", MAX_ROCE_NICS, "NICs")),
        "DrainRequest": _command(),
        "ResumeRequest": _command(),
        "ExportRequestsRequest": _command(
            Cap("request_ids", MAX_MIGRATION_REQUESTS, "request ids", each=MAX_ID_CHARS)
        ),
        "ImportRequestsRequest": _command(
            Cap("source_node", MAX_NAME_CHARS, NAME),
            Cap("requests", MAX_MIGRATION_REQUESTS, "requests"),
        ),
        "ResolveExportRequest": _command(
            Cap("export_command_id", MAX_ID_CHARS, "an id"),
            Cap("destination_node", MAX_NAME_CHARS, NAME),
            Cap("destination_address", MAX_ADDRESS_CHARS, "HOST:PORT"),
        ),
        "FollowRequestRequest": (Cap("request_id", MAX_ID_CHARS, "an id"),),
        "UpdateWeightsRequest": _command(
            Cap("version", MAX_VERSION_CHARS, "a checkpoint version"),
            Cap("checksum", MAX_CHECKSUM_CHARS, "a SHA-256 in hex"),
            Cap("source_node", MAX_NAME_CHARS, NAME),
            Cap("source_address", MAX_ADDRESS_CHARS, "HOST:PORT"),
            Cap("in_flight", MAX_ID_CHARS, '"finish" or "resume"'),
        ),
        # CheckpointStore
        "GetCheckpointRequest": (
            Cap("version", MAX_VERSION_CHARS, "a checkpoint version"),
            Cap("checksum", MAX_CHECKSUM_CHARS, "a SHA-256 in hex"),
        ),
        "ReadCheckpointRequest": (
            Cap("version", MAX_VERSION_CHARS, "a checkpoint version"),
            Cap("checksum", MAX_CHECKSUM_CHARS, "a SHA-256 in hex"),
            Cap("file", MAX_FILE_CHARS, "a file of the checkpoint"),
        ),
        # OpticalSwitch (the pairs of a batch: at most port_count // 2 per list, checked
        # by the switch) and OcsFaultInjection
        "ApplyCrossConnectsRequest": (Cap("request_id", MAX_ID_CHARS, "an id"),),
        "FailNextApplyRequest": (Cap("message", MAX_TEXT_CHARS, "a message"),),
    }.items()
}


def check_request(message: Any) -> None:
    """InvalidArgument when a decoded request exceeds a cap of ``REQUEST_CAPS``."""
    descriptor = getattr(message, "DESCRIPTOR", None)
    caps = REQUEST_CAPS.get(getattr(descriptor, "full_name", ""), ())
    for cap in caps:
        cap.check(message)


def check_text(field: str, value: str, limit: int, what: str) -> str:
    """``value`` when at most ``limit`` characters long; InvalidArgument naming ``what``
    the field holds otherwise (the value shown cut)."""
    if len(value) > limit:
        raise errors.field_error(field, value, f"{what}, at most {limit} characters")
    return value


def check_count(field: str, items: Sized, limit: int, what: str) -> None:
    """InvalidArgument when ``items`` has more than ``limit`` entries."""
    if len(items) > limit:
        raise errors.field_error(field, f"{len(items)} {what}", f"at most {limit} {what}")

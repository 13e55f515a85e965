"""Messages between the WorkerPool (parent) and its worker processes, over pipes.

Every command carries a sequence number unique within the pool; the reply to it
carries the same number, so a late reply to a command that timed out is recognised and
dropped. Transfers of one command are tagged from its sequence number (see :func:`tag`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from node_agent.reshard.plan import ModelSpec, ReshardPlan

FailureMode = Literal["raise", "stall", "exit"]
FAILURE_MODES: tuple[FailureMode, ...] = ("raise", "stall", "exit")
INJECTED_EXIT_CODE = 86
TAG_INDEX_BITS = 22  # transfers per command; the sequence number fills the bits above


@dataclass(frozen=True)
class InjectedFailure:
    """Make worker ``rank`` fail in the middle of a weight move, after it has posted all
    its receives and ``after_sends`` of its sends:

    - ``raise``: it raises and reports the error (the process lives on);
    - ``stall``: it stops making progress until the pool aborts the move (a hung link);
    - ``exit``: the process exits at once (a crash: that rank's weights are lost).
    """

    rank: int
    after_sends: int = 1
    mode: FailureMode = "raise"


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    store_host: str
    store_port: int
    backend: str
    model: ModelSpec
    seed: int
    layout: tuple[int, ...]
    timeout_s: float


# -- commands (parent -> worker) ---------------------------------------------------------


@dataclass(frozen=True)
class Reshard:
    """Stage the shards of ``plan.new_layout``; the current shards stay in use."""

    seq: int
    plan: ReshardPlan
    inject: InjectedFailure | None = None


@dataclass(frozen=True)
class Checksum:
    """Block digests of the current shards, or of those staged by command ``staged``."""

    seq: int
    layout: tuple[int, ...]
    staged: int | None = None


@dataclass(frozen=True)
class Commit:
    """Swap in the shards staged by command ``target``."""

    seq: int
    target: int


@dataclass(frozen=True)
class Abort:
    """Stop transfers of command ``target`` (and anything earlier), drop staged shards and
    join a fresh process group, since transfers of the old one may be left half-done."""

    seq: int
    target: int


@dataclass(frozen=True)
class Stop:
    seq: int


Command = Reshard | Checksum | Commit | Abort | Stop


# -- replies (worker -> parent) ----------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    rank: int
    seq: int
    pid: int
    device: str
    shard_bytes: int


@dataclass(frozen=True)
class Staged:
    rank: int
    seq: int
    transfer: WorkerTransfer


@dataclass(frozen=True)
class Checksums:
    """Per tensor, the SHA-256 of each block of this rank's shard, in order."""

    rank: int
    seq: int
    blocks: dict[str, list[bytes]]
    seconds: float


@dataclass(frozen=True)
class Done:
    rank: int
    seq: int


@dataclass(frozen=True)
class Failed:
    rank: int
    seq: int
    error: str


Reply = Ready | Staged | Checksums | Done | Failed


# -- results of the pool -------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerTransfer:
    """What one worker did while staging a new layout."""

    rank: int
    sent_bytes: int
    received_bytes: int
    copied_bytes: int  # kept locally, copied into a differently shaped shard
    transfers: int  # point-to-point sends and receives posted
    seconds: float  # all of the staging on this worker, of which:
    local_s: float  # allocating the new shards and copying what is kept
    transfer_s: float  # posting the sends and receives and waiting for all of them
    unpack_s: float  # copying received pieces that land non-contiguous into place


@dataclass(frozen=True)
class ReshardReport:
    old_layout: tuple[int, ...]
    new_layout: tuple[int, ...]
    bytes_moved: int  # over torch.distributed, as the workers counted them
    plan_bytes: int  # as planned; equal to bytes_moved
    move_s: float  # staging: local copies and every transfer, until the last worker is done
    verify_s: float  # checksums of the staged full tensors
    commit_s: float
    workers: tuple[WorkerTransfer, ...]
    checksums: dict[str, str]

    @property
    def senders(self) -> int:
        return sum(1 for w in self.workers if w.sent_bytes)


def tag(seq: int, index: int) -> int:
    """The message tag of transfer ``index`` of command ``seq`` (fits a C int)."""
    if not 0 <= index < 1 << TAG_INDEX_BITS:
        raise ValueError(f"transfer index {index} exceeds {1 << TAG_INDEX_BITS} per command")
    return (seq % 256) << TAG_INDEX_BITS | index

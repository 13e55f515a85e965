"""The standby's answer (orchestrrl.leader): how it reads, and how clients parse it."""

from __future__ import annotations

import grpc
import pytest

from fabric_controller.election import past_due
from orchestrrl import errors, leader

pytestmark = pytest.mark.unit


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str | bytes], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


def standby(leader_address: str | None) -> grpc.aio.AioRpcError:
    return rpc_error(
        grpc.StatusCode.UNAVAILABLE,
        leader.not_leader_message(leader_address),
        leader.not_leader_metadata(leader_address),
    )


def test_the_standby_answer_reads_as_the_contract_says() -> None:
    assert leader.LEADER_METADATA_KEY == "orl-leader"
    assert leader.not_leader_message("10.0.0.2:50051") == (
        "not the leader; the leader is at 10.0.0.2:50051"
    )
    assert leader.not_leader_message(None) == "not the leader; no leader elected yet"
    assert leader.not_leader_metadata("10.0.0.2:50051") == (("orl-leader", "10.0.0.2:50051"),)
    assert leader.not_leader_metadata(None) == ()


def test_leader_of_a_standby_answer() -> None:
    assert leader.leader_of(standby("ctl-b.example:50051")) == "ctl-b.example:50051"
    assert leader.leader_of(standby("[::1]:50051")) == "[::1]:50051"
    assert leader.is_not_leader(standby("ctl-b.example:50051"))
    # a standby that knows no leader: recognised, no address
    assert leader.leader_of(standby(None)) is None
    assert leader.is_not_leader(standby(None))


@pytest.mark.parametrize(
    "error",
    [
        # not UNAVAILABLE: the metadata is not a redirect
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad phase", (("orl-leader", "ctl-b:50051"),)),
        # UNAVAILABLE of a connection failure
        rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
        # a value that cannot be dialled
        rpc_error(grpc.StatusCode.UNAVAILABLE, "not the leader", (("orl-leader", "ctl-b"),)),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "not the leader", (("orl-leader", "ctl-b:0"),)),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "not the leader", (("orl-leader", "a b:1"),)),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "not the leader", (("orl-leader", ""),)),
        # another key
        rpc_error(grpc.StatusCode.UNAVAILABLE, "not the leader", (("orl-leaders", "b:1"),)),
    ],
)
def test_no_leader_is_read_from_anything_else(error: grpc.aio.AioRpcError) -> None:
    assert leader.leader_of(error) is None


def test_only_unavailable_with_the_prefix_is_a_standby_answer() -> None:
    assert not leader.is_not_leader(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert not leader.is_not_leader(
        rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "not the leader; no leader elected yet")
    )


async def test_call_tells_a_standby_from_an_unreachable_controller_from_other_errors() -> None:
    async def fails(error: grpc.aio.AioRpcError) -> None:
        raise error

    with pytest.raises(leader.NotLeader) as redirected:
        await leader.call("controller a:1: SetPhase", fails(standby("b:2")))
    assert redirected.value.leader == "b:2"
    assert str(redirected.value) == (
        "controller a:1: SetPhase: not the leader; the leader is at b:2"
    )
    assert isinstance(redirected.value, errors.Unavailable)
    with pytest.raises(leader.NotLeader) as unknown:
        await leader.call("SetPhase", fails(standby(None)))
    assert unknown.value.leader is None
    with pytest.raises(leader.Unreachable, match="SetPhase: UNAVAILABLE: connection refused"):
        await leader.call(
            "SetPhase", fails(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
        )
    with pytest.raises(errors.InvalidArgument, match="SetPhase: bad phase") as other:
        await leader.call(
            "SetPhase", fails(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad phase"))
        )
    assert not isinstance(other.value, errors.Unavailable)
    deadline = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")
    with pytest.raises(errors.Unavailable) as late:
        await leader.call("SetPhase", fails(deadline))
    assert not isinstance(late.value, leader.NotLeader | leader.Unreachable)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a:1", ("a:1",)),
        ("a:1,b:2", ("a:1", "b:2")),
        (" a:1 , b:2 ", ("a:1", "b:2")),
        (["a:1", "[::1]:2"], ("a:1", "[::1]:2")),
        (("x.example:50051",), ("x.example:50051",)),
    ],
)
def test_parse_addresses(value: str | list[str], expected: tuple[str, ...]) -> None:
    assert leader.parse_addresses(value, "controller") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "--controller='' is not valid: HOST:PORT, or several separated by commas"),
        ([], "--controller=[] is not valid: HOST:PORT, or several"),
        ("a:1,", "--controller='a:1,' is not valid: an empty address in the list"),
        ("a", "--controller='a' is not valid: expected HOST:PORT"),
        ("a:1,b", "--controller='b' is not valid: expected HOST:PORT"),
        ("a:0", "--controller='a:0' is not valid: port must be 1..65535"),
        ("a:1,b:2,a:1", "--controller='a:1,b:2,a:1' is not valid: each address once (a:1"),
        (",".join(f"h{i}:1" for i in range(17)), "is not valid: at most 16 controller addresses"),
        ([1, 2], "--controller=[1, 2] is not valid: a HOST:PORT string or a list of them"),
    ],
)
def test_parse_addresses_refuses_with_the_field_the_value_and_the_rule(
    value: object, message: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        leader.parse_addresses(value, "--controller")  # type: ignore[arg-type]
    assert message in str(info.value)


class RecordingContext:
    """The part of a grpc.aio servicer context that abort_not_leader uses."""

    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] | None = None
        self.aborted: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(
        self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self.aborted = (code, details, metadata)
        raise grpc.aio.AbortError()


@pytest.mark.parametrize("leader_address", ["10.0.0.2:50051", None])
async def test_abort_not_leader_sets_the_trailer_then_aborts(leader_address: str | None) -> None:
    context = RecordingContext()
    with pytest.raises(grpc.aio.AbortError):
        await leader.abort_not_leader(context, leader_address)
    expected = leader.not_leader_metadata(leader_address)
    assert context.trailing == expected
    assert context.aborted == (
        grpc.StatusCode.UNAVAILABLE,
        leader.not_leader_message(leader_address),
        expected,
    )


def test_a_standby_names_no_leader_whose_lease_is_past_due() -> None:
    assert leader.not_leader_message(None, overdue="10.0.0.2:50051") == (
        "not the leader; the leader at 10.0.0.2:50051 is past due renewing its lease (frozen "
        "or partitioned?): a standby takes over when the lease ends"
    )
    # (a leader named wins: the message names it as the leader)
    assert leader.not_leader_message("10.0.0.3:1", overdue="x:1").endswith("is at 10.0.0.3:1")


@pytest.mark.parametrize(
    ("remaining", "granted", "due"),
    [
        (1, 2, False),  # a 2 s lease renewed within the last second (etcd rounds down)
        (0, 2, True),  # not renewed for a second: two thirds of its renewals missed
        (-1, 2, True),  # gone
        (2, 3, False),
        (1, 3, False),  # 1-2 s since its renewal (every 1 s): maybe one late
        (0, 3, True),
        (7, 10, False),
        (3, 10, True),
        (5, 0, True),  # no TTL granted: not a live lease
    ],
)
def test_a_lease_is_past_due_below_a_third_of_its_ttl(
    remaining: int, granted: int, due: bool
) -> None:
    assert past_due(remaining, granted) is due

"""Server options: a controller of thousands of agents must take their reconnect storm."""

from __future__ import annotations

import pytest

from orchestrrl import grpcutil

pytestmark = pytest.mark.unit


def test_small_servers_keep_grpcs_pending_call_limits() -> None:
    for clients in (0, 500):
        opts = dict(grpcutil.server_options(clients))
        assert "grpc.server.max_pending_requests" not in opts
        assert opts["grpc.http2.bdp_probe"] == 0  # no PING per upload to wake the agents


def test_a_controller_of_2048_agents_lets_every_agent_open_its_streams_at_once() -> None:
    # above gRPC's default of 1000 waiting calls, new calls are refused at random (CANCELLED)
    opts = dict(grpcutil.server_options(2048))
    assert opts["grpc.server.max_pending_requests"] == 4096
    assert opts["grpc.server.max_pending_requests_hard_limit"] == 8192
    assert opts["grpc.keepalive_time_ms"] == 30_000  # the shared options stay


def test_servers_accept_the_keepalive_pings_that_channels_send() -> None:
    """A server that sees pings more often than its min_ping_interval_without_data_ms
    (gRPC's default: 5 minutes) answers the third with GOAWAY "too_many_pings" and the
    next call on that channel fails UNAVAILABLE (seen: a controller's UpdateWeights after
    a long training phase). Every server must accept what every channel sends."""
    server = dict(grpcutil.server_options(0))
    channel = dict(grpcutil.CHANNEL_OPTIONS)
    assert (
        server["grpc.http2.min_ping_interval_without_data_ms"] <= channel["grpc.keepalive_time_ms"]
    )
    assert server["grpc.keepalive_permit_without_calls"] == 1

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

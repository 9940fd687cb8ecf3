"""``grpc_server.bind`` listens where ``--host`` says, an IPv6 address included (gRPC wants it in brackets: given
``::1`` bare, every service refused to start with "cannot listen on ::1:0")."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from pagedserve.services.common.grpc_server import add_health, bind, check_health, host_port, set_serving
from tests.e2e.ports import has_ipv6_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]"])
def test_a_server_bound_to_host_answers_there(host):
    if ":" in host and not has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health = add_health(server)
    port = bind(server, host, 0)
    server.start()
    try:
        set_serving(health, True)
        assert check_health(host_port(host.strip("[]"), port))
    finally:
        server.stop(None)


def test_host_port_brackets_an_ipv6_address_once():
    assert [host_port(h, 5) for h in ("127.0.0.1", "gw.local", "::1", "[::1]", "::")] == [
        "127.0.0.1:5", "gw.local:5", "[::1]:5", "[::1]:5", "[::]:5"]

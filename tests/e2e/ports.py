"""Free TCP ports for the services the tests start: each pytest-xdist worker picks from its own share
of a range below the ephemeral ports, and never hands the same port out twice."""

from __future__ import annotations

import os
import random
import socket

PORT_RANGE = range(20000, 32000)
"""Ports the tests' services bind: below the ephemeral range (32768+), where a port the OS picks can
be taken, between the check and a service's bind seconds later, by another test's outgoing connection."""


def worker_ports() -> range:
    """This pytest-xdist worker's share of ``PORT_RANGE`` (all of it without xdist): two workers that
    pick the same free port at once would both bind it, and one service would exit with EADDRINUSE."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = len(PORT_RANGE) // count
    return range(PORT_RANGE.start + index * share, PORT_RANGE.start + (index + 1) * share)


_handed_out: set[int] = set()  # ports free_port gave this process: free until their service binds them


def free_port(span: int = 1) -> int:
    """A TCP port P of this worker's share (``worker_ports``) with P .. P + span - 1 free on
    127.0.0.1 now and never handed out before by this process (two calls before the services bind
    could otherwise pick the same port: a gateway once failed with EADDRINUSE at start-up).

    Raises:
        RuntimeError: none found in 200 tries.
    """
    rng = random.Random()
    ports = worker_ports()
    for _ in range(200):
        port = rng.randrange(ports.start, ports.stop - span)
        if _handed_out.intersection(range(port, port + span)):
            continue
        sockets = [socket.socket() for _ in range(span)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
        _handed_out.update(range(port, port + span))
        return port
    raise RuntimeError(f"no {span} free port(s) in {ports}")


def has_ipv6_loopback() -> bool:
    """Whether this machine can listen on ``::1`` (some containers have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False

"""The ports of `pagedserve up`, checked before anything starts: a second stack beside a running one
is told so, and how to start it beside the first (``--port-offset``), instead of attaching to the
first stack's Redis and failing on a port with a line from gRPC's C++ core."""

from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from pagedserve.local_redis import BIND_ADDRESSES, REDIS_PORT, redis_answers
from pagedserve.services.common.grpc_server import host_port

LOCAL_HOSTS = tuple(BIND_ADDRESSES)
"""Redis hosts `pagedserve up` starts a Redis on when none answers."""

OFFSET_STEP = 100
"""``--port-offset`` values suggested are multiples of this."""

MAX_OFFSET_TRIES = 20
"""How many multiples of ``OFFSET_STEP`` are tried for a suggestion."""

PORT_OFFSET_HELP = ("add this to every port of the stack (gRPC, HTTP, schedulers, metrics, and the local Redis's) "
                    "to start a second stack beside a running one")


class PortsInUseError(OSError):
    """A port the stack needs is in use (``conflict_message`` says what to do)."""


@dataclass(frozen=True)
class Port:
    """One port the stack listens on: what it is for, and where."""

    what: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{host_port(self.host, self.port)} ({self.what})"


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a bind with SO_REUSEADDR fails only then).

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def local_redis_port(redis_url: str) -> int | None:
    """The port of a Redis `up` would start for ``redis_url`` (a local address), else None."""
    url = urlparse(redis_url)
    return (url.port or REDIS_PORT) if url.hostname in LOCAL_HOSTS else None


def local_redis(redis_url: str) -> Port | None:
    """The port of a Redis `up` would start for ``redis_url`` (a local address), as one of the stack's ports, on
    the URL's host (where that Redis listens: ``local_redis.BIND_ADDRESSES``)."""
    port = local_redis_port(redis_url)
    return None if port is None else Port("Redis", urlparse(redis_url).hostname, port)


def moved_redis_url(redis_url: str, offset: int) -> str:
    """``redis_url`` with its port moved by ``offset`` when it is local (a remote Redis stays)."""
    port = local_redis_port(redis_url)
    if port is None or not offset:
        return redis_url
    url = urlparse(redis_url)
    address, userinfo = host_port(url.hostname, port + offset), url.netloc.rpartition("@")[0]
    return url._replace(netloc=f"{userinfo}@{address}" if userinfo else address).geturl()


def apply_port_offset(args: argparse.Namespace) -> argparse.Namespace:
    """`up`'s parsed flags with ``--port-offset`` added to every port (metrics off stays off).

    Raises:
        ValueError: a negative offset.
    """
    offset = args.port_offset
    if offset < 0:
        raise ValueError(f"--port-offset must be 0 or more, got {offset}")
    if not offset:
        return args
    moved = {name: getattr(args, name) + offset for name in ("port", "http_port", "scheduler_port")}
    if args.metrics_port:
        moved["metrics_port"] = args.metrics_port + offset
    past = [f"--{name.replace('_', '-')} {port - offset}" for name, port in moved.items() if port > 65535]
    redis_port = local_redis_port(args.redis_url)
    if redis_port is not None and redis_port + offset > 65535:
        past.append(f"the local Redis's port {redis_port}")
    if past:
        raise ValueError(f"--port-offset {offset} moves {', '.join(past)} past port 65535; use a smaller offset")
    return argparse.Namespace(**{**vars(args), **moved, "redis_url": moved_redis_url(args.redis_url, offset)})


def ports_in_use(ports: list[Port]) -> list[Port]:
    """Those of ``ports`` something listens on now."""
    return [p for p in ports if port_in_use(p.host, p.port)]


def free_offset(ports: list[Port]) -> int | None:
    """The smallest multiple of ``OFFSET_STEP`` that moves every one of ``ports`` to a free port."""
    for k in range(1, MAX_OFFSET_TRIES + 1):
        offset = k * OFFSET_STEP
        moved = [Port(p.what, p.host, p.port + offset) for p in ports if p.port + offset < 65536]
        if len(moved) == len(ports) and not ports_in_use(moved):
            return offset
    return None


def conflict_message(taken: list[Port], all_ports: list[Port]) -> str:
    """What to tell the user when ``taken`` (some of ``all_ports``) are in use."""
    offset = free_offset(all_ports)
    beside = (f"start another beside it with `pagedserve up --port-offset {offset}` (every port moved by {offset}, "
              "Redis's too; those are free now)" if offset is not None else
              "give this stack free ports with --port, --http-port, --scheduler-port, --metrics-port and --redis-url")
    return (f"ports in use: {', '.join(map(str, taken))}. A pagedserve stack (another `pagedserve up`) is probably "
            f"running on them: stop it (Ctrl-C where it runs; `ss -ltnp` names the processes that hold them), "
            f"or {beside}.")


def same_port_twice(ports: list[Port]) -> str | None:
    """What to tell the user when two of the stack's own ``ports`` are one port (whatever their hosts: one
    bound to 0.0.0.0 takes it on every address); None when each has its own."""
    first: dict[int, Port] = {}
    for port in ports:
        other = first.setdefault(port.port, port)
        if other is not port:
            return (f"{other.what} and {port.what} would both listen on port {port.port} (set by --port, --http-port, "
                    f"--scheduler-port, --metrics-port, --redis-url and --port-offset): give each its own port")
    return None


def check_ports(ports: list[Port], redis_url: str) -> None:
    """Raises ``PortsInUseError`` with ``conflict_message`` when a port of the stack is in use, or when a
    local Redis port is in use by a Redis that does not answer at ``redis_url`` (another stack's,
    with its own password). A Redis answering at ``redis_url`` is used, as `up` always did."""
    redis = local_redis(redis_url)
    all_ports = list(ports)
    taken = ports_in_use(ports)
    if redis is not None:
        all_ports.append(redis)
        if port_in_use(redis.host, redis.port) and not redis_answers(redis_url):
            taken.append(redis)
    if taken:
        raise PortsInUseError(conflict_message(taken, all_ports))

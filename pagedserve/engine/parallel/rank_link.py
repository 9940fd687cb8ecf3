"""Helper ranks on other machines: rank 0 listens, the ranks it does not spawn dial in.

A worker of ``T x P`` ranks spawns ranks ``1..K-1`` on its own machine (``K``: the local ranks,
all of them by default) and talks to each through a ``multiprocessing`` pipe. With a rank address
``HOST:PORT``, rank 0 also listens there for ranks ``K..T*P-1``, started elsewhere with
``pagedserve worker-rank --rank R --rank-address HOST:PORT``. Each dials in over TCP, proves it
holds the cluster token (the ``multiprocessing.connection`` HMAC challenge, both ways: the
connection carries pickles, so nothing is read from a peer that has not proved it), says its rank,
and receives the ``RankConfig`` and ``GroupSpec``; from then on its connection has the pipe's
``send``/``recv``/``poll`` API and the helper loops (``helper_main``, ``pipeline_helper_main``)
run unchanged. The gloo rendezvous is at ``HOST:PORT+1``; rank 0 stops listening once all joined.

A remote rank that dies closes its connection: :class:`RemoteRank` reports it not alive, so rank
0's next step raises ``CollectiveError`` as for a local helper. Rank 0 that dies closes the
connections: each remote rank reads EOF and exits.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from pagedserve.engine.parallel.group import CollectiveError

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that connects, then stays silent, is dropped after this


@dataclass(frozen=True)
class RankPlacement:
    """Where the ranks of one worker live.

    Attributes:
        address: ``HOST:PORT`` rank 0 listens at for the ranks it does not spawn (the gloo
            rendezvous is at ``PORT+1`` on the same host); "" when every rank is local.
        local_ranks: ranks ``0..K-1`` spawned on this machine (0: all ``T*P``).
        authkey: the secret every remote rank must hold (the cluster token's bytes).
        join_timeout_s: seconds rank 0 waits for every remote rank to join.
    """

    address: str = ""
    local_ranks: int = 0
    authkey: bytes = field(default=b"", repr=False)
    join_timeout_s: float = 300.0

    def spawned(self, world_size: int) -> int:
        """How many ranks run on this machine (rank 0 included).

        Raises:
            ValueError: ``local_ranks`` outside ``1..world_size``, remote ranks without an address
                or without a secret, an address that is not ``HOST:PORT``.
        """
        if self.address:
            parse_address(self.address)
        local = self.local_ranks or world_size
        if not 1 <= local <= world_size:
            raise ValueError(f"--local-ranks must be in 1..{world_size} (T*P), got {local}")
        if local < world_size and not self.address:
            raise ValueError(f"--local-ranks {local} < {world_size} ranks: give --rank-address HOST:PORT, "
                             "where rank 0 waits for the others")
        if local < world_size and not self.authkey:
            raise ValueError("remote ranks need the cluster token to authenticate them")
        return local

    def rendezvous(self, fallback: str) -> str:
        """The gloo ``init_method``: ``tcp://HOST:PORT+1`` with an address, else ``fallback``."""
        if not self.address:
            return fallback
        host, port = parse_address(self.address)
        return f"tcp://{host}:{port + 1}"


LOCAL = RankPlacement()
"""Every rank on this machine (the default)."""


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        ValueError: no port, or a port outside 1..65534 (``PORT+1`` is used too).
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"a rank address must be HOST:PORT with PORT in 1..65534, got {text!r}")
    return host.strip("[]"), int(port)


class RemoteRank:
    """A helper rank on another machine, seen like a ``multiprocessing.Process`` (``name``,
    ``is_alive``, ``join``, ``kill``; ``pid`` and ``exitcode`` are None): alive while its
    connection is open."""

    def __init__(self, rank: int, conn: Connection, peer: str) -> None:
        self.rank = rank
        self.conn = conn
        self.name = f"rank-{rank} (at {peer})"
        self.pid = None
        self.exitcode = None

    def is_alive(self) -> bool:
        """False once the peer closed the connection (it exited, or was killed)."""
        if self.conn.closed:
            return False
        with socket.socket(fileno=_dup(self.conn)) as sock:
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                return True  # open, nothing to read
            except OSError:
                return False  # reset

    def join(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` seconds (None: for ever) for the peer to close the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)

    def kill(self) -> None:
        """Shuts the connection down (the peer reads EOF and exits; a local reader wakes up)."""
        if self.conn.closed:
            return
        with socket.socket(fileno=_dup(self.conn)) as sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _dup(conn: Connection) -> int:
    """A new descriptor of ``conn``'s socket (for a ``socket.socket`` view that closes only it)."""
    return os.dup(conn.fileno())


def accept_ranks(placement: RankPlacement, ranks: range) -> list[tuple[RemoteRank, Connection]]:
    """Listens at ``placement.address`` until every rank of ``ranks`` joined (then stops listening).
    A peer with the wrong secret, or a rank not expected, is refused and logged; waiting goes on.
    The caller sends each rank its setup with :func:`send_setup`.

    Returns:
        ``[(RemoteRank, connection)]`` in rank order.

    Raises:
        CollectiveError: some ranks did not join within ``placement.join_timeout_s`` (the message
            names them and the command to start them).
        OSError: the address cannot be bound.
    """
    host, port = parse_address(placement.address)
    joined: dict[int, tuple[RemoteRank, Connection]] = {}
    deadline = time.monotonic() + placement.join_timeout_s
    with socket.create_server((host, port), reuse_port=False) as server:
        log.info("rank 0 waits at %s for ranks %s", placement.address, list(ranks))
        while len(joined) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveError(_missing(placement, [r for r in ranks if r not in joined]))
            server.settimeout(remaining)
            try:
                sock, peer = server.accept()
            except TimeoutError:
                continue
            rank, conn = _admit(sock, placement.authkey, ranks, joined)
            if conn is not None:
                joined[rank] = (RemoteRank(rank, conn, f"{peer[0]}:{peer[1]}"), conn)
                log.info("rank %d joined from %s:%d", rank, peer[0], peer[1])
    return [joined[r] for r in ranks]


def send_setup(remotes: list[tuple[RemoteRank, Connection]], config, spec) -> None:
    """Sends every joined rank its ``RankConfig`` and ``GroupSpec``: it starts its helper loop."""
    for _, conn in remotes:
        conn.send(("setup", config, spec))


def _admit(sock: socket.socket, authkey: bytes, ranks: range, joined: dict) -> tuple[int, Connection | None]:
    """Authenticates a new peer and reads its rank; ``(rank, connection)`` or ``(-1, None)`` when refused."""
    sock.setblocking(True)
    _set_receive_timeout(sock, HANDSHAKE_TIMEOUT_S)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        kind, rank = conn.recv()
        if kind != "join" or rank not in ranks or rank in joined:
            conn.send(("refused", f"rank {rank} is not awaited (awaiting {sorted(set(ranks) - set(joined))})"))
            conn.close()
            return -1, None
    except (AuthenticationError, OSError, EOFError, ValueError, TypeError) as exc:
        log.warning("refused a rank connection: %r (a wrong cluster token?)", exc)
        conn.close()
        return -1, None
    with socket.socket(fileno=_dup(conn)) as view:
        _set_receive_timeout(view, 0.0)
    return rank, conn


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO on a blocking socket (0: none): a read waits at most ``seconds``, then fails."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


def _missing(placement: RankPlacement, ranks: list[int]) -> str:
    commands = "; ".join(f"`pagedserve worker-rank --rank {r} --rank-address {placement.address}`" for r in ranks)
    return (f"ranks {ranks} did not join rank 0 at {placement.address} within {placement.join_timeout_s} s: "
            f"start each on its machine with the cluster token in PAGEDSERVE_CLUSTER_TOKEN: {commands}")


def join_worker(address: str, rank: int, authkey: bytes, timeout_s: float) -> tuple[Connection, tuple]:
    """Dials rank 0 at ``address`` (again every second until ``timeout_s`` seconds passed), proves
    the secret and asks to be ``rank``.

    Returns:
        ``(connection, (RankConfig, GroupSpec))``, the rendezvous host set to ``address``'s.

    Raises:
        AuthenticationError: rank 0 holds another secret.
        ConnectionError: rank 0 did not answer in time, or refused the rank (the message says why).
    """
    deadline = time.monotonic() + timeout_s
    host, port = parse_address(address)
    while True:
        try:
            conn = Client((host, port), authkey=authkey)
            break
        except OSError as exc:  # not listening yet (an AuthenticationError is no OSError: it is raised)
            if time.monotonic() > deadline:
                raise ConnectionError(f"rank 0 did not answer at {address} within {timeout_s} s: {exc}") from exc
            time.sleep(1.0)
    conn.send(("join", rank))
    try:
        kind, *rest = conn.recv()
    except EOFError as exc:
        raise ConnectionError(f"rank 0 at {address} closed the connection: a wrong cluster token?") from exc
    if kind != "setup":
        raise ConnectionError(f"rank 0 at {address} refused rank {rank}: {rest[0]}")
    config, spec = rest
    _, _, rendezvous_port = spec.init_method.rpartition(":")  # rank 0's host may be 0.0.0.0: dial the host we reached
    return conn, (config, replace(spec, init_method=f"tcp://{host}:{rendezvous_port}"))

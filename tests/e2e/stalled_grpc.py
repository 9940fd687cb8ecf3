"""A gRPC client that stops reading, written on a raw HTTP/2 socket (RFC 9113): it opens one call and
advertises a flow-control window of 0, so the server can send it no message, while it answers the
server's PINGs as any live client does (gRPC's keepalive would otherwise end the connection)."""

from __future__ import annotations

import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING = 0, 1, 4, 6
END_STREAM, ACK, END_HEADERS = 1, 1, 4
SETTINGS_INITIAL_WINDOW_SIZE = 4


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def _hpack_length(n: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (RFC 7541 §5.1), Huffman bit clear."""
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes(out + [n])


def _header(name: str, value: str) -> bytes:
    """A literal header field without indexing, new name (RFC 7541 §6.2.2)."""
    return b"\x00" + _hpack_length(len(name)) + name.encode() + _hpack_length(len(value)) + value.encode()


class StalledCall:
    """One ``method`` call to ``host:port`` with ``message`` (a serialized request), never read.

    Attributes:
        closed: set once the server ended the connection.
    """

    def __init__(self, host: str, port: int, method: str, message: bytes, metadata: dict[str, str]) -> None:
        self.closed = threading.Event()
        self._socket = socket.create_connection((host, port))
        self._socket.sendall(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 0)))
        headers = {":method": "POST", ":scheme": "http", ":path": method, ":authority": f"{host}:{port}",
                   "content-type": "application/grpc", "te": "trailers", **metadata}
        self._socket.sendall(frame(HEADERS, END_HEADERS, 1, b"".join(_header(k, v) for k, v in headers.items()))
                             + frame(DATA, END_STREAM, 1, b"\x00" + struct.pack(">I", len(message)) + message))
        threading.Thread(target=self._answer_pings, daemon=True).start()

    def _answer_pings(self) -> None:
        buffer = b""
        try:
            while chunk := self._socket.recv(1 << 16):
                buffer += chunk
                while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                    length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    if kind == SETTINGS and not flags & ACK:
                        self._socket.sendall(frame(SETTINGS, ACK, 0, b""))
                    elif kind == PING and not flags & ACK:
                        self._socket.sendall(frame(PING, ACK, 0, payload))
        except OSError:
            pass
        self.closed.set()

    def close(self) -> None:
        self._socket.close()

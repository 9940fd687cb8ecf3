"""Config fields shared by several services (their flags: ``pagedserve/config_flags.py``).

Environment variables are read when the parser is built (at start), never at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.options import Secret, option


def env_default(name: str, default: str) -> str:
    """``$name`` if set, else ``default``."""
    return os.environ.get(name) or default


def redact_url(url: str) -> str:
    """``url`` fit to print: a password in it becomes ``***`` (``redis://:***@host:6379/0``).

    A user name without a password is hidden too (it may be a password written without its colon);
    everything before the last ``@`` counts as user and password (an unescaped ``/`` or ``?`` in a
    password cannot make it show; a URL with ``@`` only in its query is over-redacted, never leaked).
    """
    scheme, sep, rest = url.partition("://")
    userinfo, at, after = rest.rpartition("@")
    if not (sep and at):
        return url
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon and "/" not in user else "***"
    return f"{scheme}://{shown}@{after}"


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

DEFAULT_PORT = 50051
"""The gateway's gRPC port unless told otherwise (`gateway`, `up`, and the clients' ``--target``)."""

DEFAULT_SCHEDULER_PORT = 50052
"""The scheduler's gRPC port unless told otherwise (`scheduler`; `up`'s first scheduler)."""

DEFAULT_HTTP_PORT = 8000
"""The gateway's OpenAI-compatible HTTP API port unless told otherwise (`gateway`, `up`)."""

DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"
"""Where the clients (`complete`, `health`, `bench serve`) look for a gateway unless given ``--target``."""

GRPC_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")
"""Target name schemes gRPC resolves itself (gRPC's naming doc); other targets must be HOST:PORT."""


def grpc_target(value: str) -> str:
    """argparse type of a client's ``--target``: the gateway's gRPC HOST:PORT (or a target in one of
    ``GRPC_TARGET_SCHEMES``).

    Raises:
        argparse.ArgumentTypeError: a URL (the OpenAI HTTP API's form), or no port (gRPC would take 443).
    """
    if value.startswith(GRPC_TARGET_SCHEMES):
        return value
    if "://" in value:
        raise argparse.ArgumentTypeError(f"{value!r} is a URL: --target takes the gateway's gRPC HOST:PORT, "
                                         f"e.g. {DEFAULT_TARGET} (the OpenAI HTTP API is another port)")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} has no port: --target takes HOST:PORT, e.g. {DEFAULT_TARGET}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"{value!r}: write an IPv6 address in brackets, e.g. [::1]:{DEFAULT_PORT}")
    if not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: the port must be in 1..65535")
    return value


def read_redis_url(value: str, path: str) -> str:
    """The Redis URL in the file ``path`` when given, else ``value``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is empty.
    """
    if not path:
        return value
    url = Path(path).read_text().strip()
    if not url:
        raise ValueError(f"--redis-url-file {path} is empty")
    return url


def redis_url_option() -> Any:
    """The ``redis_url`` field of a service's config: ``--redis-url`` (env PAGEDSERVE_REDIS_URL) and
    ``--redis-url-file``. The URL may hold a password: print it with ``redact_url``."""
    return option(
        "Redis holding the request stream and worker registrations; a URL with a "
        "password is visible in `ps` here, prefer the file or the variable", DEFAULT_REDIS_URL, repr=False,
        env="PAGEDSERVE_REDIS_URL", secret=Secret(read_redis_url, "the Redis URL"), show=redact_url)


def model_option(default: Any = dataclasses.MISSING) -> Any:
    """The ``model`` field of a config: ``--model`` (env PAGEDSERVE_MODEL), the folder as given; the
    command resolves it (``pagedserve.model_files.resolve_model``) and passes the folder."""
    return option("local Hugging Face model folder", default, parse=str, env="PAGEDSERVE_MODEL",
                  default_help="SmolLM2-135M-Instruct, built on first use by `pagedserve prepare-model`")


@dataclass(frozen=True)
class ModelChoice:
    """The ``--model`` flag alone, for a command that resolves the folder itself (``complete``)."""

    model: str = model_option("")


def bare_host(text: str) -> str:
    """A ``--host`` as the sockets take it: an IPv6 address without the brackets URLs put around it
    (``[::1]`` -> ``::1``; gRPC's addresses get them back from ``grpc_server.host_port``)."""
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def host_option() -> Any:
    """The ``host`` field of a service's config: where its gRPC service listens."""
    return option("address to listen on; 0.0.0.0 serves other machines too", "127.0.0.1", parse=bare_host)


def port_option(default: int) -> Any:
    """The ``port`` field of a service's config (0 picks a free one)."""
    return option("gRPC port (0 picks a free one)", default)


def advertise_host_option(env: str = "") -> Any:
    """The ``advertise_host`` field: the address peers dial; "" makes it ``default_advertise_host(host)``."""
    return option("host name or address the other services use to reach this one (registered in Redis)", "",
                  env=env, default_help="--host, or this machine's address when listening on all interfaces")


def default_advertise_host(listen_host: str) -> str:
    """The listen address itself, or this machine's address when listening on all interfaces."""
    if listen_host not in ("0.0.0.0", "::", "[::]", ""):
        return listen_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

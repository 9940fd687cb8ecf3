"""Command-line flags shared by several services, with environment-variable defaults.

Environment variables are read when the parser is built (at start), never at import.
"""

from __future__ import annotations

import argparse
import socket
import os
from pathlib import Path


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


def add_redis_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--redis-url`` (env PAGEDSERVE_REDIS_URL) and ``--redis-url-file``; read them with
    ``redis_url_from_args``."""
    default = env_default("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--redis-url", default=default,
        help="Redis holding the request stream and worker registrations (env PAGEDSERVE_REDIS_URL; "
        f"default {redact_url(default)}); a URL with a password is visible in `ps` here, prefer the file "
        "or the variable".replace("%", "%%"),
    )
    parser.add_argument("--redis-url-file", default="",
                        help="file holding the Redis URL (takes precedence over --redis-url)")


def redis_url_from_args(args: argparse.Namespace) -> str:
    """The Redis URL of ``--redis-url-file`` if given, else of ``--redis-url``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is empty.
    """
    if not args.redis_url_file:
        return args.redis_url
    url = Path(args.redis_url_file).read_text().strip()
    if not url:
        raise ValueError(f"--redis-url-file {args.redis_url_file} is empty")
    return url


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=env_default("PAGEDSERVE_MODEL", ""),
        help="local Hugging Face model folder (env PAGEDSERVE_MODEL); default: SmolLM2-135M-Instruct, "
        "built on first use by `pagedserve prepare-model`",
    )


def add_listen_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 serves other machines too (default %(default)s)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (default %(default)s; 0 picks a free one)")


def default_advertise_host(listen_host: str) -> str:
    """The listen address itself, or this machine's address when listening on all interfaces."""
    if listen_host not in ("0.0.0.0", "::", "[::]", ""):
        return listen_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

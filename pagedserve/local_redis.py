"""The local Redis of `pagedserve up`: whether one answers, its settings, its password file."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import redis

REDIS_PORT = 6379
"""Redis's port when a URL names none."""

BIND_ADDRESSES = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1 -::1", "::1": "::1"}
"""The hosts `pagedserve up` starts a Redis on when none answers there -> the addresses that Redis binds (redis.conf
``bind``; ``-``: where this machine has it), so that the services reach it at the URL's host."""


def redis_answers(url: str) -> bool:
    """Whether a Redis answers PING at ``url`` within a second (one wanting another password does not)."""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def write_secret_file(path: Path, secret: str) -> None:
    """Writes ``secret`` (and a newline) to ``path``, readable and writable by this user only."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n")


def redis_settings(port: int, data_dir: Path, url) -> str:
    """redis-server configuration (file syntax) for a local Redis at ``port`` on the host of the parsed ``url``
    (one of ``BIND_ADDRESSES``) that requires its password, if it has one (for its user name, if not ``default``)."""
    lines = [f"bind {BIND_ADDRESSES[url.hostname]}", f"port {port}", f"dir {_quoted(str(data_dir))}", "appendonly yes",
             'save ""', "loglevel warning"]
    if url.password:
        password, user = unquote(url.password), unquote(url.username or "")
        if user and user != "default":
            lines.append(f"user {_quoted(user)} on {_quoted('>' + password)} ~* &* +@all")
        else:
            lines.append(f"requirepass {_quoted(password)}")
    return "\n".join(lines) + "\n"


def _quoted(value: str) -> str:
    """``value`` as a double-quoted redis.conf string."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'

"""Command-line flags shared by several services, with environment-variable defaults.

Environment variables are read when the parser is built (at start), never at import.
"""

from __future__ import annotations

import argparse
import os


def env_default(name: str, default: str) -> str:
    """``$name`` if set, else ``default``."""
    return os.environ.get(name) or default


def add_redis_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=env_default("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis holding the request stream and worker registrations (env PAGEDSERVE_REDIS_URL; "
        "default %(default)s)",
    )


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=env_default("PAGEDSERVE_MODEL", ""),
        help="local Hugging Face model folder (env PAGEDSERVE_MODEL); default: SmolLM2-135M-Instruct, "
        "built on first use by `pagedserve prepare-model`",
    )


def add_listen_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (default %(default)s; 0 picks a free one)")

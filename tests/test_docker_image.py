"""The Docker image's static facts (issue #24) and its health probe, checked without a Docker engine;
scripts/compose-check.sh builds and runs the image for real."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pagedserve.services.common.grpc_server import add_health, set_serving
from pagedserve.services.common.health_probe import main as probe

ROOT = Path(__file__).resolve().parents[1]


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """The Dockerfile's stages: (the FROM line, its instructions), comments and continuations joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    for line in (line.strip() for line in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        if op.upper() == "FROM":
            found.append((arg, []))
        else:
            found[-1][1].append((op.upper(), arg.strip()))
    return found


def build_args() -> dict[str, str | None]:
    """Every ARG of the Dockerfile (global or in a stage) and its default (None: none)."""
    args = {}
    for _, instructions in stages():
        for op, arg in instructions:
            if op == "ARG":
                name, eq, default = arg.partition("=")
                args[name] = default if eq else None
    return args


def test_the_torch_index_is_a_build_argument_added_to_pypi_not_replacing_it():
    args = build_args()
    assert args["PAGEDSERVE_TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${PAGEDSERVE_TORCH_VARIANT}"
    assert args["PAGEDSERVE_TORCH_VARIANT"] == "cpu"
    runs = " ".join(arg for _, instructions in stages() for op, arg in instructions if op == "RUN")
    assert "--index-url" not in runs.replace("--extra-index-url", "")
    assert '--extra-index-url "$PAGEDSERVE_TORCH_INDEX_URL"' in runs
    assert '"torch==${TORCH_VERSION}+${PAGEDSERVE_TORCH_VARIANT}"' in runs  # never PyPI's CUDA build by mistake


def test_the_build_machines_pip_settings_are_build_arguments_the_compose_file_passes_through():
    import yaml

    pip_args = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_NO_INDEX"}
    args = build_args()
    assert all(args[name] is None for name in pip_args)  # unset unless given: pip's own defaults
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    passed = compose["x-pagedserve"]["build"]["args"]
    assert all("=" not in arg for arg in passed)  # taken from the environment, else the Dockerfile's default
    assert set(passed) == set(args) - {"TORCH_VERSION"}


def test_the_run_time_stage_has_no_compiler_and_the_op_is_built_outside_the_models_volume():
    final_from, final = stages()[-1]
    build_from, build = next(stage for stage in stages() if stage[0].endswith(" AS build"))
    assert final_from == "python" and build_from == "python AS build"
    copies = [arg for op, arg in final if op == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv", "--from=build /opt/pagedserve /opt/pagedserve"]
    assert not any(op == "RUN" for op, _ in final)
    python_stage = next(instructions for name, instructions in stages() if name.endswith(" AS python"))
    assert not any("g++" in arg for _, arg in python_stage) and any("g++" in arg for _, arg in build)
    env = " ".join(arg for op, arg in python_stage if op == "ENV")
    assert "PAGEDSERVE_CACHE_DIR=/opt/pagedserve" in env  # copied from the build, not on the models volume
    assert any("load_cpu_attention_op" in arg and "sys.exit(load() is None or not decode_layers_available())" in arg
               for op, arg in build if op == "RUN")


def test_every_kernel_source_and_header_is_package_data():
    """The image installs the project (`pip install .`, not editable): a header missing from the package data
    (models/csrc/l2_prefetch.h was, after a99da5e) fails its kernels' builds there, and the worker falls back
    to slower GEMMs with only a warning."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "pagedserve", "pagedserve_kernels"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.split()
    runtime_files = [Path(f) for f in tracked if Path(f).suffix not in (".py", ".pyi")]
    assert any(f.suffix == ".h" for f in runtime_files)
    folders = {Path(*package.split(".")): patterns for package, patterns in package_data.items()}
    unpackaged = [str(f) for f in runtime_files
                  if not any(f.relative_to(folder).match(pattern) for folder, patterns in folders.items()
                             if f.is_relative_to(folder) for pattern in patterns)]
    assert unpackaged == []


def test_the_cpu_image_leaves_triton_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert project["optional-dependencies"]["triton"] == ["triton>=3.0"]
    assert "pagedserve[triton]" in project["optional-dependencies"]["test"]  # the kernel tests need it


def test_the_build_context_leaves_secrets_environments_and_caches_out():
    ignored = {line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")}
    assert {".env", ".git", ".venv", "**/__pycache__", ".pytest_cache", ".hypothesis", ".cache", "models"} <= ignored
    copied = [arg.split()[0] for _, instructions in stages() for op, arg in instructions
              if op == "COPY" and not arg.startswith("--from")]
    assert not set(copied) & ignored


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = add_health(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_the_health_probe_answers_the_servers_status(health_server, capsys):
    servicer, target = health_server
    assert probe([target]) == 1  # NOT_SERVING at start
    set_serving(servicer, True)
    assert probe([target]) == 0
    assert probe(["no-port"]) == 2 and "usage" in capsys.readouterr().err


def children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def test_the_health_probe_imports_only_grpc_and_costs_a_fraction_of_the_cli(health_server):
    """CPU seconds, not wall time (a busy host slows both): the probe, run every 5 s in every
    container, costs a third of the CLI with every command's flags (`pagedserve --help`, 0.34-0.7 s of
    CPU; `pagedserve health` builds only its own flags since the CLI builds one command's: 0.2 s, the
    probe 0.17 s)."""
    servicer, target = health_server
    set_serving(servicer, True)
    check = ("import runpy, sys; sys.argv = ['probe', %r]\n"
             "try: runpy.run_module('pagedserve.services.common.health_probe', run_name='__main__')\n"
             "except SystemExit as exit: print(exit.code, sorted(set(sys.modules) & {'torch', 'transformers', "
             "'pagedserve.engine', 'pagedserve.text', 'pagedserve.cli', 'redis', 'numpy'}))") % target
    began = children_cpu_s()
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    probe_cpu_s = children_cpu_s() - began
    assert out.split(None, 1) == ["0", "[]\n"]
    began = children_cpu_s()
    subprocess.run([sys.executable, "-m", "pagedserve", "--help"], capture_output=True, check=True)
    cli_cpu_s = children_cpu_s() - began
    assert probe_cpu_s < cli_cpu_s / 3, (probe_cpu_s, cli_cpu_s)


def test_compose_check_runs_in_ci_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"scripts/test\.sh.*\n(.*\n)*.*scripts/compose-check\.sh", ci)

"""scripts/suite_cpu_report.py sums a suite CPU log by process kind and by the test file that started each process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.suite_cpu_report import process_kind

ROOT = Path(__file__).resolve().parents[1]


def test_processes_are_told_apart_by_argv_and_the_test_that_started_them():
    assert process_kind("-c", "-") == "pytest worker"
    assert process_kind("-c", "tests/worker/test_tp.py::test_x (call)") == "python -c (rank processes, probes)"
    assert process_kind("/r/pagedserve/__main__.py worker --model m", "t") == "pagedserve worker"
    assert process_kind("/r/pagedserve/__main__.py bench serve --target x", "t") == "pagedserve bench serve"
    assert process_kind("/r/tests/worker/load_memory.py 3", "t") == "load_memory.py"
    assert process_kind("/v/site-packages/pytest/__main__.py -n 0 tests", "-") == "pytest"
    assert process_kind("/r/.venv/bin/pagedserve up --workers 2", "t") == "pagedserve up"


def test_a_log_written_by_the_sitecustomize_is_summed_by_kind_and_file(tmp_path):
    log = tmp_path / "cpu.tsv"
    child = "import sys; sys.argv = ['/r/pagedserve/__main__.py', 'gateway']"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "suite_cpu"), "PAGEDSERVE_SUITE_CPU_LOG": str(log),
           "PYTEST_CURRENT_TEST": "tests/e2e/test_a.py::test_b (call)"}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", child], env=env, check=True)
    with open(log, "a") as cut:
        cut.write("123\t4.5\n")  # a line cut short is skipped
    lines = log.read_text().splitlines()[:2]
    assert len(lines) == 2 and all(line.split("\t")[2] == "tests/e2e/test_a.py::test_b (call)" for line in lines)
    report = subprocess.run([sys.executable, str(ROOT / "scripts" / "suite_cpu_report.py"), str(log)],
                            capture_output=True, text=True, check=True).stdout
    assert "      2  pagedserve gateway" in report and "tests/e2e/test_a.py: pagedserve gateway" in report


def test_the_process_ends_as_it_would_without_it_when_the_log_cannot_be_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "suite_cpu"),
           "PAGEDSERVE_SUITE_CPU_LOG": str(tmp_path / "no-such-folder" / "cpu.tsv")}
    done = subprocess.run([sys.executable, "-c", "print('ok')"], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")

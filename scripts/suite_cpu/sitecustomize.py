"""Where the test suite's CPU goes, process by process (a measuring aid, not part of pagedserve).

With this folder first on PYTHONPATH and PAGEDSERVE_SUITE_CPU_LOG naming a file, every Python process of
a test run (pytest's workers, the services a test starts, CLI subprocesses, tensor-parallel ranks) appends
one line to that file when it exits: pid, CPU seconds (user + system, all its threads), the test that was
running in the process that started it (PYTEST_CURRENT_TEST, which children inherit; "-" for pytest's
own workers) and its argv. Processes killed by a signal they do not handle (SIGKILL; SIGTERM without a
handler), leaving through ``os._exit``, or started with their own PYTHONPATH write nothing; nothing it
does can fail the process. It stands in for any other ``sitecustomize`` (this project's .venv has none).
``scripts/suite_cpu_report.py`` sums the file up. Usage (README, "Test it"):

    PYTHONPATH=$PWD/scripts/suite_cpu PAGEDSERVE_SUITE_CPU_LOG=/tmp/cpu.tsv ./scripts/test.sh
    python scripts/suite_cpu_report.py /tmp/cpu.tsv
"""

import atexit
import os
import resource
import sys


def _log_cpu_at_exit() -> None:
    path = os.environ.get("PAGEDSERVE_SUITE_CPU_LOG")
    if not path:
        return
    try:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").replace("\t", " ")
        argv = " ".join(sys.argv)[:300].replace("\t", " ").replace("\n", " ")
        with open(path, "a", encoding="utf-8", errors="replace") as log:
            log.write(f"{os.getpid()}\t{usage.ru_utime + usage.ru_stime:.2f}\t{test}\t{argv}\n")
    except Exception:  # noqa: BLE001 - a measuring aid must never change how a process ends
        pass


atexit.register(_log_cpu_at_exit)

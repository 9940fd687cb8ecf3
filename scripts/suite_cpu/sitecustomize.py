"""Where the test suite's CPU goes, process by process (a measuring aid, not part of pagedserve).

With this folder first on PYTHONPATH and PAGEDSERVE_SUITE_CPU_LOG naming a file, every Python process of
a test run (pytest's workers, the services a test starts, CLI subprocesses, tensor-parallel ranks) appends
one line to that file when it exits: pid, CPU seconds (user + system, all its threads), the test that was
running in the process that started it (PYTEST_CURRENT_TEST, which children inherit; "-" for pytest's
own workers) and its argv. Processes killed with SIGKILL, or leaving through ``os._exit``, write nothing.
``scripts/suite_cpu_report.py`` sums the file up. Usage (README, "Test it"):

    PYTHONPATH=scripts/suite_cpu PAGEDSERVE_SUITE_CPU_LOG=/tmp/cpu.tsv ./scripts/test.sh
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
    usage = resource.getrusage(resource.RUSAGE_SELF)
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").replace("\t", " ")
    argv = " ".join(sys.argv)[:300].replace("\t", " ").replace("\n", " ")
    try:
        with open(path, "a") as log:
            log.write(f"{os.getpid()}\t{usage.ru_utime + usage.ru_stime:.2f}\t{test}\t{argv}\n")
    except OSError:
        pass


atexit.register(_log_cpu_at_exit)

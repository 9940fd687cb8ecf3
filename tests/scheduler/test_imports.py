"""The scheduler service starts without torch: it only plans (1.3 CPU-s to start instead of 3.2,
in every stack of every deployment and test)."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_service_does_not_import_torch():
    code = "import sys, pagedserve.services.scheduler.server; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"

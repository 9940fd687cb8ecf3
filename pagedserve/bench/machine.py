"""A description of the machine a benchmark ran on, for its report."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def code_revision(folder: Path = Path(__file__).parent) -> str:
    """The git commit of the checkout holding ``folder`` (pagedserve's code by default), with ``+changes`` when its
    tracked files differ from that commit; ``"unknown"`` outside a git checkout (an installed package) or
    without git. A result file thus names the code that produced it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def machine_info() -> dict[str, str | int]:
    """Cores, CPU model, GPU (if torch sees one), torch version, the date (UTC) and the code's revision."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": code_revision(),
    }


def machine_line(info: dict[str, str | int]) -> str:
    return f"{info['cores']} cores, {info['cpu']}, GPU: {info['gpu']}, torch {info['torch']}, {info['date']}"

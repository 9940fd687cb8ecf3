"""A description of the machine a benchmark ran on, for its report."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict[str, str | int]:
    """Cores, CPU model, GPU (if torch sees one), torch version and the date (UTC)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(info: dict[str, str | int]) -> str:
    return f"{info['cores']} cores, {info['cpu']}, GPU: {info['gpu']}, torch {info['torch']}, {info['date']}"

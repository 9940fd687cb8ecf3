"""The process's limit on open file descriptors, raised to what a service needs."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("pagedserve")


def raise_open_files_limit(needed: int) -> int:
    """Raises the soft ``RLIMIT_NOFILE`` of this process to ``needed`` when it is lower (many
    systems start processes at 1,024, fewer than a gateway's connections), up to the hard limit;
    logs a warning when the hard limit is lower than ``needed``. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
        return soft
    if target < needed:
        log.warning("open files are limited to %d (hard limit), fewer than the %d this configuration may use: "
                    "connections beyond it fail (raise `ulimit -Hn`, or lower --max-concurrent-requests)",
                    target, needed)
    return target

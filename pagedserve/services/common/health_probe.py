"""A container health check that costs milliseconds: ``python -m pagedserve.services.common.health_probe HOST:PORT``
exits 0 when the gRPC server there answers SERVING, else 1.

It imports only grpc and grpc_health (through ``pagedserve.services.common.grpc_server``), unlike
``pagedserve health``, whose CLI start-up (torch, transformers) took 1-3 s and 0.3 s of CPU for
every check of every container.
"""

from __future__ import annotations

import sys

from pagedserve.services.common.grpc_server import check_health

TIMEOUT_S = 2.0
"""How long the probe waits for the answer, seconds."""


def main(argv: list[str]) -> int:
    """Exit status for ``argv`` = ``[HOST:PORT]``: 0 SERVING, 1 anything else; 2 on a bad argument."""
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m pagedserve.services.common.health_probe HOST:PORT", file=sys.stderr)
        return 2
    return 0 if check_health(argv[0], timeout_s=TIMEOUT_S) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`pagedserve worker-rank`: one helper rank of a tensor/pipeline-parallel worker, on another machine.

It dials rank 0 (a `pagedserve worker --rank-address HOST:PORT --local-ranks K`), proves the
cluster token, receives the worker's settings and runs what a spawned helper runs, until rank 0
stops it or goes away (``pagedserve/engine/parallel/rank_link.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

log = logging.getLogger(__name__)


def add_worker_rank_parser(sub) -> None:
    """Adds the ``worker-rank`` command to the subcommands ``sub``."""
    from pagedserve.config_flags import add_config_arguments
    from pagedserve.services.common.auth import ClusterAuth

    p = sub.add_parser(
        "worker-rank", help="join a tensor/pipeline-parallel worker as one of its ranks, from another machine",
        description="Run one rank of a worker whose rank 0 (`pagedserve worker --rank-address HOST:PORT "
        "--local-ranks K`) runs elsewhere: dial HOST:PORT, authenticate with the cluster token, receive the "
        "model and sizes from rank 0, serve until rank 0 stops or exits. The model folder must exist here too.")
    p.add_argument("--rank", type=int, required=True,
                   help="this rank, in K..T*P-1 (K: rank 0's --local-ranks; each remote rank once)")
    p.add_argument("--rank-address", required=True, metavar="HOST:PORT",
                   help="rank 0's --rank-address, as reachable from here (the gloo rendezvous is at PORT+1)")
    p.add_argument("--model", default="",
                   help="this machine's copy of the model folder (default: rank 0's path)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch CPU threads of this rank (default: this machine's cores)")
    p.add_argument("--connect-timeout", type=float, default=300.0,
                   help="seconds to keep dialing while rank 0 is not listening yet (default %(default)s)")
    add_config_arguments(p, ClusterAuth)
    p.set_defaults(func=cmd_worker_rank)


def cmd_worker_rank(args: argparse.Namespace) -> int:
    """Joins the worker and serves as ``args.rank``; 0 when rank 0 stopped it, 1 on a failure."""
    from multiprocessing import AuthenticationError

    from pagedserve.engine.parallel.group import CollectiveError
    from pagedserve.config_flags import config_from_args
    from pagedserve.services.common.auth import ClusterAuth

    token = config_from_args(ClusterAuth, args).cluster_token
    try:
        run_remote_rank(args.rank_address, args.rank, token.encode(), args.connect_timeout, args.model,
                        args.num_threads)
    except AuthenticationError as exc:
        print(f"pagedserve worker-rank: rank 0 at {args.rank_address} refused the cluster token ({exc}): "
              "give this rank the worker's PAGEDSERVE_CLUSTER_TOKEN", file=sys.stderr)
        return 1
    except CollectiveError as exc:
        print(f"pagedserve worker-rank: rank {args.rank} failed: {exc}", file=sys.stderr)
        return 1
    return 0


def run_remote_rank(address: str, rank: int, authkey: bytes, connect_timeout_s: float, model: str = "",
                    num_threads: int = 0) -> None:
    """Joins rank 0 at ``address`` as ``rank`` and runs the helper loop until rank 0 stops it or
    closes the connection.

    Args:
        model: the model folder on this machine ("" : the path rank 0 sent).
        num_threads: torch threads of this rank (0: this machine's cores).

    Raises:
        AuthenticationError: rank 0 holds another secret.
        ConnectionError: rank 0 did not answer within ``connect_timeout_s`` seconds, or refused the rank.
        CollectiveError: a peer rank failed while this rank served.
    """
    from pagedserve.engine.parallel.launch import helper_main
    from pagedserve.engine.parallel.pipeline_runner import pipeline_helper_main
    from pagedserve.engine.parallel.rank_link import join_worker

    conn, (config, spec) = join_worker(address, rank, authkey, connect_timeout_s)
    config = replace(config, model_path=model or config.model_path, num_threads=num_threads or os.cpu_count() or 1)
    log.info("rank %d of %d joined rank 0 at %s (%s)", rank, spec.world_size, address, config.model_path)
    target = pipeline_helper_main if config.pipeline_parallel_size > 1 else helper_main
    try:
        target(config, spec, rank, conn)
    finally:
        conn.close()

"""The worker's Prometheus series: how long its model steps take.

Ownership (see ``pagedserve/services/common/metrics.py``): a worker owns only its own step time; queues, KV
usage and token counts belong to the scheduler and the gateway, so nothing here double counts them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from pagedserve.services.common.metrics import MODEL_NAME, STEP_BUCKETS_S, new_registry


class WorkerMetrics:
    """One worker process's registry.

    Args:
        model_name: the served model's name (the ``model_name`` label).
        worker_id: this worker's id (the ``worker`` label).
    """

    def __init__(self, model_name: str, worker_id: str) -> None:
        self.registry: CollectorRegistry = new_registry()
        step = Histogram("pagedserve_worker_step_seconds",
                         "Time one worker takes to run one BatchPlan (model forward and sampling), seconds.",
                         [MODEL_NAME, "worker"], registry=self.registry, buckets=STEP_BUCKETS_S)
        self._step = step.labels(model_name, worker_id)

    def step_done(self, seconds: float) -> None:
        """Records one step that took ``seconds``."""
        self._step.observe(seconds)

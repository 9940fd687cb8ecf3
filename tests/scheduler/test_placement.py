"""Prefix-aware placement: a request goes to the worker that holds its prompt's prefix, unless
that worker is loaded enough to outweigh it; ``least-loaded`` ignores the cache."""

from __future__ import annotations

import pytest

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.worker_pool import placement_score
from tests.scheduler.test_scheduler_features import make, prompt, req

SYSTEM = prompt(16, 60)  # four full blocks of 4


def test_the_score_weighs_cached_prefix_against_usage_and_load():
    engine, _ = make({"w0": 16, "w1": 16})
    engine.add_request(req("first", SYSTEM + [7, 8], 3))
    engine.step()  # admitted on w0 (a tie: the first registered), its 5 blocks held, 4 of them cached
    scheduler = engine.scheduler
    w0, w1 = (scheduler._workers[w] for w in ("w0", "w1"))
    second = Sequence(req("second", SYSTEM + [9, 9, 9, 9], 3))
    assert scheduler.sequence(SequenceId("first")).worker_id == "w0"
    assert placement_score(w0, second, 8) == pytest.approx(2 * 16 / 20 - 5 / 16 - 1 / 8)
    assert placement_score(w1, second, 8) == 0.0
    assert w0.blocks.num_hit_tokens == 0  # probing for placement is not counted as a lookup


@pytest.mark.parametrize("placement, worker, hit_tokens", [("prefix", "w1", 16), ("least-loaded", "w0", 0)])
def test_a_shared_prefix_draws_the_request_to_its_worker(placement, worker, hit_tokens):
    engine, _ = make({"w0": 16, "w1": 20}, placement=placement)
    engine.add_request(req("first", SYSTEM + [7, 8], 8))
    engine.step()  # w1 (most free blocks); it keeps 5 blocks while it decodes
    engine.add_request(req("second", SYSTEM + [9, 9, 9, 9], 3))
    engine.step()
    assert engine.scheduler.sequence(SequenceId("first")).worker_id == "w1"
    assert engine.scheduler.sequence(SequenceId("second")).worker_id == worker  # least-loaded: 16 free > 15
    assert engine.scheduler.stats().prefix_cache_hits == hit_tokens


def test_placement_is_validated():
    with pytest.raises(ValueError):
        SchedulerConfig(placement="random")

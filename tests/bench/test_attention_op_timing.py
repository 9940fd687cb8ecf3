"""`bench attention-op`'s timing: the op and the streaming read timed in turns within each round."""

from pagedserve.bench.attention_op import interleaved_median_ms


def test_calls_are_timed_in_turns_each_round_and_the_warm_up_round_is_dropped():
    order = []
    calls = [(lambda i: order.append(("stream", i)), 2), (lambda i: order.append(("op", i)), 3)]
    medians = interleaved_median_ms(calls, rounds=3)
    one_round = [("stream", 0), ("stream", 1), ("op", 0), ("op", 1), ("op", 2)]
    assert order == one_round * 4  # a warm-up round, then 3 timed rounds
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_the_median_is_of_the_timed_rounds_only():
    import time
    rounds = iter([0.05, 0.0])  # only the warm-up round is slow: with it counted the median would be 25 ms

    def call(i):
        time.sleep(next(rounds))

    assert interleaved_median_ms([(call, 1)], rounds=1)[0] < 20

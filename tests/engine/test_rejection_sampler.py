"""The rejection sampler keeps the target's distribution (a chi-square test on a tiny vocabulary,
with a draft model's distributions and with one-hot n-gram drafts; and through the worker's verifier
with drawn and chosen drafts in one batch), is the argmax for greedy rows, and handles ragged draft
counts."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.grammar_matchers import DraftMasks
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.spec_decode.rejection_sampler import rejection_sample
from pagedserve.engine.spec_decode.verifier import Drafted, verify

VOCAB, K, TRIALS = 6, 3, 200_000
CHI2_DF5_P0001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def random_probs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(*shape, VOCAB, generator=generator), dim=-1)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_emitted_tokens_have_the_targets_distribution(draft):
    g = torch.Generator().manual_seed(23)
    p = random_probs(g, K + 1)                                           # one target distribution per position
    q = random_probs(g, K)
    target = p.repeat(TRIALS, 1)                                         # (TRIALS * (K + 1), V): K + 1 rows each
    if draft == "model":
        drafts = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=g) for i in range(K)], 1)
        draft_probs = q.repeat(TRIALS, 1)                                # (TRIALS * K, V)
    else:  # a lookup proposes fixed tokens: the same ones every trial
        drafts, draft_probs = torch.tensor([[1, 4, 2]]).expand(TRIALS, K), None
    out = rejection_sample(target, [K] * TRIALS, drafts.reshape(-1), torch.rand(TRIALS * (K + 1), generator=g),
                           torch.rand(TRIALS * (K + 1), generator=g), draft_probs)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square(torch.bincount(first, minlength=VOCAB).float(), p[0]) < CHI2_DF5_P0001
    # given the first draft was accepted (only then is p[1] the right conditional), the second token ~ p[1]
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert len(second) > TRIALS // 10
    assert chi_square(torch.bincount(second, minlength=VOCAB).float(), p[1]) < CHI2_DF5_P0001
    accepted = torch.tensor(out.num_accepted)
    assert accepted.min() >= 0 and accepted.max() == K and all(len(t) == a + 1 for t, a in zip(out.token_ids, out.num_accepted))


def test_greedy_rows_emit_the_targets_argmax_tokens():
    argmax = torch.tensor([3, 1, 4, 0, 3, 1, 4, 5])                      # two sequences' rows, the target's argmax each
    target = torch.nn.functional.one_hot(argmax, VOCAB).float()
    drafts = torch.tensor([3, 1, 5, 3, 1, 4])                            # the first wrong at its 3rd draft
    out = rejection_sample(target, [3, 3], drafts, torch.rand(8), torch.rand(8))
    assert out.token_ids == [[3, 1, 4], [3, 1, 4, 5]] and out.num_accepted == [2, 3]


def test_ragged_drafts_and_rows_without_drafts():
    # one draft (2 rows), two drafts (3 rows), none (1 row)
    argmax = torch.tensor([2, 2, 5, 0, 1, 4])
    target = torch.nn.functional.one_hot(argmax, VOCAB).float()
    out = rejection_sample(target, [1, 2, 0], torch.tensor([2, 5, 0]), torch.rand(6), torch.rand(6))
    # the first: its draft accepted, then its second row's token; the second: both, then its third row's; the last: none
    assert out.token_ids == [[2, 2], [5, 0, 1], [4]] and out.num_accepted == [1, 2, 0]


def test_a_rejected_drawn_draft_takes_the_residual_of_its_own_row():
    # the target puts everything on token 2 at both drafted rows; the draft drew 5 from q: rejected
    # (p(5) = 0), and the residual max(0, p - q) is token 2's alone, whatever the draw uniform
    p = torch.nn.functional.one_hot(torch.tensor([2, 2, 3]), VOCAB).float()
    q = torch.full((2, VOCAB), 1 / VOCAB)
    for u in (0.0, 0.5, 0.999):
        out = rejection_sample(p, [2], torch.tensor([5, 2]), torch.zeros(3), torch.full((3,), u), q)
        assert out.token_ids == [[2]] and out.num_accepted == [0]
    # the first draft accepted (p(2) = 1 >= q(2)): the second rejected, drawn from its own row
    out = rejection_sample(p, [2], torch.tensor([2, 5]), torch.full((3,), 0.5), torch.full((3,), 0.7), q)
    assert out.token_ids == [[2, 2]] and out.num_accepted == [1]


def test_each_sequence_draws_with_the_uniform_of_the_row_after_its_accepted_drafts():
    # flat target rows: the draw uniform alone picks the token; the first sequence keeps 1 of 2 drafts
    # (u = 0 < p = 1/6, then 0.9 > 1/6) and draws from row 1 without the rejected id 3; the second keeps none
    target = torch.full((5, VOCAB), 1 / VOCAB)
    out = rejection_sample(target, [2, 1], torch.tensor([1, 3, 4]), torch.tensor([0.0, 0.9, 0.0, 0.9, 0.0]),
                           torch.tensor([0.0, 0.99, 0.5, 0.01, 0.7]))
    assert out.token_ids == [[1, 5], [0]] and out.num_accepted == [1, 0]


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="accept_uniforms"):
        rejection_sample(torch.rand(4, VOCAB), [1, 1], torch.zeros(2, dtype=torch.long), torch.rand(2), torch.rand(4))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.rand(4, VOCAB), [1, 1], torch.zeros(2, dtype=torch.long), torch.rand(4), torch.rand(4),
                         torch.rand(2, VOCAB + 1))


def test_verify_keeps_the_targets_distribution_with_drawn_and_chosen_drafts_in_one_batch():
    # the worker's path: per sequence, the logits of its last token's row and of each draft's row; half
    # the sequences drafted from q (draft_probs given), half chose a fixed draft (one-hot q)
    trials, g = 20_000, torch.Generator().manual_seed(5)
    p, q = random_probs(g, 3), random_probs(g, 2)                          # 2 drafts: 3 target rows
    drawn = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=g) for i in range(2)], 1)
    sampling = EngineSamplingParams(max_tokens=8, temperature=1.0)
    drafted = [Drafted(SequenceId(str(t)), [0, 1], 1, sampling, tuple(drawn[t].tolist()), q) for t in range(trials)]
    drafted += [Drafted(SequenceId(f"c{t}"), [0, 1], 1, sampling, (1, 4)) for t in range(trials)]
    logits = p.log().repeat(2 * trials, 1)                                # (2 * trials * 3, V)
    out = verify(Sampler(seed=3), logits, drafted)
    # a drawn first draft is kept with probability sum(min(p, q)) (with q taken as one-hot: sum(p * q)),
    # the fixed one with p(1); any of these keeps the target's distribution, only the rate tells them apart
    chosen = torch.tensor([[1, 4]]).expand(trials, 2)
    for half, drafts, rate in ((out[:trials], drawn, torch.minimum(p[0], q[0]).sum()), (out[trials:], chosen, p[0, 1])):
        first = torch.tensor([t.accepted[0].token_id if t.accepted else t.token_id for t in half])
        assert chi_square(torch.bincount(first, minlength=VOCAB).float(), p[0]) < CHI2_DF5_P0001
        assert all(t.accepted[0].token_id == int(drafts[i, 0]) for i, t in enumerate(half) if t.accepted)
        kept = sum(1 for t in half if t.accepted) / trials
        assert abs(kept - float(rate)) < 4 * (float(rate) * (1 - float(rate)) / trials) ** 0.5, (kept, float(rate))


def masks(*allowed: set[int], failures: tuple[str | None, ...] = ()) -> DraftMasks:
    """Bitmask rows allowing the given ids (VOCAB < 32: one word a row), and each row's failure."""
    words = [sum(1 << t for t in ids) for ids in allowed]
    return DraftMasks(torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w] for w in words], dtype=torch.int32),
                      failures or (None,) * len(allowed))


def test_verify_masks_each_row_by_the_grammar_after_the_drafts_before_it():
    # drafts (1, 4): row 0 allows {1, 2, 3}, row 1 refuses 4, row 2 allows all; sampled rows keep the
    # masked target's distribution and never accept the refused draft; greedy rows take the masked argmax
    trials, g = 20_000, torch.Generator().manual_seed(9)
    p = random_probs(g, 3)
    sampling, greedy = (EngineSamplingParams(max_tokens=8, temperature=t) for t in (1.0, 0.0))
    grammar = masks({1, 2, 3}, {0, 1, 2, 3, 5}, set(range(VOCAB)))
    drafted = [Drafted(SequenceId(str(t)), [0, 1], 1, sampling, (1, 4), masks=grammar) for t in range(trials)]
    drafted.append(Drafted(SequenceId("greedy"), [0, 1], 1, greedy, (1, 4), masks=grammar))
    out = verify(Sampler(seed=4), p.log().repeat(trials + 1, 1), drafted)
    first = torch.tensor([t.accepted[0].token_id if t.accepted else t.token_id for t in out[:trials]])
    allowed = torch.tensor([1, 2, 3])
    counts = torch.bincount(first, minlength=VOCAB).float()
    assert counts.sum() == counts[allowed].sum()
    assert chi_square(counts[allowed], p[0, allowed] / p[0, allowed].sum()) < 13.82  # 2 degrees of freedom
    assert all(len(t.accepted) <= 1 and t.token_id != 4 for t in out[:trials] if t.accepted)
    rate = float(p[0, 1] / p[0, allowed].sum())  # the first draft is kept with its masked probability
    kept = sum(1 for t in out[:trials] if t.accepted) / trials
    assert abs(kept - rate) < 4 * (rate * (1 - rate) / trials) ** 0.5, (kept, rate)
    masked = p[:2].clone()
    masked[0, [0, 4, 5]] = masked[1, 4] = 0
    first, second = (int(row.argmax()) for row in masked)
    assert [t.token_id for t in out[-1].accepted] + [out[-1].token_id] == ([1, second] if first == 1 else [first])


@pytest.mark.parametrize("failed_row, tokens, error",
                         [(0, [1], "failed"), (2, [1, 2], None), (None, [1, 2, 3, 5], None)])
def test_a_failed_grammar_ends_the_drafts_where_plain_decoding_would(failed_row, tokens, error):
    # greedy rows whose argmax is each draft: every draft is kept unless a row's matcher had failed; a
    # failure before the step ends the sequence at its first token, a later one at the tokens before it
    logits = torch.full((4, VOCAB), -5.0)
    logits[[0, 1, 2, 3], [1, 2, 3, 5]] = 5.0
    failures = tuple("failed" if j == failed_row else None for j in range(4))
    d = Drafted(SequenceId("s"), [0, 1], 1, EngineSamplingParams(max_tokens=8, temperature=0.0), (1, 2, 3),
                masks=masks(*[set(range(VOCAB))] * 4, failures=failures))
    (out,) = verify(Sampler(seed=0), logits, [d])
    assert ([a.token_id for a in out.accepted] + [out.token_id], out.grammar_error) == (tokens, error)

"""A step's rows in attention order (``attention_layout``): rows at generated positions first, one
token each (the decode op), each request's prompt rows after as one sequence (the prefill op)."""

from __future__ import annotations

from pagedserve.engine.attention_layout import attention_layout
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.worker_requests import RequestState, ScheduledRequest, batch_order


def scheduled(request_id: str, token_ids: list[int], num_prompt: int, computed: int, num_scheduled: int,
              blocks: list[int], drafts: tuple[int, ...] = ()) -> ScheduledRequest:
    state = RequestState(SequenceId(request_id), token_ids, num_prompt, blocks, computed,
                         EngineSamplingParams(max_tokens=4))
    return ScheduledRequest(state, num_scheduled, len(drafts), drafts)


def test_decodes_then_a_prompt_chunk_keep_the_batch_order():
    layout = attention_layout([scheduled("a", [1, 2, 3, 4], 3, 3, 1, [7]),
                               scheduled("b", [5, 6, 7, 8, 9], 5, 2, 3, [8])])
    assert (layout.token_ids, layout.query_lens, layout.context_lens) == ([4, 7, 8, 9], [1, 3], [3, 2])
    assert layout.block_tables == [[7], [8]] and layout.num_decode_seqs == 1 and layout.in_batch_order


def test_a_recomputed_sequence_splits_at_its_prompts_end_and_its_outputs_go_first():
    recompute = scheduled("r", [10, 11, 12, 13, 14, 15], 4, 0, 6, [3, 4])  # 4 prompt tokens, 2 outputs
    layout = attention_layout([scheduled("d", [1, 2, 3], 2, 2, 1, [9]), recompute])
    assert layout.token_ids == [3, 14, 15, 10, 11, 12, 13]
    assert layout.query_lens == [1, 1, 1, 4] and layout.context_lens == [2, 4, 5, 0]
    assert layout.block_tables == [[9], [3, 4], [3, 4], [3, 4]] and layout.num_decode_seqs == 3
    assert layout.batch_rows == [0, 5, 6, 1, 2, 3, 4] and not layout.in_batch_order


def test_drafts_attend_as_decodes_after_their_last_known_token():
    layout = attention_layout([scheduled("s", [1, 2, 3, 4], 3, 3, 1, [5], drafts=(8, 9))])
    assert (layout.token_ids, layout.query_lens, layout.context_lens) == ([4, 8, 9], [1, 1, 1], [3, 4, 5])
    assert layout.num_decode_seqs == 3 and layout.in_batch_order


def test_a_prompts_one_token_remainder_is_a_prompt_row_not_a_decode():
    remainder = scheduled("p", list(range(17)), 17, 16, 1, [0, 1])  # 16 cached, the prompt's last token left
    decode = scheduled("d", [1, 2, 3], 2, 2, 1, [9])
    batch = sorted([remainder, decode], key=batch_order)
    assert [s.state.seq_id.request_id for s in batch] == ["d", "p"]
    layout = attention_layout(batch)
    assert layout.query_lens == [1, 1] and layout.context_lens == [2, 16] and layout.num_decode_seqs == 1

"""Conversions of logprobs between ``pagedserve.engine.messages`` and proto/engine.proto."""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.engine.messages import PromptLogprobs, SequenceId, TokenLogprobs
from pagedserve.services.common.pb import engine_pb2 as pb


def token_logprobs_to_pb(entry: TokenLogprobs) -> pb.TokenLogprobs:
    """TokenLogprobs -> pb.TokenLogprobs."""
    return pb.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                            top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)


def token_logprobs_from_pb(msg: pb.TokenLogprobs) -> TokenLogprobs:
    """pb.TokenLogprobs -> TokenLogprobs (values widened from the wire's float32)."""
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, tuple(msg.top_token_ids), tuple(msg.top_logprobs))


def entries_from_pb(msgs: Iterable[pb.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(token_logprobs_from_pb(m) for m in msgs)


def prompt_logprobs_to_pb(chunk: PromptLogprobs) -> pb.PromptLogprobs:
    """PromptLogprobs -> pb.PromptLogprobs (worker to scheduler)."""
    return pb.PromptLogprobs(
        seq_id=pb.SequenceId(request_id=chunk.seq_id.request_id, sample_index=chunk.seq_id.sample_index),
        first_position=chunk.first_position, entries=[token_logprobs_to_pb(e) for e in chunk.entries])


def prompt_logprobs_from_pb(msg: pb.PromptLogprobs) -> PromptLogprobs:
    """pb.PromptLogprobs -> PromptLogprobs (in the scheduler)."""
    return PromptLogprobs(SequenceId(msg.seq_id.request_id, msg.seq_id.sample_index), msg.first_position,
                          entries_from_pb(msg.entries))

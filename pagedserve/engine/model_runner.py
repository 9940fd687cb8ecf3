"""The worker's step executor: applies a BatchPlan to its per-request state, runs one forward
pass over the paged KV cache, samples, and answers with a StepResult.

Per request the worker keeps the tokens it knows (prompt + sampled), its block table and how many
tokens have K/V in the cache. A plan carries new requests in full and running ones as deltas
(new block ids, tokens to compute now). Sequences with one new token (decodes) go first in the
flat batch, longest context first, so attention can batch them; results return in plan order.
A sequence given lookahead slots runs its last token and the proposer's drafts as several query
rows, which ``spec_decode.verifier`` turns into its accepted drafts and one more token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

import torch
from torch import nn

from pagedserve.engine.messages import (BatchPlan, CachedRequestData, NewRequestData, PromptLogprobs, SampledToken,
                                        SequenceId, StepResult)
from pagedserve.engine.attention import AttentionBackend
from pagedserve.engine.forward_batch import ForwardBatch
from pagedserve.engine.grammar_matchers import GrammarCompiler, advance, built, draft_masks, failure
from pagedserve.engine.kv_cache import KVCache
from pagedserve.engine.logprobs import prompt_logprobs
from pagedserve.engine.penalties import TokenHistory
from pagedserve.engine.structured_output import StructuredOutput
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.attention_layout import attention_layout
from pagedserve.engine.worker_requests import (PlanMismatchError, RequestState, ScheduledRequest, batch_order,
                                               check_schedulable, expand_samples, prompt_chunk)
from pagedserve.engine.spec_decode.lookahead import kept_blocks
from pagedserve.engine.spec_decode.proposer import Proposer
from pagedserve.engine.spec_decode.verifier import Drafted, verify as verify_drafts


class ModelRunner:
    """Executes BatchPlans on one model with one paged KV cache.

    Args:
        model: a model with ``forward(input_ids, positions, attention)`` (``attention``: a
            :class:`StepAttention`), ``compute_logits`` and a ``dtype`` attribute.
        kv_cache: the paged cache the plans' block ids index.
        attention_backend: paged attention implementation.
        sampler: turns logits into tokens.
        proposer: drafts tokens for the sequences a plan reserves lookahead slots for
            (speculative decoding), and sees every forward batch and block move (a draft model keeps
            its K/V in step); ``None``: the worker does not speculate (such a plan is refused).
        forward: runs the model's forward (default: ``model`` itself, eager); a
            :class:`~pagedserve.engine.models.compiled.CompiledForward` for inductor.
        grammar: builds the matchers of structured outputs; ``None`` on ranks that do not sample
            (their sampler receives rank 0's tokens), where structured outputs are ignored.
        verify: turns the logits of drafted sequences' rows into their tokens
            (``spec_decode.verifier.verify`` with ``sampler``; a tensor-parallel rank's shares rank 0's).
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, attention_backend: AttentionBackend,
                 sampler: Sampler, forward: Callable[..., torch.Tensor] | None = None,
                 grammar: GrammarCompiler | None = None, proposer: Proposer | None = None,
                 verify: Callable[[torch.Tensor, Sequence[Drafted]], list[SampledToken]] | None = None) -> None:
        self.model = model
        self.proposer = proposer
        self.verify = verify or partial(verify_drafts, sampler)
        self.grammar = grammar
        self.forward = forward or model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.device = next(model.parameters()).device
        self.requests: dict[SequenceId, RequestState] = {}
        self._session_id = ""

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.kv_cache.num_cpu_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """Builds ``structure``'s grammar on the compile thread (``GrammarCompiler.prepare``); done at
        once on a rank that does not sample."""
        return self.grammar.prepare(structure) if self.grammar is not None else built()

    def execute(self, plan: BatchPlan) -> StepResult:
        """Runs one iteration: drop finished requests, apply the plan, forward, sample.

        Returns:
            One :class:`SampledToken` per request whose scheduled tokens reach the end of its known
            tokens, in plan order (new requests, then cached ones). Chunks that stop short sample nothing.

        Raises:
            PlanMismatchError: the plan contradicts the worker's state (a cached request it does not
                hold, a new one it already holds, a computed-token count that differs from its own,
                too few tokens or blocks). Nothing of the plan is applied then, except dropping
                ``finished_seq_ids``.
        """
        if plan.session_id != self._session_id:  # a new scheduler session: nothing held is valid
            self.requests.clear()
            self._session_id = plan.session_id
        for seq_id in plan.finished_seq_ids:
            self.requests.pop(seq_id, None)
        self.kv_cache.move_blocks(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy)
        if self.proposer is not None:
            self.proposer.move_blocks(plan)
        new_states = self._check_new(plan.new_requests)
        held = self._check_deltas(plan.cached_requests)
        scheduled = [ScheduledRequest(st, r.num_scheduled_tokens) for st, r in zip(new_states, plan.new_requests)]
        for state, delta in zip(held, plan.cached_requests):
            state.block_ids.extend(delta.new_block_ids)
            scheduled.append(ScheduledRequest(state, delta.num_scheduled_tokens, delta.num_lookahead_tokens))
        self.requests.update((st.seq_id, st) for st in new_states)
        scheduled = [s for s in scheduled if s.num_scheduled_tokens > 0]
        if not scheduled:
            return StepResult(step_id=plan.step_id)
        with torch.inference_mode():
            scheduled = self._with_drafts(scheduled)
            sampled, prompt = self._run(scheduled)
        self._settle(scheduled, sampled)
        return StepResult(step_id=plan.step_id, sampled=tuple(sampled), prompt_logprobs=tuple(prompt))

    def _settle(self, scheduled: Sequence[ScheduledRequest], sampled: Sequence[SampledToken]) -> None:
        """Counts the step's computed tokens (the accepted drafts' too); a sequence given lookahead
        slots gives back the blocks past its computed ones (as the scheduler does)."""
        accepted = {t.seq_id: len(t.accepted) for t in sampled}
        for s in scheduled:
            s.state.num_computed_tokens += s.num_scheduled_tokens + accepted.get(s.state.seq_id, 0)
            if s.num_lookahead_tokens:
                del s.state.block_ids[kept_blocks(s.state.num_computed_tokens, self.block_size):]

    def _with_drafts(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """``scheduled`` with the proposer's drafts (at most its lookahead) for each request that has
        lookahead slots and whose step reaches its end; one proposer call for all of them."""
        drafting = [i for i, s in enumerate(scheduled) if s.num_lookahead_tokens and s.reaches_end]
        if not drafting:
            return scheduled
        proposals = self.proposer.propose([scheduled[i] for i in drafting], self.sampler)
        with_drafts = list(scheduled)
        for i, proposal in zip(drafting, proposals):
            s = scheduled[i]
            with_drafts[i] = ScheduledRequest(s.state, s.num_scheduled_tokens, s.num_lookahead_tokens,
                                              proposal.token_ids, proposal.probs)
        return with_drafts

    def _check_new(self, requests: Sequence[NewRequestData]) -> list[RequestState]:
        """States for the plan's new requests (not yet registered), validated."""
        states, seen = [], set()
        for data in requests:
            if data.seq_id in self.requests or data.seq_id in seen:
                raise PlanMismatchError(f"sequence {data.seq_id} is new in the plan but the worker already holds it")
            seen.add(data.seq_id)
            state = RequestState(data.seq_id, list(data.token_ids), data.num_prompt_tokens,
                                 list(data.block_ids), data.num_computed_tokens, data.sampling)
            check_schedulable(state, data.num_scheduled_tokens, len(state.block_ids), self.block_size)
            states.append(state)
        for state in states:  # replays the output it carries (recompute, swap-in, fork, migration)
            if state.sampling.structured_output is not None and self.grammar is not None:
                state.matcher = self.grammar.matcher(state.sampling.structured_output,
                                                     state.token_ids[state.num_prompt_tokens:])
        return states

    def _check_deltas(self, deltas: Sequence[CachedRequestData]) -> list[RequestState]:
        """The held states the deltas refer to, after checking each delta against its state."""
        states = []
        for data in deltas:
            state = self.requests.get(data.seq_id)
            if state is None:
                raise PlanMismatchError(f"sequence {data.seq_id} is cached in the plan but unknown to the worker")
            if data.num_computed_tokens != state.num_computed_tokens:
                raise PlanMismatchError(
                    f"sequence {data.seq_id}: the plan says {data.num_computed_tokens} tokens are computed, "
                    f"the worker has {state.num_computed_tokens}")
            num_blocks = len(state.block_ids) + len(data.new_block_ids)
            check_schedulable(state, data.num_scheduled_tokens, num_blocks, self.block_size, data.num_lookahead_tokens)
            if data.num_lookahead_tokens and self.proposer is None:
                raise PlanMismatchError(f"sequence {data.seq_id}: lookahead slots for drafts, but the worker "
                                        "runs without speculative decoding")
            states.append(state)
        return states

    def _run(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list[SampledToken], list[PromptLogprobs]]:
        """Forward + sampling; appends sampled tokens to the states; returns them in ``scheduled``
        order, and the prompt logprobs of the chunks computed for sequences that ask for them."""
        batch = sorted(scheduled, key=batch_order)
        hidden = self._forward(batch)                                     # (T, hidden)
        plain, plain_rows, drafted, drafted_rows, chunks, total = [], [], [], [], [], 0
        for s in batch:
            if (chunk := prompt_chunk(s, total)) is not None:
                chunks.append(chunk)
            total += s.num_query_tokens
            if s.reaches_end and s.draft_token_ids:  # the last known token's row and each draft's
                masks = (draft_masks(s.state.matcher, s.draft_token_ids, self.grammar.vocab_size)
                         if s.state.matcher is not None else None)
                drafted.append(Drafted(s.state.seq_id, list(s.state.token_ids), s.state.num_prompt_tokens,
                                       s.state.sampling, s.draft_token_ids, s.draft_probs, masks))
                drafted_rows += range(total - s.num_query_tokens + s.num_scheduled_tokens - 1, total)
            elif s.reaches_end:
                plain.append(s)
                plain_rows.append(total - 1)  # the sequence's last new token predicts the next one
        prompt = prompt_logprobs(hidden, self.model.compute_logits, chunks) if chunks else []
        by_id: dict[SequenceId, list[SampledToken]] = {}
        if drafted:
            logits = self.model.compute_logits(hidden[torch.tensor(drafted_rows, device=self.device)])  # (R, vocab)
            for token in self.verify(logits, drafted):
                by_id[token.seq_id] = [token]
                state = self.requests[token.seq_id]
                for token_id in [*(t.token_id for t in token.accepted), token.token_id]:
                    state.token_ids.append(token_id)
                    if state.matcher is not None:
                        advance(state.matcher, token_id)
        if plain:
            self._sample(hidden, plain, plain_rows, by_id)
        return [t for s in scheduled for t in by_id.get(s.state.seq_id, ())], prompt

    def _sample(self, hidden: torch.Tensor, ends: list[ScheduledRequest], rows: list[int],
                by_id: dict[SequenceId, list[SampledToken]]) -> None:
        """Samples one token per sequence of ``ends`` (``n`` for a prompt with ``n > 1`` samples)
        from the hidden rows ``rows`` of ``hidden`` ``[T, hidden]``; appends each sequence's own
        token to its state and its sampled tokens to ``by_id``."""
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=self.device)]      # (N, hidden)
        logits = self.model.compute_logits(hidden)                        # (N, vocab) float32
        rows, params, counts, samples = expand_samples(ends)
        if len(rows) > len(ends):
            logits = logits[torch.tensor(rows, device=logits.device)]    # (N', vocab): n rows per n-sample prompt
        histories = ([TokenHistory(s.state.token_ids, s.state.num_prompt_tokens) for s, _ in samples]
                     if any(p.needs_history for p in params) else None)
        matchers = ([s.state.matcher for s, _ in samples]
                    if any(s.state.matcher is not None for s, _ in samples) else None)
        out = self.sampler(logits, params, counts, histories, matchers)
        for (s, index), token_id, logprob, entry in zip(samples, out.token_ids, out.logprobs, out.token_logprobs):
            seq_id, error = s.state.seq_id, failure(s.state.matcher)
            if index == seq_id.sample_index:  # the sequence's own token (other ones start forked samples)
                s.state.token_ids.append(token_id)
                if s.state.matcher is not None:
                    advance(s.state.matcher, token_id)
            by_id.setdefault(seq_id, []).append(SampledToken(seq_id, token_id, logprob, index, entry, error))

    def _forward(self, batch: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Builds the flat token batch and its metadata (index tensors made once, from lists) and runs
        the model: hidden states ``[T, hidden]``, rows in ``batch`` order. Rows at generated positions
        (decodes, a verification's last token and drafts, outputs recomputed) attend as one-token
        sequences, the decode path, as plain decoding computes each position; prompt rows as one
        sequence each (``attention_layout``; all K/V are written first)."""
        layout = attention_layout(batch)
        hidden = self._forward_tokens(layout.token_ids, layout.query_lens, layout.context_lens, layout.block_tables,
                                      layout.num_decode_seqs)                # (T, hidden), attention order
        if layout.in_batch_order:
            return hidden
        order = torch.argsort(torch.tensor(layout.batch_rows))             # (T,) flat row of each batch row
        return hidden[order.to(hidden.device)]

    def _forward_tokens(self, token_ids: list[int], query_lens: list[int], context_lens: list[int],
                        block_tables: list[list[int]], num_decode_seqs: int) -> torch.Tensor:
        """The model over a flat token batch, each sequence's new tokens after its computed ones, the
        first ``num_decode_seqs`` sequences decodes: hidden states ``[T, hidden]``. The proposer sees
        the batch after the model ran it."""
        batch = ForwardBatch.build(token_ids, query_lens, context_lens, block_tables, self.block_size,
                                   self.model.dtype, self.device, num_decode_seqs)
        hidden = batch.run(self.forward, self.kv_cache, self.attention_backend)  # (T, hidden)
        if self.proposer is not None:
            self.proposer.observe(batch)
        return hidden

    def warm_up(self) -> None:
        """Runs a 2-token and a 1-token forward over block 0 (before any sequence owns a block), so
        that a compiled forward compiles its graphs now rather than in the first requests' steps."""
        with torch.inference_mode():  # as in execute: guards check the inputs are inference tensors
            for num_tokens in (2, 1):
                self._forward_tokens([0] * num_tokens, [num_tokens], [0], [[0]], int(num_tokens == 1))

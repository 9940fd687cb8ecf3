"""A stand-in for a worker's model runner in scheduler unit tests.

It keeps worker-side state the way the real ModelRunner does (checking every delta against it),
keeps a model of the KV cache in which a slot holds the whole prefix up to its token (as K/V
depend on it), makes the plan's swap and copy-on-write copies, drafts the sequence's own next tokens
into lookahead slots and accepts some (giving the blocks past them back as a worker does), and
checks in every step that each sequence's context reads back exactly its tokens. Its "sampled"
token is a pure function of the sequence so far, so recompute after preemption must reproduce the
same output. Integration tests use the real model instead.
"""

import math
import zlib
from concurrent.futures import Future

from pagedserve.engine.grammar_matchers import built
from pagedserve.engine.messages import AcceptedDraft, BatchPlan, SampledToken, SequenceId, StepResult
from pagedserve.engine.spec_decode.lookahead import kept_blocks

TOKEN_COUNTS_ONLY = {"max_decode_slowdown": math.inf}
"""SchedulerConfig settings for tests that script exact token counts: prefill chunks fill the token
budget, not the time a scripted step (microseconds of noise) would leave them (step_cost.py has
its own tests)."""


def next_token(tokens: list[int], sample_index: int = 0) -> int:
    """Deterministic stand-in for decoding; never returns EOS (id 2)."""
    return (sum(tokens) * 31 + len(tokens) * 7 + sample_index * 13) % 97 + 3


def reference_output(prompt: list[int], max_tokens: int, sample_index: int = 0) -> list[int]:
    tokens = list(prompt)
    for i in range(max_tokens):
        tokens.append(next_token(tokens, sample_index if i == 0 else 0))
    return tokens[len(prompt):]


class ScriptedRunner:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.state: dict[str, dict] = {}
        self.plans: list[BatchPlan] = []
        self.device = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu = {b: [None] * block_size for b in range(num_cpu_blocks)}

    def prepare(self, structure) -> Future[None]:
        """Builds no grammar: the scripted tokens ignore structures."""
        return built()

    def execute(self, plan: BatchPlan) -> StepResult:
        self.plans.append(plan)
        for rid in plan.finished_seq_ids:
            self.state.pop(rid, None)
        for device_block, cpu_block in plan.blocks_to_swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in plan.blocks_to_swap_in:
            self.device[device_block] = list(self.cpu[cpu_block])
        for source, target in plan.blocks_to_copy:
            self.device[target] = list(self.device[source])
        for new in plan.new_requests:
            assert new.seq_id not in self.state, f"{new.seq_id} sent in full twice"
            self.state[new.seq_id] = dict(tokens=list(new.token_ids), table=list(new.block_ids),
                                              computed=new.num_computed_tokens, prompt=new.num_prompt_tokens,
                                              n=new.sampling.n)
        for cached in plan.cached_requests:
            st = self.state[cached.seq_id]
            assert st["computed"] == cached.num_computed_tokens
            st["table"].extend(cached.new_block_ids)
            st["lookahead"] = cached.num_lookahead_tokens
        scheduled = [(r.seq_id, r.num_scheduled_tokens) for r in plan.new_requests + plan.cached_requests]
        for rid, num in scheduled:  # every layer writes the step's K/V before any attention reads
            self._write(self.state[rid], num)
        sampled = []
        for rid, num in scheduled:
            st = self.state[rid]
            st["computed"] += num
            lookahead = st.pop("lookahead", 0)
            self._check_context(rid, st)
            if st["computed"] == len(st["tokens"]):
                first_of_many = len(st["tokens"]) == st["prompt"] and st["n"] > 1
                indexes = range(st["n"]) if first_of_many else [rid.sample_index]
                accepted = self._verify_drafts(rid, st, lookahead)
                tokens = [next_token(st["tokens"], i if first_of_many else 0) for i in indexes]
                sampled += [SampledToken(rid, t, 0.0, i, accepted=accepted, num_draft_tokens=lookahead)
                            for i, t in zip(indexes, tokens)]
                st["tokens"].append(tokens[0])
            if lookahead:  # the blocks past its computed slots go back, as ModelRunner._settle drops them
                del st["table"][kept_blocks(st["computed"], self.block_size):]
        return StepResult(plan.step_id, tuple(sampled))

    def _verify_drafts(self, rid: SequenceId, st: dict, lookahead: int) -> tuple[AcceptedDraft, ...]:
        """Drafts the sequence's next ``lookahead`` tokens into its lookahead slots and accepts the first
        0..lookahead of them (fixed per sequence and position): their K/V are computed; the slots of the
        rejected ones hold garbage, as a worker's do."""
        num_accepted = zlib.crc32(f"{rid}:{st['computed']}".encode()) % (lookahead + 1)
        accepted = []
        for i in range(lookahead):
            block, offset = self._slot(st, st["computed"] + i)
            if i < num_accepted:
                accepted.append(AcceptedDraft(next_token(st["tokens"]), 0.0))
                st["tokens"].append(accepted[-1].token_id)
                block[offset] = tuple(st["tokens"])  # the draft's K/V: its whole prefix
            else:
                block[offset] = ("rejected draft",)
        st["computed"] += num_accepted
        return tuple(accepted)

    def _slot(self, st: dict, pos: int) -> tuple[list, int]:
        table = st["table"]
        assert pos // self.block_size < len(table), "too few blocks for the slots"
        block = table[pos // self.block_size]
        assert 0 <= block < self.num_blocks
        return self.device[block], pos % self.block_size

    def _write(self, st: dict, num: int) -> None:
        for pos in range(st["computed"], st["computed"] + num):
            block, offset = self._slot(st, pos)
            block[offset] = tuple(st["tokens"][:pos + 1])

    def _check_context(self, rid: str, st: dict) -> None:
        for pos in range(st["computed"]):
            block, offset = self._slot(st, pos)
            assert block[offset] == tuple(st["tokens"][:pos + 1]), f"{rid} reads a wrong slot at {pos}"

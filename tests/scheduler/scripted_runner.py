"""A stand-in for a worker's model runner in scheduler unit tests.

It keeps worker-side state the way the real ModelRunner does (and checks every delta against it),
and "samples" a token that is a pure function of the sequence so far, so recompute after
preemption must reproduce the same output. Integration tests use the real model instead.
"""

from services.common.messages import BatchPlan, SampledToken, StepResult


def next_token(tokens: list[int]) -> int:
    """Deterministic stand-in for greedy decoding; never returns EOS (id 2)."""
    return (sum(tokens) * 31 + len(tokens) * 7) % 97 + 3


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class ScriptedRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.state: dict[str, dict] = {}
        self.plans: list[BatchPlan] = []

    def execute(self, plan: BatchPlan) -> StepResult:
        self.plans.append(plan)
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.state, f"{new.request_id} sent in full twice"
            self.state[new.request_id] = dict(
                tokens=list(new.token_ids), table=list(new.block_ids), computed=new.num_computed_tokens
            )
        for cached in plan.cached_requests:
            st = self.state[cached.request_id]
            assert st["computed"] == cached.num_computed_tokens
            st["table"].extend(cached.new_block_ids)
        sampled = []
        scheduled = [(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests + plan.cached_requests]
        used_blocks: set[int] = set()
        for rid, num in scheduled:
            st = self.state[rid]
            st["computed"] += num
            assert st["computed"] <= len(st["tokens"])
            assert len(st["table"]) * self.block_size >= st["computed"], "too few blocks for the slots"
            assert not used_blocks & set(st["table"]), "two running requests share a block"
            assert all(0 <= b < self.num_blocks for b in st["table"])
            used_blocks |= set(st["table"])
            if st["computed"] == len(st["tokens"]):
                token = next_token(st["tokens"])
                st["tokens"].append(token)
                sampled.append(SampledToken(rid, token, 0.0))
        return StepResult(plan.step_id, tuple(sampled))

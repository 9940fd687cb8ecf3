"""A hypothesis state machine over allocate / append / fork / free / cache hit / evict / swap out /
swap in. It keeps a model of what each block holds (as the worker would write it) and checks after
every step: no block leaks, no referenced block is free, every reference count equals the number
of tables holding the block, and every table reads back exactly its request's tokens."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.engine.prefix_caching import PrefixCachingBlockManager

BLOCK, DEVICE, CPU = 2, 12, 8
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # few distinct tokens: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = PrefixCachingBlockManager(DEVICE, BLOCK, num_cpu_blocks=CPU, hash_fn=_weak_hash)
        self.tokens: dict[str, list[int]] = {}
        self.device: dict[int, list] = {b: [None] * BLOCK for b in range(DEVICE)}
        self.cpu: dict[int, list] = {b: [None] * BLOCK for b in range(CPU)}
        self.next_id = 0

    def _write(self, rid: str, first: int) -> None:
        """What the worker writes at a slot depends on the whole prefix up to it, as K/V do."""
        table = self.bm.block_table(rid)
        for pos in range(first, len(self.tokens[rid])):
            self.device[table[pos // BLOCK]][pos % BLOCK] = tuple(self.tokens[rid][:pos + 1])

    @rule(prompt=PROMPTS)
    def admit(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prefix = self.bm.find_cached_prefix(prompt)
        if not self.bm.can_allocate(rid, len(prompt), prefix):
            return
        self.bm.allocate_slots(rid, len(prompt), prefix)
        table = self.bm.block_table(rid)
        for pos in range(prefix.num_tokens):  # a hit must hold K/V computed for exactly this prefix
            assert self.device[table[pos // BLOCK]][pos % BLOCK] == tuple(prompt[:pos + 1])
        self.tokens[rid] = list(prompt)
        self._write(rid, prefix.num_tokens)
        self.bm.cache_full_blocks(rid, lambda: self.tokens[rid], len(prompt))

    def _resident(self) -> list[str]:
        return sorted(r for r in self.tokens if not self.bm.is_swapped(r))

    @precondition(lambda self: self._resident())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(self._resident()))
        pos = len(self.tokens[rid])
        cow = self.bm.needs_copy_on_write(rid, pos)
        grow = self.bm.num_new_blocks(rid, pos + 1)
        if cow + grow > self.bm.num_free_blocks:
            return
        for src, dst in self.bm.copy_on_write(rid, pos):
            self.device[dst] = list(self.device[src])
        self.bm.allocate_slots(rid, pos + 1)
        self.tokens[rid].append(token)
        self._write(rid, pos)
        self.bm.cache_full_blocks(rid, lambda: self.tokens[rid], pos + 1)

    @precondition(lambda self: self._resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._resident()))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child, len(self.tokens[parent]))
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self._resident())
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._resident()))
        if self.bm.can_swap_out(rid):
            for device_block, cpu_block in self.bm.swap_out(rid):
                self.cpu[cpu_block] = list(self.device[device_block])

    @precondition(lambda self: self.bm.swapped_seq_ids())
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.bm.swapped_seq_ids())))
        if self.bm.can_swap_in(rid):
            for cpu_block, device_block in self.bm.swap_in(rid):
                self.device[device_block] = list(self.cpu[cpu_block])

    @invariant()
    def blocks_are_accounted_for(self):
        for pool_size, tables, free in (
            (DEVICE, [self.bm.block_table(r) for r in self.bm.seq_ids()], self.bm.free_block_ids()),
            (CPU, [self.bm.cpu_block_table(r) for r in self.bm.swapped_seq_ids()], self.bm.free_cpu_block_ids()),
        ):
            held: dict[int, int] = {}
            for table in tables:
                for b in table:
                    held[b] = held.get(b, 0) + 1
            assert not set(held) & set(free), "a held block is in the free list"
            assert sorted(set(held) | set(free)) == list(range(pool_size)), "a block leaked"
            assert len(free) == len(set(free))
        for b in range(DEVICE):
            holders = sum(self.bm.block_table(r).count(b) for r in self.bm.seq_ids())
            assert self.bm.ref_count(b) == holders

    @invariant()
    def every_table_reads_back_its_tokens(self):
        for rid, toks in self.tokens.items():
            swapped = self.bm.is_swapped(rid)
            table = self.bm.cpu_block_table(rid) if swapped else self.bm.block_table(rid)
            content = self.cpu if swapped else self.device
            assert [content[table[p // BLOCK]][p % BLOCK] for p in range(len(toks))] == [
                tuple(toks[:p + 1]) for p in range(len(toks))]


def _weak_hash(data: bytes) -> bytes:
    """A hash blind to the parent block: equal blocks after different prefixes collide, which must
    never return a block computed after another prefix."""
    return data.split(b"|", 1)[1]


BlockManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase

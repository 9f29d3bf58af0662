"""Property-based test of the block manager: random interleavings of add, append,
fork, free, abort, prefix hits, swap out/in, preemption and speculative
rollback, with a shadow KV memory that carries out every copy the manager
asks for. After every step the pool invariants hold and every sequence reads
back exactly its own tokens: all of them in a full-attention KV group, those
its next query sees in a sliding-window group (which gives the rest back).

Prompts and appended tokens are computed as the scheduler computes them: in
steps of at most ``STEP_TOKENS`` positions, each first growing the tables to
the step's end (a windowed group takes blocks only that far), then writing,
then marking the positions computed (a windowed group gives back what left
its window)."""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedbackend.core.block_manager import AllocStatus, BlockManager, NoFreeBlocksError
from pagedbackend.core.kv_groups import skipped_blocks
from pagedbackend.core.group_alloc import allocate_group

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_SWAP = 12
# A tiny alphabet and shared stems make prompts collide, so prefix hits happen.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [5, 5, 5, 5, 5]]


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOWS = (None,)        # each KV group's sliding window (None: full attention)
    STEP_TOKENS = None       # positions one step computes at most (None: all at once)
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BLOCK_SIZE, num_swap_blocks=NUM_SWAP, watermark=0.0,
                               windows=self.WINDOWS, step_tokens=self.STEP_TOKENS)
        self.device = [[None] * BLOCK_SIZE for _ in range(self.NUM_BLOCKS)]
        self.host = [[None] * BLOCK_SIZE for _ in range(NUM_SWAP)]
        self.tokens = {}   # seq id -> its tokens
        self.groups = {}   # group id -> list of seq ids
        self.next_id = 0

    # -- helpers: the "runner" side that owns the memory
    def _compute(self, seq_id, start, end, tokens=None):
        """Compute positions start..end-1 step by step; False (and nothing
        computed past the last whole step) when the pool runs out."""
        tokens = self.tokens[seq_id] if tokens is None else tokens
        step = self.STEP_TOKENS or max(end - start, 1)
        while start < end:
            stop = min(end, start + step)
            if self.bm.blocks_to_append(seq_id, max(len(tokens), self.bm.num_tokens(seq_id)),
                                        stop) > self.bm.num_free_blocks:
                return False
            copies = self.bm.append_slots(seq_id, max(len(tokens), self.bm.num_tokens(seq_id)), stop)
            self._copy(copies, self.device, self.device)
            for table in self.bm.get_block_tables(seq_id):
                for pos in range(start, stop):
                    block = table[pos // BLOCK_SIZE]
                    assert self.bm.ref_count(block) == 1, f"write into shared block {block}"
                    self.device[block][pos % BLOCK_SIZE] = tokens[pos]
            self.bm.mark_computed(seq_id, tokens, stop)
            start = stop
        return True

    def _copy(self, pairs, src_mem, dst_mem):
        for src, dst in pairs:
            dst_mem[dst] = list(src_mem[src])

    def _running_groups(self):
        return [g for g, seqs in self.groups.items() if not self.bm.is_swapped(seqs[0])]

    def _swapped_groups(self):
        return [g for g, seqs in self.groups.items() if self.bm.is_swapped(seqs[0])]

    def _drop(self, group):
        for seq_id in self.groups.pop(group):
            if self.bm.has_seq(seq_id):
                self.bm.free(seq_id)
            del self.tokens[seq_id]

    def _admit(self, group):
        """Allocate every sequence of a group together, as the scheduler does
        (``allocate_group``: all or none, even when a sibling's new blocks evict
        a prefix block another counted on), then prefill each; the group is
        dropped when the pool runs out."""
        seqs, free = self.groups[group], self.bm.num_free_blocks
        computed = allocate_group(self.bm, seqs, [self.tokens[s] for s in seqs])
        if computed is None:
            assert self.bm.num_free_blocks == free and not any(self.bm.has_seq(s) for s in seqs)
            self._drop(group)
            return
        for seq_id, cached in zip(seqs, computed):
            assert cached % BLOCK_SIZE == 0 and cached < len(self.tokens[seq_id])
            if not self._compute(seq_id, cached, len(self.tokens[seq_id])):
                self._drop(group)
                return

    # -- rules
    @rule(stem=st.integers(0, len(STEMS) - 1), cut=st.integers(1, 9),
          tail=st.lists(st.integers(0, 9), max_size=6))
    def add(self, stem, cut, tail):
        toks = STEMS[stem][:cut] + tail
        status = self.bm.can_allocate([toks])
        seq_id = self.next_id
        self.next_id += 1
        if status != AllocStatus.OK:
            return
        self.tokens[seq_id] = toks
        self.groups[seq_id] = [seq_id]
        self._admit(seq_id)

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), new=st.lists(st.integers(0, 9), min_size=1, max_size=5))
    def append(self, data, new):
        running = self._running_groups()
        if not running:
            return
        group = data.draw(st.sampled_from(running))
        seq_id = data.draw(st.sampled_from(self.groups[group]))
        old = len(self.tokens[seq_id])
        target = old + len(new)
        if self.bm.blocks_to_append(seq_id, target) > self.bm.num_free_blocks:
            try:
                self.bm.append_slots(seq_id, target)
            except NoFreeBlocksError:
                return
            raise AssertionError("append_slots succeeded past the free block count")
        tokens = self.tokens[seq_id] + new
        if self._compute(seq_id, old, target, tokens):
            self.tokens[seq_id] = tokens
        else:
            self._drop(group)

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 9), min_size=1, max_size=4),
          accepted=st.integers(0, 4))
    def speculate_and_roll_back(self, data, drafts, accepted):
        """Slots for draft tokens, their K/V written, then the rejected ones given back."""
        running = self._running_groups()
        if not running:
            return
        seq_id = data.draw(st.sampled_from(self.groups[data.draw(st.sampled_from(running))]))
        old, accepted = len(self.tokens[seq_id]), min(accepted, len(drafts))
        tokens = self.tokens[seq_id] + drafts
        end = old + len(drafts)
        if self.bm.blocks_to_append(seq_id, end, end) > self.bm.num_free_blocks:
            return
        self._copy(self.bm.append_slots(seq_id, end, end), self.device, self.device)
        for table in self.bm.get_block_tables(seq_id):
            for pos in range(old, end):
                block = table[pos // BLOCK_SIZE]
                assert self.bm.ref_count(block) == 1, f"draft written into shared block {block}"
                self.device[block][pos % BLOCK_SIZE] = tokens[pos]
        self.tokens[seq_id] = tokens[:old + accepted]
        self.bm.truncate(seq_id, old + accepted)
        self.bm.mark_computed(seq_id, self.tokens[seq_id], old + accepted)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def fork(self, data):
        running = self._running_groups()
        if not running:
            return
        group = data.draw(st.sampled_from(running))
        parent = data.draw(st.sampled_from(self.groups[group]))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.groups[group].append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_one_sequence(self, data):
        """A beam or sample that finishes (or drops out) on its own."""
        group = data.draw(st.sampled_from(sorted(self.groups)))
        seq_id = data.draw(st.sampled_from(self.groups[group]))
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        self.groups[group].remove(seq_id)
        if not self.groups[group]:
            del self.groups[group]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort_group(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.groups))))

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def preempt_by_swapping(self, data):
        running = self._running_groups()
        if not running:
            return
        group = data.draw(st.sampled_from(running))
        seqs = self.groups[group]
        if not self.bm.can_swap_out(seqs):
            return
        self._copy(self.bm.swap_out(seqs), self.device, self.host)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def resume_swapped(self, data):
        swapped = self._swapped_groups()
        if not swapped:
            return
        group = data.draw(st.sampled_from(swapped))
        seqs = self.groups[group]
        if not self.bm.can_swap_in(seqs):
            return
        self._copy(self.bm.swap_in(seqs), self.host, self.device)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        """Drop the group's blocks, then re-allocate every sequence from its tokens."""
        running = self._running_groups()
        if not running:
            return
        group = data.draw(st.sampled_from(running))
        seqs = self.groups[group]
        for seq_id in seqs:
            self.bm.free(seq_id)
        if self.bm.can_allocate([self.tokens[s] for s in seqs]) != AllocStatus.OK:
            for seq_id in seqs:
                del self.tokens[seq_id]
            del self.groups[group]
            return
        self._admit(group)

    # -- invariants
    @invariant()
    def pool_is_consistent(self):
        self.bm.check_invariants()
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.NUM_BLOCKS

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq_id, toks in self.tokens.items():
            state = self.bm._seqs[seq_id]
            memory = self.device if state.on_device else self.host
            assert state.num_computed == len(toks), f"sequence {seq_id}: {state.num_computed} of {len(toks)} computed"
            for window, table in zip(self.WINDOWS, state.tables):
                first = skipped_blocks(len(toks), window, BLOCK_SIZE) * BLOCK_SIZE   # what the next query sees
                read = [memory[table.blocks[p // BLOCK_SIZE - table.skipped].block_id][p % BLOCK_SIZE]
                        for p in range(first, len(toks))]
                assert read == toks[first:], f"sequence {seq_id} (window {window}) reads {read}, holds {toks[first:]}"

    def teardown(self):
        for seqs in self.groups.values():
            for seq_id in seqs:
                self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.NUM_BLOCKS
        assert self.bm.num_free_swap_blocks == NUM_SWAP


class WindowedMachine(BlockManagerMachine):
    """A full-attention group beside two sliding-window groups (windows of 5
    and 2 positions, shorter than most sequences), prompts computed in steps
    of at most 6 positions."""
    WINDOWS = (None, 5, 2)
    STEP_TOKENS = 6
    NUM_BLOCKS = 40


class SlidingOnlyMachine(BlockManagerMachine):
    """One group, every layer windowed (Mistral): its tables keep a window."""
    WINDOWS = (6,)
    STEP_TOKENS = 5


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
BlockManagerMachine.TestCase.settings = SETTINGS
WindowedMachine.TestCase.settings = settings(SETTINGS, max_examples=100)
SlidingOnlyMachine.TestCase.settings = settings(SETTINGS, max_examples=60)
test_block_manager_state_machine = BlockManagerMachine.TestCase
test_block_manager_with_windowed_kv_groups = WindowedMachine.TestCase
test_block_manager_with_one_windowed_group = SlidingOnlyMachine.TestCase

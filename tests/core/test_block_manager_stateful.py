"""Property-based test of the block manager: random interleavings of add, append,
fork, free, abort, prefix hits, swap out/in and preemption, with a shadow KV
memory that carries out every copy the manager asks for. After every step the
pool invariants hold and every sequence reads back exactly its own tokens."""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedbackend.core.block_manager import AllocStatus, BlockManager, NoFreeBlocksError

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_SWAP = 12
# A tiny alphabet and shared stems make prompts collide, so prefix hits happen.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [5, 5, 5, 5, 5]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_swap_blocks=NUM_SWAP, watermark=0.0)
        self.device = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.host = [[None] * BLOCK_SIZE for _ in range(NUM_SWAP)]
        self.tokens = {}   # seq id -> its tokens
        self.groups = {}   # group id -> list of seq ids
        self.next_id = 0

    # -- helpers: the "runner" side that owns the memory
    def _write(self, seq_id, start, end):
        table = self.bm.get_block_table(seq_id)
        for pos in range(start, end):
            block = table[pos // BLOCK_SIZE]
            assert self.bm.ref_count(block) == 1, f"write into shared block {block}"
            self.device[block][pos % BLOCK_SIZE] = self.tokens[seq_id][pos]
        self.bm.mark_computed(seq_id, self.tokens[seq_id], end)

    def _copy(self, pairs, src_mem, dst_mem):
        for src, dst in pairs:
            dst_mem[dst] = list(src_mem[src])

    def _running_groups(self):
        return [g for g, seqs in self.groups.items() if not self.bm.is_swapped(seqs[0])]

    def _swapped_groups(self):
        return [g for g, seqs in self.groups.items() if self.bm.is_swapped(seqs[0])]

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
        cached = self.bm.allocate(seq_id, toks)
        assert cached % BLOCK_SIZE == 0 and cached < len(toks)
        self._write(seq_id, cached, len(toks))
        self.groups[seq_id] = [seq_id]

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
        copies = self.bm.append_slots(seq_id, target)
        self._copy(copies, self.device, self.device)
        self.tokens[seq_id] = self.tokens[seq_id] + new
        self._write(seq_id, old, target)

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
        group = data.draw(st.sampled_from(sorted(self.groups)))
        for seq_id in self.groups.pop(group):
            self.bm.free(seq_id)
            del self.tokens[seq_id]

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
        for seq_id in seqs:
            cached = self.bm.allocate(seq_id, self.tokens[seq_id])
            self._write(seq_id, cached, len(self.tokens[seq_id]))

    # -- invariants
    @invariant()
    def pool_is_consistent(self):
        self.bm.check_invariants()
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == NUM_BLOCKS

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq_id, toks in self.tokens.items():
            state = self.bm._seqs[seq_id]
            memory = self.device if state.on_device else self.host
            read = [memory[b.block_id][pos % BLOCK_SIZE]
                    for pos, b in ((p, state.blocks[p // BLOCK_SIZE]) for p in range(len(toks)))]
            assert read == toks, f"sequence {seq_id} reads {read}, holds {toks}"

    def teardown(self):
        for seqs in self.groups.values():
            for seq_id in seqs:
                self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert self.bm.num_free_swap_blocks == NUM_SWAP


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_manager_state_machine = BlockManagerMachine.TestCase

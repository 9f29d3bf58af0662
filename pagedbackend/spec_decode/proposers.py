"""Proposers for speculative decoding: each returns, for a sequence about to
decode, up to ``n`` tokens it expects to follow; the target model verifies
them in its next forward pass (``spec_decode/speculator.py``). Proposals are
deterministic (a draft model's argmax, a copied n-gram continuation), which
is what keeps verification exact.

- ``NgramProposer`` (prompt lookup): the latest earlier occurrence of the
  sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens, in
  its prompt and output, and what followed it. An index per sequence keeps
  every step O(new tokens).
- ``SuffixProposer`` (suffix decoding, vLLM's method "suffix"): the longest
  match of the sequence's last tokens in its own prompt and output, and in
  the outputs of earlier requests of the same tenant (``suffix_index.py``).
- These two size their drafts themselves, from the match: as many tokens
  as the match is long (times ``suffix_decoding_max_spec_factor`` for
  suffix), so a run of copied text gets its full draft at once, and a short,
  chance match a short one.
- ``DraftModelProposer``: a smaller or quantised model with a KV cache of its
  own, laid out exactly like the target's: the same block ids and slots, so
  the scheduler's block tables serve both and the draft needs no blocks of
  its own (copy-on-write copies reach its cache too). It computes what it has
  not computed yet of each sequence, then one token per round.
"""
from array import array
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

from pagedbackend.core.scheduled import ScheduledSeq, SeqEntry
from pagedbackend.core.sequence import SequenceGroup
from pagedbackend.sample.sampler import row_argmax
from pagedbackend.spec_decode.suffix_index import SuffixIndex, walk

Request = Tuple[ScheduledSeq, int]   # a decoding sequence's entry, and how many tokens to propose


class NgramProposer:
    sizes_drafts = True   # the match's length bounds the draft (the module's docstring)

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._index: Dict[int, "_NgramIndex"] = {}

    def propose(self, requests: Sequence[Request]) -> List[List[int]]:
        out = []
        for item, n in requests:
            index = self._index.get(item.seq.seq_id)
            if index is None:
                index = self._index[item.seq.seq_id] = _NgramIndex(self.lookup_min, self.lookup_max)
            out.append(index.propose(item.seq.token_ids, n))
        return out

    def accepted(self, item: ScheduledSeq, num_accepted: int) -> None:
        pass

    def copy_blocks(self, pairs) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


class _NgramIndex:
    """For each n-gram size, the latest start of every n-gram of a sequence
    that some token follows."""

    def __init__(self, lo: int, hi: int):
        self.sizes = list(range(hi, lo - 1, -1))   # longest match first
        self.starts: Dict[int, Dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed: Dict[int, int] = {n: 0 for n in self.sizes}   # starts below this are in

    def propose(self, tokens: List[int], n: int) -> List[int]:
        length = len(tokens)
        for size in self.sizes:
            starts = self.starts[size]
            for i in range(self.indexed[size], length - size):   # i + size < length: followed
                starts[tuple(tokens[i:i + size])] = i
            self.indexed[size] = max(self.indexed[size], length - size)
        for size in self.sizes:
            if length <= size:
                continue
            start = self.starts[size].get(tuple(tokens[length - size:]))
            if start is not None:
                # The match extended backwards, as far as it can matter: up to n tokens.
                match = size
                while match < n and start - 1 - (match - size) >= 0 and \
                        tokens[start - 1 - (match - size)] == tokens[length - 1 - match]:
                    match += 1
                return tokens[start + size:start + size + min(n, match)]
        return []


def tenant_key(group: SequenceGroup) -> bytes:
    """Whose earlier answers a request may draft from: its ``cache_salt``
    (the prefix cache's namespace too; an adapter joins it once adapters
    exist)."""
    return group.cache_salt


class SuffixProposer:
    """Suffix decoding: per sequence an index over its prompt and output, and
    per tenant a bounded index over recent requests' outputs (each with the
    last ``max_tree_depth`` tokens of its prompt, so a question asked again
    matches its earlier answer from the first output token). A draft comes
    from whichever index offers the higher score.

    Tenants never share state: a request reads and feeds only its tenant's
    index, so another tenant's answers change neither its drafts nor the
    time they take. Bounds: per tenant ``max_cached_requests`` outputs and
    ``max_cached_tokens`` tokens, oldest out first; at most ``max_tenants``
    tenant indexes, the least recently used dropped whole (the one way many
    tenants together touch another: its index can go, never change)."""
    sizes_drafts = True

    def __init__(self, spec):
        self.depth = spec.suffix_decoding_max_tree_depth
        self.factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.max_requests = spec.suffix_decoding_max_cached_requests
        self.max_tokens = spec.suffix_decoding_max_cached_tokens
        self.max_tenants = spec.suffix_decoding_max_tenants
        self._local: Dict[int, SuffixIndex] = {}
        self._tenants: "OrderedDict[bytes, SuffixIndex]" = OrderedDict()

    def propose(self, requests: Sequence[Request]) -> List[List[int]]:
        out = []
        for item, n in requests:
            tokens = item.seq.token_ids
            local = self._local.get(item.seq.seq_id)
            if local is None or local.docs[0] is not tokens:
                local = self._local[item.seq.seq_id] = SuffixIndex()
                local.add(tokens)
            else:
                local.extend(0)
            draft, score = self._draft(local, tokens, n)
            key = tenant_key(item.group)
            shared = self._tenants.get(key)
            if shared is not None:
                self._tenants.move_to_end(key)
                other, other_score = self._draft(shared, tokens, n)
                if other_score > score:
                    draft = other
            out.append(draft)
        return out

    def _draft(self, index: SuffixIndex, context: List[int], n: int):
        length, cands = index.match(context, self.depth)
        if not cands:
            return [], 0.0
        return walk(cands, min(n, int(length * self.factor + 1e-6)), self.min_prob)

    def remember(self, group: SequenceGroup) -> None:
        """A finished request's outputs join its tenant's index."""
        if not self.max_requests:
            return
        key = tenant_key(group)
        index = self._tenants.get(key)
        if index is None:
            index = self._tenants[key] = SuffixIndex()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(key)
        for seq in group.finished_seqs:
            if seq.num_output_tokens:
                start = max(0, seq.num_prompt_tokens - self.depth)
                index.add(array("i", seq.token_ids[start:]))
                while index.docs and (len(index.docs) > self.max_requests or index.num_tokens > self.max_tokens):
                    index.pop_oldest()

    def accepted(self, item: ScheduledSeq, num_accepted: int) -> None:
        pass

    def copy_blocks(self, pairs) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._local.pop(seq_id, None)


class DraftModelProposer:
    def __init__(self, runner):
        self.runner = runner
        # Per sequence: positions whose draft K/V are computed, and the group's
        # preemption count then (a preemption moves or drops the blocks).
        self._done: Dict[int, Tuple[int, int]] = {}
        self._proposed: Dict[int, int] = {}   # per sequence: its length when the last proposal was made

    def propose(self, requests: Sequence[Request]) -> List[List[int]]:
        drafts: List[List[int]] = [[] for _ in requests]
        entries: List[SeqEntry] = []
        for item, _ in requests:
            seq = item.seq
            length = seq.num_tokens
            done, seen = self._done.get(seq.seq_id, (0, -1))
            start = min(done, length - 1) if seen == item.group.num_preemptions else 0
            # A vision-language draft takes the prompt's images in their places too.
            entries.append(SeqEntry(seq.token_ids[start:length], start, item.block_table,
                                    mm_items=tuple(item.group.mm_items)))
            self._proposed[seq.seq_id] = length
        active = [i for i, (_, n) in enumerate(requests) if n > 0]
        while active:
            logits = self.runner.execute_model([entries[i] for i in active])
            next_active = []
            for i, token in zip(active, row_argmax(logits).tolist()):
                item, n = requests[i]
                drafts[i].append(token)
                if len(drafts[i]) < n:
                    length = self._proposed[item.seq.seq_id]
                    entries[i] = SeqEntry([token], length - 1 + len(drafts[i]), item.block_table)
                    next_active.append(i)
            active = next_active
        for (item, _), proposal in zip(requests, drafts):
            if proposal:   # draft K/V now stand for the positions below length - 1 + len(proposal)
                length = self._proposed[item.seq.seq_id]
                self._done[item.seq.seq_id] = (length - 1 + len(proposal), item.group.num_preemptions)
        return drafts

    def accepted(self, item: ScheduledSeq, num_accepted: int) -> None:
        """Of the draft's K/V, those of rejected tokens no longer stand."""
        seq_id = item.seq.seq_id
        if seq_id in self._done:
            done, seen = self._done[seq_id]
            self._done[seq_id] = (min(done, self._proposed[seq_id] + num_accepted), seen)

    def copy_blocks(self, pairs) -> None:
        self.runner.copy_blocks(pairs)

    def release(self, seq_id: int) -> None:
        self._done.pop(seq_id, None)
        self._proposed.pop(seq_id, None)


def draft_runner(config, target, compile_in_background: bool = False):
    """The draft model's runner: ``config`` is the draft's engine settings;
    its KV cache mirrors ``target``'s blocks one for one."""
    from pagedbackend.worker.model_runner import ModelRunner
    runner = ModelRunner(config, compile_in_background=compile_in_background)
    if runner.positions_of is not None:
        raise ValueError(f"speculative_config: a draft model with multimodal RoPE ({type(runner.model).__name__}) "
                         "is not served as a draft (its draft steps carry no images); speculate with ngram or suffix")
    if runner.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({runner.vocab_size} tokens) "
                         f"differs from the target's ({target.vocab_size}); the draft must share its tokenizer")
    if runner.num_kv_blocks != target.num_kv_blocks or runner.block_size != target.block_size:
        raise ValueError("speculative_config: the draft's KV cache must have the target's blocks")
    for name, model in (("target", target), ("draft", runner)):
        layout = model.kv_layout
        if len(layout.groups) > 1 or layout.frees_blocks:
            raise ValueError(f"speculative_config: a draft model reads the target's block table, whole; the "
                             f"{name} model has sliding-window layers whose blocks leave the pool "
                             f"(set disable_hybrid_kv_cache_manager=True, or speculate with ngram)")
    return runner


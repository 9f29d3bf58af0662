"""Suffix matching over token documents, the index behind suffix speculation.

A ``SuffixIndex`` records, for every pair of adjacent tokens in its documents,
where the pair occurs (the latest ``per_key`` occurrences). Matching a
context finds the longest suffix of it, up to ``depth`` tokens, that occurs
in the documents: the occurrences of its last pair, each extended backwards
token by token. The occurrences that match longest are the node a suffix
tree of depth ``depth`` would reach; walking forward from them, always to
the token that most of them continue with, is that tree's most frequent
path, and the share of them that agree at each token estimates its
probability. This holds one entry per token where a depth-limited suffix
tree holds up to ``depth`` nodes, which matters in Python.

Documents are kept whole; the oldest can be dropped (``pop_oldest``), and
an index over a growing document (a sequence's prompt and output) takes
its new tokens with ``extend``.
"""
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

_PAIR = 1 << 20          # a pair's key: first * _PAIR + second (vocabularies stay below 2^20)
_DOC = 1 << 32           # an occurrence: document id * _DOC + offset of the pair's second token

Candidates = List[Tuple[Sequence[int], int]]   # (document tokens, offset of the token that follows the match)


class SuffixIndex:
    def __init__(self, per_key: int = 64):
        self.per_key = per_key
        self.docs: "OrderedDict[int, Sequence[int]]" = OrderedDict()
        self._next: Dict[int, int] = {}         # per document: the first offset not indexed yet
        self._where: Dict[int, List[int]] = {}  # pair key -> occurrences, oldest first
        self.num_tokens = 0                     # tokens indexed, all documents together
        self._ids = 0                           # the next document's id

    def add(self, tokens: Sequence[int]) -> int:
        """Index ``tokens`` as a new document; returns its id (0, 1, ... in order)."""
        doc_id = self._ids
        self._ids += 1
        self.docs[doc_id] = tokens
        self._next[doc_id] = 1
        self.extend(doc_id)
        return doc_id

    def extend(self, doc_id: int) -> None:
        """Index what document ``doc_id`` gained since. A pair is indexed once a
        token follows it, since only then does it propose something."""
        tokens, where, cap = self.docs[doc_id], self._where, self.per_key
        start, end, base = self._next[doc_id], len(tokens) - 1, doc_id * _DOC
        for i in range(start, end):
            key = tokens[i - 1] * _PAIR + tokens[i]
            found = where.get(key)
            if found is None:
                where[key] = [base + i]
            else:
                found.append(base + i)
                if len(found) > 2 * cap:        # trimmed now and then, so appends stay O(1)
                    del found[:len(found) - cap]
        if end > start:
            self.num_tokens += end - start
            self._next[doc_id] = end

    def pop_oldest(self) -> None:
        """Forget the oldest document and its occurrences."""
        doc_id, tokens = self.docs.popitem(last=False)
        limit, indexed = (doc_id + 1) * _DOC, self._next.pop(doc_id)
        for i in range(1, indexed):
            key = tokens[i - 1] * _PAIR + tokens[i]
            found = self._where.get(key)
            if found is None:
                continue
            drop = 0
            while drop < len(found) and found[drop] < limit:
                drop += 1
            if drop == len(found):
                del self._where[key]
            elif drop:
                del found[:drop]
        self.num_tokens -= indexed - 1

    def match(self, context: Sequence[int], depth: int) -> Tuple[int, Candidates]:
        """The longest suffix of ``context`` (at least 2, at most ``depth``
        tokens) found in the documents: its length and the occurrences that
        match it, newest first."""
        n = len(context)
        if n < 2:
            return 0, []
        found = self._where.get(context[-2] * _PAIR + context[-1])
        if not found:
            return 0, []
        best, cands = 0, []
        for entry in reversed(found[-self.per_key:]):
            doc = self.docs.get(entry // _DOC)
            if doc is None:
                continue
            i = entry % _DOC
            cap = min(depth, i + 1, n)
            m = 0
            while m < cap and doc[i - m] == context[n - 1 - m]:
                m += 1
            if m < 2 or m < best:
                continue
            if m > best:
                best, cands = m, []
            cands.append((doc, i + 1))
        return best, cands


def walk(cands: Candidates, limit: int, min_prob: float) -> Tuple[List[int], float]:
    """Up to ``limit`` tokens that most of ``cands`` continue with, each while
    the estimated probability of reaching it (the product of the agreeing
    shares so far) stays at least ``min_prob``; and the draft's score, the sum
    of those probabilities (its expected number of accepted tokens)."""
    draft, score, prob = [], 0.0, 1.0
    for j in range(limit):
        counts: Dict[int, int] = {}
        for doc, at in cands:
            if at + j < len(doc):
                token = doc[at + j]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.get)     # ties: the newest occurrence's (insertion order)
        agree = counts[token]
        prob *= agree / sum(counts.values())
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        if agree != len(cands):
            cands = [(doc, at) for doc, at in cands if at + j < len(doc) and doc[at + j] == token]
    return draft, score

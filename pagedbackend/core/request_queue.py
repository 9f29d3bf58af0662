"""A queue of sequence groups in scheduling order: by arrival (``fcfs``), or
by priority then arrival (``priority``, lower values first, as vLLM's).

A binary heap: push and pop in O(log n), peek in O(1) amortised; removal
from the middle (an aborted request) marks the entry and is paid when it
surfaces. Iterating gives the groups in order (O(n log n); statistics and
tests only)."""
import heapq
import itertools
from typing import Callable, Dict, Iterator, List, Optional

from .sequence import SequenceGroup

Key = Callable[[SequenceGroup], tuple]


class RequestQueue:
    def __init__(self, key: Key):
        self._key = key
        self._heap: List[list] = []                # [key, tie, group or None when removed]
        self._entries: Dict[int, list] = {}        # id(group) -> its heap entry
        self._ties = itertools.count()

    def push(self, group: SequenceGroup) -> None:
        if id(group) in self._entries:
            raise ValueError(f"request {group.request_id} is already queued")
        entry = [self._key(group), next(self._ties), group]
        self._entries[id(group)] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, group: SequenceGroup) -> bool:
        """Take ``group`` out wherever it stands; False if it was not queued."""
        entry = self._entries.pop(id(group), None)
        if entry is None:
            return False
        entry[2] = None
        return True

    def peek(self) -> Optional[SequenceGroup]:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> SequenceGroup:
        self._drop_removed()
        group = heapq.heappop(self._heap)[2]
        del self._entries[id(group)]
        return group

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, group: SequenceGroup) -> bool:
        return id(group) in self._entries

    def first(self, count: int) -> List[SequenceGroup]:
        """The first ``count`` groups in order (O(n log count))."""
        return [entry[2] for entry in heapq.nsmallest(count, self._entries.values())]

    def __iter__(self) -> Iterator[SequenceGroup]:
        return (entry[2] for entry in sorted(self._entries.values()))

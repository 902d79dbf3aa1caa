"""SeqQueue: the scheduler's waiting and running queues, ordered sets of sequences.

Both ends and membership are O(1), and so is removing any sequence (a request that finishes,
is aborted or preempted), so aborting N requests costs O(N), not O(N x queue length) as
`list.remove` / `deque.remove` did. Reads like the list/deque it replaces (`q[0]`, `q[-1]`,
`len`, iteration in order, `in`, `list + q`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator

from mmkit.engine.sequence import Sequence


class SeqQueue:
    def __init__(self, seqs: Iterable[Sequence] = ()) -> None:
        self._seqs: OrderedDict[Sequence, None] = OrderedDict.fromkeys(seqs)

    def append(self, seq: Sequence) -> None:
        self._seqs[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        self._seqs[seq] = None
        self._seqs.move_to_end(seq, last=False)

    def popleft(self) -> Sequence:
        return self._seqs.popitem(last=False)[0]

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq]  # KeyError when absent, as list.remove raises ValueError

    def __getitem__(self, index: int) -> Sequence:
        if index == 0:
            return next(iter(self._seqs))
        if index == -1:
            return next(reversed(self._seqs))
        return list(self._seqs)[index]  # O(n): only tests read other positions

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs)

    def __add__(self, other: Iterable[Sequence]) -> list[Sequence]:
        return list(self._seqs) + list(other)

    def __radd__(self, other: Iterable[Sequence]) -> list[Sequence]:
        return list(other) + list(self._seqs)

    def __repr__(self) -> str:
        return f"SeqQueue({list(self._seqs)!r})"

"""WaitingQueue: the scheduler's FIFO of sequences waiting for blocks, with removal in constant time.

A deque's `remove` walks the queue: aborting a request of 1,024 samples behind a million waiting ones
cost seconds per request, and a cut flood of them kept the server's engine thread busy for minutes.
Here a removed sequence is only marked; it is dropped when it reaches the head.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from batchgen.engine.core.sequence import Sequence


class WaitingQueue:
    """FIFO with appendleft (a preempted sequence goes first), O(1) remove and len."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()
        self._removed: set[int] = set()  # id() of sequences removed but still in _queue

    def append(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def extendleft(self, seqs) -> None:
        """Put `seqs` back at the head, each before the one put before it (as deque.extendleft)."""
        self._queue.extendleft(seqs)

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (it must be waiting here)."""
        self._removed.add(id(seq))

    def popleft(self) -> Sequence:
        seq = self[0]
        self._queue.popleft()
        return seq

    def __getitem__(self, index: int) -> Sequence:
        """The head (index 0 only): the first sequence not removed."""
        if index != 0:
            raise IndexError("a WaitingQueue gives its head only")
        while self._queue and id(self._queue[0]) in self._removed:
            self._removed.discard(id(self._queue.popleft()))
        if not self._queue:
            raise IndexError("the waiting queue is empty")
        return self._queue[0]

    def __len__(self) -> int:
        return len(self._queue) - len(self._removed)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for seq in self._queue if id(seq) not in self._removed)

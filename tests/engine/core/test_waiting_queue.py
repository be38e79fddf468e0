"""WaitingQueue against a deque (the scheduler's queue before it): the same order under a random mix of
appends, preemptions (appendleft), removals and pops; and removal in constant time."""

from __future__ import annotations

import random
import time
from collections import deque

from batchgen.engine.core.waiting_queue import WaitingQueue


class Item:  # a stand-in for a Sequence: the queue keys on identity only
    def __init__(self, n: int):
        self.n = n


def test_matches_a_deque_under_random_operations():
    rng = random.Random(0)
    queue, reference = WaitingQueue(), deque()
    items = [Item(i) for i in range(3000)]
    next_item = 0
    for _ in range(5000):
        op = rng.random()
        if op < 0.5 and next_item < len(items):
            to_left = op >= 0.4  # a preempted sequence goes back first in line
            (queue.appendleft if to_left else queue.append)(items[next_item])
            (reference.appendleft if to_left else reference.append)(items[next_item])
            next_item += 1
        elif op < 0.55 and next_item + 3 <= len(items):  # admission skipped some and puts them back
            queue.extendleft(items[next_item:next_item + 3])
            reference.extendleft(items[next_item:next_item + 3])
            next_item += 3
        elif op < 0.75 and reference:
            victim = rng.choice(reference)
            queue.remove(victim); reference.remove(victim)
        elif reference:
            assert queue[0] is reference[0]
            assert queue.popleft() is reference.popleft()
        assert len(queue) == len(reference) and bool(queue) == bool(reference)
    assert [i.n for i in queue] == [i.n for i in reference]


def test_removing_from_a_long_queue_takes_constant_time():
    items = [Item(i) for i in range(200_000)]
    queue = WaitingQueue()
    for item in items:
        queue.append(item)
    start = time.perf_counter()
    for item in reversed(items[1:]):  # the worst case for a deque: each from the far end
        queue.remove(item)
    assert time.perf_counter() - start < 2.0  # a deque's remove here: ~200,000^2 / 2 steps
    assert len(queue) == 1 and queue.popleft() is items[0] and not queue

"""Feed the engine: read ahead one window of requests, order it, keep the engine's queue bounded, drain.

Why bounded: a request's arrival time is when it is handed to the engine, so a queue of millions
would make every queue_s/ttft_s meaningless; and read-ahead beyond what the engine can start soon
only costs memory. Two bounds, both in sequences (n per request), not requests:
- `max_engine_seqs` (max_num_seqs): a request is handed over only while the engine holds fewer
  sequences than that, running or waiting (its `num_unfinished_seqs`; the last request may pass it by
  n - 1). The feeder refills between steps, so every slot a finished sequence frees is taken at the next
  step, while nothing queues behind a full batch: queue_s measures the engine (its prefill budget, its
  KV blocks), not how much the feeder read ahead. A sample that finishes before its siblings frees
  its slot at once, as the engine counts it, where a count of requests would keep it idle.
- `max_in_flight` (2 x max_num_seqs): requests in flight, as sequences; the only bound for an engine
  that does not count its sequences (the tests' fakes).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from batchgen.engine import RequestOutput
from batchgen.pipeline.ordering import order_window
from batchgen.pipeline.request_builder import RowTask


class Feeder:
    """Drives add_request/step until every task has an output or an error (handed to the callbacks)."""

    def __init__(self, engine, tasks: Iterator[RowTask], *, window: int, sort_by_length: bool,
                 max_in_flight: int, on_output: Callable[[RowTask, RequestOutput], None],
                 on_error: Callable[[RowTask], None], on_step: Callable[[], None] = lambda: None,
                 max_engine_seqs: int | None = None):
        self.engine = engine
        self.tasks = tasks
        self.window_size = window
        self.sort_by_length = sort_by_length
        self.max_in_flight = max_in_flight  # sequences of the requests in flight
        self.max_engine_seqs = max_engine_seqs  # sequences the engine holds (None: no such bound)
        self.num_seqs_in_flight = 0
        self.on_output = on_output
        self.on_error = on_error
        self.on_step = on_step  # after every engine step (the progress bar's token rate)
        self.window: deque[RowTask] = deque()
        # A task whose request key is in flight waits for its twin (keys are unique unless an id given in
        # the input collides with an internal repeat key); per key, so each lookup is O(1).
        self.deferred: dict[str, deque[RowTask]] = {}
        self.released: deque[RowTask] = deque()  # deferred tasks whose twin has finished
        self.in_flight: dict[str, RowTask] = {}
        self.is_exhausted = False
        self.first_add_time: float | None = None
        self.last_output_time: float | None = None

    @property
    def generation_seconds(self) -> float:
        """From the first request handed to the engine to the last output (0 when none ran)."""
        if self.first_add_time is None or self.last_output_time is None:
            return 0.0
        return self.last_output_time - self.first_add_time

    def run(self) -> None:
        if self.engine.has_unfinished():
            raise RuntimeError("the engine already holds unfinished requests; a job needs it to itself")
        while True:
            self._fill()
            if not self.in_flight:
                if self.deferred:
                    raise RuntimeError(f"{len(self.deferred)} request key(s) left waiting with no twin in flight")
                return  # _fill found nothing more to start: every task is done
            outputs = self.engine.step()
            if outputs:
                self.last_output_time = time.monotonic()
            self.on_step()
            for out in outputs:
                task = self.in_flight.pop(out.request_id)
                self.num_seqs_in_flight -= num_seqs(task)
                self.on_output(task, out)
                self._release_twin(out.request_id)
            if self.in_flight and not self.engine.has_unfinished():
                raise RuntimeError(f"the engine dropped {len(self.in_flight)} requests without an output")

    def _has_room(self) -> bool:
        if self.num_seqs_in_flight >= self.max_in_flight:
            return False
        held = getattr(self.engine, "num_unfinished_seqs", None)
        return self.max_engine_seqs is None or held is None or held < self.max_engine_seqs

    def _fill(self) -> None:
        while self._has_room():
            was_waiting = bool(self.released)
            task = self._next_task()
            if task is None:
                return
            # A released twin goes first; a new task queues behind any twins still waiting.
            if task.request_id in self.in_flight or (not was_waiting and task.request_id in self.deferred):
                self.deferred.setdefault(task.request_id, deque()).append(task)
                continue
            # Read before the engine stamps the request's arrival, so every row's e2e_s fits inside
            # generation_seconds.
            handed_at = time.monotonic()
            try:
                # sample_key only when set: fakes and older engines take no such argument
                keys = {} if task.sample_key is None else {"sample_key": task.sample_key}
                lora = {} if task.lora_request is None else {"lora_request": task.lora_request}  # likewise
                if task.is_scoring:
                    self.engine.add_score_request(task.request_id, task.token_ids, task.continuation_token_ids,
                                                  **lora)
                elif task.is_reward:
                    self.engine.add_pooling_request(task.request_id, task.token_ids)
                else:
                    self.engine.add_request(task.request_id, None, task.params, prompt_token_ids=task.token_ids,
                                            **keys, **lora)
            except ValueError as exc:  # the engine's own checks (empty, too long): this row's error
                task.error = str(exc)
                self.on_error(task)
                self._release_twin(task.request_id)
                continue
            if self.first_add_time is None:
                self.first_add_time = handed_at
            self.in_flight[task.request_id] = task
            self.num_seqs_in_flight += num_seqs(task)

    def _release_twin(self, request_id: str) -> None:
        waiting = self.deferred.get(request_id)
        if waiting:
            self.released.append(waiting.popleft())
            if not waiting:
                del self.deferred[request_id]

    def _next_task(self) -> RowTask | None:
        if self.released:
            return self.released.popleft()
        while not self.window and not self.is_exhausted:  # a window of error rows only leaves it empty
            self._refill()
        return self.window.popleft() if self.window else None

    def _refill(self) -> None:
        batch: list[RowTask] = []
        while not self.is_exhausted and len(batch) < self.window_size:
            task = next(self.tasks, None)
            if task is None:
                self.is_exhausted = True
            elif task.is_error:
                self.on_error(task)
            else:
                batch.append(task)
        block_size = getattr(getattr(self.engine, "config", None), "block_size", 16)
        self.window.extend(order_window(batch, self.sort_by_length, block_size))


def num_seqs(task: RowTask) -> int:
    """The sequences a task's request runs: its n samples (a scored context: 1)."""
    return max(1, getattr(task.params, "n", 1) or 1) if task.params is not None else 1


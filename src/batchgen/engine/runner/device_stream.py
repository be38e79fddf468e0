"""Where a step's device work runs from the host's point of view, and when the device sat idle.

On CUDA the model's kernels, the sampler and the read-back copy are queued on the device's stream by
the host thread and run later; on the CPU they run where they are called. `ImmediateStream` is both:
it calls the work at once (on CUDA that only queues it) and hands back its result. `ThreadStream`
emulates a GPU on the CPU for `batchgen bench --workload overhead`: the work runs on one worker thread
in submission order, after a fixed device time per step, so the host can prepare the next step while
the "device" runs this one, exactly as it would with a GPU.

Each stream records when every step was submitted and when its work finished; `idle_seconds` sums the
gaps in which the device had nothing queued: the host time on the critical path. (On CUDA the
finishing times are those of the queuing, not of the kernels: the figure means something only on
the CPU and with ThreadStream.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise


class ImmediateStream:
    """Runs each step's device work when it is submitted."""

    def __init__(self):
        self.timeline: list[list[float]] = []  # [submitted, finished] per step

    def submit(self, work: Callable[[], object]) -> Future:
        submitted = time.perf_counter()
        future: Future = Future()
        future.set_result(work())
        self.timeline.append([submitted, time.perf_counter()])
        return future

    def idle_gaps(self) -> list[float]:
        """Per step after the first: seconds between the previous step's end and its submission (0 if
        it was queued before the previous one ended)."""
        return [max(0.0, nxt[0] - prev[1]) for prev, nxt in pairwise(self.timeline)]

    def idle_seconds(self) -> float:
        return sum(self.idle_gaps())

    def reset(self) -> None:
        """Start a new timeline (steps still running record into the old one)."""
        self.timeline = []


class ThreadStream(ImmediateStream):
    """A stand-in GPU: one worker thread runs the steps in order, each after `device_seconds`."""

    def __init__(self, device_seconds: float):
        super().__init__()
        self.device_seconds = device_seconds
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-stream")
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], object]) -> Future:
        entry = [time.perf_counter(), float("inf")]  # finished: not yet
        self.timeline.append(entry)

        def run():
            started = time.perf_counter()
            result = work()
            # The device's time for the step (a GPU's kernels), after the work it depends on.
            remaining = self.device_seconds - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
            with self._lock:
                entry[1] = time.perf_counter()
            return result

        return self._worker.submit(run)

    def idle_gaps(self) -> list[float]:
        with self._lock:
            steps = [entry for entry in self.timeline if entry[1] != float("inf")]
            return [max(0.0, nxt[0] - prev[1]) for prev, nxt in pairwise(steps)]

    def close(self) -> None:
        self._worker.shutdown(wait=True)

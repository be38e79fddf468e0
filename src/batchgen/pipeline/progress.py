"""tqdm progress: requests done (with ETA), completion tokens/s, prefix cache hit rate.

The rate counts every token the engine generates, step by step (its `num_generated_tokens`), over
the time since the first request was handed to it; at the end it is refreshed with the run's own
figure (tokens over the feeder's generation seconds), the one `_SUCCESS` reports.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

REFRESH_SECONDS = 0.5  # engine.stats builds a dict; no need to ask more often than the bar redraws


class Progress:
    def __init__(self, engine, total: int, desc: str, enabled: bool = True):
        self.engine = engine
        # In a log file (no terminal) a line per redraw would flood it: redraw every 30 s there instead.
        mininterval = 0.1 if sys.stderr.isatty() else 30.0
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True,
                        mininterval=mininterval)
        self.is_enabled = enabled
        self.num_tokens_before = self._num_generated_tokens()  # the engine may have run earlier work
        self.last_refresh = 0.0
        self.rate = 0.0  # completion tokens/s last shown

    def _num_generated_tokens(self) -> int:
        return self.engine.stats.get("num_generated_tokens", 0)

    def advance(self, num_requests: int = 1) -> None:
        """Requests done (outputs written or error rows)."""
        self.bar.update(num_requests)

    def on_step(self, started: float | None) -> None:
        """After an engine step; `started`: when the first request was handed to the engine."""
        now = time.monotonic()
        if not self.is_enabled or started is None or now - self.last_refresh < REFRESH_SECONDS:
            return
        self.last_refresh = now
        self._show(self._num_generated_tokens() - self.num_tokens_before, now - started, refresh=False)

    def close(self, generation_seconds: float) -> None:
        """The final rate, over the run's generation seconds (first request handed in to last output)."""
        if self.is_enabled and generation_seconds > 0:
            self._show(self._num_generated_tokens() - self.num_tokens_before, generation_seconds, refresh=True)
        self.bar.close()

    def _show(self, num_tokens: int, seconds: float, refresh: bool) -> None:
        self.rate = num_tokens / max(seconds, 1e-9)
        hit_rate = self.engine.stats.get("prefix_cache_hit_rate", 0.0)
        self.bar.set_postfix_str(f"{self.rate:,.1f} tok/s, prefix hit {hit_rate:.0%}", refresh=refresh)

"""tqdm progress: requests done (with ETA), completion tokens/s, prefix cache hit rate."""

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
        self.start = time.monotonic()
        self.num_completion_tokens = 0
        self.last_refresh = 0.0

    def advance(self, num_requests: int = 1, num_completion_tokens: int = 0) -> None:
        self.num_completion_tokens += num_completion_tokens
        self.bar.update(num_requests)
        now = time.monotonic()
        if now - self.last_refresh >= REFRESH_SECONDS:
            self.last_refresh = now
            rate = self.num_completion_tokens / max(now - self.start, 1e-9)
            hit_rate = self.engine.stats.get("prefix_cache_hit_rate", 0.0)
            self.bar.set_postfix_str(f"{rate:,.1f} tok/s, prefix hit {hit_rate:.0%}", refresh=False)

    def close(self) -> None:
        self.bar.close()

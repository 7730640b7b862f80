"""Sampling of repeated warnings, for every listener a stranger can reach (the phone edge, the engine link)."""

from __future__ import annotations

import time
from collections import Counter


class LogSampler:
    """Which of a repeated event's occurrences to log: the 1st, 10th and every 100th of each kind in a
    `window_s`. A flood (of connections, of bad messages) must not flood the logs too; the metrics count every
    one, and the first of a new burst is logged again."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._seen: Counter[str] = Counter()
        self._since = time.monotonic()

    def __call__(self, kind: str) -> int | None:
        """The occurrence's number in the window when it is to be logged, else None."""
        if (now := time.monotonic()) - self._since > self.window_s:
            self._seen.clear()
            self._since = now
        self._seen[kind] += 1
        n = self._seen[kind]
        return n if n in (1, 10) or n % 100 == 0 else None

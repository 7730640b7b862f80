"""Logging set-up: plain or JSON lines, with the call id on every line logged inside a call."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections import Counter

call_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("call_id", default=None)


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


class _CallIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "call_id"):
            record.call_id = call_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "call_id": getattr(record, "call_id", None),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, separators=(",", ":"))


def setup_logging(json_lines: bool = False, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_CallIdFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(call_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)

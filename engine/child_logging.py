"""A spawned child's logging set up as its parent's: the same level, format and filters on stderr.

A spawned process starts with logging unconfigured: its warnings reached stderr through Python's last-resort
handler, as bare messages with no time, level or logger, and its INFO lines not at all. Under `--log-json`
those were the only lines a log pipeline could not parse, and they are the ones that matter most: an engine
that is broken, an STT row falling behind.
"""

from __future__ import annotations

import logging
import pickle
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class LogSetup:
    level: int
    # The parent's stderr handlers, each (formatter, filters, level), pickled here: a formatter the child cannot
    # rebuild (a class of the parent's __main__) then costs the child its format, not its start.
    handlers: tuple[bytes, ...]

    @classmethod
    def of_this_process(cls) -> LogSetup:
        """The root logger's stderr handlers (what the CLI's setup_logging installs), to pass to a child."""
        root = logging.getLogger()
        handlers = []
        for handler in root.handlers:
            if type(handler) is not logging.StreamHandler or handler.stream is not sys.stderr:
                continue  # a file, a test's capture: this process's own
            filters = tuple(f for f in handler.filters if isinstance(f, logging.Filter))
            try:
                handlers.append(pickle.dumps((handler.formatter, filters, handler.level)))
            except Exception:  # a formatter that cannot cross: that handler's lines keep the default
                continue
        return cls(root.level, tuple(handlers))

    def apply(self) -> None:
        """In the child, first thing: nothing to copy (logging never set up in the parent) leaves it alone."""
        built = []
        for payload in self.handlers:
            try:
                formatter, filters, level = pickle.loads(payload)
            except Exception:
                continue
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(formatter)
            handler.setLevel(level)
            for f in filters:
                handler.addFilter(f)
            built.append(handler)
        if not built:
            return
        root = logging.getLogger()
        root.handlers[:] = built
        root.setLevel(self.level)

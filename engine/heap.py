"""Keep the garbage collector's full collections off the real-time path."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def freeze_startup_heap() -> None:
    """Once the model is loaded: put everything alive (torch, the model's modules) beyond the collector,
    so no full collection walks it between two ticks (in the engine process it stalled ticks to 151 ms
    p99 at 32 calls on an H100). The phone edge has its own (telephony.server), keeping the two apart."""
    gc.collect()
    gc.freeze()


@dataclass
class CollectorWatch:
    """The collector's full (generation 2) collections while watching, and the longest pause of any."""

    full_collections: int = 0
    longest_pause_ms: float = 0.0
    _started: float = field(default=0.0, repr=False)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.longest_pause_ms = max(self.longest_pause_ms, (time.perf_counter() - self._started) * 1000)
        if info.get("generation") == 2:
            self.full_collections += 1


@contextmanager
def served_heap() -> Iterator[CollectorWatch]:
    """The heap as the engine process serves with it (frozen after start-up), for a benchmark's measured
    ticks; unfrozen at the end unless it was frozen before, so what the run leaves can be collected. The
    watch says whether any collection still fell in them. A full collection over torch's and the model's
    objects takes 15-190 ms on dev-2c (tiny model): one in a measured window would be a tail a served tick
    never has."""
    watch = CollectorWatch()
    frozen_before = gc.get_freeze_count() > 0  # someone else's freeze: not ours to undo
    freeze_startup_heap()
    gc.callbacks.append(watch._callback)
    try:
        yield watch
    finally:
        gc.callbacks.remove(watch._callback)
        if not frozen_before:
            gc.unfreeze()

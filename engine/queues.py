"""The engine's one queueing rule toward a consumer: bounded, and a consumer behind loses the oldest."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .interface import BotFrames


def put_dropping_oldest(queue: asyncio.Queue[Any], item: object, on_drop: Callable[[Any], None] | None = None) -> bool:
    """Queue `item`; if the queue is full, drop its oldest first (a stalled consumer loses old outputs,
    never stalls the engine or the link's reader), handed to `on_drop`. True if something was dropped."""
    dropped = queue.full()
    if dropped:
        old = queue.get_nowait()
        if on_drop is not None:
            on_drop(old)
    queue.put_nowait(item)
    return dropped


MAX_CARRIED = 4096  # calls with a fresh mark waiting: one that never comes back (ended) is forgotten past this


class FreshCarry:
    """The fresh marks (a row's model state restarted) of ticks dropped for a consumer that fell behind: each
    rides on its call's next frame delivered. A reset comes with a stall, when ticks are dropped: the mark lost
    with its tick, the edge kept playing audio from before the reset, its resampler's history across the cut."""

    def __init__(self) -> None:
        self._pending: dict[str, None] = {}  # call ids, oldest first

    def __bool__(self) -> bool:
        return bool(self._pending)

    def dropped(self, call_ids: Sequence[str], fresh: Sequence[bool]) -> None:
        for call_id, restarted in zip(call_ids, fresh, strict=True):
            if restarted:
                self._pending[call_id] = None
        while len(self._pending) > MAX_CARRIED:
            del self._pending[next(iter(self._pending))]

    def dropped_frames(self, frames: BotFrames | None) -> None:
        """`put_dropping_oldest`'s `on_drop` for a queue of ticks (None: the end of them)."""
        if frames is not None:
            self.dropped(frames.call_ids, frames.fresh)

    def carry(self, call_ids: Sequence[str], fresh: Sequence[bool]) -> tuple[bool, ...]:
        """`fresh` with each waiting mark of these calls set (and no longer waiting)."""
        out = list(fresh)
        for i, call_id in enumerate(call_ids):
            if call_id in self._pending:
                del self._pending[call_id]
                out[i] = True
        return tuple(out)


def with_carried_fresh(frames: BotFrames, carry: FreshCarry) -> BotFrames:
    """`frames` as the consumer gets it: with the marks of its calls' dropped ticks."""
    if not carry:
        return frames
    return dataclasses.replace(frames, fresh=carry.carry(frames.call_ids, frames.fresh))

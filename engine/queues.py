"""The engine's one queueing rule toward a consumer: bounded, and a consumer behind loses the oldest."""

from __future__ import annotations

import asyncio
from typing import Any


def put_dropping_oldest(queue: asyncio.Queue[Any], item: object) -> bool:
    """Queue `item`; if the queue is full, drop its oldest first (a stalled consumer loses old outputs,
    never stalls the engine or the link's reader). True if something was dropped."""
    dropped = queue.full()
    if dropped:
        queue.get_nowait()
    queue.put_nowait(item)
    return dropped

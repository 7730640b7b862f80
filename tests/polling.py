"""Waiting, in tests, for what has no event to wait on: another process, Redis, a metric, a worker thread."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path


async def until(check: Callable[[], bool | Awaitable[bool]], what: str = "", within: float = 10.0,
                every: float = 0.05) -> None:
    """Poll `check` (plain or async) every `every` s until it holds. `within` is a guard against a hang, not
    a timing assertion; the failure names `what`, or where `check` was written."""
    try:
        async with asyncio.timeout(within):
            while True:
                held = check()
                if inspect.isawaitable(held):
                    held = await held
                if held:
                    return
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"timed out after {within:g} s waiting for: {what or _where(check)}") from None


def _where(check: Callable[..., object]) -> str:
    code = getattr(check, "__code__", None)
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}" if code else repr(check)


class RecordedEvent(threading.Event):
    """A `threading.Event` that keeps when it was set (time.monotonic()): a test's view of another loop's ticks."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def set(self) -> None:
        self.times.append(time.monotonic())
        super().set()

"""engine/ticker.py: a loop's own 80 ms clock, or following another loop's ticks."""

from __future__ import annotations

import threading
import time

import torch  # noqa: F401  (imported here, not by the ticker's thread: that takes a second the first time)

from engine.ticker import FrameTicker


def test_a_follower_steps_after_each_pace_and_on_its_own_when_the_pace_is_quiet() -> None:
    """The batched STT follows the KAME engine's ticks (they share a GPU): one step per tick of the other
    loop, however those fall, and, the other loop quiet (idle, gone), a step every period and a half."""
    steps: list[float] = []
    ticker = FrameTicker("follower", lambda: steps.append(time.monotonic()), period_s=0.2)
    pace = threading.Event()
    ticker.follow(pace)
    assert ticker.following is pace
    ticker.start()
    try:
        time.sleep(0.05)
        assert steps == []  # waits for the pace, not its own clock
        sets = []
        for _ in range(5):  # faster than its own clock (0.2 s): it keeps up, one step each
            sets.append(time.monotonic())
            pace.set()
            time.sleep(0.06)
        assert len(steps) == 5
        assert all(0 <= step - at < 0.05 for step, at in zip(steps, sets, strict=True))  # right after each
        time.sleep(0.75)  # quiet: 0.3 s apart on its own
        assert 6 <= len(steps) <= 8
        ticker.follow(None)  # its own clock again: every 0.2 s
        time.sleep(0.35)  # (the wait under way ends first, at most 0.3 s)
        before = len(steps)
        time.sleep(0.65)
        assert 2 <= len(steps) - before <= 4
    finally:
        ticker.stop()
    assert not ticker.running

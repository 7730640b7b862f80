"""engine/ticker.py: a loop's own 80 ms clock, or following another loop's ticks."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch  # noqa: F401  (imported here, not by the ticker's thread: that takes a second the first time)

from engine.tick_signal import TickSignal
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
        for _ in range(5):  # sooner than its own clock would (0.2 s): one step right after each
            sets.append(time.monotonic())
            pace.set()
            time.sleep(0.12)
        assert len(steps) == 5
        assert all(0 <= step - at < 0.05 for step, at in zip(steps, sets, strict=True))  # right after each
        time.sleep(0.75)  # quiet: on its own, 0.3 s after the last, then every 0.2 s (the audio's rate)
        assert 7 <= len(steps) <= 9
        quiet = [b - a for a, b in zip(steps[4:], steps[5:], strict=False)]
        assert 0.25 < quiet[0] < 0.4 and all(0.15 < gap < 0.27 for gap in quiet[1:]), quiet
        ticker.follow(None)  # its own clock again: every 0.2 s
        time.sleep(0.35)  # (the wait under way ends first, at most 0.3 s)
        before = len(steps)
        time.sleep(0.65)
        assert 2 <= len(steps) - before <= 4
    finally:
        ticker.stop()
    assert not ticker.running


def test_a_follower_of_a_slow_loop_steps_once_per_tick_of_it() -> None:
    """The other loop late (its ticks 1.7 periods apart, an overloaded engine): the follower steps on its own
    after a period and a half, and the late tick that ends just after must not make it step again."""
    def other_loop(pace: threading.Event) -> None:
        pace.set()
        time.sleep(0.02)
        for _ in range(12):  # 12 ticks, 0.17 s apart
            time.sleep(0.17)
            pace.set()
        time.sleep(0.02)

    steps = _steps_following(other_loop, period_s=0.1)
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert 12 <= len(steps) <= 19 and min(gaps) > 0.045, (len(steps), min(gaps))  # (two a tick: ~24, 0.02 s)


def test_a_follower_steps_for_each_of_two_ticks_close_together() -> None:
    """The other loop's tick overran and the next one started at once (a late tick starts late, it is not
    skipped): two ticks 30 ms apart are two frames of audio, each its step. Skipping the second left every
    call's transcript a frame further behind for each overrun."""
    def other_loop(pace: threading.Event) -> None:
        for i in range(4):  # 4 x (an overrun tick of 0.12 s, then a catch-up tick of 0.03 s)
            time.sleep(0.12 if i else 0.02)
            pace.set()
            time.sleep(0.03)
            pace.set()
        time.sleep(0.05)

    steps = _steps_following(other_loop, period_s=0.1)
    assert len(steps) == 8, len(steps)


def _steps_following(other_loop, period_s: float) -> list[float]:  # type: ignore[no-untyped-def]
    """When each step of a follower ran, while `other_loop(pace)` sets its pace as the other loop's ticks end."""
    steps: list[float] = []
    ticker = FrameTicker("follower", lambda: steps.append(time.monotonic()), period_s=period_s)
    pace = threading.Event()
    ticker.follow(pace)
    ticker.start()
    try:
        other_loop(pace)
    finally:
        ticker.stop()
    return steps


def _follow_forever(signal: TickSignal, ready: Any) -> None:  # a spawned child: module level
    ready.set()
    while True:
        if signal.wait(0.05):
            signal.clear()


def test_a_tick_signal_survives_a_follower_killed_while_waiting() -> None:
    """A multiprocessing Event left its lock held by a follower killed in `wait`: the engine's next `set` blocked
    for good, and so did the restarted follower. A TickSignal's `set` never blocks, a full pipe included."""
    import multiprocessing
    import os
    import signal as signals

    tick = TickSignal()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_follow_forever, args=(tick, ready), daemon=True)
    child.start()
    assert ready.wait(30)
    for _ in range(20):  # it follows ticks for a while, then is killed in the middle of a wait
        tick.set()
        time.sleep(0.01)
    assert child.pid is not None
    os.kill(child.pid, signals.SIGKILL)
    child.join(10)
    began = time.monotonic()
    for _ in range(50_000):  # over an hour of ticks nobody reads: the pipe fills, and `set` drops them
        tick.set()
    assert time.monotonic() - began < 30  # (a guard against a hang: it takes well under a second)
    tick.clear()  # a new follower drains what piled up, then waits for the next tick
    assert not tick.wait(0.05)
    threading.Timer(0.1, tick.set).start()
    assert tick.wait(5)
    tick.close()


def test_a_follower_killed_half_way_through_reading_leaves_the_signal_whole() -> None:
    """A follower may die having read part of what is in the pipe (framed messages: a length without its body).
    The next follower then misread a byte of zeros as a 16 MiB length and blocked in `clear` for good; raw
    bytes carry nothing, so whatever was read before, the next `clear` drains and `wait` sees the next tick."""
    import os

    tick = TickSignal()
    for _ in range(3):
        tick.set()
    os.read(tick._reader.fileno(), 1)  # what the killed follower took with it
    cleared = threading.Thread(target=tick.clear, daemon=True)
    cleared.start()
    cleared.join(5)
    assert not cleared.is_alive(), "clear() blocked"
    assert not tick.wait(0.05)
    tick.set()
    assert tick.wait(5)
    tick.clear()
    assert not tick.wait(0.05)
    tick.close()

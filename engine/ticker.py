"""A thread that runs one step every 80 ms against a monotonic deadline (the engine's real-time clock).

Used by the KAME frame loop and the batched Kyutai STT. A step that overruns makes the next one start
late rather than skip; a loop that falls more than a frame behind re-anchors its deadline instead of
bursting through steps to catch up.

A ticker can instead `follow` another loop: step right after each of its ticks. The batched STT follows the
KAME engine so that, sharing one GPU, the two take turns: stepping on their own clocks, at unrelated
phases, the STT's kernels ran inside the engine's ticks (docs/benchmarks.md, section 4).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .interface import FRAME_SECONDS

TimingHook = Callable[[float, bool], None]  # (seconds the step took, whether it finished past its frame)


class FrameTicker:
    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        on_timing: TimingHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        period_s: float = FRAME_SECONDS,
    ) -> None:
        self.name = name
        self.step = step
        self.on_timing = on_timing
        self.clock = clock
        self.period_s = period_s
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._pace: threading.Event | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running.set()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def follow(self, pace: threading.Event | None) -> None:
        """Step each time `pace` is set (the other loop's tick just ended; this clears it), or on this
        thread's own clock again (None). When `pace` stays quiet for a period and a half (a late tick, the
        other loop idle or gone), a step goes on without it, then one every period while it stays quiet."""
        self._pace = pace

    @property
    def following(self) -> threading.Event | None:
        return self._pace

    def stop(self, timeout_s: float = 5.0) -> None:
        self._running.clear()
        if self._pace is not None:
            self._pace.set()  # a follower waiting for it wakes now
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        import torch

        torch.set_grad_enabled(False)  # grad mode is per thread
        deadline = self.clock()
        last = deadline - self.period_s  # when the last step started (following)
        stood_in = False  # the last step was taken on the timeout, standing in for a late tick of the other loop
        while self._running.is_set():
            pace = self._pace
            if pace is not None:
                # A period and a half for a tick that is late; once quiet (the other loop idle, gone), a step
                # every period: the audio comes at that rate, slower steps would grow every row's backlog.
                wait = (1.0 if stood_in else 1.5) * self.period_s
                paced = pace.wait(timeout=max(0.0, last + wait - self.clock()))
                pace.clear()
                if not self._running.is_set():
                    break
                if paced and stood_in and self.clock() - last < 0.5 * self.period_s:
                    # The late tick that step stood in for: stepping for it too would give a slow engine two
                    # steps a tick. Only that one: two ticks close together (an overrun, then the catch-up
                    # tick that starts at once) are two frames, each its step.
                    stood_in = False
                    continue
                stood_in = not paced
                started = last = self.clock()
                self.step()
                finished = self.clock()
                if self.on_timing is not None:
                    self.on_timing(finished - started, finished - started > self.period_s)
                deadline = finished  # on this clock from here if no longer following
                continue
            now = self.clock()
            if now < deadline:
                time.sleep(deadline - now)
            started = self.clock()
            self.step()  # the step owns its errors: a raise here ends the thread
            finished = self.clock()
            if self.on_timing is not None:
                # Step k owns [deadline, deadline + period): finishing later means its frame was late.
                self.on_timing(finished - started, finished > deadline + self.period_s)
            deadline += self.period_s
            if finished > deadline + self.period_s:
                deadline = finished  # far behind: re-anchor instead of bursting to catch up

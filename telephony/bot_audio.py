"""The bot's audio to every caller: one pass per engine tick.

The engine makes every call's next 80 ms at the same instant. Taken one call at a time (a task per call,
each resampling, encoding and sending its own frame), the last call of a tick waited for all the others:
29 ms p99 at 200 calls. Here one task takes the whole tick: one batched 24 -> 8 kHz downsample and one
μ-law pass over every voiced row, then a tight loop of sends, then the marks (which can wait a little;
the audio cannot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from threadpoolctl import threadpool_limits

from engine.interface import BotFrames, Engine

from . import metrics
from .framing import FRAME_BYTES
from .mulaw import float_to_ulaw
from .resample import DownsamplerBank
from .turns import levels_dbfs

if TYPE_CHECKING:
    from .call_leg import CallLeg

log = logging.getLogger(__name__)

# One child per phase, bound once: this runs every tick.
_PHASE_SECONDS = {phase: metrics.MEDIA_FANOUT_SECONDS.labels(phase=phase) for phase in metrics.FANOUT_PHASES}


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Stop a background task of the edge's and wait until it has (its own cancellation is not an error)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class BotAudioFanout:
    """Takes the engine's `BotFrames` and plays each row to its call's stream (keyed by call id)."""

    def __init__(self, streams: Mapping[str, CallLeg]) -> None:
        self.streams = streams
        self._task: asyncio.Task[None] | None = None
        self.engine: Engine | None = None
        self.downsampler = DownsamplerBank()  # every stream's 24 -> 8 kHz filter state, keyed by its session

    def forget(self, session: CallLeg) -> None:
        """The stream ended: free its filter state."""
        self.downsampler.forget(session)

    def start(self, engine: Engine) -> None:
        if self._task is not None and self.engine is engine:
            return
        # numpy's OpenBLAS would split each tick's small product across every core and then keep its
        # threads spinning: measured, a whole extra core burnt at 200 calls, stolen from the event loop
        # and the engine. One thread does the product in under a millisecond.
        threadpool_limits(limits=1, user_api="blas")
        self.stop()
        self.engine = engine
        self._task = asyncio.create_task(self._run(engine), name="bot-audio-fanout")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self, engine: Engine) -> None:
        async for frames in engine.bot_frames():
            try:
                await self.deliver(frames)
            except Exception:  # one bad tick must not silence every call from then on
                log.exception("bot audio fan-out failed for one tick")

    async def deliver(self, frames: BotFrames) -> None:
        """Play one tick: every row whose call is streaming here gets its text noted and its audio sent."""
        began = time.monotonic()
        sessions: list[CallLeg] = []
        rows: list[int] = []
        quiet: list[CallLeg] = []
        for i, call_id in enumerate(frames.call_ids):
            session = self.streams.get(call_id)
            if session is None or not session.playing:
                continue  # not (or no longer) streaming on this node: nothing to play it to
            session.note_bot_text(frames.texts[i])
            if frames.fresh[i]:
                self.downsampler.forget(session)  # the speech the reset cut off: not the start of the next
                await session.restart_playout()
            if frames.voiced[i]:
                sessions.append(session)
                rows.append(i)
            else:
                # Nothing is sent: the line goes quiet. Its filter's history is the speech before the gap
                # (or before an engine reset): kept, the next frame would begin with a click of it.
                self.downsampler.forget(session)
                quiet.append(session)
        now = time.monotonic()
        for session in quiet:
            session.bot_silent(now)  # the turn tracker hears the bot stop (a held reply, a reset)
        if not rows:
            return
        picked = time.monotonic()
        line = self.downsampler.process(sessions, frames.pcm[rows])
        resampled = time.monotonic()
        mulaw, levels = float_to_ulaw(line), levels_dbfs(line)  # every row's 640 bytes, back to back
        encoded = time.monotonic()
        sent_at = [
            await session.send_bot_audio(mulaw[k * FRAME_BYTES : (k + 1) * FRAME_BYTES], float(levels[k]))
            for k, session in enumerate(sessions)
        ]
        sent = time.monotonic()
        for phase, seconds in zip(
            metrics.FANOUT_PHASES,
            (began - frames.produced_at, resampled - picked, encoded - resampled, sent - encoded),
            strict=True,
        ):
            _PHASE_SECONDS[phase].observe(seconds)
        # Bookkeeping and marks after every call's audio is out: they can wait a millisecond, the audio cannot.
        for session, level, at in zip(sessions, levels, sent_at, strict=True):
            if at is not None:
                session.after_bot_audio(float(level), frames.produced_at, at)
        for session in sessions:
            await session.send_mark_if_due()

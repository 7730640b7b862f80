"""Twilio's playout queue after a stall: the edge drains it through the bot's pauses and clears it when the
caller talks over stale speech (telephony/playout_clock.py). Without that, both sides run at real time and
a stall's burst delays every later word of the bot for the rest of the call."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import aiohttp
import numpy as np

from engine.interface import FRAME_SECONDS
from telephony import twilio_messages as tm
from telephony.mulaw import float_to_ulaw
from telephony.playout_clock import (
    BARGE_IN_AFTER_S,
    CLEAR_ON_BARGE_IN_ABOVE_S,
    DRAIN_ABOVE_S,
    ECHO_SLACK_S,
    MAX_PENDING_MARKS,
    PlayoutClock,
)

from .phone_fixtures import metric, running_phone


def test_the_clock_follows_sends_corrects_by_echoes_and_forgets_cleared_marks() -> None:
    clock = PlayoutClock()
    for k in range(5):  # real time: the queue holds about the frame just sent
        clock.sent(10.0 + k * FRAME_SECONDS)
    assert abs(clock.backlog(10.0 + 4 * FRAME_SECONDS) - FRAME_SECONDS) < 1e-9
    for _ in range(6):  # a stall's burst: six frames in one instant
        clock.sent(11.0)
    assert abs(clock.backlog(11.0) - 6 * FRAME_SECONDS) < 1e-9
    assert clock.backlog(20.0) == 0.0

    clock = PlayoutClock()
    clock.sent(1.0)
    clock.mark_sent("a", 1.0)  # due when the frame has played: 1.08
    echo = clock.echoed("a", 1.1)  # on time (the way back): no correction
    assert echo.played and abs(echo.waited_s - 0.1) < 1e-9 and abs(clock.until - 1.08) < 1e-9
    clock.sent(2.0)
    clock.mark_sent("b", 2.0)
    echo = clock.echoed("b", 2.6)  # half a second late: a stall after the socket; the queue is deeper
    assert echo.played and abs(clock.until - (2.08 + 0.52 - ECHO_SLACK_S)) < 1e-9

    clock.sent(3.0)
    clock.mark_sent("c", 3.0)
    clock.cleared(3.01)
    assert clock.backlog(3.01) == 0.0
    assert clock.echoed("c", 3.02) == type(echo)(played=False, waited_s=None)  # emptied, never heard
    assert clock.echoed("nobody-sent-this", 3.0).played  # not the clock's to judge
    for k in range(100):  # a peer that never echoes: bounded
        clock.mark_sent(f"m{k}", 4.0)
    assert len(clock._pending) <= 64


def test_the_clock_forgets_the_oldest_mark_and_counts_an_echo_once() -> None:
    clock = PlayoutClock()
    for k in range(MAX_PENDING_MARKS + 6):  # a peer that never echoes: the newest marks are the ones kept
        clock.sent(1.0 + k * FRAME_SECONDS)
        clock.mark_sent(f"m{k}", 1.0 + k * FRAME_SECONDS)
    newest = f"m{MAX_PENDING_MARKS + 5}"
    assert "m0" not in clock._pending and newest in clock._pending
    assert clock.echoed(newest, 7.0).waited_s is not None  # still timed: the delay figure and the correction
    # An echo repeated (or late, after its first) corrects the estimate once, not twice.
    clock = PlayoutClock()
    clock.sent(2.0)
    clock.mark_sent("b", 2.0)
    clock.echoed("b", 2.6)
    until = clock.until
    assert clock.echoed("b", 2.6).waited_s is None and clock.until == until


def test_one_stall_is_counted_once_however_many_marks_were_in_flight() -> None:
    """A stall on the way to the caller delays every mark in flight by the same second: each echo added that
    second again (four marks: 3.7 s of queue read for 1 s), and for seconds the stream cleared and drained
    what was not stale (review, session 22)."""
    clock = PlayoutClock()
    marks = []
    for k in range(25):  # 2 s of the bot at real time, a mark every 0.4 s
        at = 10.0 + k * FRAME_SECONDS
        clock.sent(at)
        if k % 5 == 4:
            clock.mark_sent(f"m{k}", at)
            marks.append((f"m{k}", at + FRAME_SECONDS))  # when the audio before it plays, on time
    for name, due in marks:  # Twilio's playout held up 1 s: every echo 1 s late
        clock.echoed(name, due + 1.0)
    # The queue ran dry at 12.0 by the sends; the stall moved that once (less the echo's slack).
    assert abs(clock.until - (12.0 + 1.0 - ECHO_SLACK_S)) < 1e-6, clock.until


def _tone(samples: int) -> bytes:
    return bytes(float_to_ulaw((0.5 * np.sin(2 * np.pi * 440 * np.arange(samples) / 8000)).astype(np.float32)))


async def _call_with_a_stall(
    checkpoint: Path, *, talk_s: float
) -> tuple[list[tuple[float, str]], float, float, float, float]:
    """A call on loopback whose edge stalls 0.8 s (the event loop blocked: the engine thread keeps making
    frames, the fan-out sends them as a burst after). From the stall's end the caller talks for `talk_s`,
    counted on the packets' 20 ms schedule: a slow turn of a loaded loop neither shortens nor stretches it.
    Returns the events received (time, kind), the stall's end, the deepest estimated queue after it, the
    estimate 4 s later, and by then how long Twilio's queue stood empty between the bot's frames after the
    `clear` (the caller's side, played here from their arrival times): a gap that a loaded box puts in the
    bot's audio leaves the queue that much deeper for good, and the clock rightly follows it."""
    async with running_phone(checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (call_sid, ws):
        events: list[tuple[float, str]] = []
        loud = _tone(160)
        talk = [float("inf"), float("inf")]  # when the caller talks: [from, until) on the packets' schedule
        heard: list[float] = []  # from the first `clear`: [seconds Twilio's queue stood empty, when it runs dry]

        async def read() -> None:
            async for m in ws:
                if m.type == aiohttp.WSMsgType.TEXT:
                    at, message = time.monotonic(), json.loads(m.data)
                    events.append((at, message["event"]))
                    if message["event"] == "clear" and not heard:
                        heard.append(0.0)
                    elif message["event"] == "media" and heard:
                        gaps, dry_at = heard if len(heard) == 2 else (0.0, at)  # counted from the first frame
                        seconds = len(base64.b64decode(message["media"]["payload"])) / 8000
                        heard[:] = [gaps + max(0.0, at - dry_at), max(dry_at, at) + seconds]

        async def send() -> None:  # 20 ms packets on the wall clock: after a stall, the ones due go at once
            seq, began = 1, time.monotonic()
            while True:
                seq += 1
                due = began + 0.02 * (seq - 2)
                payload = loud if talk[0] <= due < talk[1] else b"\xff" * 160
                await ws.send_str(tm.media_msg("MZ1", seq, seq - 1, 20 * seq, payload))
                await asyncio.sleep(max(0.0, began + 0.02 * seq - time.monotonic()))

        reader, sender = asyncio.create_task(read()), asyncio.create_task(send())
        try:
            async with asyncio.timeout(10):
                while sum(kind == "media" for _, kind in events) < 10:  # noqa: ASYNC110 - polls what the reader saw
                    await asyncio.sleep(0.05)
            session = phone.ctx.streams[call_sid]
            time.sleep(0.8)  # noqa: ASYNC251 - the stall under test: the edge's loop blocked
            stalled_until = time.monotonic()
            talk[:] = [stalled_until, stalled_until + talk_s]  # the packets due during the stall stay silent
            deepest = 0.0
            for _ in range(10):  # the burst goes out within a few loop turns
                await asyncio.sleep(0.02)
                deepest = max(deepest, session.playout.backlog(time.monotonic()))
            await asyncio.sleep(max(0.0, stalled_until + 4.0 - time.monotonic()))
            backlog_after, gaps_after = session.playout.backlog(time.monotonic()), heard[0] if heard else 0.0
        finally:
            sender.cancel()
            reader.cancel()
    return events, stalled_until, deepest, backlog_after, gaps_after


async def test_a_stalls_backlog_at_twilio_drains_through_the_bots_pauses(tiny_checkpoint: Path) -> None:
    """The tiny model's random voice is never quiet, so this test plays the bot itself through the real
    stream (the fan-out stopped): a stall's burst of speech, then a pause at real time."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (call_sid, ws):
        media = 0

        async def read() -> None:
            nonlocal media
            async for m in ws:
                if m.type == aiohttp.WSMsgType.TEXT and json.loads(m.data)["event"] == "media":
                    media += 1

        reader = asyncio.create_task(read())
        try:
            async with asyncio.timeout(10):
                while media < 3:
                    await ws.send_str(tm.media_msg("MZ1", 2, 1, 20, b"\xff" * 160))
                    await asyncio.sleep(0.02)
            await phone.ctx.fanout.aclose()  # from here the test is the bot
            session = phone.ctx.streams[call_sid]
            drained_before = metric("kame_media_playout_drained_frames_total")
            speech, pause = bytes(_tone(640)), b"\xff" * 640
            await asyncio.sleep(0.3)  # Twilio's queue runs dry
            before = media
            for _ in range(8):  # the stall's burst
                assert await session.send_bot_audio(speech, -10.0) is not None
            t0 = time.monotonic()
            assert 0.6 < session.playout.backlog(t0) <= 8 * FRAME_SECONDS
            sent = []
            for k in range(12):  # the bot pauses, at real time
                await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME_SECONDS - time.monotonic()))
                sent.append(await session.send_bot_audio(pause, -60.0) is not None)
            # The pause's frames are skipped while over two frames are queued, then sent again.
            assert sent[:4] == [False] * 4 and sent[-4:] == [True] * 4, sent
            assert metric("kame_media_playout_drained_frames_total") - drained_before == sent.count(False)
            assert session.playout.backlog(time.monotonic()) <= DRAIN_ABOVE_S + FRAME_SECONDS
            for _ in range(6):  # speech is never skipped, however deep the queue
                assert await session.send_bot_audio(speech, -10.0) is not None
            for level in (-40.0, -48.0):  # nor quiet speech (a soft consonant, a word's fading end)
                assert await session.send_bot_audio(speech, level) is not None, level
            async with asyncio.timeout(5):  # what was sent arrived, and nothing else
                while media < before + 8 + sent.count(True) + 8:  # noqa: ASYNC110 - polls what the reader saw
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert media == before + 8 + sent.count(True) + 8
        finally:
            reader.cancel()


async def test_talking_over_a_stale_queue_clears_it(tiny_checkpoint: Path) -> None:
    clears_before = metric("kame_media_playout_clears_total")
    events, stalled_until, deepest, later, gaps = await _call_with_a_stall(tiny_checkpoint, talk_s=3.0)
    assert deepest > DRAIN_ABOVE_S
    kinds_after = [kind for t, kind in events if t > stalled_until]
    assert "clear" in kinds_after
    cleared_at = next(t for t, kind in events if t > stalled_until and kind == "clear")
    assert cleared_at - stalled_until >= BARGE_IN_AFTER_S  # after half a second of the caller's voice
    assert metric("kame_media_playout_clears_total") - clears_before == 1  # once per utterance
    assert kinds_after[kinds_after.index("clear") + 1 :].count("media") > 0  # and the bot goes on
    # The queue stays short: 4 s later the clock says no more is queued than three frames and what the gaps in
    # the bot's audio since the clear put there (a few ms on an idle box, as much as the loop lagged on a busy
    # one). A clock not told of the clear still counts the stale queue, and fails this.
    assert later <= DRAIN_ABOVE_S + FRAME_SECONDS + gaps, (later, gaps)


async def test_talking_over_a_short_stale_queue_clears_it_too(tiny_checkpoint: Path) -> None:
    """A queue of ~0.4 s (a stall of a few frames) is stale speech too: the caller who talks over it for half
    a second gets it cleared. The test is the bot (the fan-out stopped), keeping 0.4-0.48 s queued at real
    time: topped up by the clock before each of the caller's packets, so a slow turn of a loaded loop does not
    drain it below the barge-in's threshold (a frame every fourth packet, a lag of 0.15 s could)."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (call_sid, ws):
        events: list[str] = []

        async def read() -> None:
            async for m in ws:
                if m.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(m.data)["event"])

        reader = asyncio.create_task(read())
        try:
            async with asyncio.timeout(10):
                while events.count("media") < 3:
                    await ws.send_str(tm.media_msg("MZ1", 2, 1, 20, b"\xff" * 160))
                    await asyncio.sleep(0.02)
            await phone.ctx.fanout.aclose()
            session = phone.ctx.streams[call_sid]
            clears_before = metric("kame_media_playout_clears_total")
            speech, loud = bytes(_tone(640)), _tone(160)
            session.playout.until = time.monotonic()  # Twilio's queue dry, whatever the fan-out sent before
            t0 = time.monotonic()
            for k in range(60):  # 1.2 s: the caller talks (20 ms packets), the bot goes on at real time
                for _ in range(8):  # up to 0.4 s queued, or a frame over (at most 8: a clock that never moved)
                    if session.playout.backlog(time.monotonic()) >= 5 * FRAME_SECONDS:
                        break
                    await session.send_bot_audio(speech, -10.0)
                if metric("kame_media_playout_clears_total") == clears_before:  # until cleared: under 0.6 s
                    assert session.playout.backlog(time.monotonic()) <= 0.5
                await ws.send_str(tm.media_msg("MZ1", 3 + k, 2 + k, 40 + 20 * k, loud))
                await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.02 - time.monotonic()))
            async with asyncio.timeout(3):
                while "clear" not in events:  # noqa: ASYNC110 - polls what the reader saw
                    await asyncio.sleep(0.02)
            assert metric("kame_media_playout_clears_total") - clears_before == 1
        finally:
            reader.cancel()


async def test_a_backchannel_over_a_stale_queue_does_not_cut_the_bot(tiny_checkpoint: Path) -> None:
    """'Mm-hm' while the bot talks is not a barge-in: the bot's sentence is not cut."""
    clears_before = metric("kame_media_playout_clears_total")
    events, stalled_until, deepest, _, _ = await _call_with_a_stall(tiny_checkpoint, talk_s=0.3)
    assert deepest > CLEAR_ON_BARGE_IN_ABOVE_S
    assert "clear" not in [kind for t, kind in events if t > stalled_until]
    assert metric("kame_media_playout_clears_total") == clears_before


async def test_an_action_line_cleared_before_it_played_is_waited_for_again(tiny_checkpoint: Path) -> None:
    """Twilio echoes every pending mark at once when a `clear` empties its queue: such an echo is not the
    line heard, so a transfer or hang-up does not cut in over a line the caller never got."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (call_sid, ws):
        marks: asyncio.Queue[str] = asyncio.Queue()

        async def read() -> None:
            async for m in ws:
                event = json.loads(m.data)
                if event["event"] == "mark" and event["mark"]["name"].startswith("line"):
                    marks.put_nowait(event["mark"]["name"])

        async def send() -> None:
            seq = 1
            while True:
                seq += 1
                await ws.send_str(tm.media_msg("MZ1", seq, seq - 1, 20 * seq, b"\xff" * 160))
                await asyncio.sleep(0.02)

        reader, sender = asyncio.create_task(read()), asyncio.create_task(send())
        try:
            async with asyncio.timeout(10):
                while call_sid not in phone.ctx.streams:  # noqa: ASYNC110 - the server side's seat
                    await asyncio.sleep(0.02)
            session = phone.ctx.streams[call_sid]
            played_before = session.state.marks_played
            line = asyncio.create_task(session._line_played("Let me put you through."))
            first = await asyncio.wait_for(marks.get(), 15)
            await session.clear()  # an engine reset, say: Twilio empties its queue and echoes the mark
            await ws.send_str(tm.mark_msg("MZ1", 10**5, first))
            second = await asyncio.wait_for(marks.get(), 5)  # waited for again, after what comes next
            assert second != first and not line.done()
            await ws.send_str(tm.mark_msg("MZ1", 10**5 + 1, second))
            await asyncio.wait_for(line, 5)
            assert session.state.marks_played == played_before + 1  # the cleared echo was not "played"
        finally:
            sender.cancel()
            reader.cancel()

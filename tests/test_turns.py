"""Turn latency as the line hears it (telephony/turns.py): the end of the caller's turn to the bot's reply,
for a full-duplex model that answers within the silence that ends a turn, and for a bot held silent while
the caller barges in (a forced response delay)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from engine.interface import FRAME_SAMPLES, BotFrames
from kame_phone.media_bench import LoopbackEngine
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call
from telephony.turns import SILENCE_DBFS, TurnEnd, TurnTracker, Unanswered

from .link_fixtures import TOKEN, tone
from .phone_fixtures import metric

FRAME_S = 0.08
LOUD = (0.3 * np.sin(2 * np.pi * 440 * np.arange(FRAME_SAMPLES) / 24_000)).astype(np.float32)
QUIET = np.zeros(FRAME_SAMPLES, np.float32)


def _reply_latency(caller_until_s: float, bot_from_s: float) -> float | None:
    """The caller speaks until `caller_until_s`; the bot answers from `bot_from_s`: the latency measured."""
    turns = TurnTracker()
    for k in range(60):
        t = k * FRAME_S
        if t >= bot_from_s:
            reply = turns.bot_level(-10.0, t)
            if reply is not None:
                return reply.latency_s
        ended = turns.caller_frame(LOUD if t < caller_until_s else QUIET, t)
        if ended is not None and ended.reply_latency_s is not None:
            return ended.reply_latency_s
    return None


def test_a_reply_inside_the_silence_that_ends_a_turn_is_measured_as_it_came() -> None:
    """The turn ends after 0.6 s of the caller's silence; a bot that answered sooner was booked at its next
    loud frame after that: every fast answer read ~0.64 s, the full-duplex model's strength hidden."""
    last_voice = 0.96  # the caller's last loud frame (speaking until 1.0 s, frames every 80 ms)
    for after in (0.08, 0.32, 0.48, 0.8, 1.2):
        got = _reply_latency(1.0, last_voice + after)
        assert got is not None and abs(got - after) < 0.09, (after, got)


def test_a_bot_held_silent_through_a_barge_in_is_heard_to_stop() -> None:
    """The bot talked, the caller cut in and the bot fell silent (held: no frame sent). Told of the silence,
    the tracker measures the reply; without it, the caller's turn read as an overlap (latency 0)."""
    turns = TurnTracker()
    for k in range(25):  # the bot talks 0-2 s
        turns.bot_level(-10.0, k * FRAME_S)
    outcome = None
    for k in range(25, 60):
        t = k * FRAME_S
        caller = LOUD if t < 3.0 else QUIET  # the caller barges in 2-3 s
        if t < 3.2:
            turns.bot_level(SILENCE_DBFS, t)  # held: silent
        else:
            reply = turns.bot_level(-10.0, t)
            if reply is not None:
                outcome = ("reply", reply.latency_s)
        ended = turns.caller_frame(caller, t)
        if ended is not None:
            if ended.overlap:
                outcome = ("overlap", 0.0)
            elif ended.reply_latency_s is not None:
                outcome = ("reply", ended.reply_latency_s)
        if outcome is not None:
            break
    assert outcome is not None and outcome[0] == "reply" and 0.15 < outcome[1] < 0.35, outcome


class _HoldingEngine(LoopbackEngine):
    """Speaks first, falls silent (unvoiced rows: nothing sent) while the caller speaks, and answers
    `reply_after_s` after the caller's last loud frame: a full-duplex model with a forced response delay."""

    reply_after_s = 0.2

    def __init__(self, max_calls: int) -> None:
        super().__init__(max_calls)
        self.last_loud: dict[str, float] = {}

    def _emit(self) -> None:
        sessions = [s for s in self._sessions.values() if s.last is not None]
        if not sessions:
            return
        now = time.monotonic()
        voiced = []
        for s in sessions:
            assert s.last is not None
            if float(np.sqrt(np.mean(s.last**2))) > 0.05:
                self.last_loud[s.call_id] = now
                voiced.append(False)  # held while the caller speaks
            else:
                since = self.last_loud.get(s.call_id)
                voiced.append(since is None or now - since >= self.reply_after_s)
        n = len(sessions)
        self._frames.put_nowait(BotFrames(
            call_ids=tuple(s.call_id for s in sessions), pcm=np.tile(LOUD, (n, 1)), texts=("",) * n,
            voiced=tuple(voiced), indices=tuple(s.index for s in sessions), fresh=(False,) * n, produced_at=now,
        ))  # fmt: skip
        for s in sessions:
            s.index += 1


async def test_the_turn_latency_of_a_call_is_the_reply_the_caller_heard() -> None:
    """Through the real service: the bot greets, the caller speaks 1 s (the bot held silent), the bot
    answers 0.2 s after. The call's recorded turn latency is about 0.2 s: not ~0.65 (the turn end's 0.6 s
    silence wait) and not an overlap at 0 (the held bot taken for still talking)."""
    engine = _HoldingEngine(max_calls=2)
    store = MemoryCallStore()
    handle = await ServiceHandle(ServerContext(
        ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=TOKEN), store, engine)).start()  # fmt: skip
    overlaps = metric("kame_turn_overlaps_total")
    audio = np.concatenate([np.zeros(8000, np.float32), tone(300.0, 1.0), np.zeros(12000, np.float32)])
    try:
        report = await simulate_call(handle.http_url.replace("http://", "ws://") + MEDIA_PATH, audio,
                                     auth_token=TOKEN, public_url=None, hold_after=0.5)  # fmt: skip
    finally:
        await engine.stop()
        await handle.aclose()
    assert report.outcome == "completed", report.errors
    record = await store.get(report.call_sid)
    assert record is not None
    assert len(record.turn_latencies_s) == 1 and 0.1 < record.turn_latencies_s[0] < 0.45, record.turn_latencies_s
    assert metric("kame_turn_overlaps_total") == overlaps


def test_a_turn_the_bot_never_answers_is_counted_when_the_caller_speaks_again_or_hangs_up() -> None:
    """Dead air was invisible: a turn left unanswered was dropped when the caller said "hello?" (or gave up),
    so the turn-latency alerts saw only the turns the bot did answer."""
    turns = TurnTracker()
    got = []
    for k in range(100):  # the caller speaks 0-1 s, waits 4 s in silence, then speaks again
        t = k * FRAME_S
        out = turns.caller_frame(LOUD if t < 1.0 or t >= 5.0 else QUIET, t)
        if isinstance(out, Unanswered):
            got.append(out.waited_s)
    assert len(got) == 1 and abs(got[0] - 4.04) < 0.1, got  # from the last voiced frame (0.96 s) to 5.0 s
    assert turns.hang_up(9.0) is None  # still talking: nothing is waiting

    turns = TurnTracker()
    for k in range(30):  # speaks to 1 s, and hangs up at 2.4 s with no answer
        turns.caller_frame(LOUD if k * FRAME_S < 1.0 else QUIET, k * FRAME_S)
    left = turns.hang_up(2.4)
    assert left is not None and abs(left.waited_s - 1.44) < 0.01

    answered = TurnTracker()
    for k in range(30):
        t = k * FRAME_S
        answered.caller_frame(LOUD if t < 1.0 else QUIET, t)
        if t >= 1.8:
            answered.bot_level(-10.0, t)
    assert answered.hang_up(2.4) is None  # answered: a turn latency, not dead air


def _caller_over_the_bot(
    turns: TurnTracker, bot_level_at: Callable[[int], float] = lambda k: -10.0
) -> tuple[TurnEnd, int]:
    """The bot talks 0-3 s, the caller talks over it 0.5-1.5 s: (the caller's TurnEnd, the frame index)."""
    for k in range(60):
        t = k * FRAME_S
        if t < 3.0:
            turns.bot_level(bot_level_at(k), t)
        ended = turns.caller_frame(LOUD if 0.5 <= t < 1.5 else QUIET, t)
        if isinstance(ended, TurnEnd):
            return ended, k
    raise AssertionError("the caller's turn never ended")


def test_a_caller_turn_ending_while_the_bot_talks_is_an_overlap_not_a_reply() -> None:
    """The bot was talking before and after the caller's words: an overlap, not a (negative) reply latency."""
    ended, _ = _caller_over_the_bot(TurnTracker())
    assert ended.overlap and ended.reply_latency_s is None, ended


def test_an_overlapped_turn_waits_for_no_reply() -> None:
    """After an overlap the bot's speech goes on: it is no reply to book, nor dead air at the hang-up."""
    talking_on, hanging_up = TurnTracker(), TurnTracker()
    ended, k = _caller_over_the_bot(talking_on)
    assert ended.overlap and talking_on.bot_level(-10.0, (k + 1) * FRAME_S) is None
    _caller_over_the_bot(hanging_up)
    assert hanging_up.hang_up((k + 1) * FRAME_S) is None


def test_one_quiet_bot_frame_mid_sentence_does_not_end_the_bots_speech() -> None:
    """A single quiet frame (a pause between words) is not the bot falling silent: still an overlap."""
    ended, _ = _caller_over_the_bot(TurnTracker(), lambda k: -60.0 if k % 5 == 4 else -10.0)
    assert ended.overlap and ended.reply_latency_s is None, ended


def test_a_caller_turn_ends_after_0_6_s_of_silence() -> None:
    """The turn-end wait is counted into every reply's dead air: 0.6 s, so the stop at 0.96 ends at ~1.6 s."""
    turns = TurnTracker()
    for k in range(40):
        t = k * FRAME_S
        ended = turns.caller_frame(LOUD if t < 1.0 else QUIET, t)
        if ended is not None:
            break
    assert isinstance(ended, TurnEnd) and abs(ended.at - 0.96) < 1e-6 and abs(t - 1.6) < 0.01, (ended, t)

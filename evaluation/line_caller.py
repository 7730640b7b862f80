"""One eval call on the line: the caller asks, then listens until the bot falls quiet (or a cap), and
what the timeline shows afterwards (the paper's latency, takeover in a pause, talk after a barge-in).

`AskAndListen` is a `telephony.sim_playout.CallerScript`: it decides each 20 ms packet as the call goes,
listening to the bot audio Twilio would be playing. Times are seconds on the call's timeline (0 = the
`start` message), the same clock as the heard audio the simulated caller renders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from telephony import sim_playout as sp


@dataclass(frozen=True)
class Listening:
    """When the caller hangs up."""

    lead_in_s: float = 1.0  # silence before the question: room for a greeting to start
    quiet_s: float = 2.0  # the bot has answered and been quiet this long: its reply is over
    no_answer_s: float = 10.0  # nothing from the bot this long after the question: no reply
    max_reply_s: float = 60.0  # the reply is cut here, however long the bot talks
    barge_after_s: float = 1.0  # probes: barge in once the bot has spoken this long after the question


# A bot still sounding this long after the caller's barge-in phrase ended was talking over the caller;
# sound that starts later is its answer to the barge-in.
BARGE_IN_MARGIN_S = 0.2


class _Phase(enum.Enum):
    LEAD = 1
    ASK = 2
    LISTEN = 3
    BARGE = 4
    DONE = 5


@dataclass(eq=False)
class AskAndListen:
    """Say `question` (optionally as two parts with a pause between), listen; in a probe, barge in with
    `barge_in` once the bot has talked `barge_after_s`, then listen again."""

    question: list[bytes]
    listening: Listening = field(default_factory=Listening)
    second_part: list[bytes] | None = None  # probes: said after `pause_s` of silence
    pause_s: float = 0.0
    barge_in: list[bytes] | None = None
    # What happened, on the call's timeline:
    question_start_s: float | None = None
    question_end_s: float | None = None  # end of the last voiced packet of the question
    asked_end_s: float | None = None  # end of the question's last packet, voiced or not
    pause_start_s: float | None = None  # end of the first part's speech
    pause_end_s: float | None = None  # the second part starts
    barge_in_start_s: float | None = None
    barge_in_end_s: float | None = None  # end of the last voiced packet of the barge-in phrase
    hung_up_because: str = ""
    _phase: _Phase = _Phase.LEAD
    _plan: list[tuple[bytes, bool, str]] = field(default_factory=list)  # (packet, voiced, mark) to say
    _said: int = 0
    _last_sound_s: float | None = None
    _bot_talk_s: float = 0.0  # bot sound heard since the question ended
    _barge_voiced: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._plan = _utterance(self.question, "a")
        if self.second_part is not None:
            gap = round(self.pause_s / sp.PACKET_SECONDS)
            self._plan += [(sp.SILENCE_PACKET, False, "pause")] * gap + _utterance(self.second_part, "b")
        self._barge_voiced = sp.voiced_flags(self.barge_in) if self.barge_in else []

    @property
    def asked(self) -> bool:
        """The whole question went out (a hang-up before this cut the question short)."""
        return self.asked_end_s is not None

    @property
    def listen_from_s(self) -> float | None:
        """Where the wait for a reply starts: the question's last voiced packet, or, when no packet of it
        was voiced (a TTS that spoke silence), the end of its last packet."""
        return self.question_end_s if self.question_end_s is not None else self.asked_end_s

    def next_packet(self, t: float, playout: sp.Playout) -> tuple[bytes, bool] | None:
        L = self.listening
        if playout.sound_between(t - sp.PACKET_SECONDS, t):
            self._last_sound_s = t
            if self._phase is _Phase.LISTEN:
                self._bot_talk_s += sp.PACKET_SECONDS
        if self._phase is _Phase.LEAD:
            if t + 1e-9 < L.lead_in_s:
                return sp.SILENCE_PACKET, False
            self._phase, self.question_start_s = _Phase.ASK, t
        if self._phase is _Phase.ASK:
            step = self._ask(t)
            if step is not None:
                return step
        if self._phase is _Phase.BARGE:
            return self._barge(t)
        return self._listen(t, playout)

    def _ask(self, t: float) -> tuple[bytes, bool] | None:
        """The question's next packet; None once it is all said (an empty question: at once)."""
        if self._said >= len(self._plan):
            self._phase, self.asked_end_s = _Phase.LISTEN, t
            return None
        packet, voiced, part = self._plan[self._said]
        self._said += 1
        if voiced:
            self.question_end_s = t + sp.PACKET_SECONDS
            if part == "a":
                self.pause_start_s = self.question_end_s
            elif self.pause_end_s is None:
                self.pause_end_s = t
        if self._said == len(self._plan):
            self._phase, self.asked_end_s = _Phase.LISTEN, t + sp.PACKET_SECONDS
        return packet, voiced

    def _listen(self, t: float, playout: sp.Playout) -> tuple[bytes, bool] | None:
        L, end = self.listening, self.listen_from_s
        if end is None:  # not reached: LISTEN follows the whole question
            end = t
        since_q = t - end
        # Sound heard only while the caller was asking is talking over, not a reply: wait for one.
        answered = self._last_sound_s is not None and self._last_sound_s > end
        if self.barge_in is not None and self.barge_in_start_s is None and self._bot_talk_s >= L.barge_after_s:
            self._phase, self.barge_in_start_s, self._said = _Phase.BARGE, t, 0
            return self._barge(t)
        reason = ""
        if since_q >= L.max_reply_s:
            reason = "max_reply"
        elif not answered and since_q >= L.no_answer_s:
            reason = "no_answer"
        elif answered and t - (self._last_sound_s or t) >= L.quiet_s and not playout.sound_between(t, 1e9):
            reason = "quiet"
        if reason:
            self.hung_up_because, self._phase = reason, _Phase.DONE
            return None
        return sp.SILENCE_PACKET, False

    def _barge(self, t: float) -> tuple[bytes, bool] | None:
        assert self.barge_in is not None
        if self._said >= len(self.barge_in):
            self._phase = _Phase.LISTEN
            return sp.SILENCE_PACKET, False
        packet = self.barge_in[self._said]
        if self._barge_voiced[self._said]:
            self.barge_in_end_s = t + sp.PACKET_SECONDS
        self._said += 1
        return packet, True


def _utterance(packets: list[bytes], part: str) -> list[tuple[bytes, bool, str]]:
    voiced = sp.voiced_flags(packets)
    return [(p, v, part) for p, v in zip(packets, voiced, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Reading the timeline afterwards


@dataclass(frozen=True, slots=True)
class Span:
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def _loud_windows(pcm8k: np.ndarray) -> np.ndarray:
    """Per 20 ms window of int16 audio: is it bot sound (RMS over SOUND_RMS)?"""
    n = sp.PACKET_BYTES
    x = pcm8k[: len(pcm8k) // n * n].astype(np.float64).reshape(-1, n) / 32768.0
    return np.sqrt((x * x).mean(axis=1)) > sp.SOUND_RMS if len(x) else np.zeros(0, dtype=bool)


def speech_spans(pcm8k: np.ndarray, merge_gap_s: float = 0.5, min_s: float = 0.1) -> list[Span]:
    """Stretches of bot sound in the heard audio: 20 ms windows over SOUND_RMS, gaps under `merge_gap_s`
    bridged (pauses between words), stretches under `min_s` dropped (clicks)."""
    spans: list[Span] = []
    for i in np.flatnonzero(_loud_windows(pcm8k)).tolist():  # Python ints: figures must be plain floats for JSON
        s, e = i * sp.PACKET_SECONDS, (i + 1) * sp.PACKET_SECONDS
        if spans and s - spans[-1].end_s < merge_gap_s:
            spans[-1] = Span(spans[-1].start_s, e)
        else:
            spans.append(Span(s, e))
    return [sp_ for sp_ in spans if sp_.seconds >= min_s]


def sound_seconds(pcm8k: np.ndarray, start_s: float, end_s: float) -> float:
    """How much bot sound (20 ms windows over SOUND_RMS) the heard audio holds between two times."""
    loud = _loud_windows(pcm8k)
    a = max(0, int(np.floor(start_s / sp.PACKET_SECONDS + 1e-9)))
    b = max(a, int(np.ceil(end_s / sp.PACKET_SECONDS - 1e-9)))
    return float(np.count_nonzero(loud[a:b]) * sp.PACKET_SECONDS)


def answer_latency(spans: list[Span], question_end_s: float) -> float | None:
    """The paper's latency: from the end of the question to the start of the bot's answer, the first
    stretch of bot speech still going at, or starting after, the question's end (negative when the bot
    began before the caller finished). None: the bot never answered."""
    for s in spans:
        if s.end_s > question_end_s:
            return s.start_s - question_end_s
    return None


def took_turn_in_pause(heard: np.ndarray, start_s: float, end_s: float, min_talk_s: float = 0.5) -> bool:
    """Full-Duplex-Bench's takeover in a pause: did the bot talk at least `min_talk_s` while the caller
    paused mid-sentence (it should not: the caller has not finished)? Only actual sound counts: the gaps
    `speech_spans` bridges between words are silence here, so short noises cannot add up to a turn."""
    return bool(sound_seconds(heard, start_s, end_s) >= min_talk_s - 1e-9)


def talk_after_barge_in(
    spans: list[Span], barge_s: float, barge_end_s: float, call_end_s: float, margin_s: float = BARGE_IN_MARGIN_S
) -> tuple[float, bool]:
    """How long the bot kept talking after the caller barged in, and whether it stopped before the call
    ended. The bot talked over the caller if it sounded between the barge-in and the end of the caller's
    phrase (plus `margin_s`), even after a pause; its talk runs to the end of the last such stretch (0 if it
    was silent throughout). A stretch starting later is its answer to the barge-in, not talk over it."""
    over = [s for s in spans if s.end_s > barge_s and s.start_s < barge_end_s + margin_s]
    if not over:
        return 0.0, True
    end = over[-1].end_s
    return end - barge_s, bool(end < call_end_s - sp.PACKET_SECONDS)

"""Where the bot's audio stands in Twilio's playout queue, as far as this edge can tell.

Twilio plays what a stream sends at real time, and the engine makes it at real time: so the queue keeps
whatever depth a stall gave it. A stall on our side (an event-loop pause, a slow hop from a remote engine)
releases the frames it held as a burst; a stall on the way to Twilio (a TCP retransmit) does the same out
of the socket's buffers. Either way every later word reaches the caller that much late, for the rest of
the call, and a caller who talks over the bot hears it carry on for as long. The clock estimates the
queue from what was sent when, corrects it by the marks' echoes (an echo comes when the audio before its
mark has played), and the stream uses it to drain the queue through the bot's pauses, and to `clear`
stale speech when the caller starts talking over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.interface import FRAME_SECONDS

# Above this much queued, the bot's silent frames are not sent: they are pauses, and skipping them brings
# the queue back without losing a word. Two frames: one for the tick's own jitter, one for the network's.
DRAIN_ABOVE_S = 2 * FRAME_SECONDS
# Silent, not merely quiet: well under the turn threshold (-38 dBFS), so a soft consonant or a word's
# fading end is never taken for a pause.
DRAIN_SILENT_DBFS = -50.0
# The caller talks over more than this much queued: the queue is stale speech (the model already hears the
# caller, its answer to them is behind it), so it is cleared; once they have talked for BARGE_IN_AFTER_S
# of voice, so a backchannel ("mm-hm") or a cough does not cut the bot's sentence.
CLEAR_ON_BARGE_IN_ABOVE_S = 0.25
BARGE_IN_AFTER_S = 0.5
# An echo this much later than the estimate says the queue is deeper than what was sent shows (the part
# beyond it is added). Below it, the echo's own way back and Twilio's jitter would bias the estimate up.
ECHO_SLACK_S = 0.1
MAX_PENDING_MARKS = 64


@dataclass(frozen=True, slots=True)
class Echo:
    played: bool  # False: a `clear` emptied the queue before it played (Twilio echoes those marks at once)
    waited_s: float | None  # from sending the mark to its echo: the audio queued ahead of it plus the round trip


@dataclass
class PlayoutClock:
    until: float = 0.0  # monotonic time Twilio's queue runs dry, by the estimate
    # What the echoes have added to `until` so far. A mark's due time is the estimate when it was sent; one
    # stall delays every mark in flight, so each echo is late by what the earlier echoes already added, and
    # without this each added it again (four marks in flight, a 1 s stall read as 3.7 s of queue).
    _shift: float = 0.0
    # mark name -> (sent at, when the audio before it should have played, None once a `clear` came after
    # it; the shift then)
    _pending: dict[str, tuple[float, float | None, float]] = field(default_factory=dict)

    def sent(self, at: float, seconds: float = FRAME_SECONDS) -> None:
        self.until = max(self.until, at) + seconds

    def backlog(self, now: float) -> float:
        return max(0.0, self.until - now)

    def mark_sent(self, name: str, at: float) -> None:
        if len(self._pending) >= MAX_PENDING_MARKS:  # a peer that never echoes: forget the oldest
            self._pending.pop(next(iter(self._pending)))
        self._pending[name] = (at, max(self.until, at), self._shift)

    def cleared(self, now: float) -> None:
        self.until = now
        self._pending = {name: (sent, None, shift) for name, (sent, _due, shift) in self._pending.items()}

    def echoed(self, name: str, at: float) -> Echo:
        pending = self._pending.pop(name, None)
        if pending is None:
            return Echo(True, None)  # not one the clock timed (a peer's invention, or forgotten)
        sent, due, shift = pending
        if due is None:
            return Echo(False, None)
        late = at - (due + self._shift - shift)  # against the estimate as corrected since it was sent
        if late > ECHO_SLACK_S:
            self.until += late - ECHO_SLACK_S
            self._shift += late - ECHO_SLACK_S
        return Echo(True, at - sent)

"""Per-stream rate limits on Twilio's control messages, so one admitted (or merely upgraded) socket cannot
flood the node: every kind but `media` gets a token bucket sized well above what Twilio sends; `media` has its
own real-time guard in the media session, whose drops count here too, and media refused before `start` or
for another stream counts against `invalid`. Drops are counted, never logged one by one, and a
stream far past its limits (within a minute) is ended (outcome `flooding`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import metrics

# (per second, burst). Twilio sends one `connected`, one `start`, one `stop`, a mark echo per mark we send
# (~2/s), and a dtmf event per key pressed (a person presses at most a few a second).
LIMITS: dict[str, tuple[float, float]] = {
    "connected": (0.5, 2),
    "start": (0.5, 2),
    "stop": (0.5, 2),
    "mark": (20.0, 100),
    "dtmf": (5.0, 20),
    "invalid": (5.0, 50),  # malformed or unknown messages (also counted as protocol errors)
    # AudioSocket's audio messages: Asterisk sends 50 a second. Tiny ones pass the real-time guard (it counts
    # seconds of audio), so a flood of them is capped by count too.
    "audio": (100.0, 200),
    # Twilio's media messages by count (50 a second; a network stall delivers them in a burst): the real-time
    # guard counts seconds of caller audio, so messages with none (empty, or the outbound track) pass it.
    "media_msgs": (100.0, 500),
    # WebSocket pings and pongs: Twilio sends none; answered by us under this cap, never by aiohttp on its own
    # (it answered every ping at once, and a peer that never reads stalled the receive loop in that pong).
    "ping": (5.0, 20),
}
# Text a stream may send, in characters: its JSON is parsed before its kind is known, and a 64 KiB frame of
# numbers costs ~8 ms of the event loop every call shares (review, session 28: a socket sending them, 1000
# drops before its end, stalled the loop for seconds). Twilio sends ~20 KB a second (50 media messages), a
# `start` of a few KB once, and a backlog after a network stall: a frame over this is refused unparsed.
TEXT_PER_S, TEXT_BURST = 64 * 1024.0, 256 * 1024.0
END_AFTER_DROPS = 1000  # a stream this far past its limits within a window is hostile or broken: end it
# Counted per window, not over the call's life: an honest sender whose clock runs a little fast, or the odd
# burst after a network stall, drops a few messages an hour; over a long call those would add up to an end.
DROP_WINDOW_S = 60.0


@dataclass(slots=True)
class _Bucket:
    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float, cost: float = 1.0) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True


@dataclass(slots=True)
class RealTimeAllowance:
    """Seconds of caller audio a stream may still send: real time accrues from the connection's opening, on top
    of a burst. Before, the allowance was all the time since the opening: a stream that sent little (a peer
    pausing, or feigning it) banked it for good, then pushed minutes of audio at once, to be transcribed at 25x
    real time. Banking now stops at `cap_s`: what may pile up while the stream is not read or is stalled, and
    still keep its socket (a late start, its seat's set-up, a stall the silence watchdog lets it survive), plus
    the burst. Such a backlog still arrives whole."""

    cap_s: float
    credit_s: float
    at: float

    def take(self, seconds: float, now: float) -> bool:
        """False: `seconds` more now would be ahead of real time by more than the bank (refuse them)."""
        self.credit_s = min(self.cap_s, self.credit_s + max(0.0, now - self.at))
        self.at = max(self.at, now)
        if seconds > self.credit_s + 1e-6:  # (a sender exactly at real time, less float rounding, is on time)
            return False
        self.credit_s -= seconds
        return True


@dataclass(slots=True)
class StreamLimits:
    """One stream's buckets, made on first use of each kind."""

    dropped: int = 0  # since the stream began
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _window_drops: int = 0
    _window_start: float = 0.0

    def allow(self, kind: str, now: float | None = None) -> bool:
        """False (and counted) when `kind` is over its limit; kinds without a limit always pass."""
        limit = LIMITS.get(kind)
        if limit is None:
            return True
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(kind)
        if bucket is None:
            bucket = self._buckets[kind] = _Bucket(limit[0], limit[1], limit[1], now)
        if bucket.take(now):
            return True
        self.drop(kind, now)
        return False

    def allow_text(self, chars: int, now: float | None = None) -> bool:
        """False (and counted, as a `text` drop) when a text frame of `chars` is over the stream's text rate:
        it is then refused before it is parsed."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get("text")
        if bucket is None:
            bucket = self._buckets["text"] = _Bucket(TEXT_PER_S, TEXT_BURST, TEXT_BURST, now)
        if bucket.take(now, chars):
            return True
        self.drop("text", now)
        return False

    def drop(self, kind: str, now: float | None = None) -> None:
        """A message refused by a guard of its own (media past real time): counted as a drop all the same."""
        now = time.monotonic() if now is None else now
        if now - self._window_start > DROP_WINDOW_S:
            self._window_start, self._window_drops = now, 0
        self.dropped += 1
        self._window_drops += 1
        metrics.STREAM_MESSAGES_DROPPED.labels(event=kind).inc()

    @property
    def flooding(self) -> bool:
        return self._window_drops > END_AFTER_DROPS

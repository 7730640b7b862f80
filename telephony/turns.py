"""Who is speaking, measured on the line itself: caller turns from inbound audio energy, the bot's
speech from what we send. Gives the turn latency (end of the caller's turn to the bot's next audio)
independently of the STT, so it can be trusted when the STT is slow or off."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FLOOR_MEAN_SQUARE = 1e-18  # -180 dBFS: digital silence
SILENCE_DBFS = -180.0


def level_dbfs(pcm: np.ndarray) -> float:
    if not len(pcm):
        return -180.0
    v = np.asarray(pcm, dtype=np.float32)  # no copy for the engine's float32 frames
    mean_square = float(np.dot(v, v)) / len(v)  # one BLAS call: this runs for every caller frame
    return 10.0 * np.log10(max(mean_square, _FLOOR_MEAN_SQUARE))


def levels_dbfs(rows: np.ndarray) -> np.ndarray:
    """`level_dbfs` of each row at once: [N, n] -> [N] float64 (a whole engine tick of bot audio)."""
    mean_square = np.einsum("ij,ij->i", rows, rows, dtype=np.float64) / max(rows.shape[1], 1)
    return 10.0 * np.log10(np.maximum(mean_square, _FLOOR_MEAN_SQUARE))


@dataclass(frozen=True, slots=True)
class TurnEnd:
    at: float  # when the caller's last voiced frame arrived
    overlap: bool  # the bot was already speaking when the caller's turn ended
    # The bot began its reply after the caller's last voice but before the silence that ends a turn had
    # passed (a full-duplex model answers that fast): its latency, known only now.
    reply_latency_s: float | None = None


@dataclass(frozen=True, slots=True)
class Unanswered:
    """A caller turn the bot never answered: the caller spoke again, or hung up, into its silence."""

    waited_s: float  # from the turn's end (the caller's last voice) to then


@dataclass(frozen=True, slots=True)
class BotReply:
    latency_s: float  # from the caller's turn end to this first bot audio


@dataclass
class TurnTracker:
    threshold_dbfs: float = -38.0
    caller_hangover_s: float = 0.6  # silence that ends a caller turn (a pause inside a sentence is shorter)
    bot_hangover_s: float = 0.3
    caller_speaking: bool = False
    last_caller_voice: float = 0.0
    bot_speaking_since: float | None = None
    last_bot_voice: float = 0.0
    waiting_since: float | None = None  # a turn ended and the bot has not answered yet

    def caller_frame(self, pcm: np.ndarray, at: float) -> TurnEnd | Unanswered | None:
        if level_dbfs(pcm) > self.threshold_dbfs:
            self.caller_speaking = True
            self.last_caller_voice = at
            # The caller talks again: a turn still waiting for its answer never got one (the worst dead air
            # ends this way, or with a hang-up: neither is a turn latency).
            unanswered = self.hang_up(at)
            return unanswered
        if self.caller_speaking and at - self.last_caller_voice >= self.caller_hangover_s:
            self.caller_speaking = False
            ended = self.last_caller_voice
            since = self.bot_speaking_since
            if since is not None and since >= ended:  # already answering: the reply started at `since`
                self.waiting_since = None
                return TurnEnd(at=ended, overlap=False, reply_latency_s=since - ended)
            overlap = since is not None
            self.waiting_since = None if overlap else ended
            return TurnEnd(at=ended, overlap=overlap)
        return None

    def hang_up(self, at: float) -> Unanswered | None:
        """The turn waiting for an answer, if any, is over unanswered at `at` (the caller spoke, or left)."""
        since, self.waiting_since = self.waiting_since, None
        return None if since is None else Unanswered(max(0.0, at - since))

    def bot_level(self, level: float, at: float) -> BotReply | None:
        """A bot frame of this level (dBFS) was sent at `at` (the fan-out measures a whole tick's levels)."""
        if level <= self.threshold_dbfs:
            if self.bot_speaking_since is not None and at - self.last_bot_voice >= self.bot_hangover_s:
                self.bot_speaking_since = None
            return None
        if self.bot_speaking_since is None:
            self.bot_speaking_since = at
        self.last_bot_voice = at
        if self.waiting_since is not None:
            latency = max(0.0, at - self.waiting_since)
            self.waiting_since = None
            return BotReply(latency_s=latency)
        return None

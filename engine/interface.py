"""The one boundary between the phone edge and the engine.

Telephony talks to an `Engine` and the `CallSession`s it opens; nothing else from `engine/` is imported
by `telephony/`. Everything that crosses is plain data (numpy arrays, strings, frozen dataclasses), so
the engine can later live in another process or on another node behind the same two protocols.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

SAMPLE_RATE = 24_000  # Mimi's rate
FRAME_SAMPLES = 1_920  # one Mimi frame
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE  # 0.08 s
# After `CallSession.close()`, its `outputs()` may still yield the call's last words (the back-end makes the
# caller's unfinished utterance final as it closes): how long a call's end waits for them, at most.
LAST_WORDS_WAIT_S = 1.0


class EngineError(Exception):
    """Base class for errors the engine reports to its callers."""


class EngineFull(EngineError):
    """Every call slot is taken."""


class EngineClosed(EngineError):
    """The engine is stopping or stopped; no new calls."""


@dataclass(frozen=True, slots=True)
class BotFrames:
    """One engine tick: the bot's next 80 ms for every seated call, in one piece.

    Row i belongs to `call_ids[i]`. The engine makes all rows at the same instant, so the edge takes them
    as one batch (one resample + encode pass, then one fan-out) rather than as N separate messages.
    """

    call_ids: tuple[str, ...]
    pcm: np.ndarray  # [N, FRAME_SAMPLES] float32 mono 24 kHz; rows not voiced hold silence
    texts: tuple[str, ...]  # the text piece each row emitted ('' for padding)
    voiced: tuple[bool, ...]  # False while a row has produced no real audio yet (its first frames)
    indices: tuple[int, ...]  # each row's frame number since its call joined
    # True where the row's model state started afresh with this frame (its call's first frame, or after
    # an engine reset): audio from before, still queued downstream, is stale and should be cleared.
    fresh: tuple[bool, ...]
    produced_at: float  # time.monotonic() when the engine finished the tick

    def __post_init__(self) -> None:
        n = len(self.call_ids)
        per_row = (self.texts, self.voiced, self.indices, self.fresh)
        if self.pcm.shape != (n, FRAME_SAMPLES) or any(len(column) != n for column in per_row):
            raise ValueError(f"BotFrames rows disagree: {n} calls, pcm {self.pcm.shape}")


@dataclass(frozen=True, slots=True)
class CallerTranscript:
    """What the STT heard from the caller so far in the current turn."""

    text: str
    final: bool
    at: float  # time.monotonic() when the transcript arrived


@dataclass(frozen=True, slots=True)
class OracleUpdate:
    """The call's oracle is now this draft: a new candidate, or a longer text of the current one."""

    text: str  # the whole draft so far
    at: float  # time.monotonic()
    candidate: int = 0  # the same id while one LLM answer streams in; a new id supersedes it


@dataclass(frozen=True, slots=True)
class EngineNotice:
    """Something the call's owner should know (an error of the back-end, an underrun burst)."""

    # engine_lost: the engine died with this call's state (the call cannot go on; the process needs a restart)
    kind: Literal["stt_error", "llm_error", "reset", "engine_lost"]
    detail: str


CallAction = Literal["transfer", "end"]  # what the agent may ask the phone edge to do with a live call


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The agent's LLM called a tool. The edge records it; an `action` asks the edge to act on the call once
    the bot has said `say` (the back-end made it the call's oracle): hand it to a person, or hang up."""

    name: str  # transfer_call, end_call, or one of the agent's HTTP tools ("unknown" for a name it lacks)
    arguments: str  # the JSON arguments as the LLM gave them (capped)
    outcome: str  # ok | error | timeout | too_large | bad_arguments | requested (an action, for the edge)
    action: CallAction | None = None
    say: str = ""


@dataclass(frozen=True)
class CallSetup:
    """What the phone edge knows of a call when it opens its seat: the agent that answers it (its
    instructions and greeting live where the back-end runs), the numbers, and the call actions the edge
    can carry out (it holds the Twilio REST credentials; the back-end offers the LLM only those tools)."""

    agent: str = "default"
    to_number: str | None = None
    from_number: str | None = None
    actions: tuple[CallAction, ...] = ()
    forced_delay_ms: float | None = None  # the agent's forced response delay; None: the engine's


MAX_FORCED_DELAY_MS = 10_000
MAX_SETUP_TEXT = 100  # chars of each text field of a CallSetup (the engine link refuses longer)


def is_forced_delay_ms(value: object) -> bool:
    """A forced response delay as an agents file or the engine link may give it: milliseconds, 0 to 10 s."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= MAX_FORCED_DELAY_MS


# What one call's `outputs()` yields; its audio comes in the engine-wide `BotFrames` instead.
EngineOutput = CallerTranscript | OracleUpdate | EngineNotice | ToolUse


@runtime_checkable
class CallSession(Protocol):
    """One call's seat in the engine. Created by `Engine.open_call`, ended by `close`."""

    call_id: str

    def push_audio(self, pcm: np.ndarray) -> None:
        """Queue the caller's audio: float32 mono 24 kHz, exactly FRAME_SAMPLES. Never blocks."""
        ...

    def outputs(self) -> AsyncIterator[EngineOutput]:
        """The call's events (transcripts, oracle drafts, notices), in order, until the call is closed."""
        ...

    async def close(self) -> None:
        """Leave the engine. Idempotent."""
        ...

    def action_failed(self, action: CallAction, result: str) -> None:
        """The edge could not carry out a call action the back-end asked for (`result`: error, unavailable):
        the back-end tells its LLM, which may speak again. Never blocks."""
        ...


@runtime_checkable
class Engine(Protocol):
    """The engine as the phone edge sees it."""

    @property
    def max_calls(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """The engine died and cannot serve again in this process (liveness should fail)."""
        ...

    async def open_call(self, call_id: str, setup: CallSetup | None = None) -> CallSession:
        """Seat a call (answered by `setup.agent`); raises EngineFull or EngineClosed."""
        ...

    def bot_frames(self) -> AsyncIterator[BotFrames]:
        """Every tick's audio for all seated calls, in order, until the engine stops. One consumer.

        A consumer that falls behind loses the oldest ticks; the engine never waits for it."""
        ...

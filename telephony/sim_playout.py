"""The pure half of the simulated caller (`telephony.sim_caller`): audio in, Twilio's playout, the report.

No network I/O: the caller feeds times in (seconds since it sent `start`).

- `caller_packets` turns a WAV file or array into 20 ms mu-law packets; `voiced_flags` marks speech.
- `CallReport` is what a call produced; `format_summary` prints it for people.
- `parse_server_message` reads the three messages a bidirectional stream may send (`media`, `mark`,
  `clear`); anything else raises `ServerMessageError`, as Twilio would warn 31950/31951.
- `Playout` is Twilio's outbound buffer: media plays in order at real time, a mark comes back once the
  audio queued before it has played, and `clear` drops what has not played and returns pending marks.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import secrets
import wave
from collections import deque
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Annotated, BinaryIO, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError
from scipy.signal import resample_poly

from telephony.mulaw import float_to_ulaw, ulaw_to_float, ulaw_to_pcm16

RATE = 8000  # the phone line: mu-law, 8 kHz, mono
PACKET_BYTES = 160  # 20 ms, what Twilio sends per media message
PACKET_SECONDS = PACKET_BYTES / RATE
SILENCE_BYTE = 0xFF  # mu-law code for 0
SILENCE_PACKET = bytes([SILENCE_BYTE]) * PACKET_BYTES
# Bot audio counts as sound above -46 dBFS RMS over 20 ms: well under speech (-20..-35 dBFS), well over
# mu-law's idle codes, so a model's near-silence does not count as its first word.
SOUND_RMS = 0.005
# A caller packet is voiced when within 26 dB of the loudest packet (and above SOUND_RMS): the tail of a
# word or breath noise after it then does not move "end of the caller's last word" by much.
VOICED_RELATIVE = 0.05


# ---------------------------------------------------------------------------------------------------------
# The caller's audio


def read_wav(path: Path | BinaryIO) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV (any rate, any channel count) as mono float32 in [-1, 1), and its rate."""
    with wave.open(path if hasattr(path, "read") else str(path), "rb") as w:  # type: ignore[arg-type]
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported, got {8 * w.getsampwidth()}-bit")
        channels, rate = w.getnchannels(), w.getframerate()
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    pcm = data.reshape(-1, channels).astype(np.float32) / np.float32(32768.0)
    return pcm.mean(axis=1), rate  # stereo: the average, as a phone's mono mic would hear both


def to_line_rate(audio: np.ndarray, rate: int) -> np.ndarray:
    """Resample mono float audio to 8 kHz (one-shot polyphase; scipy's anti-alias filter)."""
    audio = np.asarray(audio, dtype=np.float32).ravel()
    if rate == RATE:
        return audio
    g = gcd(RATE, rate)
    return resample_poly(audio, RATE // g, rate // g).astype(np.float32)


def packetize(audio_8k: np.ndarray) -> list[bytes]:
    """mu-law encode and cut into 160-byte packets; the last one is padded with silence."""
    data = float_to_ulaw(audio_8k)
    data += bytes([SILENCE_BYTE]) * (-len(data) % PACKET_BYTES)
    return [data[i : i + PACKET_BYTES] for i in range(0, len(data), PACKET_BYTES)]


def packet_rms(packet: bytes) -> float:
    x = ulaw_to_float(packet).astype(np.float64)
    return float(np.sqrt(np.mean(x * x))) if len(x) else 0.0


def voiced_flags(packets: list[bytes]) -> list[bool]:
    """Per packet: does it carry the caller's speech (frame energy against the loudest packet)?"""
    rms = [packet_rms(p) for p in packets]
    threshold = max(SOUND_RMS, VOICED_RELATIVE * max(rms, default=0.0))
    return [r >= threshold for r in rms]


def has_sound(payload: bytes) -> bool:
    """True if any 20 ms stretch of this mu-law audio is louder than SOUND_RMS."""
    return any(packet_rms(payload[i : i + PACKET_BYTES]) > SOUND_RMS for i in range(0, len(payload), PACKET_BYTES))


def first_sound_at(pcm: np.ndarray, start: int, window: int = PACKET_BYTES, hop: int = 40) -> int | None:
    """Onset of the first `window`-sample stretch of int16 audio, at or after `start`, louder than SOUND_RMS.

    The onset is the stretch's first sample above SOUND_RMS in magnitude (one exists: the RMS is above it).
    """
    x = pcm.astype(np.float64) / 32768.0
    for i in range(max(start, 0), len(x) - window + 1, hop):
        seg = x[i : i + window]
        if np.sqrt(np.mean(seg * seg)) > SOUND_RMS:
            return i + int(np.argmax(np.abs(seg) > SOUND_RMS))
    return None


def write_wav(path: Path | BinaryIO, pcm: np.ndarray, rate: int = RATE) -> None:
    """16-bit mono WAV of int16 samples (8 kHz unless `rate` says otherwise), to a path or a binary file."""
    with wave.open(path if hasattr(path, "write") else str(path), "wb") as w:  # type: ignore[arg-type]
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(pcm, dtype="<i2").tobytes())


# ---------------------------------------------------------------------------------------------------------
# The call's inputs and its report

Outcome = Literal["completed", "busy", "rejected", "error"]
DTMF_DIGITS = frozenset("0123456789ABCD*#")
_MAX_WARNINGS = 10  # one bad server message per packet must not grow the report without bound


@dataclass
class CallReport:
    """What happened on one simulated call. Times are seconds; latencies start at the `start` message."""

    outcome: Outcome = "error"
    call_sid: str = ""
    account_sid: str = ""
    stream_sid: str | None = None
    http_status: int | None = None  # the voice webhook's answer
    ws_status: int | None = None  # the status of a refused WebSocket upgrade
    twiml_say: str | None = None  # what a busy answer said
    custom_parameters: dict[str, str] = field(default_factory=dict)
    call_seconds: float = 0.0  # from sending `start` to sending `stop` (or the server hanging up)
    seconds_sent: float = 0.0  # caller audio, hold-after silence included
    media_sent: int = 0
    dtmf_sent: int = 0
    bot_seconds_received: float = 0.0
    bot_seconds_played: float = 0.0  # less than received when a clear dropped audio or the call ended
    media_received: int = 0
    marks_received: int = 0
    clears_received: int = 0
    marks_echoed: list[str] = field(default_factory=list)  # every mark sent back, in order
    marks_cleared: list[str] = field(default_factory=list)  # those sent back because a clear dropped them
    marks_unplayed: int = 0  # still waiting for their audio when the call ended
    invalid_messages: int = 0  # server messages Twilio would reject (31950/31951) and ignore
    first_media_latency_s: float | None = None  # first bot media of any kind
    first_audio_latency_s: float | None = None  # first bot media that is not silence
    last_word_at_s: float | None = None  # when the caller's last voiced packet was sent
    last_word_latency_s: float | None = None  # from then to the first non-silent bot audio played
    server_hung_up: bool = False  # the server closed the socket before the caller was done
    fallback_twiml: str | None = None  # what the <Connect action> answered after the server hung up
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def warn(self, text: str) -> None:
        if len(self.warnings) < _MAX_WARNINGS:
            self.warnings.append(text)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


# ---------------------------------------------------------------------------------------------------------
# Inputs


def new_sid(prefix: str) -> str:
    """A Twilio-shaped SID: two letters and 32 hex digits."""
    return prefix + secrets.token_hex(16)


def parse_dtmf(spec: str) -> list[tuple[str, float]]:
    """'1@2.0,#@3.5' -> [('1', 2.0), ('#', 3.5)]: digits and their send times in seconds after `start`."""
    events: list[tuple[str, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        digit, sep, at = item.partition("@")
        if not sep or digit.upper() not in DTMF_DIGITS:
            raise ValueError(f"bad DTMF event {item!r}; expected DIGIT@SECONDS with DIGIT in 0-9 A-D * #")
        seconds = float(at)
        if seconds < 0:
            raise ValueError(f"DTMF time must not be negative: {item!r}")
        events.append((digit.upper(), seconds))
    return sorted(events, key=lambda e: e[1])


def caller_packets(wav: Path | str | np.ndarray, sample_rate: int = RATE) -> list[bytes]:
    """The caller's audio as 20 ms mu-law packets; an array is float audio at `sample_rate` (8k or 24k)."""
    if isinstance(wav, np.ndarray):
        audio = wav.mean(axis=1) if wav.ndim == 2 else wav
        rate = sample_rate
    else:
        audio, rate = read_wav(Path(wav))
    return packetize(to_line_rate(audio, rate))


@runtime_checkable
class CallerScript(Protocol):
    """What the caller says, packet by packet: `next_packet(t, playout)` is asked at each 20 ms slot
    (t: seconds since `start`) and answers (160 mu-law bytes, is it speech) or None to hang up. It may
    listen first: `playout` holds the bot audio queued so far (see `Playout.sound_between`)."""

    def next_packet(self, t: float, playout: Playout) -> tuple[bytes, bool] | None: ...


@dataclass(eq=False)
class WavThenHold:
    """The plain call: the caller's packets, then `hold_s` of silence, then hang up."""

    packets: list[bytes]
    hold_s: float = 2.0
    _voiced: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self._voiced = voiced_flags(self.packets)

    def next_packet(self, t: float, playout: Playout) -> tuple[bytes, bool] | None:
        k = round(t / PACKET_SECONDS)
        if k < len(self.packets):
            return self.packets[k], self._voiced[k]
        if k < len(self.packets) + round(self.hold_s / PACKET_SECONDS):
            return SILENCE_PACKET, False
        return None


def format_summary(r: CallReport) -> str:
    """A few human lines about the call."""

    def sec(x: float | None) -> str:
        return "none" if x is None else f"{x:.3f} s"

    head = f"call {r.call_sid}: {r.outcome}"
    if r.outcome != "completed":
        statuses = [f"webhook HTTP {r.http_status}"] * (r.http_status is not None)
        statuses += [f"upgrade HTTP {r.ws_status}"] * (r.ws_status is not None)
        lines = [head + (f" ({', '.join(statuses)})" if statuses else "")]
        lines += [f"  said: {r.twiml_say}"] * bool(r.twiml_say)
        return "\n".join(lines + [f"  warning: {w}" for w in r.warnings] + [f"  error: {e}" for e in r.errors])
    # Names only: a parameter can carry the call's admission token, which must not end up in logs.
    params = ", ".join(r.custom_parameters) or "none"
    lines = [
        f"{head} after {r.call_seconds:.2f} s; stream {r.stream_sid}; parameters: {params}",
        f"  sent {r.seconds_sent:.2f} s of caller audio in {r.media_sent} media, {r.dtmf_sent} dtmf",
        f"  bot audio: {r.bot_seconds_received:.2f} s received in {r.media_received} media, "
        f"{r.bot_seconds_played:.2f} s played",
        f"  first bot media {sec(r.first_media_latency_s)}, first bot audio {sec(r.first_audio_latency_s)} "
        f"after start; after the caller's last word: {sec(r.last_word_latency_s)}",
        f"  marks: {r.marks_received} received, {len(r.marks_echoed)} echoed "
        f"({len(r.marks_cleared)} by {r.clears_received} clear), {r.marks_unplayed} unplayed at hang-up",
    ]
    if r.server_hung_up:
        lines.append("  the server hung up first")
    if r.invalid_messages:
        lines.append(f"  invalid server messages: {r.invalid_messages}")
    return "\n".join(lines + [f"  warning: {w}" for w in r.warnings] + [f"  error: {e}" for e in r.errors])


# ---------------------------------------------------------------------------------------------------------
# What the server sends (bidirectional stream: media, mark, clear)


class ServerMessageError(Exception):
    """A message Twilio would not accept (it would log warning 31950 or 31951 and ignore it)."""


def _decode_any_payload(value: object) -> bytes:
    # Unlike inbound packets, outbound media "can be of any size", so no size cap here.
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "payload must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("invalid_base64", "media payload is not valid base64") from None


class _Out(BaseModel):
    # extra="forbid": Twilio lists extra fields among the causes of 31951 "Invalid Message".
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


class _OutMediaInfo(_Out):
    payload: Annotated[bytes, PlainValidator(_decode_any_payload)]


class ServerMedia(_Out):
    event: Literal["media"]
    stream_sid: str = Field(alias="streamSid")
    media: _OutMediaInfo


class _OutMarkInfo(_Out):
    name: str


class ServerMark(_Out):
    event: Literal["mark"]
    stream_sid: str = Field(alias="streamSid")
    mark: _OutMarkInfo


class ServerClear(_Out):
    event: Literal["clear"]
    stream_sid: str = Field(alias="streamSid")


ServerMessage = Annotated[ServerMedia | ServerMark | ServerClear, Field(discriminator="event")]
_SERVER_ADAPTER: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


def parse_server_message(raw: str | bytes) -> ServerMessage:
    """Parse one frame the server sent; raise ServerMessageError for binary frames or invalid JSON/fields."""
    if isinstance(raw, bytes | bytearray | memoryview):
        raise ServerMessageError(f"binary frame of {len(raw)} bytes (Twilio: 31950 Malformed Message)")
    try:
        return _SERVER_ADAPTER.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ServerMessageError(f"{where}: {first['msg']}") from None
    except json.JSONDecodeError as exc:  # pragma: no cover - pydantic reports bad JSON as ValidationError
        raise ServerMessageError(f"bad JSON: {exc}") from None


# ---------------------------------------------------------------------------------------------------------
# Twilio's outbound playout buffer


@dataclass(slots=True)
class _Chunk:
    start: int  # sample index on the call timeline (0 = when `start` was sent)
    pcm: np.ndarray  # int16


@dataclass(eq=False)  # stateful; compare by identity
class Playout:
    """Plays the server's audio on a sample clock; times are seconds since the caller sent `start`."""

    _chunks: list[_Chunk] = field(init=False, default_factory=list)
    _marks: deque[tuple[int, str]] = field(init=False, default_factory=deque)  # (due sample, name), in order
    _end: int = field(init=False, default=0)  # playout clock: sample where the queued audio runs out
    # Where queued audio is sound (20 ms RMS over SOUND_RMS), as merged [start, end) sample spans: a caller
    # that waits for the bot to fall quiet, or barges in while it talks, asks `sound_between`.
    _sound: list[list[int]] = field(init=False, default_factory=list)
    received_samples: int = field(init=False, default=0)

    @staticmethod
    def _sample(t: float) -> int:
        return max(0, round(t * RATE))

    def enqueue_media(self, payload: bytes, now: float) -> int:
        """Queue audio; it starts when what is queued before it ends, or now. Returns its start sample."""
        start = max(self._sample(now), self._end)
        pcm = ulaw_to_pcm16(payload)
        self._chunks.append(_Chunk(start, pcm))
        self._end = start + len(pcm)
        self.received_samples += len(pcm)
        for i in range(0, len(payload), PACKET_BYTES):
            if packet_rms(payload[i : i + PACKET_BYTES]) > SOUND_RMS:
                s, e = start + i, start + min(len(pcm), i + PACKET_BYTES)
                if self._sound and self._sound[-1][1] >= s:
                    self._sound[-1][1] = max(self._sound[-1][1], e)
                else:
                    self._sound.append([s, e])
        return start

    def sound_between(self, t0: float, t1: float) -> bool:
        """Does bot audio queued to play between t0 and t1 (seconds) hold sound? Future audio counts."""
        a, b = self._sample(t0), self._sample(t1)
        for s, e in reversed(self._sound):
            if e <= a:
                return False
            if s < b:
                return True
        return False

    def enqueue_mark(self, name: str, now: float) -> None:
        # Due when the audio queued so far has played; with nothing queued, that is now.
        self._marks.append((max(self._end, self._sample(now)), name))

    def due_marks(self, now: float) -> list[str]:
        """Marks whose audio has finished playing by `now`, removed from the queue, in order."""
        t = self._sample(now)
        names: list[str] = []
        while self._marks and self._marks[0][0] <= t:
            names.append(self._marks.popleft()[1])
        return names

    def clear(self, now: float) -> tuple[list[str], list[str]]:
        """Drop the audio not yet played; returns (marks already due, marks whose audio was dropped)."""
        played = self.due_marks(now)
        dropped = [name for _, name in self._marks]
        self._marks.clear()
        cut = self._sample(now)
        kept = [c for c in self._chunks if c.start < cut]
        if kept and kept[-1].start + len(kept[-1].pcm) > cut:
            kept[-1] = _Chunk(kept[-1].start, kept[-1].pcm[: cut - kept[-1].start])
        self._chunks = kept
        self._sound = [[s, min(e, cut)] for s, e in self._sound if s < cut]
        self._end = min(self._end, cut)  # a backlog now ends here; an idle buffer is untouched
        return played, dropped

    @property
    def pending_marks(self) -> int:
        return len(self._marks)

    def render(self, n_samples: int) -> np.ndarray:
        """The call as heard, int16 [n_samples]: played audio in place, silence elsewhere."""
        out = np.zeros(n_samples, dtype=np.int16)
        for c in self._chunks:
            if c.start >= n_samples:
                break
            seg = c.pcm[: n_samples - c.start]
            out[c.start : c.start + len(seg)] = seg
        return out

    def played_samples(self, n_samples: int) -> int:
        """How many samples of bot audio played within the first n_samples of the call."""
        return sum(max(0, min(len(c.pcm), n_samples - c.start)) for c in self._chunks)

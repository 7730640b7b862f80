"""Twilio Media Streams wire format: typed inbound messages, one parser, JSON builders. Pure, no I/O.

Inbound events (`connected`, `start`, `media`, `dtmf`, `mark`, `stop`) are frozen pydantic models joined
in one discriminated union on `event`. Everything bad that the parser can see is raised as a single
`ProtocolError` whose `kind` is a metric label of `TWILIO_PROTOCOL_ERRORS`. Key order in every builder
follows the examples on Twilio's "Media Streams - WebSocket Messages" page.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

# ---------------------------------------------------------------------------------------------------------
# Error kinds: the only values the `kind` label of TWILIO_PROTOCOL_ERRORS takes.
# The parser raises the first six; the session code raises the rest.
MALFORMED_JSON: Final = "malformed_json"
BINARY_FRAME: Final = "binary_frame"
UNKNOWN_EVENT: Final = "unknown_event"
INVALID_MESSAGE: Final = "invalid_message"
INVALID_BASE64: Final = "invalid_base64"
OVERSIZE: Final = "oversize"
MEDIA_BEFORE_START: Final = "media_before_start"
WRONG_STREAM_SID: Final = "wrong_stream_sid"
FLOODING: Final = "flooding"
SILENT_SOCKET: Final = "silent_socket"
DUPLICATE_START: Final = "duplicate_start"
NO_START: Final = "no_start"

PROTOCOL_ERROR_KINDS: Final = frozenset(
    {
        MALFORMED_JSON,
        BINARY_FRAME,
        UNKNOWN_EVENT,
        INVALID_MESSAGE,
        INVALID_BASE64,
        OVERSIZE,
        MEDIA_BEFORE_START,
        WRONG_STREAM_SID,
        FLOODING,
        SILENT_SOCKET,
        DUPLICATE_START,
        NO_START,
    }
)

LINE_RATE: Final = 8000  # µ-law samples (bytes) a second
# Inbound frames are 160 bytes (20 ms) in practice; 1 s of µ-law is far beyond anything legitimate.
MAX_MEDIA_PAYLOAD_BYTES: Final = LINE_RATE
_MAX_PAYLOAD_B64_CHARS: Final = 4 * -(-MAX_MEDIA_PAYLOAD_BYTES // 3)
# A whole text frame: `start` may carry many <Parameter>s (TwiML itself is capped at 64 kB), so 128 KiB
# only stops pathological input before json parsing spends time on it.
MAX_FRAME_CHARS: Final = 128 * 1024
# Sequence numbers, chunks and timestamps are decimal strings; 18 digits always fit an int64.
_NUMERIC_STR_MAX_DIGITS: Final = 18


class ProtocolError(Exception):
    """Bad or unexpected Media Streams input. `kind` is one of PROTOCOL_ERROR_KINDS (a metric label)."""

    def __init__(self, kind: str, detail: str) -> None:
        if kind not in PROTOCOL_ERROR_KINDS:
            raise ValueError(f"unknown protocol error kind {kind!r}")
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


# ---------------------------------------------------------------------------------------------------------
# Field types


def _numeric_str(value: Any) -> int:
    # Twilio sends counters as strings ("1"); a JSON number here means a different protocol, so reject it.
    if not isinstance(value, str):
        raise PydanticCustomError("numeric_string", "expected a string of decimal digits")
    if not (0 < len(value) <= _NUMERIC_STR_MAX_DIGITS and value.isascii() and value.isdigit()):
        raise PydanticCustomError("numeric_string", "expected a string of decimal digits")
    return int(value)


def _decode_payload(value: Any) -> bytes:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "payload must be a base64 string")
    # Check the encoded size first so an oversize frame is never decoded.
    if len(value) > _MAX_PAYLOAD_B64_CHARS:
        raise PydanticCustomError(
            OVERSIZE,
            "media payload over {limit} bytes",
            {"limit": MAX_MEDIA_PAYLOAD_BYTES},
        )
    try:
        audio = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError(INVALID_BASE64, "media payload is not valid base64") from None
    if len(audio) > MAX_MEDIA_PAYLOAD_BYTES:
        raise PydanticCustomError(
            OVERSIZE,
            "media payload over {limit} bytes",
            {"limit": MAX_MEDIA_PAYLOAD_BYTES},
        )
    return audio


def _encode_payload(audio: bytes) -> str:
    return base64.b64encode(audio).decode("ascii")


# Parsed as int, dumped back as the wire's string form.
NumericStr = Annotated[int, PlainValidator(_numeric_str), PlainSerializer(str, return_type=str)]
# Parsed from base64 into raw µ-law bytes, dumped back as base64.
AudioPayload = Annotated[bytes, PlainValidator(_decode_payload), PlainSerializer(_encode_payload, return_type=str)]
# Letters and digits only (Twilio's are two letters and 32 hex digits): a callSid goes into log lines and
# record keys, and one with a newline forged a log line.
Sid = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9]+$")]


class _Wire(BaseModel):
    # strict: no "1" -> 1 coercion; extra="ignore": Twilio may add fields without breaking calls.
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


# ---------------------------------------------------------------------------------------------------------
# Inbound messages (Twilio -> us)


class ConnectedMessage(_Wire):
    event: Literal["connected"]
    protocol: str
    version: str


class MediaFormat(_Wire):
    # Documented as always these values; the codec assumes them, so anything else is refused here.
    encoding: Literal["audio/x-mulaw"]
    sample_rate: Literal[8000] = Field(alias="sampleRate")
    channels: Literal[1]


class StartInfo(_Wire):
    account_sid: Sid = Field(alias="accountSid")
    stream_sid: Sid = Field(alias="streamSid")
    call_sid: Sid = Field(alias="callSid")
    tracks: tuple[str, ...]
    media_format: MediaFormat = Field(alias="mediaFormat")
    # Present (possibly empty) in every documented example; a default keeps a parameterless stream valid.
    custom_parameters: dict[str, str] = Field(default_factory=dict, alias="customParameters")


class StartMessage(_Wire):
    event: Literal["start"]
    sequence_number: NumericStr = Field(alias="sequenceNumber")
    start: StartInfo
    stream_sid: Sid = Field(alias="streamSid")

    @model_validator(mode="after")
    def _same_stream(self) -> StartMessage:
        # Two stream SIDs in one message would make later stream checks ambiguous.
        if self.start.stream_sid != self.stream_sid:
            raise ValueError("start.streamSid differs from streamSid")
        return self


class MediaInfo(_Wire):
    track: Literal["inbound", "outbound"]
    chunk: NumericStr
    timestamp: NumericStr  # ms from the start of the stream
    payload: AudioPayload  # raw µ-law bytes, already decoded


class MediaMessage(_Wire):
    event: Literal["media"]
    sequence_number: NumericStr = Field(alias="sequenceNumber")
    media: MediaInfo
    stream_sid: Sid = Field(alias="streamSid")


class DtmfInfo(_Wire):
    track: str  # documented as always "inbound_track"; informational only
    digit: Annotated[str, Field(pattern=r"^[0-9A-D*#]$")]


class DtmfMessage(_Wire):
    event: Literal["dtmf"]
    stream_sid: Sid = Field(alias="streamSid")
    sequence_number: NumericStr = Field(alias="sequenceNumber")
    dtmf: DtmfInfo


class MarkInfo(_Wire):
    name: str


class MarkMessage(_Wire):
    event: Literal["mark"]
    sequence_number: NumericStr = Field(alias="sequenceNumber")
    stream_sid: Sid = Field(alias="streamSid")
    mark: MarkInfo


class StopInfo(_Wire):
    account_sid: Sid = Field(alias="accountSid")
    call_sid: Sid = Field(alias="callSid")


class StopMessage(_Wire):
    event: Literal["stop"]
    sequence_number: NumericStr = Field(alias="sequenceNumber")
    stop: StopInfo
    stream_sid: Sid = Field(alias="streamSid")


TwilioMessage = Annotated[
    ConnectedMessage | StartMessage | MediaMessage | DtmfMessage | MarkMessage | StopMessage,
    Field(discriminator="event"),
]
_ADAPTER: TypeAdapter[TwilioMessage] = TypeAdapter(TwilioMessage)

# When one message has several problems, report the most specific one.
_ERROR_PRIORITY: Final = (
    ("json_invalid", MALFORMED_JSON),
    ("union_tag_invalid", UNKNOWN_EVENT),
    (OVERSIZE, OVERSIZE),
    (INVALID_BASE64, INVALID_BASE64),
)


def _protocol_error(exc: ValidationError) -> ProtocolError:
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    types = {e["type"] for e in errors}
    kind = next((k for t, k in _ERROR_PRIORITY if t in types), INVALID_MESSAGE)
    # loc + msg only: inputs may hold audio or caller data and must not reach logs.
    detail = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:3])
    return ProtocolError(kind, detail[:300])


def parse_twilio_message(raw: str | bytes) -> TwilioMessage:
    """Parse one WebSocket frame from Twilio into a typed message, or raise ProtocolError."""
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(BINARY_FRAME, f"{len(raw)}-byte frame is not UTF-8 text") from None
    if len(raw) > MAX_FRAME_CHARS:
        raise ProtocolError(OVERSIZE, f"frame of {len(raw)} chars over {MAX_FRAME_CHARS}")
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        raise _protocol_error(exc) from None


# ---------------------------------------------------------------------------------------------------------
# Outbound messages (us -> Twilio); bidirectional <Connect><Stream> only.


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def media_message(stream_sid: str, payload: bytes) -> str:
    """Audio for Twilio to queue and play: raw µ-law 8 kHz bytes, no file header."""
    return _dumps({"event": "media", "streamSid": stream_sid, "media": {"payload": _encode_payload(payload)}})


class MediaMessageTemplate:
    """`media_message` for one stream, as a prebuilt prefix and suffix around the base64 payload.

    The bot sends 12.5 of these a second per call, a whole engine tick's worth at once: two byte
    concatenations instead of a `json.dumps` and a UTF-8 encoding each. Base64 needs no JSON escaping, and
    the streamSid is escaped once by `json.dumps` itself, so the text is exactly `media_message`'s.
    """

    __slots__ = ("stream_sid", "_prefix")

    _SUFFIX = b'"}}'

    def __init__(self, stream_sid: str) -> None:
        self.stream_sid = stream_sid
        whole = _dumps({"event": "media", "streamSid": stream_sid, "media": {"payload": "P"}}).encode("utf-8")
        self._prefix = whole[: -len(b"P" + self._SUFFIX)]

    def render(self, payload: bytes) -> bytes:
        """The UTF-8 text of `media_message(stream_sid, payload)`, ready for a WebSocket TEXT frame."""
        return self._prefix + base64.b64encode(payload) + self._SUFFIX


def mark_message(stream_sid: str, name: str) -> str:
    """Ask Twilio to echo `name` back once the audio queued before it has played (or been cleared)."""
    return _dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def clear_message(stream_sid: str) -> str:
    """Drop all audio Twilio has buffered (barge-in); pending marks come back."""
    return _dumps({"event": "clear", "streamSid": stream_sid})


# ---------------------------------------------------------------------------------------------------------
# Inbound builders: what Twilio would send, for the simulated caller and tests.


class MediaFormatSpec(NamedTuple):
    encoding: str = "audio/x-mulaw"
    sample_rate: int = 8000
    channels: int = 1


def connected_msg() -> str:
    return _dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})


def start_msg(
    stream_sid: str,
    call_sid: str,
    account_sid: str,
    custom_parameters: Mapping[str, str] | None = None,
    *,
    seq: int = 1,
    tracks: Sequence[str] = ("inbound",),
    media_format: MediaFormatSpec = MediaFormatSpec(),  # noqa: B008 - immutable NamedTuple
) -> str:
    return _dumps(
        {
            "event": "start",
            "sequenceNumber": str(seq),
            "start": {
                "accountSid": account_sid,
                "streamSid": stream_sid,
                "callSid": call_sid,
                "tracks": list(tracks),
                "mediaFormat": {
                    "encoding": media_format.encoding,
                    "sampleRate": media_format.sample_rate,
                    "channels": media_format.channels,
                },
                "customParameters": dict(custom_parameters or {}),
            },
            "streamSid": stream_sid,
        }
    )


def media_msg(
    stream_sid: str, seq: int, chunk: int, timestamp_ms: int, payload: bytes, *, track: str = "inbound"
) -> str:
    return _dumps(
        {
            "event": "media",
            "sequenceNumber": str(seq),
            "media": {
                "track": track,
                "chunk": str(chunk),
                "timestamp": str(timestamp_ms),
                "payload": _encode_payload(payload),
            },
            "streamSid": stream_sid,
        }
    )


def dtmf_msg(stream_sid: str, seq: int, digit: str) -> str:
    return _dumps(
        {
            "event": "dtmf",
            "streamSid": stream_sid,
            "sequenceNumber": str(seq),
            "dtmf": {"track": "inbound_track", "digit": digit},
        }
    )


def mark_msg(stream_sid: str, seq: int, name: str) -> str:
    return _dumps({"event": "mark", "sequenceNumber": str(seq), "streamSid": stream_sid, "mark": {"name": name}})


def stop_msg(stream_sid: str, seq: int, call_sid: str, account_sid: str) -> str:
    return _dumps(
        {
            "event": "stop",
            "sequenceNumber": str(seq),
            "stop": {"accountSid": account_sid, "callSid": call_sid},
            "streamSid": stream_sid,
        }
    )

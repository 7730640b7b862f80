"""Asterisk's AudioSocket protocol: one TCP connection a call, Asterisk connecting to us.

Every message is a 3-byte header (kind, then the payload's length as a big-endian u16) and the payload.
Asterisk sends the call's UUID first (16 bytes, binary), then the caller's audio as signed 16-bit
little-endian samples at 8 kHz (`SLIN`, 320 bytes per 20 ms at the usual packetization), DTMF digits
(one ASCII byte, recent point releases only), an error code, or a hang-up. We send `SLIN` back, paced by us: Asterisk
writes each message to the channel the moment it arrives. Pure: parsing and building, no I/O.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import numpy as np

from .mulaw import ulaw_to_pcm16

KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_SLIN = 0x10  # 8 kHz; later Asterisk versions number other rates 0x11.. (not agreed between versions)
OTHER_RATES = range(0x11, 0x20)  # audio at a rate we do not take: the dialplan's channel must be 8 kHz slin
KIND_ERROR = 0xFF
DTMF_DIGITS = frozenset(b"0123456789*#ABCD")  # a DTMF message's one byte
HEADER_BYTES = 3
LINE_RATE = 8000
SAMPLE_BYTES = 2
PACKET_BYTES = 320  # 20 ms of SLIN at 8 kHz: what we send, one message per 20 ms
PACKET_S = 0.02
# The largest payload taken. Asterisk's own frames are 20-60 ms of audio (320-960 bytes); a message claiming up
# to 64 KiB would otherwise make us wait for (and hold) that much from a peer that may never send it.
MAX_PAYLOAD_BYTES = 4000  # 250 ms of audio

# Protocol error kinds (kame_audiosocket_protocol_errors_total).
OVERSIZE = "oversize"
UNKNOWN_KIND = "unknown_kind"
NO_UUID = "no_uuid"
BAD_UUID = "bad_uuid"
ODD_AUDIO = "odd_audio"  # an audio payload that is not whole samples
FLOODING = "flooding"  # audio faster than real time
PEER_ERROR = "peer_error"  # Asterisk sent its error message
WRONG_RATE = "wrong_rate"  # audio of a kind for another sample rate
PROTOCOL_ERROR_KINDS = (OVERSIZE, UNKNOWN_KIND, NO_UUID, BAD_UUID, ODD_AUDIO, FLOODING, PEER_ERROR, WRONG_RATE)


class AudioSocketError(Exception):
    """Input no AudioSocket peer sends: the connection is closed (the kind names it in the metric)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    payload: bytes


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None at a clean end of stream (between messages).

    Raises AudioSocketError for a payload over MAX_PAYLOAD_BYTES (before reading it) and
    asyncio.IncompleteReadError for a connection cut inside a message."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    kind, length = header[0], int.from_bytes(header[1:3], "big")
    if length > MAX_PAYLOAD_BYTES:
        raise AudioSocketError(OVERSIZE, f"message of kind {kind:#04x} claims {length} bytes")
    payload = await reader.readexactly(length) if length else b""
    return Message(kind, payload)


def parse_uuid(message: Message) -> uuid.UUID:
    """The call's UUID from the first message; AudioSocketError if the first message is anything else."""
    if message.kind != KIND_UUID:
        raise AudioSocketError(NO_UUID, f"first message of kind {message.kind:#04x}, not the call's UUID")
    if len(message.payload) != 16:
        raise AudioSocketError(BAD_UUID, f"a UUID of {len(message.payload)} bytes")
    return uuid.UUID(bytes=message.payload)


def encode(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > 0xFFFF:
        raise ValueError(f"payload of {len(payload)} bytes does not fit an AudioSocket message")
    return bytes((kind,)) + len(payload).to_bytes(2, "big") + payload


def slin_messages(mulaw: bytes) -> list[bytes]:
    """The bot's μ-law (the fan-out encodes every call's tick at once) as SLIN messages of 20 ms each.
    μ-law to linear is exact, so this costs one table lookup, not a second encoding of the tick."""
    pcm = ulaw_to_pcm16(mulaw).astype("<i2").tobytes()
    step = PACKET_BYTES
    return [encode(KIND_SLIN, pcm[i : i + step]) for i in range(0, len(pcm), step)]


def slin_to_float(payload: bytes) -> np.ndarray:
    """SLIN bytes (whole samples) to float32 in [-1, 1)."""
    return np.frombuffer(payload, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def hangup() -> bytes:
    return encode(KIND_HANGUP)

"""Between Twilio's 20 ms mu-law packets at 8 kHz and the engine's 80 ms float32 frames at 24 kHz.

One `InboundFramer` per call owns the inbound resampler state. Outbound, the server encodes a whole engine
tick for every call at once (`bot_audio.py`, through a `DownsamplerBank`); `OutboundFramer` is the same
path for one stream on its own. Pure: no I/O, no tasks. The caller parses the Media Streams JSON and
base64 and sends the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.interface import FRAME_SAMPLES
from telephony.audiosocket_wire import SAMPLE_BYTES, slin_to_float
from telephony.mulaw import float_to_ulaw, ulaw_to_float
from telephony.resample import RATIO, DownsamplerBank, Upsampler8to24

PACKET_BYTES = 160  # 20 ms of 8 kHz mu-law: what Twilio sends, and what we send back
FRAME_BYTES = FRAME_SAMPLES // RATIO  # 640: one engine frame on the line


@dataclass(frozen=True, slots=True)
class InboundFrame:
    """80 ms of the caller's audio, ready for `CallSession.push_audio`."""

    pcm: np.ndarray  # [FRAME_SAMPLES] float32, 24 kHz
    last_arrival: float  # time.monotonic() when the packet that completed this frame arrived
    index: int  # frame number since the framer started (or was reset)


@dataclass(eq=False)  # stateful; compare by identity
class InboundFramer:
    """Decode, upsample and cut the caller's packets into engine frames of exactly FRAME_SAMPLES.

    The line's audio is μ-law (Twilio) unless `decode` says otherwise (Asterisk's 16-bit linear: `slin()`)."""

    upsampler: Upsampler8to24 = field(default_factory=Upsampler8to24)
    decode: Callable[[bytes], np.ndarray] = ulaw_to_float  # line bytes to float32 samples at 8 kHz
    sample_bytes: int = 1
    # Line bytes of the frame being filled. Decoding and resampling once per 80 ms frame instead of
    # once per 20 ms packet gives the same samples (the filter is linear and keeps its state) for a
    # quarter of the per-call overhead, and no frame leaves earlier either way.
    _pending: bytearray = field(init=False, default_factory=bytearray)
    _emitted: int = field(init=False, default=0)

    @classmethod
    def slin(cls) -> InboundFramer:
        """For signed 16-bit little-endian samples at 8 kHz (Asterisk's AudioSocket)."""
        return cls(decode=slin_to_float, sample_bytes=SAMPLE_BYTES)

    @property
    def pending_samples(self) -> int:
        """24 kHz samples waiting for the rest of their frame."""
        return len(self._pending) // self.sample_bytes * RATIO

    def push(self, payload: bytes, arrived_at: float | None = None) -> list[InboundFrame]:
        """Add one packet's line bytes (any length; whole samples); return the frames it completed, usually 0 or 1.

        `arrived_at` is the packet's time.monotonic() receive time; it defaults to now.
        """
        if arrived_at is None:
            arrived_at = time.monotonic()
        self._pending += payload
        frames: list[InboundFrame] = []
        frame_bytes = FRAME_BYTES * self.sample_bytes
        while len(self._pending) >= frame_bytes:
            chunk = bytes(self._pending[:frame_bytes])
            del self._pending[:frame_bytes]
            pcm = self.upsampler.process(self.decode(chunk))
            frames.append(InboundFrame(pcm, arrived_at, self._emitted))
            self._emitted += 1
        return frames

    def reset(self) -> None:
        """Drop partial audio and filter state, as at the start of a call."""
        self.upsampler.reset()
        self._pending.clear()
        self._emitted = 0


@dataclass(eq=False)  # stateful; compare by identity
class OutboundFramer:
    """Turn one stream's 80 ms bot frames into mu-law for Twilio: FRAME_SAMPLES in, FRAME_BYTES out.

    The same filter code as the server's batched fan-out: a `DownsamplerBank` holding just this stream."""

    bank: DownsamplerBank = field(default_factory=DownsamplerBank)

    def encode(self, frame: np.ndarray) -> bytes:
        """One engine frame (float32, 24 kHz, exactly FRAME_SAMPLES) to FRAME_BYTES of mu-law."""
        if frame.shape != (FRAME_SAMPLES,):
            raise ValueError(f"expected a frame of shape ({FRAME_SAMPLES},), got {frame.shape}")
        return float_to_ulaw(self.bank.process([self], frame[None])[0])

    def encode_packets(self, frame: np.ndarray) -> list[bytes]:
        """Like `encode`, cut into PACKET_BYTES pieces (4 per frame), for one media message each."""
        data = self.encode(frame)
        return [data[i : i + PACKET_BYTES] for i in range(0, len(data), PACKET_BYTES)]

    def reset(self) -> None:
        """Forget filter state, as at the start of a call."""
        self.bank.forget(self)

"""G.711 mu-law codec for Twilio Media Streams, bit-exact with the reference (CPython's audioop).

Encoding ports `st_14linear2ulaw` (drop 2 LSBs with an arithmetic shift, clip the magnitude at 8159,
add the bias 0x21, find the segment, invert the bits); decoding ports `st_ulaw2linear16`. Both run
once at import over every input to build lookup tables, so a call costs one numpy fancy index.
No `audioop`: it is gone in Python 3.13.

Float convention: decode divides by 32768 (so the result lies in [-1, 1)); encode clips to [-1, 1]
and multiplies by 32767, so +1.0 maps to 32767 and never wraps.
"""

from __future__ import annotations

import numpy as np

_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)
_CLIP = 8159  # largest 14-bit magnitude that still fits the top segment once biased
_BIAS_14 = 0x21  # the 16-bit bias 0x84 seen after the >> 2
_BIAS_16 = 0x84


def _build_encode_table() -> np.ndarray:
    """ulaw code for every int16, indexed by the sample's bit pattern as uint16."""
    pcm = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16).astype(np.int32)
    val = pcm >> 2  # 16-bit to 14-bit, floor like C's >> on int
    negative = val < 0
    mag = np.minimum(np.abs(val), _CLIP) + _BIAS_14
    seg = np.searchsorted(_SEG_END, mag, side="left")  # first segment whose end >= mag
    uval = (seg << 4) | ((mag >> (seg + 1)) & 0xF)
    uval = np.where(seg >= 8, 0x7F, uval)  # past the last segment (only 8159 + 0x21): the top code
    mask = np.where(negative, 0x7F, 0xFF)  # inverting all bits also sets the sign bit for >= 0
    return (uval ^ mask).astype(np.uint8)


def _build_decode_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((code & 0x0F) << 3) + _BIAS_16) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, _BIAS_16 - t, t - _BIAS_16).astype(np.int16)


_ENCODE = _build_encode_table()  # [65536] uint8
_DECODE = _build_decode_table()  # [256] int16
_DECODE_FLOAT = (_DECODE.astype(np.float32) / np.float32(32768.0)).astype(np.float32)  # [256]


def ulaw_to_pcm16(data: bytes) -> np.ndarray:
    """Decode mu-law bytes to int16 samples, one per byte."""
    return _DECODE[np.frombuffer(data, dtype=np.uint8)]


def pcm16_to_ulaw(pcm: np.ndarray) -> bytes:
    """Encode int16 samples to mu-law bytes, one per sample."""
    if pcm.dtype != np.int16:
        raise TypeError(f"pcm16_to_ulaw wants int16, got {pcm.dtype}")
    return _ENCODE[np.ascontiguousarray(pcm).view(np.uint16)].tobytes()


def ulaw_to_float(data: bytes) -> np.ndarray:
    """Decode mu-law bytes to float32 in [-1, 1) (int16 / 32768)."""
    return _DECODE_FLOAT[np.frombuffer(data, dtype=np.uint8)]


def float_to_ulaw(x: np.ndarray) -> bytes:
    """Encode float samples to mu-law: clip to [-1, 1], scale by 32767, round to nearest."""
    # NaN/inf from a misbehaving model must not become a full-scale click on the caller's line
    # (checked first: the clean-up costs more than the encoding on this hot path).
    x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    pcm = np.rint(np.clip(x, -1.0, 1.0) * np.float32(32767.0)).astype(np.int16)
    return _ENCODE[pcm.view(np.uint16)].tobytes()

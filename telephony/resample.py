"""Streaming 8 kHz <-> 24 kHz resamplers for the phone line, one object per direction per call.

Why not soxr: `soxr.ResampleStream` (1.1.0, default HQ), fed 20 ms packets, holds back 43 ms per
direction on average (12-73 ms depending on where a packet falls in its block) and returns nothing
for the first three packets. Here one linear-phase equiripple FIR (scipy `remez`, 145 taps at 24 kHz,
designed once at import) runs as a polyphase filter with its input tail kept between calls, so
chunked output equals one-shot output and every input sample yields its outputs at once.

Measured (freqz, 65536 points; tests/test_audio_path.py): delay 3.0 ms per direction (72 samples at
24 kHz, 24 at 8 kHz); passband 0 to -0.055 dB re DC over 0-3.4 kHz (-3.8 dB at 3.6 kHz); stopband
>= 79 dB from 4.0 kHz, which holds every image of upsampling and every alias of downsampling;
each phase runs as one `np.correlate` (about 3x faster than a matrix product over a strided window
view, which numpy cannot hand to BLAS).

`DownsamplerBank` does the outbound direction for every call of an engine tick at once: the frames are cut
into overlapping blocks and multiplied by one banded (Toeplitz) matrix, a single float32 BLAS product
(1.4 ms for 200 calls on one core here, against 7 ms for 200 separate `process` calls). Same filter.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from scipy.signal import remez

RATIO = 3  # 24000 / 8000
_FS_HIGH = 24_000
_TAPS = 145  # odd and (_TAPS - 1) / 2 divisible by RATIO, so the delay is whole samples at both rates
_DELAY_HIGH = (_TAPS - 1) // 2  # 72 samples at 24 kHz
DELAY_SECONDS = _DELAY_HIGH / _FS_HIGH  # 0.003


def _design_lowpass() -> np.ndarray:
    """The shared anti-image / anti-alias filter at 24 kHz, unity gain at DC. [_TAPS] float64."""
    # Pass 0-3.4 kHz (telephone band), stop from 4.0 kHz (the 8 kHz Nyquist); the weight trades
    # passband ripple we do not need for stopband depth we do.
    h = remez(_TAPS, [0, 3400, 4000, _FS_HIGH / 2], [1, 0], weight=[1, 30], fs=_FS_HIGH)
    h = h / h.sum()
    h.setflags(write=False)
    return h


# Designed at import (remez takes < 1 ms; importing scipy.signal ~1 s) so that no call's first packet
# pays for it inside the event loop.
LOWPASS = _design_lowpass()


class _StreamingFir:
    """The input history an FIR needs across chunks, so that chunked output equals one-shot output."""

    _history: int  # inputs kept from one chunk to the next

    def reset(self) -> None:
        """Forget the past, as at the start of a call."""
        self._tail = np.zeros(self._history)  # float64

    def _extend(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """History + this chunk (float64), and the chunk's length; keeps the new history."""
        x = np.asarray(x, dtype=np.float64).ravel()
        ext = np.concatenate([self._tail, x])
        self._tail = ext[len(x) :]
        return ext, len(x)


_UP_BLOCK = 32  # inputs per block of the upsampler's band-matrix product


def _overlapping_rows(x: np.ndarray, rows: int, width: int, step: int) -> np.ndarray:
    """[rows, width] C-contiguous copy of x[i * step : i * step + width] (x 1-D float32, contiguous).
    Built through the ndarray constructor: `as_strided` costs microseconds of Python per call."""
    view = np.ndarray((rows, width), np.float32, x, strides=(step * x.itemsize, x.itemsize))
    return np.ascontiguousarray(view)


class Upsampler8to24(_StreamingFir):
    """8 kHz -> 24 kHz, exactly 3 output samples per input sample, state kept across calls."""

    delay_seconds: float = DELAY_SECONDS

    def __init__(self) -> None:
        h = np.concatenate([LOWPASS * RATIO, np.zeros(-_TAPS % RATIO)])  # gain 3 undoes zero-stuffing
        self._n_phase_taps = len(h) // RATIO  # 49
        self._history = self._n_phase_taps - 1
        # y[3k + p] = sum_m h[3m + p] * x[k - m]; each phase's taps run oldest-first for correlate.
        phases = h.reshape(self._n_phase_taps, RATIO)[::-1]  # [M, 3]
        self._phases = [np.ascontiguousarray(phases[:, p]) for p in range(RATIO)]
        # The same taps as a band matrix: a block of _UP_BLOCK inputs (plus the history before it) in,
        # its 3 * _UP_BLOCK outputs out; column 3k + p holds phase p's taps under inputs k .. k + 48.
        band = np.zeros((_UP_BLOCK + self._history, RATIO * _UP_BLOCK), dtype=np.float32)
        for k in range(_UP_BLOCK):
            band[k : k + self._n_phase_taps, RATIO * k : RATIO * k + RATIO] = phases
        band.setflags(write=False)
        self._band = band
        self.reset()

    def process(self, x: np.ndarray) -> np.ndarray:
        """Resample one chunk of float32 8 kHz audio; returns float32 of length 3 * len(x)."""
        x = np.asarray(x).ravel()
        n = len(x)
        if n and n % _UP_BLOCK == 0:
            # Whole blocks (an engine frame is 640 inputs = 20 blocks): one band-matrix product, 3x faster
            # than three correlates, and this runs for every call's every frame.
            ext = np.empty(self._history + n, dtype=np.float32)
            ext[: self._history] = self._tail
            ext[self._history :] = x
            self._tail = ext[n:].astype(np.float64)
            windows = _overlapping_rows(ext, n // _UP_BLOCK, _UP_BLOCK + self._history, _UP_BLOCK)
            return (windows @ self._band).reshape(-1)
        ext, n = self._extend(x)
        if n == 0:  # correlate would swap its arguments when the input is shorter than the taps
            return np.zeros(0, dtype=np.float32)
        y = np.empty((n, RATIO), dtype=np.float32)
        for p, taps in enumerate(self._phases):
            y[:, p] = np.correlate(ext, taps, "valid")
        return y.reshape(-1)


class Downsampler24to8(_StreamingFir):
    """24 kHz -> 8 kHz, keeping every third filtered sample, state kept across calls.

    Output length is the number of decimation instants inside the chunk, so a multiple of 3 in gives
    exactly a third out (1920 -> 640, 480 -> 160); other sizes carry the phase to the next call.
    """

    delay_seconds: float = DELAY_SECONDS

    def __init__(self) -> None:
        self._taps_reversed = np.ascontiguousarray(LOWPASS[::-1])  # oldest-first for the windows
        self._history = _TAPS - 1
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._offset = 0  # index in the next chunk of the next input sample that yields an output

    def process(self, x: np.ndarray) -> np.ndarray:
        """Resample one chunk of float32 24 kHz audio; returns float32 8 kHz audio."""
        ext, n = self._extend(x)
        # Output j is the window ending at input x[offset + 3j]; only those are computed (the polyphase
        # saving): y[j] = sum_p sum_m t[3m + p] * ext[offset + p + 3(j + m)], one correlate per phase.
        offset = self._offset
        count = len(range(offset, n, RATIO))
        self._offset = (offset - n) % RATIO
        y = np.zeros(count)
        if count:
            for p in range(RATIO):
                y += np.correlate(ext[offset + p :: RATIO], self._taps_reversed[p::RATIO], "valid")[:count]
        return y.astype(np.float32)


_BLOCK = 32  # outputs per block of the batched product: 32 keeps the band matrix (240 x 32) mostly taps
_BLOCK_IN = RATIO * _BLOCK + _TAPS - 1  # 240 inputs feed one block of outputs


def _band_matrix() -> np.ndarray:
    """[_BLOCK_IN, _BLOCK] float32: column j holds the taps (oldest-first) under inputs 3j .. 3j + 144."""
    m = np.zeros((_BLOCK_IN, _BLOCK), dtype=np.float32)
    for j in range(_BLOCK):
        m[RATIO * j : RATIO * j + _TAPS, j] = LOWPASS[::-1]
    m.setflags(write=False)
    return m


_BAND = _band_matrix()


class DownsamplerBank:
    """24 kHz -> 8 kHz for many streams at once, e.g. every call of one engine tick.

    Each stream's filter history is a row of one array, so a tick costs one gather, one band-matrix
    product and one scatter whatever the number of calls. Output equals `Downsampler24to8.process` per
    stream (to float32 rounding). Streams are named by any hashable key; `forget` frees a key's row.
    """

    def __init__(self, capacity: int = 16) -> None:
        self._history = np.zeros((capacity, _TAPS - 1), dtype=np.float32)
        self._rows: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._scratch: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, key: Hashable) -> int:
        row = self._rows.get(key)
        if row is None:
            if not self._free:  # grow: double the rows, history of the new ones is silence
                old = len(self._history)
                self._history = np.concatenate([self._history, np.zeros_like(self._history)])
                self._free = list(range(2 * old - 1, old - 1, -1))
            row = self._rows[key] = self._free.pop()
            self._history[row] = 0.0
        return row

    def forget(self, key: Hashable) -> None:
        row = self._rows.pop(key, None)
        if row is not None:
            self._free.append(row)

    def process(self, keys: Sequence[Hashable], frames: np.ndarray) -> np.ndarray:
        """Row i of `frames` ([N, n] float32 at 24 kHz, n a multiple of 96) continues stream `keys[i]`.

        Returns [N, n // 3] float32 at 8 kHz."""
        n_calls, n = frames.shape
        if len(keys) != n_calls:
            raise ValueError(f"{len(keys)} keys for {n_calls} frames")
        if n % (RATIO * _BLOCK):
            raise ValueError(f"frames of {n} samples: the bank takes multiples of {RATIO * _BLOCK}")
        rows = [self._row(key) for key in keys]
        blocks = n // (RATIO * _BLOCK)
        ext = self._buffer("ext", (n_calls, _TAPS - 1 + n))
        ext[:, : _TAPS - 1] = self._history[rows]
        ext[:, _TAPS - 1 :] = frames
        step, stride = ext.strides
        windows = np.ndarray(
            (n_calls, blocks, _BLOCK_IN), np.float32, ext, strides=(step, RATIO * _BLOCK * stride, stride)
        )
        packed = self._buffer("packed", (n_calls, blocks, _BLOCK_IN))
        packed[...] = windows
        out = np.empty((n_calls * blocks, _BLOCK), dtype=np.float32)
        np.matmul(packed.reshape(n_calls * blocks, _BLOCK_IN), _BAND, out=out)
        self._history[rows] = ext[:, n:]
        return out.reshape(n_calls, n // RATIO)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A scratch array reused from tick to tick: megabytes that a fresh allocation would page-fault in
        every 80 ms (measured: the product took 3x longer at p90 with fresh buffers)."""
        size = int(np.prod(shape))
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:
            buf = self._scratch[name] = np.empty(size, dtype=np.float32)
        return buf[:size].reshape(shape)

"""The telephony audio path: G.711 mu-law, the 8 <-> 24 kHz resamplers, and the per-call framers."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from scipy.signal import freqz

from engine.interface import FRAME_SAMPLES
from telephony.framing import FRAME_BYTES, PACKET_BYTES, InboundFramer, OutboundFramer
from telephony.mulaw import float_to_ulaw, pcm16_to_ulaw, ulaw_to_float, ulaw_to_pcm16
from telephony.resample import LOWPASS, Downsampler24to8, Upsampler8to24

LOW, HIGH = 8_000, 24_000
MAX_DELAY_SECONDS = 0.005

# --- independent G.711 reference, scalar Python, one sample at a time -------------------------------

_SEG_END = (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF)


def ref_linear2ulaw(sample: int) -> int:
    """G.711 mu-law of a 16-bit sample the way the reference code does it: 14 bits, segment search."""
    value = sample >> 2
    if value < 0:
        magnitude, mask = -value, 0x7F
    else:
        magnitude, mask = value, 0xFF
    magnitude = min(magnitude, 8159) + 0x21
    for segment, end in enumerate(_SEG_END):
        if magnitude <= end:
            return ((segment << 4) | ((magnitude >> (segment + 1)) & 0x0F)) ^ mask
    return 0x7F ^ mask


def ref_ulaw2linear(code: int) -> int:
    inverted = ~code & 0xFF
    exponent, mantissa = (inverted >> 4) & 0x07, inverted & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return -magnitude if inverted & 0x80 else magnitude


ALL_PCM16 = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = bytes(range(256))


def test_encode_is_bit_exact_on_every_int16() -> None:
    expected = bytes(ref_linear2ulaw(int(s)) for s in ALL_PCM16)
    got = pcm16_to_ulaw(ALL_PCM16)
    assert len(got) == 65536
    mismatches = [int(s) for s, a, b in zip(ALL_PCM16, got, expected, strict=True) if a != b]
    assert not mismatches, f"{len(mismatches)} samples differ, first {mismatches[:5]}"


def test_decode_is_bit_exact_on_every_code() -> None:
    got = ulaw_to_pcm16(ALL_CODES)
    assert got.dtype == np.int16
    assert got.tolist() == [ref_ulaw2linear(c) for c in ALL_CODES]


def test_known_code_points() -> None:
    # Anchors from G.711 itself, so a shared mistake in both implementations above cannot hide.
    assert ulaw_to_pcm16(bytes([0x00, 0x80, 0xFF, 0x7F])).tolist() == [-32124, 32124, 0, 0]
    assert pcm16_to_ulaw(np.array([0, 32767, -32768], dtype=np.int16)) == bytes([0xFF, 0x80, 0x00])


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="audioop was removed in Python 3.13")
def test_matches_cpython_audioop_where_it_exists() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    assert pcm16_to_ulaw(ALL_PCM16) == audioop.lin2ulaw(ALL_PCM16.tobytes(), 2)
    assert ulaw_to_pcm16(ALL_CODES).tobytes() == audioop.ulaw2lin(ALL_CODES, 2)


def test_code_round_trip() -> None:
    # Every code decodes to the centre of its own interval, so it re-encodes to itself; the only
    # exception is 0x7F ("negative zero"), which decodes to 0 and comes back as 0xFF.
    expected = bytearray(ALL_CODES)
    expected[0x7F] = 0xFF
    assert pcm16_to_ulaw(ulaw_to_pcm16(ALL_CODES)) == bytes(expected)
    assert float_to_ulaw(ulaw_to_float(ALL_CODES)) == bytes(expected)


def test_float_helpers_scale_clip_and_sanitize() -> None:
    decoded = ulaw_to_float(ALL_CODES)
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, ulaw_to_pcm16(ALL_CODES) / np.float32(32768))
    x = np.array([1.0, 5.0, -1.0, -5.0, np.nan, np.inf, -np.inf, 0.0], dtype=np.float32)
    assert float_to_ulaw(x) == bytes([0x80, 0x80, 0x00, 0x00, 0xFF, 0x80, 0x00, 0xFF])
    # 0.5 * 32767 = 16383.5 rounds to 16384 and must land where the int16 encoder puts it.
    assert float_to_ulaw(np.array([0.5], np.float32)) == pcm16_to_ulaw(np.array([16384], np.int16))
    # Round to nearest, not toward zero: 3.6 LSB is 4, which sits in the next code up from 3.
    assert pcm16_to_ulaw(np.array([3, 4], np.int16)) == bytes([0xFF, 0xFE])
    assert float_to_ulaw(np.array([3.6 / 32767], np.float32)) == bytes([0xFE])


def test_float_round_trip_noise_is_g711_sized() -> None:
    t = np.arange(LOW) / LOW
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    y = ulaw_to_float(float_to_ulaw(x))
    snr_db = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum((y - x).astype(np.float64) ** 2))
    assert 33 < snr_db < 45  # mu-law gives ~38 dB on a loud tone; far above means no quantizing at all


# --- resamplers ---------------------------------------------------------------------------------


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def settled(y: np.ndarray, rate: int) -> np.ndarray:
    """Drop the first 50 ms (well past the filter's length) and keep one whole second."""
    start = rate // 20
    return y[start : start + rate].astype(np.float64)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_filter_response_over_the_whole_band() -> None:
    # The tone tests below sample a few points; this checks every frequency of the shared filter.
    freqs, response = freqz(LOWPASS, worN=1 << 15, fs=HIGH)
    gain_db = 20 * np.log10(np.abs(response))
    passband, stopband = gain_db[freqs <= 3400], gain_db[freqs >= 4000]
    assert passband.max() <= 0.5 and passband.min() >= -0.5
    assert stopband.max() <= -60


@pytest.mark.parametrize("freq", [300, 1000, 3000, 3400])
def test_upsampler_passband_is_flat(freq: float) -> None:
    x = tone(freq, LOW, 1.2)
    y = Upsampler8to24().process(x)
    gain_db = 20 * np.log10(rms(settled(y, HIGH)) / rms(settled(x, LOW)))
    assert abs(gain_db) <= 0.5


@pytest.mark.parametrize("freq", [300, 1000, 3000, 3400])
def test_downsampler_passband_is_flat(freq: float) -> None:
    x = tone(freq, HIGH, 1.2)
    y = Downsampler24to8().process(x)
    gain_db = 20 * np.log10(rms(settled(y, LOW)) / rms(settled(x, HIGH)))
    assert abs(gain_db) <= 0.5


@pytest.mark.parametrize("freq", [1000, 3400])
def test_upsampler_rejects_images(freq: float) -> None:
    # A tone at f zero-stuffed to 24 kHz has images at 8k +/- f and 16k +/- f; the filter must remove them.
    y = settled(Upsampler8to24().process(tone(freq, LOW, 1.2)), HIGH)
    power = np.abs(np.fft.rfft(y * np.hanning(len(y)))) ** 2
    freqs = np.fft.rfftfreq(len(y), 1 / HIGH)
    tone_power = power[np.abs(freqs - freq) <= 5].sum()
    image_power = power[freqs >= 4000].sum()
    assert 10 * np.log10(tone_power / image_power) >= 60


@pytest.mark.parametrize("freq", [4100, 4600, 5000, 7000, 10_000])
def test_downsampler_rejects_aliases(freq: float) -> None:
    # Above 4 kHz nothing may survive: these would fold to 3.9, 3.4, 3, 1 and 2 kHz.
    x = tone(freq, HIGH, 1.2)
    y = Downsampler24to8().process(x)
    assert 20 * np.log10(rms(settled(x, HIGH)) / rms(settled(y, LOW))) >= 60


def test_output_sizes_are_exact_from_the_first_chunk() -> None:
    up, down = Upsampler8to24(), Downsampler24to8()
    for _ in range(3):
        assert up.process(np.zeros(160, np.float32)).shape == (480,)
        assert down.process(np.zeros(1920, np.float32)).shape == (640,)
        assert down.process(np.zeros(480, np.float32)).shape == (160,)
    assert up.process(np.zeros(0, np.float32)).shape == (0,)
    assert down.process(np.zeros(0, np.float32)).shape == (0,)


ODD_CHUNKS = [1, 7, 160, 2, 333, 5, 1000, 0, 41]


def chunked(process: Callable[[np.ndarray], np.ndarray], x: np.ndarray, sizes: list[int]) -> np.ndarray:
    parts, i = [], 0
    while i < len(x):
        for n in sizes:
            parts.append(process(x[i : i + n]))
            i += n
    return np.concatenate(parts)


@pytest.mark.parametrize("sizes", [pytest.param([160], id="packets"), pytest.param(ODD_CHUNKS, id="odd")])
def test_upsampler_chunked_equals_one_shot(sizes: list[int]) -> None:
    x = np.random.default_rng(1).uniform(-1, 1, LOW).astype(np.float32)
    whole = Upsampler8to24().process(x)
    pieces = chunked(Upsampler8to24().process, x, sizes)
    assert pieces.dtype == np.float32 and len(pieces) == 3 * len(x)
    np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-6)


def test_upsampler_block_product_equals_the_per_phase_filter() -> None:
    # Frames (multiples of 32 inputs) take the band-matrix path; 7-sample chunks the per-phase correlate.
    x = np.random.default_rng(4).uniform(-1, 1, 640 * 5).astype(np.float32)
    by_frame = chunked(Upsampler8to24().process, x, [640])
    by_sevens = chunked(Upsampler8to24().process, x, [7])
    np.testing.assert_allclose(by_frame, by_sevens, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "sizes",
    [pytest.param([1920], id="frames"), pytest.param([480], id="20ms"), pytest.param(ODD_CHUNKS, id="odd")],
)
def test_downsampler_chunked_equals_one_shot(sizes: list[int]) -> None:
    x = np.random.default_rng(2).uniform(-1, 1, HIGH).astype(np.float32)
    whole = Downsampler24to8().process(x)
    pieces = chunked(Downsampler24to8().process, x, sizes)
    assert pieces.dtype == np.float32 and len(pieces) == len(x) // 3
    np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-6)


def test_reset_forgets_the_past() -> None:
    x = np.random.default_rng(3).uniform(-1, 1, 480).astype(np.float32)
    up, down = Upsampler8to24(), Downsampler24to8()
    first_up, first_down = up.process(x[:160]), down.process(x)
    up.process(np.ones(77, np.float32))
    down.process(np.ones(77, np.float32))  # also knocks the decimation phase off 0
    up.reset()
    down.reset()
    np.testing.assert_array_equal(up.process(x[:160]), first_up)
    np.testing.assert_array_equal(down.process(x), first_down)


def chirp_24k(seconds: float = 0.5) -> np.ndarray:
    """A 300 -> 3400 Hz sweep at 24 kHz with tapered ends, so it is band-limited below 4 kHz."""
    t = np.arange(int(HIGH * seconds)) / HIGH
    sweep = np.sin(2 * np.pi * (300 * t + (3400 - 300) * t**2 / (2 * seconds)))
    taper = np.minimum(1, np.minimum(t, seconds - t) / 0.05)
    return (0.5 * sweep * taper).astype(np.float32)


def lag_of(y: np.ndarray, reference: np.ndarray) -> int:
    corr = np.correlate(np.concatenate([y, np.zeros(len(reference))]), reference, mode="valid")
    return int(np.argmax(corr))


def test_upsampler_delay() -> None:
    reference = chirp_24k()
    lag = lag_of(Upsampler8to24().process(reference[::3]), reference)
    assert lag / HIGH <= MAX_DELAY_SECONDS
    assert abs(lag / HIGH - Upsampler8to24.delay_seconds) <= 1 / HIGH


def test_downsampler_delay() -> None:
    reference = chirp_24k()
    lag = lag_of(Downsampler24to8().process(reference), reference[::3])
    assert lag / LOW <= MAX_DELAY_SECONDS
    assert abs(lag / LOW - Downsampler24to8.delay_seconds) <= 1 / LOW


def test_impulse_peaks_at_the_stated_delay() -> None:
    impulse = np.zeros(400, np.float32)
    impulse[100] = 1.0
    up = Upsampler8to24().process(impulse)
    assert np.argmax(np.abs(up)) == 300 + round(Upsampler8to24.delay_seconds * HIGH)
    impulse = np.zeros(1200, np.float32)
    impulse[300] = 1.0
    down = Downsampler24to8().process(impulse)
    assert np.argmax(np.abs(down)) == 100 + round(Downsampler24to8.delay_seconds * LOW)


# --- framers ------------------------------------------------------------------------------------


def ulaw_tone(freq: float, seconds: float) -> bytes:
    return float_to_ulaw(tone(freq, LOW, seconds))


def assert_same_stream(got: np.ndarray, want: np.ndarray) -> None:
    """Equal to float32 rounding: the upsampler's BLAS product may sum in another order for a 40-block call
    than for two 20-block calls (OpenBLAS 0.3.31 does), a few 1e-8; a cut in the wrong place is ~1e-1."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_four_packets_make_exactly_one_frame() -> None:
    framer = InboundFramer()
    data = ulaw_tone(1000, 0.16)
    packets = [data[i : i + PACKET_BYTES] for i in range(0, len(data), PACKET_BYTES)]
    assert len(packets) == 8
    emitted = [framer.push(p, arrived_at=float(i)) for i, p in enumerate(packets)]
    assert [len(e) for e in emitted] == [0, 0, 0, 1, 0, 0, 0, 1]
    frames = [f for e in emitted for f in e]
    assert [f.index for f in frames] == [0, 1]
    assert [f.last_arrival for f in frames] == [3.0, 7.0]
    for f in frames:
        assert f.pcm.shape == (FRAME_SAMPLES,) and f.pcm.dtype == np.float32
    # The frames are just the decoded, upsampled stream cut at FRAME_SAMPLES.
    expected = Upsampler8to24().process(ulaw_to_float(data))
    assert_same_stream(np.concatenate([f.pcm for f in frames]), expected)
    assert framer.pending_samples == 0


def test_odd_payloads_still_cut_exact_frames() -> None:
    framer = InboundFramer()
    data = ulaw_tone(440, 0.3)  # 2400 bytes = 3 frames + 480 bytes
    sizes = [100, 1, 0, 999, 37]
    frames, i, step = [], 0, 0
    while i < len(data):
        n = sizes[step % len(sizes)]
        frames += framer.push(data[i : i + n], arrived_at=float(step))
        i, step = i + n, step + 1
    assert len(frames) == 3 and framer.pending_samples == 3 * (len(data) - 3 * FRAME_BYTES)
    expected = Upsampler8to24().process(ulaw_to_float(data))[: 3 * FRAME_SAMPLES]
    assert_same_stream(np.concatenate([f.pcm for f in frames]), expected)


def test_one_big_payload_gives_several_frames_with_its_arrival_time() -> None:
    frames = InboundFramer().push(ulaw_tone(440, 0.2), arrived_at=12.5)  # 1600 bytes
    assert [(f.index, f.last_arrival) for f in frames] == [(0, 12.5), (1, 12.5)]


def test_emitted_frames_do_not_alias_the_buffer() -> None:
    framer = InboundFramer()
    (first,) = framer.push(ulaw_tone(440, 0.08), arrived_at=0.0)
    kept = first.pcm.copy()
    framer.push(ulaw_tone(1000, 0.08), arrived_at=1.0)
    np.testing.assert_array_equal(first.pcm, kept)


def test_inbound_reset() -> None:
    framer = InboundFramer()
    assert len(framer.push(ulaw_tone(440, 0.13))) == 1  # one frame out, 50 ms left pending
    framer.reset()
    assert framer.pending_samples == 0
    (frame,) = InboundFramer().push(ulaw_tone(1000, 0.08), arrived_at=0.0)
    (again,) = framer.push(ulaw_tone(1000, 0.08), arrived_at=0.0)
    assert again.index == 0
    np.testing.assert_array_equal(again.pcm, frame.pcm)


def test_outbound_frame_is_640_bytes_in_four_packets() -> None:
    frame = tone(1000, HIGH, FRAME_SAMPLES / HIGH)
    framer = OutboundFramer()
    data = framer.encode(frame)
    assert len(data) == FRAME_BYTES == 640
    assert data == float_to_ulaw(Downsampler24to8().process(frame))
    packets = OutboundFramer().encode_packets(frame)
    assert [len(p) for p in packets] == [PACKET_BYTES] * 4 and b"".join(packets) == data
    assert OutboundFramer().encode(np.zeros(FRAME_SAMPLES, np.float32)) == b"\xff" * 640


@pytest.mark.parametrize("shape", [(FRAME_SAMPLES - 1,), (FRAME_SAMPLES * 2,), (1, FRAME_SAMPLES)])
def test_outbound_rejects_wrong_frame_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        OutboundFramer().encode(np.zeros(shape, np.float32))


def test_loopback_keeps_the_tone() -> None:
    # Bot audio -> line -> back: the tone must survive at its level, late by both filters' delay.
    out, inbound = OutboundFramer(), InboundFramer()
    source = tone(1000, HIGH, 1.6)
    frames = []
    for i in range(0, len(source), FRAME_SAMPLES):
        for packet in out.encode_packets(source[i : i + FRAME_SAMPLES]):
            frames += inbound.push(packet, arrived_at=0.0)
    y = np.concatenate([f.pcm for f in frames])
    assert len(y) == len(source)
    lag = round((Upsampler8to24.delay_seconds + Downsampler24to8.delay_seconds) * HIGH)
    reference, looped = settled(source, HIGH), settled(y[lag:], HIGH)
    assert abs(20 * np.log10(rms(looped) / rms(reference))) <= 0.5
    snr_db = 10 * np.log10(np.sum(reference**2) / np.sum((looped - reference) ** 2))
    assert snr_db > 30  # mu-law's ~38 dB, less a little for the filters; misalignment would wreck it

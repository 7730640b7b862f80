"""A simulated Asterisk on the AudioSocket side: connects as `AudioSocket(<uuid>,host:port)` does, sends the
call's UUID and the caller's audio as 20 ms SLIN messages at real time, and keeps what the service sends
back with its arrival times. For tests, and for trying a node's AudioSocket port without a PBX.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .audiosocket_wire import (
    DTMF_DIGITS,
    KIND_DTMF,
    KIND_HANGUP,
    KIND_SLIN,
    KIND_UUID,
    LINE_RATE,
    PACKET_BYTES,
    PACKET_S,
    encode,
    read_message,
)
from .sim_playout import SOUND_RMS, read_wav, to_line_rate, write_wav


@dataclass
class AudioSocketReport:
    call_uuid: uuid.UUID
    bot_audio: bytearray = field(default_factory=bytearray)  # SLIN, as received
    arrivals: list[float] = field(default_factory=list)  # seconds since the UUID was sent, one per message
    first_sound_s: float | None = None  # the first bot message louder than SOUND_RMS
    caller_hung_up: bool = False  # we sent the hang-up
    hung_up_by_service: bool = False  # a hang-up message, or the connection closed, before ours
    other_kinds: list[int] = field(default_factory=list)

    @property
    def bot_pcm(self) -> np.ndarray:
        return np.frombuffer(bytes(self.bot_audio), dtype="<i2")

    def max_gap_s(self, after_s: float = 0.0) -> float:
        """The longest wait between two of the service's messages after `after_s` (pacing, or a stall)."""
        times = [t for t in self.arrivals if t >= after_s]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def caller_slin(wav: Path | np.ndarray, rate: int = LINE_RATE) -> list[bytes]:
    """A WAV file (or float audio at `rate`) as 20 ms SLIN payloads at 8 kHz; the last one padded."""
    audio, rate = read_wav(wav) if isinstance(wav, Path) else (np.asarray(wav, dtype=np.float32), rate)
    pcm = np.rint(np.clip(to_line_rate(audio, rate), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    pcm += bytes(-len(pcm) % PACKET_BYTES)
    return [pcm[i : i + PACKET_BYTES] for i in range(0, len(pcm), PACKET_BYTES)]


async def audiosocket_call(
    host: str, port: int, caller: list[bytes], *, hold_s: float = 3.0, call_uuid: uuid.UUID | None = None,
    dtmf: str = "", hang_up: bool = True,
) -> AudioSocketReport:  # fmt: skip
    """One call: `caller`'s packets at real time, then silence for `hold_s` (the caller listening), then a
    hang-up (unless the service hung up first). `dtmf` digits are sent after the audio, one a packet."""
    report = AudioSocketReport(call_uuid or uuid.uuid4())
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode(KIND_UUID, report.call_uuid.bytes))
    t0 = time.monotonic()
    receiving = asyncio.create_task(_receive(reader, report, t0))
    silence = bytes(PACKET_BYTES)
    packets = [*caller, *[silence] * round(hold_s / PACKET_S)]
    try:
        for i, packet in enumerate(packets):
            if receiving.done():
                break  # the service hung up
            writer.write(encode(KIND_SLIN, packet))
            if i == max(len(caller) - 1, 0):  # after the caller's last packet (with no hold, there is no next)
                for digit in dtmf:
                    writer.write(encode(KIND_DTMF, digit.encode("ascii")))
            await writer.drain()
            await asyncio.sleep(max(0.0, t0 + (i + 1) * PACKET_S - time.monotonic()))
        if hang_up and not receiving.done():
            report.caller_hung_up = True
            writer.write(encode(KIND_HANGUP))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(receiving), 3.0)
    except ConnectionError:
        pass  # the service closed the connection: the report says so
    finally:
        receiving.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await receiving
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return report


async def _receive(reader: asyncio.StreamReader, report: AudioSocketReport, t0: float) -> None:
    try:
        while (message := await read_message(reader)) is not None:
            now = time.monotonic() - t0
            if message.kind == KIND_HANGUP:
                break
            if message.kind != KIND_SLIN:
                report.other_kinds.append(message.kind)
                continue
            report.arrivals.append(now)
            report.bot_audio += message.payload
            if report.first_sound_s is None:
                x = np.frombuffer(message.payload, dtype="<i2").astype(np.float64) / 32768.0
                if len(x) and float(np.sqrt(np.mean(x * x))) > SOUND_RMS:
                    report.first_sound_s = now
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    report.hung_up_by_service = not report.caller_hung_up


def add_audiosocket_call_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, metavar="HOST:PORT", help="a `serve --audiosocket` listener")
    parser.add_argument("--wav", required=True, type=Path, help="what the caller says: 16-bit WAV, any rate")
    parser.add_argument("--out", type=Path, help="write the bot's audio as received (8 kHz WAV)")
    parser.add_argument("--hold-after", type=float, default=3.0, help="seconds to listen after the WAV ends")
    parser.add_argument("--dtmf", default="", help="digits to press once the WAV has played, e.g. 12#")


async def run_audiosocket_call_from_args(args: argparse.Namespace) -> int:
    """Run `kame-phone audiosocket-call`; exit code 0: the bot answered, 1: error, 3: hung up unanswered
    (busy, refused, or outside --audiosocket-allow)."""
    host, sep, port = args.to.rpartition(":")
    if not sep or not port.isdigit():
        print(f"--to is HOST:PORT, got {args.to!r}")
        return 1
    if bad := [d for d in args.dtmf if len(d.encode()) != 1 or d.encode()[0] not in DTMF_DIGITS]:
        print(f"--dtmf takes 0-9, *, #, A-D, got {''.join(bad)!r}")
        return 1
    try:
        caller = caller_slin(args.wav)
        report = await audiosocket_call(host.strip("[]"), int(port), caller, hold_s=args.hold_after, dtmf=args.dtmf)
    except (OSError, ValueError, EOFError, wave.Error) as exc:
        print(f"audiosocket call failed: {exc}")
        return 1
    first = "none" if report.first_sound_s is None else f"{report.first_sound_s:.2f} s after the UUID"
    print(f"call {report.call_uuid}: bot audio {len(report.bot_audio) / (2 * LINE_RATE):.1f} s, first sound {first}, "
          f"hung up by {'the service' if report.hung_up_by_service else 'the caller'}")  # fmt: skip
    if args.out is not None:
        write_wav(args.out, report.bot_pcm)
    return 0 if report.bot_audio else 3

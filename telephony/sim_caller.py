"""A simulated Twilio caller: dial the service from a terminal or a test, no phone line needed.

It does what Twilio does on an inbound call: POST the signed voice webhook, read the TwiML, open the
`<Connect><Stream>` WebSocket with a signed upgrade, send `connected`, `start`, then a 20 ms `media`
packet at real-time pace (plus optional `dtmf`), then `stop`. Meanwhile it plays the server's audio
the way Twilio does (`telephony.sim_playout.Playout`), echoes marks once their audio has played,
honours `clear`, and writes the bot's side as heard to a WAV. The result is a `CallReport` with the
latencies users feel: first bot audio after `start`, and first bot audio after the caller's last word.

    kame-phone call --url ws://127.0.0.1:8080/twilio/media --wav hello.wav --out reply.wav

The auth token is a secret: it only signs requests and never appears in logs, errors or reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import wave
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from twilio.request_validator import RequestValidator

from telephony import sim_playout as sp
from telephony import twilio_messages as tm
from telephony.signatures import SIGNATURE_HEADER, public_url_for, websocket_signature_url
from telephony.sim_playout import CallReport, caller_packets, format_summary, new_sid, parse_dtmf
from telephony.twiml import ConnectStream, parse_connect_stream

__all__ = [
    "CallReport",
    "add_call_arguments",
    "caller_packets",
    "default_voice_url",
    "format_summary",
    "parse_dtmf",
    "run_call_from_args",
    "simulate_call",
]

EXIT_CODES: dict[str, int] = {"completed": 0, "error": 1, "rejected": 2, "busy": 3}
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=15)


def _http_base(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"--url must be ws://host:port/path or wss://…, got {ws_url!r}")
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}"


def default_voice_url(ws_url: str) -> str:
    """ws://h:p/prefix/twilio/media -> http://h:p/prefix/twilio/voice (other paths: /twilio/voice)."""
    path = urlsplit(ws_url).path
    prefix = path[: -len("/twilio/media")] if path.endswith("/twilio/media") else ""
    return f"{_http_base(ws_url)}{prefix}/twilio/voice"


def _path_qs(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


# ---------------------------------------------------------------------------------------------------------
# The voice webhook and its TwiML


async def _answer(
    session: aiohttp.ClientSession,
    report: CallReport,
    voice_url: str,
    public_base: str,
    token: str | None,
    numbers: tuple[str, str],
    direction: str = "inbound",
) -> ConnectStream | None:
    """POST the voice webhook like Twilio; the stream to open, or None with the outcome set."""
    params = {
        "AccountSid": report.account_sid,
        "ApiVersion": "2010-04-01",
        "CallSid": report.call_sid,
        "CallStatus": "ringing",
        "Direction": direction,
        "From": numbers[0],
        "To": numbers[1],
    }
    headers: dict[str, str] = {}
    if token:
        # Twilio signs the public URL it called, not the socket address we reach the server on.
        signed_url = public_url_for(_path_qs(voice_url), public_base)
        headers[SIGNATURE_HEADER] = RequestValidator(token).compute_signature(signed_url, params)
    async with session.post(voice_url, data=params, headers=headers, timeout=_HTTP_TIMEOUT) as resp:
        report.http_status = resp.status
        body = await resp.text()
    if resp.status != 200:
        report.outcome = "rejected" if 400 <= resp.status < 500 else "error"
        report.errors.append(f"voice webhook answered HTTP {resp.status}")
        return None
    return _read_twiml(report, body)


def _read_twiml(report: CallReport, body: str) -> ConnectStream | None:
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        report.errors.append(f"voice webhook did not answer TwiML: {exc}")
        return None
    if root.find("./Connect/Stream") is not None:
        try:
            return parse_connect_stream(body)
        except ValueError as exc:
            report.errors.append(f"bad <Connect><Stream>: {exc}")
            return None
    reject = root.find("Reject")
    say = root.find("Say")
    report.twiml_say = say.text if say is not None else None
    if reject is not None:
        report.outcome = "busy" if reject.get("reason") == "busy" else "rejected"
    elif root.find("Hangup") is not None:
        report.outcome = "busy"  # what the server answers at capacity: <Say>…</Say><Hangup/>
    elif root.find("Dial") is not None or root.find("Enqueue") is not None:
        report.outcome = "busy"  # an agent's busy policy at capacity: handed to a person, or queued
    else:
        report.errors.append("TwiML has neither <Connect><Stream>, <Reject>, <Hangup>, <Dial> nor <Enqueue>")
    return None


def _stream_signature_url(report: CallReport, stream_url: str, public_base: str) -> str:
    """The URL Twilio would sign for the upgrade: the TwiML <Stream url> it connects to."""
    parts = urlsplit(stream_url)
    if not parts.netloc:  # relative: Twilio resolves it against the public URL
        return websocket_signature_url(public_base, parts.path or "/")
    if parts.scheme != "wss" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        report.warn(f"TwiML stream url scheme is {parts.scheme!r}; Twilio only connects to wss://")
    return stream_url


def _socket_url(report: CallReport, stream_url: str, ws_url: str) -> str:
    """Where the simulated Twilio connects: the TwiML's stream path on --url's host. --url names the node's
    stream base (…/twilio/media); the TwiML's URL is the public one (a proxy's host and path prefix before
    it) and may end in the call's own part (…/twilio/media/<CallSid>), which is kept."""
    path, base = urlsplit(stream_url).path, urlsplit(ws_url).path.rstrip("/")
    if base and path.endswith(base):
        return ws_url
    if base and (at := path.rfind(base + "/")) >= 0:
        return ws_url.rstrip("/") + path[at + len(base) :]
    report.warn(f"TwiML stream path {path!r} is not under --url's {base!r}; connecting to --url anyway")
    return ws_url


# ---------------------------------------------------------------------------------------------------------
# The stream


async def _sleep_until(deadline: float) -> None:
    # Scheduling against the monotonic clock keeps the pace at 50 packets/s however late one tick wakes.
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


@dataclass(eq=False)  # stateful; compare by identity
class _StreamedCall:
    """One open Media Streams socket, from the Twilio side."""

    ws: aiohttp.ClientWebSocketResponse
    report: CallReport
    stream_sid: str
    t0: float = 0.0  # time.monotonic() when `start` was sent
    seq: int = 0  # last sequenceNumber used
    playout: sp.Playout = field(default_factory=sp.Playout)
    _closing: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, build: Callable[..., str], *args: object) -> bool:
        """Send `build(streamSid, seq, *args)` with the next sequence number; False once the socket is gone."""
        # One lock: sender and receiver tasks both send, and sequence numbers must reach the wire in order.
        async with self._lock:
            if self.ws.closed:
                return False
            self.seq += 1
            try:
                await self.ws.send_str(build(self.stream_sid, self.seq, *args))
            except (ConnectionError, aiohttp.ClientError):
                return False
            return True

    async def echo_marks(self, names: list[str]) -> None:
        for name in names:
            if await self.send(tm.mark_msg, name):
                self.report.marks_echoed.append(name)

    async def run(self, script: sp.CallerScript, dtmf: Sequence[tuple[str, float]]) -> float:
        """Stream the call; returns its length in seconds (from `start` to `stop`)."""
        r = self.report
        await self.ws.send_str(tm.connected_msg())
        self.t0 = time.monotonic()
        start = partial(tm.start_msg, call_sid=r.call_sid, account_sid=r.account_sid)
        await self.send(lambda sid, seq: start(sid, custom_parameters=r.custom_parameters, seq=seq))
        receiver = asyncio.create_task(self._receive(), name="sim-caller-receive")
        try:
            await self._send_audio(script, dtmf)
            end = self.now()
            await self.echo_marks(self.playout.due_marks(end))
            await self.send(tm.stop_msg, r.call_sid, r.account_sid)
            self._closing = True
            await self.ws.close()
            await receiver
        finally:
            receiver.cancel()
        return end

    async def _send_audio(self, script: sp.CallerScript, dtmf: Sequence[tuple[str, float]]) -> None:
        digits = deque(sorted(dtmf, key=lambda d: d[1]))
        k = 0
        while True:
            await _sleep_until(self.t0 + k * sp.PACKET_SECONDS)
            if self.ws.closed:
                break
            await self.echo_marks(self.playout.due_marks(self.now()))
            step = script.next_packet(k * sp.PACKET_SECONDS, self.playout)
            if step is None:
                break
            payload, voiced = step
            while digits and digits[0][1] <= k * sp.PACKET_SECONDS:
                if await self.send(tm.dtmf_msg, digits.popleft()[0]):
                    self.report.dtmf_sent += 1
            # chunk counts media from 1; timestamp is the packet's place in the stream, in ms
            if not await self.send(tm.media_msg, k + 1, k * 20, payload):
                break
            k += 1
            self.report.media_sent += 1
            if voiced:
                self.report.last_word_at_s = self.now()
        if digits:
            self.report.warn(f"{len(digits)} DTMF event(s) fell after the end of the call")
        if not self.ws.closed:  # the last packet's 20 ms still has to pass before the caller hangs up
            await _sleep_until(self.t0 + k * sp.PACKET_SECONDS)

    async def _receive(self) -> None:
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await self._on_text(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                self._invalid(f"binary frame of {len(msg.data)} bytes (Twilio: 31950 Malformed Message)")
            elif msg.type == aiohttp.WSMsgType.ERROR:
                self.report.errors.append(f"WebSocket error: {self.ws.exception()!r}")
                break
        if not self._closing:
            self.report.server_hung_up = True

    def _invalid(self, why: str) -> None:
        self.report.invalid_messages += 1
        self.report.warn(f"invalid server message: {why}")

    async def _on_text(self, data: str) -> None:
        try:
            msg = sp.parse_server_message(data)
        except sp.ServerMessageError as exc:
            self._invalid(str(exc))
            return
        if msg.stream_sid != self.stream_sid:
            self._invalid(f"{msg.event} for another streamSid")
            return
        now, r = self.now(), self.report
        match msg:
            case sp.ServerMedia():
                self._on_media(msg.media.payload, now)
            case sp.ServerMark():
                r.marks_received += 1
                self.playout.enqueue_mark(msg.mark.name, now)
            case sp.ServerClear():
                r.clears_received += 1
                played, dropped = self.playout.clear(now)
                r.marks_cleared.extend(dropped)
                await self.echo_marks(played + dropped)  # Twilio returns them right away
        await self.echo_marks(self.playout.due_marks(now))

    def _on_media(self, payload: bytes, now: float) -> None:
        r = self.report
        r.media_received += 1
        if r.first_media_latency_s is None:
            r.first_media_latency_s = now
        if r.first_audio_latency_s is None and sp.has_sound(payload):
            r.first_audio_latency_s = now
        if payload[:4] == b"RIFF":
            r.warn("bot media starts with a WAV header; Twilio would play it as noise")
        self.playout.enqueue_media(payload, now)

    def finish(self, end: float) -> np.ndarray:
        """Fill in the report's totals and latencies; returns the bot audio as heard (int16 at 8 kHz)."""
        r, n = self.report, round(end * sp.RATE)
        heard = self.playout.render(n)
        r.call_seconds = end
        r.seconds_sent = r.media_sent * sp.PACKET_SECONDS
        r.bot_seconds_received = self.playout.received_samples / sp.RATE
        r.bot_seconds_played = self.playout.played_samples(n) / sp.RATE
        r.marks_unplayed = self.playout.pending_marks
        if r.last_word_at_s is not None:
            i = sp.first_sound_at(heard, round(r.last_word_at_s * sp.RATE))
            # max(0, ...): the search starts at the sample the time rounds to, up to 62 us before it
            r.last_word_latency_s = None if i is None else max(0.0, i / sp.RATE - r.last_word_at_s)
        return heard


# ---------------------------------------------------------------------------------------------------------
# Public API


async def simulate_call(
    ws_url: str,
    wav: Path | str | np.ndarray | sp.CallerScript,
    *,
    auth_token: str | None,
    public_url: str | None,
    out_wav: Path | None = None,
    dtmf: str | Sequence[tuple[str, float]] = (),
    hold_after: float = 2.0,
    custom_sid: str | None = None,
    session: aiohttp.ClientSession | None = None,
    sample_rate: int = sp.RATE,
    voice_url: str | None = None,
    from_number: str = "+15005550006",
    to_number: str = "+15005550001",
    direction: str = "inbound",  # outbound-api: a call placed through the REST API (`kame-phone dial`)
) -> CallReport:
    """Place one simulated call to the server whose Media Streams socket is `ws_url`; never raises for
    anything the server does (refusals, errors and bad messages end up in the report).

    `wav` is a 16-bit WAV path or float audio at `sample_rate` (said, then `hold_after` s of silence), or
    a `CallerScript` that decides each packet as the call goes (it may listen to the bot first).
    `public_url` is the base URL Twilio would use (PUBLIC_URL behind a proxy); it defaults to the http(s)
    base of `ws_url`. `custom_sid` sets the CallSid. `dtmf` is '1@2.0,#@3.5' or [(digit, seconds after start)].
    """
    script = wav if isinstance(wav, sp.CallerScript) else sp.WavThenHold(caller_packets(wav, sample_rate), hold_after)
    events = parse_dtmf(dtmf) if isinstance(dtmf, str) else list(dtmf)
    report = CallReport(call_sid=custom_sid or new_sid("CA"), account_sid=new_sid("AC"))
    own_session = session is None
    if session is None:
        session = aiohttp.ClientSession()
    try:
        base = public_url or _http_base(ws_url)
        stream = await _answer(
            session, report, voice_url or default_voice_url(ws_url), base, auth_token, (from_number, to_number),
            direction,
        )
        if stream is not None:
            await _stream(session, report, ws_url, stream, base, auth_token, script, events, out_wav)
            if report.server_hung_up and stream.action:  # as Twilio does: the caller is still on the line
                await _follow_action(session, report, stream.action, ws_url, base, auth_token)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        report.outcome = "error"
        report.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        if own_session:
            await session.close()
    return report


async def _follow_action(
    session: aiohttp.ClientSession, report: CallReport, action: str, ws_url: str, public_base: str, token: str | None
) -> None:
    """POST the <Connect action> URL like Twilio when a stream ends with the caller still there."""
    params = {"AccountSid": report.account_sid, "CallSid": report.call_sid, "CallStatus": "in-progress"}
    # The action URL is public; we reach the server where the stream socket is.
    url = _http_base(ws_url) + _path_qs(action)
    headers: dict[str, str] = {}
    if token:
        headers[SIGNATURE_HEADER] = RequestValidator(token).compute_signature(
            public_url_for(_path_qs(action), public_base), params
        )
    async with session.post(url, data=params, headers=headers, timeout=_HTTP_TIMEOUT) as resp:
        report.fallback_twiml = await resp.text() if resp.status == 200 else None
        if resp.status != 200:
            report.errors.append(f"<Connect action> answered HTTP {resp.status}")


async def _stream(
    session: aiohttp.ClientSession,
    report: CallReport,
    ws_url: str,
    stream: ConnectStream,
    public_base: str,
    token: str | None,
    script: sp.CallerScript,
    dtmf: Sequence[tuple[str, float]],
    out_wav: Path | None,
) -> None:
    report.custom_parameters = dict(stream.parameters)
    headers: dict[str, str] = {}
    signed_url = _stream_signature_url(report, stream.url, public_base)
    if token:
        # Twilio signs the upgrade over the wss URL with no params (see notes §1.5).
        headers[SIGNATURE_HEADER] = RequestValidator(token).compute_signature(signed_url, {})
    try:
        # Outbound media "can be of any size": allow far more than aiohttp's 4 MB default message.
        ws = await session.ws_connect(_socket_url(report, stream.url, ws_url), headers=headers,
                                      max_msg_size=64 * 1024 * 1024)  # fmt: skip
    except aiohttp.WSServerHandshakeError as exc:
        report.ws_status = exc.status
        report.outcome = "rejected" if 400 <= exc.status < 500 else "error"
        report.errors.append(f"WebSocket upgrade refused: HTTP {exc.status}")
        return
    report.stream_sid = new_sid("MZ")
    call = _StreamedCall(ws, report, report.stream_sid)
    async with ws:
        end = await call.run(script, dtmf)
    heard = call.finish(end)
    report.outcome = "error" if report.errors else "completed"  # errors here: the socket failed mid-call
    if out_wav is not None:
        sp.write_wav(out_wav, heard)


# ---------------------------------------------------------------------------------------------------------
# CLI (wired as `kame-phone call` by engine/cli.py)


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's socket, e.g. ws://127.0.0.1:8080/twilio/media")
    parser.add_argument("--wav", required=True, type=Path, help="what the caller says: 16-bit WAV, any rate")
    parser.add_argument("--out", type=Path, help="write the bot's audio as heard here (8 kHz WAV)")
    parser.add_argument(
        "--auth-token", help="Twilio auth token to sign with (default: $TWILIO_AUTH_TOKEN; none: unsigned)"
    )
    parser.add_argument("--public-url", help="the base URL Twilio would call (default: http(s) base of --url)")
    parser.add_argument("--voice-url", help="the voice webhook to POST (default: derived from --url)")
    parser.add_argument("--json", type=Path, dest="json_path", help="write the CallReport here as JSON")
    parser.add_argument("--dtmf", type=parse_dtmf, default=[], help="digits to press, e.g. 1@2.0,#@3.5")
    parser.add_argument("--hold-after", type=float, default=3.0, help="seconds to listen after the WAV ends")
    parser.add_argument("--from", dest="from_number", default="+15005550006", help="caller number")
    parser.add_argument("--to", dest="to_number", default="+15005550001", help="called number")


async def run_call_from_args(args: argparse.Namespace) -> int:
    """Run `kame-phone call`; exit code 0 completed, 1 error, 2 rejected, 3 busy."""
    try:
        audio, rate = sp.read_wav(args.wav)
    except (OSError, ValueError, EOFError, wave.Error) as exc:
        print(f"cannot read {args.wav}: {exc}")
        return EXIT_CODES["error"]
    for flag, path in (("--out", args.out), ("--json", args.json_path)):
        # Before the call: a path it could not write was a traceback once the call had run.
        if path is not None and (path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK)):
            print(f"{flag} {path}: cannot write there (a directory, or its folder is missing or not writable)")
            return EXIT_CODES["error"]
    report = await simulate_call(
        args.url,
        audio,
        sample_rate=rate,
        auth_token=args.auth_token or os.environ.get("TWILIO_AUTH_TOKEN") or None,
        public_url=args.public_url,
        out_wav=args.out,
        dtmf=args.dtmf,
        hold_after=args.hold_after,
        voice_url=args.voice_url,
        from_number=args.from_number,
        to_number=args.to_number,
    )
    print(format_summary(report))
    if args.json_path is not None:
        args.json_path.write_text(report.to_json() + "\n")
    return EXIT_CODES[report.outcome]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telephony.sim_caller", description="Dial like Twilio.")
    add_call_arguments(parser)
    return asyncio.run(run_call_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())

"""The simulated Twilio caller against a fake KAME Phone server (the server role, written here).

The fake validates signatures with the real twilio RequestValidator, answers TwiML built by
`telephony.twiml`, parses every caller message with `parse_twilio_message`, echoes the caller's audio
back in 80 ms chunks after a delay with a mark after each chunk, and can send a burst plus `clear`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import WSMsgType, web
from scipy.signal import correlate
from twilio.request_validator import RequestValidator

from telephony import sim_playout as sp
from telephony import twilio_messages as tm
from telephony.mulaw import float_to_ulaw, ulaw_to_float
from telephony.signatures import SIGNATURE_HEADER, public_url_for, validate_websocket, websocket_signature_url
from telephony.sim_caller import (
    CallReport,
    add_call_arguments,
    caller_packets,
    default_voice_url,
    parse_dtmf,
    run_call_from_args,
    simulate_call,
)
from telephony.twiml import at_capacity_twiml, busy_twiml, connect_stream_twiml

TOKEN = "0123456789abcdef0123456789abcdef"
PARAMS = {"tenant": "acme", "session": "9f3c-test"}
ECHO_DELAY = 0.15  # the fake server's think time before echoing a chunk
CHUNK_BYTES = 640  # 80 ms echo chunks
BURST_SECONDS = 1.0
CLEAR_AFTER_BURST = 0.1
SID_RE = re.compile(r"^{}[0-9a-f]{{32}}$")


@dataclass(eq=False)
class FakeServer:
    """The server role: KAME Phone's /twilio/voice and /twilio/media, with everything recorded."""

    token: str = TOKEN
    public_base: str | None = None  # the PUBLIC_URL it believes in; None: its own http://127.0.0.1:port
    busy: bool = False
    busy_answer: str | None = None  # the TwiML of an agent's busy policy, instead of busy_twiml's
    refuse_ws: bool = False
    clear_after_packets: int | None = None  # send a 1 s burst + mark "burst", then `clear`
    garbage: bool = False  # send invalid messages right after `start`
    hang_up_after_packets: int | None = None
    port: int = 0
    voice_forms: list[dict[str, str]] = field(default_factory=list)
    received: list[tuple[float, Any]] = field(default_factory=list)  # (monotonic, parsed message)
    marks_sent: dict[str, float] = field(default_factory=dict)
    marks_back: list[tuple[str, float]] = field(default_factory=list)

    @property
    def base(self) -> str:
        return self.public_base or f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:  # the real socket address the caller connects to
        return f"ws://127.0.0.1:{self.port}/twilio/media"

    async def voice(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        url = public_url_for(request.raw_path, self.base)
        if not RequestValidator(self.token).validate(url, form, request.headers.get(SIGNATURE_HEADER)):
            return web.Response(status=403)
        self.voice_forms.append(form)
        if self.busy_answer is not None:
            twiml = self.busy_answer
        elif self.busy:
            twiml = busy_twiml("All our lines are busy.")
        else:
            stream = websocket_signature_url(self.base, "/twilio/media")
            twiml = connect_stream_twiml(stream, f"{self.base}/twilio/stream-status", PARAMS)
        return web.Response(text=twiml, content_type="text/xml")

    async def media(self, request: web.Request) -> web.StreamResponse:
        signed = websocket_signature_url(self.base, request.path)
        if self.refuse_ws or not validate_websocket(self.token, signed, request.headers.get(SIGNATURE_HEADER)):
            return web.Response(status=403)  # before prepare(), as the real server must
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        out: asyncio.Queue[tuple[float, str, bytes | str]] = asyncio.Queue()
        sender = asyncio.create_task(self._send_loop(ws, out))
        try:
            await self._receive_loop(ws, out)
        finally:
            sender.cancel()
        return ws

    async def _receive_loop(self, ws: web.WebSocketResponse, out: asyncio.Queue) -> None:
        buffered, packets = b"", 0
        async for raw in ws:
            assert raw.type == WSMsgType.TEXT
            now = time.monotonic()
            msg = tm.parse_twilio_message(raw.data)  # raises on anything Twilio would not send
            self.received.append((now, msg))
            if isinstance(msg, tm.StartMessage):
                sid = msg.stream_sid
                out.put_nowait((0.0, "sid", sid))
                if self.garbage:
                    await self._send_garbage(ws, sid)
            elif isinstance(msg, tm.MediaMessage):
                packets += 1
                buffered += msg.media.payload
                if len(buffered) >= CHUNK_BYTES:
                    out.put_nowait((now + ECHO_DELAY, "chunk", buffered))
                    buffered = b""
                if packets == self.clear_after_packets:
                    out.put_nowait((now + ECHO_DELAY, "burst", b"\xff" * int(BURST_SECONDS * sp.RATE)))
                    out.put_nowait((now + ECHO_DELAY + CLEAR_AFTER_BURST, "clear", b""))
                if packets == self.hang_up_after_packets:
                    await ws.close()
            elif isinstance(msg, tm.MarkMessage):
                self.marks_back.append((msg.mark.name, now))
            elif isinstance(msg, tm.StopMessage):
                break

    async def _send_loop(self, ws: web.WebSocketResponse, out: asyncio.Queue) -> None:
        sid, n = "", 0
        while True:
            due, kind, data = await out.get()
            if kind == "sid":
                sid = str(data)
                continue
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if kind == "clear":
                await ws.send_str(tm.clear_message(sid))
                continue
            assert isinstance(data, bytes)
            name = "burst" if kind == "burst" else f"m{n}"
            n += 1
            await ws.send_str(tm.media_message(sid, data))
            await ws.send_str(tm.mark_message(sid, name))
            self.marks_sent[name] = time.monotonic()

    @staticmethod
    async def _send_garbage(ws: web.WebSocketResponse, sid: str) -> None:
        await ws.send_str("not json")
        await ws.send_bytes(b"\x00\x01")
        await ws.send_str(json.dumps({"event": "speak", "streamSid": sid}))
        await ws.send_str(tm.media_message("MZ" + "0" * 32, b"\xff" * 160))  # someone else's stream

    def caller_messages(self, kind: type) -> list[tuple[float, Any]]:
        return [(t, m) for t, m in self.received if isinstance(m, kind)]


ServerFactory = Callable[..., Awaitable[FakeServer]]


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    runners: list[web.AppRunner] = []

    async def start(**options: Any) -> FakeServer:
        server = FakeServer(**options)
        app = web.Application()
        app.router.add_post("/twilio/voice", server.voice)
        app.router.add_get("/twilio/media", server.media)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.port = runner.addresses[0][1]
        return server

    yield start
    for runner in runners:
        await runner.cleanup()


def speech_like(seconds_before: float = 0.3, seconds_noise: float = 1.0, seconds_after: float = 0.3) -> np.ndarray:
    """Silence, white noise (a sharp correlation peak), silence; float at 8 kHz."""
    noise = np.random.default_rng(7).uniform(-0.3, 0.3, int(seconds_noise * sp.RATE))
    before, after = np.zeros(int(seconds_before * sp.RATE)), np.zeros(int(seconds_after * sp.RATE))
    return np.concatenate([before, noise, after])


def echo_lag(heard: np.ndarray, sent: np.ndarray, j: int, earliest: float) -> float | None:
    """Where the echo of the j-th 80 ms chunk of `sent` plays in `heard`, as a delay in s; None if absent."""
    n = CHUNK_BYTES
    chunk = sent[j * n : (j + 1) * n]
    lo = j * n + round((earliest - 0.01) * sp.RATE)
    window = heard[lo : lo + round(0.5 * sp.RATE) + n]
    if len(window) < n:
        return None
    k = int(np.argmax(correlate(window, chunk, mode="valid")))
    return (lo + k - j * n) / sp.RATE if np.array_equal(window[k : k + n], chunk) else None


# ---------------------------------------------------------------------------------------------------------
# A full call


async def test_call_speaks_twilio_and_plays_like_twilio(make_server: ServerFactory, tmp_path: Path) -> None:
    server = await make_server(clear_after_packets=40)
    audio = speech_like()
    hold = 0.6
    out = tmp_path / "reply.wav"
    report = await simulate_call(
        server.ws_url, audio, auth_token=TOKEN, public_url=None, out_wav=out, dtmf="5@0.5", hold_after=hold
    )
    assert report.outcome == "completed", report.errors
    assert not report.errors and report.invalid_messages == 0 and not report.server_hung_up

    # Webhook: Twilio's form fields, signed (the fake answered, so the signature validated).
    (form,) = server.voice_forms
    assert re.match(SID_RE.pattern.format("CA"), form["CallSid"]) and form["CallSid"] == report.call_sid
    assert re.match(SID_RE.pattern.format("AC"), form["AccountSid"])
    assert (form["CallStatus"], form["Direction"]) == ("ringing", "inbound")

    # The stream: connected, start (with the TwiML parameters), media..., stop; sequence numbers 1, 2, ...
    kinds = [type(m) for _, m in server.received]
    assert kinds[0] is tm.ConnectedMessage and kinds[1] is tm.StartMessage and kinds[-1] is tm.StopMessage
    start = server.received[1][1]
    assert start.start.custom_parameters == PARAMS == report.custom_parameters
    assert start.start.tracks == ("inbound",)
    assert (start.stream_sid, start.start.call_sid) == (report.stream_sid, report.call_sid)
    assert re.match(SID_RE.pattern.format("MZ"), start.stream_sid)
    seqs = [m.sequence_number for _, m in server.received[1:]]
    assert seqs == list(range(1, len(seqs) + 1))
    assert all(m.stream_sid == report.stream_sid for _, m in server.received[1:])

    # Media: one packet per 20 ms of audio + hold, chunks 1..n, timestamps 20 ms apart, real-time pace.
    media = server.caller_messages(tm.MediaMessage)
    n_expected = len(audio) // sp.PACKET_BYTES + round(hold / sp.PACKET_SECONDS)
    assert len(media) == n_expected == report.media_sent
    assert [m.media.chunk for _, m in media] == list(range(1, n_expected + 1))
    assert [m.media.timestamp for _, m in media] == [20 * i for i in range(n_expected)]
    assert all(len(m.media.payload) == 160 and m.media.track == "inbound" for _, m in media)
    t_first = media[0][0]
    assert all(t - t_first >= i * sp.PACKET_SECONDS - 0.01 for i, (t, _) in enumerate(media))  # never early
    assert media[-1][0] - t_first < (n_expected - 1) * sp.PACKET_SECONDS + 0.5  # and not far behind
    ((_, dtmf),) = server.caller_messages(tm.DtmfMessage)
    assert dtmf.dtmf.digit == "5" and report.dtmf_sent == 1

    # Marks: each echoed only once its 80 ms chunk could have played; the burst's came back on clear.
    back = dict(server.marks_back)
    assert len(back) == len(server.marks_back), "a mark came back twice"
    assert "burst" in report.marks_cleared and report.clears_received == 1
    assert back["burst"] - server.marks_sent["burst"] < BURST_SECONDS / 2
    for name, t_back in back.items():
        if name not in report.marks_cleared:
            assert t_back - server.marks_sent[name] >= CHUNK_BYTES / sp.RATE - 0.005, name
    missing = set(server.marks_sent) - set(back)
    assert len(missing) <= 3 and report.marks_unplayed <= len(missing)  # the last ones, still queued at stop
    assert report.marks_echoed == [name for name, _ in server.marks_back]

    # Latencies: first media is the echo of the first (silent) chunk; first audio that of the noise onset.
    assert report.first_media_latency_s is not None and report.first_audio_latency_s is not None
    assert 0 < report.first_media_latency_s < report.first_audio_latency_s
    assert ECHO_DELAY + 0.3 <= report.first_audio_latency_s < ECHO_DELAY + 0.3 + 0.25
    assert report.last_word_at_s is not None and 1.2 < report.last_word_at_s < 1.5
    assert report.last_word_latency_s is not None and 0 <= report.last_word_latency_s < 0.1  # echo still on

    # The reply WAV: the call's length, the echo in place (~ECHO_DELAY + 60 ms later), exact mu-law copies.
    heard, rate = sp.read_wav(out)
    assert rate == sp.RATE and abs(len(heard) / rate - report.call_seconds) < 0.01
    sent = ulaw_to_float(b"".join(caller_packets(audio)))
    # Echo chunk j (caller packets 4j..4j+3) is complete when packet 4j+3 is sent, at (4j+3) * 20 ms, so it
    # can be heard no earlier than ECHO_DELAY + 60 ms after its place in the input: look for exact copies.
    earliest = ECHO_DELAY + 3 * sp.PACKET_SECONDS
    lags = [echo_lag(heard, sent, j, earliest) for j in range(4, 16)]  # the chunks inside the noise
    found = [lag for lag in lags if lag is not None]
    assert len(found) >= 8, lags  # the clear dropped a chunk or two
    assert all(earliest - 0.002 <= lag < earliest + 0.3 for lag in found), lags
    assert 0 < report.bot_seconds_played < report.bot_seconds_received  # the burst was cut short
    assert report.bot_seconds_received >= BURST_SECONDS


async def test_wrong_token_is_rejected(make_server: ServerFactory) -> None:
    server = await make_server()
    report = await simulate_call(server.ws_url, speech_like(), auth_token="wrong", public_url=None)
    assert (report.outcome, report.http_status) == ("rejected", 403)
    assert not server.received
    assert "wrong" not in report.to_json()  # the token never lands in a report


async def test_refused_upgrade_is_rejected(make_server: ServerFactory) -> None:
    server = await make_server(refuse_ws=True)
    report = await simulate_call(server.ws_url, speech_like(), auth_token=TOKEN, public_url=None)
    assert (report.outcome, report.http_status, report.ws_status) == ("rejected", 200, 403)


async def test_busy_answer(make_server: ServerFactory) -> None:
    server = await make_server(busy=True)
    report = await simulate_call(server.ws_url, speech_like(), auth_token=TOKEN, public_url=None)
    assert report.outcome == "busy" and report.twiml_say == "All our lines are busy."
    assert report.stream_sid is None and not server.received


@pytest.mark.parametrize("policy", ["dial", "enqueue:overflow"])
async def test_an_agents_busy_policy_is_a_busy_answer_not_an_error(make_server: ServerFactory, policy: str) -> None:
    """`busy = "dial"` or `"enqueue:NAME"` answers <Dial> or <Enqueue> at capacity: `kame-phone call` said
    "error: TwiML has neither <Connect><Stream> nor <Hangup>" of a service doing as configured."""
    server = await make_server(busy_answer=at_capacity_twiml(policy, "busy", "+15550009999"))
    report = await simulate_call(server.ws_url, speech_like(), auth_token=TOKEN, public_url=None)
    assert report.outcome == "busy" and not report.errors


async def test_behind_a_proxy_signs_the_public_urls(make_server: ServerFactory) -> None:
    # The server believes it is https://voice.example.com; the caller reaches it on 127.0.0.1.
    server = await make_server(public_base="https://voice.example.com")
    report = await simulate_call(
        server.ws_url, speech_like(0.1, 0.2, 0.1), auth_token=TOKEN, public_url=server.base, hold_after=0.1
    )
    assert report.outcome == "completed", report.errors
    assert not report.warnings  # wss:// and the same path: nothing Twilio would object to


async def test_invalid_server_messages_are_counted(make_server: ServerFactory) -> None:
    server = await make_server(garbage=True)
    report = await simulate_call(
        server.ws_url, speech_like(0.1, 0.2, 0.1), auth_token=TOKEN, public_url=None, hold_after=0.1
    )
    assert report.outcome == "completed" and report.invalid_messages == 4


async def test_server_hang_up_ends_the_call(make_server: ServerFactory) -> None:
    server = await make_server(hang_up_after_packets=10)
    report = await simulate_call(server.ws_url, speech_like(), auth_token=TOKEN, public_url=None)
    assert report.outcome == "completed" and report.server_hung_up
    assert 9 <= report.media_sent <= 15 and report.call_seconds < 0.5


async def test_nothing_listening_is_an_error() -> None:
    report = await simulate_call("ws://127.0.0.1:9/twilio/media", speech_like(), auth_token=None, public_url=None)
    assert report.outcome == "error" and report.errors


# ---------------------------------------------------------------------------------------------------------
# WAV input and the CLI


@pytest.fixture
def flite_wav(tmp_path: Path) -> Path:
    if not (shutil.which("flite") and shutil.which("sox")):
        pytest.skip("flite and sox are needed")
    mono = tmp_path / "hello16k.wav"
    subprocess.run(["flite", "-voice", "rms", "-t", "hello", "-o", str(mono)], check=True)
    stereo = tmp_path / "hello.wav"  # 44.1 kHz stereo, to exercise reading and resampling
    subprocess.run(["sox", str(mono), "-r", "44100", "-c", "2", str(stereo)], check=True)
    return stereo


def test_wav_becomes_packets(flite_wav: Path) -> None:
    from telephony.sim_playout import read_wav

    audio, rate = read_wav(flite_wav)
    packets = caller_packets(flite_wav)
    assert rate == 44100
    assert len(packets) == -(-round(len(audio) * sp.RATE / rate) // sp.PACKET_BYTES)
    voiced = sp.voiced_flags(packets)
    assert 0 < sum(voiced) < len(voiced)  # flite pads the word with silence


async def test_cli_call(
    make_server: ServerFactory, flite_wav: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await make_server()
    parser = argparse.ArgumentParser()
    add_call_arguments(parser)
    report_path, out = tmp_path / "report.json", tmp_path / "reply.wav"
    args = parser.parse_args(
        ["--url", server.ws_url, "--wav", str(flite_wav), "--out", str(out), "--auth-token", TOKEN]
        + ["--json", str(report_path), "--hold-after", "0.3", "--dtmf", "1@0.1,#@0.2"]
    )
    assert await run_call_from_args(args) == 0
    assert "completed" in capsys.readouterr().out  # the human summary
    saved = json.loads(report_path.read_text())
    assert set(saved) == set(CallReport.__dataclass_fields__) and saved["outcome"] == "completed"
    assert saved["first_audio_latency_s"] > ECHO_DELAY and out.exists()
    assert [m.dtmf.digit for _, m in server.caller_messages(tm.DtmfMessage)] == ["1", "#"]
    # A report or recording it could not write is said before the call (a traceback after it; review, session 29).
    calls = len(server.caller_messages(tm.StartMessage))
    for flag, where in (("--json", tmp_path / "missing" / "r.json"), ("--out", tmp_path)):
        args = parser.parse_args(["--url", server.ws_url, "--wav", str(flite_wav), "--auth-token", TOKEN, flag,
                                  str(where)])  # fmt: skip
        assert await run_call_from_args(args) == 1
        assert f"{flag} {where}: cannot write there" in capsys.readouterr().out
    assert len(server.caller_messages(tm.StartMessage)) == calls  # no call made


# ---------------------------------------------------------------------------------------------------------
# Pure parts


def test_playout_marks_and_clear() -> None:
    p = sp.Playout()
    tone = float_to_ulaw(0.3 * np.cos(np.arange(800) * 0.3))  # 100 ms
    assert p.enqueue_media(tone, now=0.0) == 0
    p.enqueue_mark("a", now=0.01)
    assert p.enqueue_media(tone, now=0.02) == 800  # queued behind the first: no gap, no overlap
    p.enqueue_mark("b", now=0.03)
    assert p.due_marks(0.099) == [] and p.due_marks(0.1) == ["a"]
    played, dropped = p.clear(0.15)
    assert (played, dropped) == ([], ["b"])
    assert p.enqueue_media(tone, now=0.5) == 4000  # after a clear, new audio starts when it arrives
    p.enqueue_mark("c", now=0.7)  # nothing queued once it has played: due at once
    assert p.due_marks(0.7) == ["c"]
    heard = p.render(8000)
    assert np.all(heard[1200:4000] == 0) and np.any(heard[1000:1200] != 0)  # cut at 150 ms
    assert p.played_samples(8000) == 800 + 400 + 800
    assert sp.first_sound_at(heard, 1200) == 4000


def test_parse_dtmf_and_voice_url() -> None:
    assert parse_dtmf("1@2.0, #@0.5") == [("#", 0.5), ("1", 2.0)]
    with pytest.raises(ValueError):
        parse_dtmf("x@1")
    assert default_voice_url("wss://h.example/pre/twilio/media") == "https://h.example/pre/twilio/voice"
    assert default_voice_url("ws://127.0.0.1:8080/ws") == "http://127.0.0.1:8080/twilio/voice"


def test_the_simulated_twilio_connects_to_the_twiml_stream_path_on_the_url_it_was_given() -> None:
    """The TwiML gives the public URL (a proxy's host and path prefix) and, since per-call URLs, the call's own
    part after the node's base: kept, on --url's host. An older node's fixed URL: --url as it is."""
    from telephony.sim_caller import _socket_url

    local = "ws://127.0.0.1:8080/twilio/media"
    report = CallReport()
    assert _socket_url(report, "wss://h.example/kame/twilio/media/CA1", local) == local + "/CA1"
    assert _socket_url(report, "wss://h.example/twilio/media", local) == local
    assert _socket_url(report, "wss://h.example/twilio/media/CA2", local + "/CA2") == local + "/CA2"
    assert not report.warnings
    assert _socket_url(report, "wss://h.example/elsewhere", local) == local
    assert report.warnings and "not under --url's" in report.warnings[0]


def test_report_round_trips_to_json() -> None:
    r = CallReport(outcome="busy", call_sid="CA1")
    assert json.loads(r.to_json())["outcome"] == "busy"

"""Stand-ins for what `kame-phone eval` talks to, as real servers on loopback: the paid APIs, OpenAI-
compatible (a judge: non-streaming chat completions; speech: /v1/audio/speech, spoken by flite;
transcriptions: /v1/audio/transcriptions, verbose_json with word times), and a phone line (`FakeLine`: a
Twilio voice webhook and Media Streams socket whose bot answers, talks, hangs up or is busy on cue)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from telephony.mulaw import pcm16_to_ulaw
from telephony.sim_playout import PACKET_SECONDS, RATE, has_sound
from telephony.twilio_messages import media_message

from .llm_server import REASONING_MODEL_REFUSALS
from .loopback_http import serve_on_loopback


@dataclass
class FakeJudge:
    """Rates every answer `rating`, except: a question containing a key of `no_rating_first` gets one
    answer without a rating first (the client must retry), one containing a key of `always_fail` gets
    HTTP 500 every time (its score must end up missing, not 0)."""

    rating: int = 7
    no_rating_first: tuple[str, ...] = ()
    always_fail: tuple[str, ...] = ()
    # A question containing a key gets this raw HTTP 200 body every time, as (content type, text): the odd
    # answers "compatible" servers give (an HTML page, a choice without a message, content as a list).
    odd_reply: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Speech for a text containing a key is a valid WAV with no samples.
    empty_speech: tuple[str, ...] = ()
    transcription: dict[str, Any] | None = None  # the transcriptions answer, when not the usual one
    refuse_params: tuple[str, ...] = ()  # refused as OpenAI's reasoning models do (tests/llm_server.py)
    requests: list[dict[str, Any]] = field(default_factory=list)
    speech_requests: list[dict[str, Any]] = field(default_factory=list)
    transcription_requests: int = 0
    untimed_models: tuple[str, ...] = ()  # transcription models that refuse verbose_json (as gpt-4o-transcribe does)
    _unrated: set[str] = field(default_factory=set)
    base_url: str = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = body["messages"][-1]["content"]
        for name in self.refuse_params:
            if name in body and not (name == "temperature" and body[name] == 1):
                return web.json_response({"error": REASONING_MODEL_REFUSALS[name]}, status=400)
        if any(k in prompt for k in self.always_fail):
            return web.json_response({"error": {"message": "judge overloaded"}}, status=500)
        for key, (content_type, text) in self.odd_reply.items():
            if key in prompt:
                return web.Response(text=text, content_type=content_type)
        text = f"The assistant's answer was assessed. Rating: [[{self.rating}]]"
        for key in self.no_rating_first:
            if key in prompt and key not in self._unrated:
                self._unrated.add(key)
                text = "I think the answer is fine."
        return web.json_response({
            "id": "chatcmpl-judge", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        })

    async def speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.speech_requests.append(body)
        if any(k in body["input"] for k in self.empty_speech):
            return web.Response(body=_empty_wav(), content_type="audio/wav")
        return web.Response(body=await asyncio.to_thread(_flite_wav, body["input"]), content_type="audio/wav")

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        self.transcription_requests += 1
        model, response_format = str(form["model"]), str(form["response_format"])
        if response_format == "json":
            return web.json_response({"text": "hello there friend"})
        if model.startswith("gpt-4o") or model in self.untimed_models:  # as OpenAI answers it
            return web.json_response({"error": {
                "message": f"response_format 'verbose_json' is not compatible with model '{model}'. Use 'json' or "
                           "'text' instead.",
                "type": "invalid_request_error", "param": "response_format", "code": "unsupported_value"}}, status=400)
        assert response_format == "verbose_json"
        if self.transcription is not None:
            return web.json_response(self.transcription)
        return web.json_response({
            "task": "transcribe", "language": "english", "duration": 2.0, "text": "hello there friend",
            "words": [{"word": "hello", "start": 0.5, "end": 0.8}, {"word": "there", "start": 0.9, "end": 1.1},
                      {"word": "friend", "start": 1.2, "end": 1.5}],
        })


def _empty_wav() -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    return buf.getvalue()


def _flite_wav(text: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.wav"
        subprocess.run([shutil.which("flite") or "flite", "-voice", "rms", "-t", text, "-o", str(out)], check=True)
        return out.read_bytes()


@contextlib.asynccontextmanager
async def serve_fake_judge(**kwargs: Any) -> AsyncIterator[FakeJudge]:
    judge = FakeJudge(**kwargs)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", judge.chat)
    app.router.add_post("/v1/audio/speech", judge.speech)
    app.router.add_post("/v1/audio/transcriptions", judge.transcriptions)
    async with serve_on_loopback(app) as base:
        judge.base_url = f"{base}/v1"
        yield judge


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    """Bot "speech": a tone, int16 at 8 kHz."""
    t = np.arange(round(seconds * RATE))
    return (8000 * np.sin(2 * np.pi * hz * t / RATE)).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * RATE), dtype=np.int16)


@dataclass
class FakeLine:
    """A stand-in phone service: answers the voice webhook with <Connect><Stream> (or busy), then on the
    socket its bot answers each caller turn (sound, then `end_of_turn_s` of quiet) with `reply` (int16,
    8 kHz; None: never), plays `timeline` (int16, 8 kHz) from the call's start if given, and hangs up `hang_up_after_s`
    after `start` if given. It does not check signatures."""

    reply: np.ndarray | None = field(default_factory=lambda: tone(1.0))
    end_of_turn_s: float = 0.3
    timeline: np.ndarray | None = None
    hang_up_after_s: float | None = None
    busy: bool = False
    calls: int = 0  # streams opened
    open_calls: int = 0
    base_url: str = ""

    async def voice(self, request: web.Request) -> web.StreamResponse:
        if self.busy:
            twiml = '<Response><Reject reason="busy"/></Response>'
        else:
            twiml = f'<Response><Connect><Stream url="ws://{request.host}/twilio/media"/></Connect></Response>'
        return web.Response(text=f'<?xml version="1.0" encoding="UTF-8"?>{twiml}', content_type="text/xml")

    async def media(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.calls += 1
        self.open_calls += 1
        turn = _Turn(round(self.end_of_turn_s / PACKET_SECONDS))
        hang_up: asyncio.Task[None] | None = None
        try:
            async for msg in ws:
                data = json.loads(msg.data)
                if data.get("event") == "start":
                    turn.sid = data["streamSid"]
                    if self.timeline is not None:
                        await ws.send_str(media_message(turn.sid, pcm16_to_ulaw(self.timeline)))
                    if self.hang_up_after_s is not None:
                        hang_up = asyncio.create_task(_close_later(ws, self.hang_up_after_s))
                elif data.get("event") == "media" and turn.heard(base64.b64decode(data["media"]["payload"])):
                    if self.reply is not None:
                        await ws.send_str(media_message(turn.sid, pcm16_to_ulaw(self.reply)))
        finally:
            self.open_calls -= 1
            if hang_up is not None:
                hang_up.cancel()
        return ws


@dataclass
class _Turn:
    """The caller's turns as the bot hears them: `heard` is True at the end of each one."""

    quiet_packets: int
    sid: str = ""
    speaking: bool = False
    quiet: int = 0

    def heard(self, payload: bytes) -> bool:
        if has_sound(payload):
            self.speaking, self.quiet = True, 0
            return False
        self.quiet += 1
        if self.speaking and self.quiet >= self.quiet_packets:
            self.speaking = False
            return True
        return False


async def _close_later(ws: web.WebSocketResponse, seconds: float) -> None:
    await asyncio.sleep(seconds)
    await ws.close()


@contextlib.asynccontextmanager
async def serve_fake_line(**kwargs: Any) -> AsyncIterator[FakeLine]:
    line = FakeLine(**kwargs)
    app = web.Application()
    app.router.add_post("/twilio/voice", line.voice)
    app.router.add_get("/twilio/media", line.media)
    async with serve_on_loopback(app) as base:
        line.base_url = base
        yield line

"""Stand-ins for the paid APIs `kame-phone eval` talks to, as real OpenAI-compatible HTTP servers on
loopback: a judge (non-streaming chat completions), speech (/v1/audio/speech, spoken by flite) and
transcriptions (/v1/audio/transcriptions, verbose_json with word times)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from .loopback_http import serve_on_loopback


@dataclass
class FakeJudge:
    """Rates every answer `rating`, except: a question containing a key of `no_rating_first` gets one
    answer without a rating first (the client must retry), one containing a key of `always_fail` gets
    HTTP 500 every time (its score must end up missing, not 0)."""

    rating: int = 7
    no_rating_first: tuple[str, ...] = ()
    always_fail: tuple[str, ...] = ()
    requests: list[dict[str, Any]] = field(default_factory=list)
    speech_requests: list[dict[str, Any]] = field(default_factory=list)
    transcription_requests: int = 0
    _unrated: set[str] = field(default_factory=set)
    base_url: str = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = body["messages"][-1]["content"]
        if any(k in prompt for k in self.always_fail):
            return web.json_response({"error": {"message": "judge overloaded"}}, status=500)
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
        return web.Response(body=await asyncio.to_thread(_flite_wav, body["input"]), content_type="audio/wav")

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        self.transcription_requests += 1
        assert form["response_format"] == "verbose_json"
        return web.json_response({
            "task": "transcribe", "language": "english", "duration": 2.0, "text": "hello there friend",
            "words": [{"word": "hello", "start": 0.5, "end": 0.8}, {"word": "there", "start": 0.9, "end": 1.1},
                      {"word": "friend", "start": 1.2, "end": 1.5}],
        })


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

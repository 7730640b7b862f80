"""Helpers for end-to-end phone tests: a real service on loopback over the tiny engine, signed requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import subprocess
import textwrap
import time
import wave
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client import REGISTRY
from twilio.request_validator import RequestValidator

import knowledge.metrics  # noqa: F401 - serve's wiring (kame_phone/app.py) always exports the back-end's metrics
from engine.sampling import SamplingOverrides
from engine.service import BackendProvider, EngineConfig, LocalEngine
from knowledge.agents import AgentDirectory
from telephony import twilio_messages as tm
from telephony.call_store import CallStore, MemoryCallStore
from telephony.cluster import stream_url_for
from telephony.config import ServiceConfig
from telephony.logs import setup_logging
from telephony.server import MEDIA_PATH, VOICE_PATH, ServerContext, ServiceHandle
from telephony.sim_playout import PACKET_SECONDS, RATE, Playout, voiced_flags
from telephony.twilio_rest import TwilioRest
from telephony.twiml import parse_connect_stream

from .polling import until


def metric(name: str, **labels: str) -> float:
    """A sample's value, summed over the series whose labels include `labels` (so a label added later,
    like kame_calls_total's agent, does not turn a test's reading into 0)."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def dominant_hz(path: Path) -> float:
    """The strongest frequency of a recorded reply, past its first half second."""
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        audio = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float64)
    audio = audio[rate // 2 :]  # past the first frames
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.fft.rfftfreq(len(audio), 1 / rate)[int(np.argmax(spectrum))])


def new_call_sid() -> str:
    return "CA" + secrets.token_hex(16)


def write_agents(tmp_path: Path, text: str, name: str = "agents.toml") -> Path:
    """An agents file (TOML, dedented) in `tmp_path`."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def flite_wav(text: str, out: Path) -> Path:
    if shutil.which("flite") is None:
        raise RuntimeError("flite is not installed: run ./scripts/setup.sh")
    subprocess.run(["flite", "-voice", "rms", "-t", text, "-o", str(out)], check=True)
    return out


@dataclass(eq=False)
class TalksUntil:
    """A caller (a `CallerScript`) who says `packets` over and over until `done` is set, then goes on for `tail_s`
    and hangs up; `bot_after_s`: the bot audio received in that tail, `longest_bot_gap_s`: the longest stretch
    of real time without new bot audio, from the first to the hang-up. For a test that waits for something to
    happen during a call, however long this machine takes, rather than guessing how much to say."""

    done: asyncio.Event
    packets: tuple[bytes, ...]
    tail_s: float = 1.5
    limit_s: float = 60.0  # a guard against a hang, not a timing assertion
    done_at: tuple[float, int] | None = None  # (t, bot samples received) once `done` was seen
    bot_after_s: float = 0.0
    longest_bot_gap_s: float = 0.0
    _voiced: list[bool] = field(init=False)
    _bot_grew: tuple[float, int] | None = None  # (time.monotonic(), bot samples received) when bot audio last came

    def __post_init__(self) -> None:
        self._voiced = voiced_flags(list(self.packets))

    def next_packet(self, t: float, playout: Playout) -> tuple[bytes, bool] | None:
        # The real clock, not `t` (the packet's slot): after a stall the caller catches up in a burst.
        now = time.monotonic()
        if self._bot_grew is not None:
            self.longest_bot_gap_s = max(self.longest_bot_gap_s, now - self._bot_grew[0])
        if playout.received_samples and (self._bot_grew is None or playout.received_samples > self._bot_grew[1]):
            self._bot_grew = (now, playout.received_samples)
        if self.done.is_set() and self.done_at is None:
            self.done_at = (t, playout.received_samples)
        if self.done_at is not None and t >= self.done_at[0] + self.tail_s:
            self.bot_after_s = (playout.received_samples - self.done_at[1]) / RATE
            return None
        if t > self.limit_s:
            return None
        k = round(t / PACKET_SECONDS) % len(self.packets)
        return self.packets[k], self._voiced[k]


@dataclass
class Phone:
    handle: ServiceHandle
    engine: LocalEngine
    store: CallStore
    token: str

    @property
    def ctx(self) -> ServerContext:
        return self.handle.ctx

    @property
    def base(self) -> str:
        return self.handle.http_url

    @property
    def ws_url(self) -> str:
        return self.base.replace("http://", "ws://") + MEDIA_PATH

    async def settled(self) -> None:
        """Wait until every stream has ended on the server side and its writes reached the store."""
        async with asyncio.timeout(10):
            await self.ctx.no_streams.wait()
        await self.store.flush()

    def sign(self, url: str, params: dict[str, str]) -> str:
        return RequestValidator(self.token).compute_signature(url, params)

    async def ready(self, http: aiohttp.ClientSession) -> bool:
        """GET /readyz as a load balancer would: in rotation (200) or not."""
        async with http.get(self.base + "/readyz") as resp:
            return resp.status == 200

    async def keeping_time(self, timeout_s: float = 30.0) -> None:
        """Until the engine keeps its 80 ms frames again. After a burst (a call's start, an attack) the tiny
        engine on a slow 2-core day misses frames for a few seconds, and the node answers new calls busy
        then, by design (engine/service.py). A test about something else dials once it is back."""
        await until(lambda: self.engine.ready, "the engine keeping time again", timeout_s, every=0.1)

    async def answer(self, http: aiohttp.ClientSession, call_sid: str | None = None) -> tuple[str, dict[str, str]]:
        """POST the voice webhook like Twilio, once the engine keeps time; return (call_sid, the TwiML
        <Parameter>s)."""
        await self.keeping_time()
        call_sid = call_sid or new_call_sid()
        params = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": "+15550002"}
        url = self.base + VOICE_PATH
        async with http.post(url, data=params, headers={"X-Twilio-Signature": self.sign(url, params)}) as r:
            assert r.status == 200, await r.text()
            twiml = await r.text()
            assert "<Connect" in twiml, twiml
            stream = parse_connect_stream(twiml)
        return call_sid, dict(stream.parameters)

    def stream_url(self, call_sid: str) -> str:
        """The call's own stream URL on this node (what the voice webhook's TwiML gives Twilio)."""
        return stream_url_for(self.ws_url, call_sid)

    async def open_stream(
        self, http: aiohttp.ClientSession, call_sid: str | None = None
    ) -> aiohttp.ClientWebSocketResponse:
        """A signed upgrade on `call_sid`'s stream URL (no CallSid: a fresh one's, a call never answered: 403)."""
        url = self.stream_url(call_sid or new_call_sid())
        return await http.ws_connect(url, headers={"X-Twilio-Signature": self.sign(url, {})})

    async def awaiting_stream(self, http: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse:
        """A call answered and its stream's socket open, never started (an attacker's, or Twilio's first
        moments): each holds an engine seat's reservation until it lapses."""
        call_sid, _ = await self.answer(http)
        return await self.open_stream(http, call_sid)

    @contextlib.asynccontextmanager
    async def started_call(
        self, http: aiohttp.ClientSession
    ) -> AsyncIterator[tuple[str, aiohttp.ClientWebSocketResponse]]:
        """A call answered and its stream started as Twilio does (stream MZ1); (CallSid, socket). After: the
        stream stopped, the socket closed, the call settled on the server side."""
        call_sid, params = await self.answer(http)
        ws = await self.open_stream(http, call_sid)
        await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        try:
            yield call_sid, ws
        finally:
            await ws.send_str(tm.stop_msg("MZ1", 10**6, call_sid, "AC1"))
            await ws.close()
            await self.settled()


@contextlib.asynccontextmanager
async def running_phone(
    checkpoint: Path,
    *,
    max_calls: int = 2,
    store: CallStore | None = None,
    backend: BackendProvider | None = None,
    agents: AgentDirectory | None = None,
    twilio_rest: TwilioRest | None = None,
    kv_dtype: str = "auto",
    weights_dtype: str = "auto",
    compile_mode: str = "off",
    engine_process: bool = False,
    **config: object,
) -> AsyncIterator[Phone]:
    token = secrets.token_hex(16)
    engine = await LocalEngine.load(
        EngineConfig(checkpoint=str(checkpoint), device="cpu", max_calls=max_calls, warmup_ticks=2,
                     sampling=SamplingOverrides(greedy=True), kv_dtype=kv_dtype, weights_dtype=weights_dtype,
                     compile_mode=compile_mode, engine_process=engine_process),
        backend,
    )
    await engine.start()
    store = store or MemoryCallStore()
    cfg = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token, **config)  # type: ignore[arg-type]
    handle = await ServiceHandle(ServerContext(cfg, store, engine, agents=agents, twilio_rest=twilio_rest)).start()
    try:
        yield Phone(handle, engine, store, token)
    finally:
        await handle.aclose()
        await engine.stop()


@contextlib.contextmanager
def json_logging(capfd: pytest.CaptureFixture[str]) -> Iterator[Callable[[], list[dict]]]:
    """Logging set up as `serve --log-json` sets it, inside a test (pytest's own handlers come and go between a
    test's phases): yields a function giving the JSON lines written to stderr so far, a spawned child's included
    (the child shares the captured file descriptor)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    setup_logging(json_lines=True)

    def lines() -> list[dict]:
        return [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]

    try:
        yield lines
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)

"""The bot's audio path: the engine's per-tick `BotFrames`, the batched 24 -> 8 kHz bank, the media template
and the fan-out that plays each row to its own call."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
from twilio.request_validator import RequestValidator

from engine.interface import FRAME_SAMPLES, BotFrames
from kame_phone.media_bench import LoopbackEngine
from telephony import twilio_messages as tm
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.metrics import FANOUT_PHASES
from telephony.mulaw import float_to_ulaw
from telephony.resample import Downsampler24to8, DownsamplerBank
from telephony.server import MEDIA_PATH, VOICE_PATH, ServerContext, ServiceHandle
from telephony.signatures import SIGNATURE_HEADER, websocket_signature_url
from telephony.sim_caller import simulate_call
from telephony.turns import level_dbfs, levels_dbfs
from telephony.twilio_messages import MediaMessageTemplate, media_message
from telephony.twiml import parse_connect_stream

from .phone_fixtures import dominant_hz, metric, running_phone
from .polling import until


def test_bank_equals_one_downsampler_per_stream_as_calls_come_and_go() -> None:
    rng = np.random.default_rng(7)
    bank = DownsamplerBank(capacity=2)  # grows twice below
    reference = {key: Downsampler24to8() for key in "abcde"}
    for tick in range(8):
        keys = [k for k in "abcde" if rng.random() < 0.8]  # a call missing from a tick keeps its history
        if tick == 4:  # call "b" ends; a new call under the same key starts from silence
            bank.forget("b")
            reference["b"] = Downsampler24to8()
        frames = (0.3 * rng.standard_normal((len(keys), FRAME_SAMPLES))).astype(np.float32)
        got = bank.process(keys, frames)
        want = np.stack([reference[k].process(row) for k, row in zip(keys, frames, strict=True)])
        assert got.shape == (len(keys), FRAME_SAMPLES // 3)
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert len(bank) == 5


def test_a_big_tick_in_a_new_order_each_time_keeps_every_row_on_its_own_stream() -> None:
    """45 calls whose rows come in a different order (and some missing) each tick: every row must still
    continue its own stream's filter history."""
    rng = np.random.default_rng(11)
    keys = [f"call-{i}" for i in range(45)]
    bank = DownsamplerBank()
    reference = {key: Downsampler24to8() for key in keys}
    for _ in range(4):
        tick = [k for k in rng.permutation(keys) if rng.random() < 0.9]  # order and membership change
        frames = (0.3 * rng.standard_normal((len(tick), FRAME_SAMPLES))).astype(np.float32)
        got = bank.process(tick, frames)
        want = np.stack([reference[k].process(row) for k, row in zip(tick, frames, strict=True)])
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_bank_is_the_same_filter_so_aliases_stay_rejected() -> None:
    t = np.arange(10 * FRAME_SAMPLES) / 24_000
    tone = (0.5 * np.sin(2 * np.pi * 5_000 * t)).astype(np.float32)  # would alias to 3 kHz
    bank = DownsamplerBank()
    out = np.concatenate([bank.process(["x"], f[None])[0] for f in tone.reshape(-1, FRAME_SAMPLES)])
    level = 20 * np.log10(np.sqrt(np.mean(out[200:] ** 2)) / np.sqrt(np.mean(tone**2)))
    assert level < -60


def test_bank_refuses_frames_it_cannot_block() -> None:
    with pytest.raises(ValueError, match="multiples of 96"):
        DownsamplerBank().process(["x"], np.zeros((1, 100), np.float32))
    with pytest.raises(ValueError, match="2 keys for 1 frames"):
        DownsamplerBank().process(["x", "y"], np.zeros((1, 96), np.float32))


@pytest.mark.parametrize("sid", ["MZ" + "0" * 32, 'MZ"quoted\\sid', "MZü"])
def test_media_template_writes_exactly_media_message(sid: str) -> None:
    payload = bytes(range(256)) * 2
    rendered = MediaMessageTemplate(sid).render(payload).decode("utf-8")
    assert rendered == media_message(sid, payload)
    assert json.loads(rendered)["streamSid"] == sid


def test_bot_frames_rows_must_agree() -> None:
    pcm = np.zeros((2, FRAME_SAMPLES), np.float32)
    BotFrames(("a", "b"), pcm, ("", ""), (True, True), (0, 0), (False, False), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        BotFrames(("a", "b"), pcm, ("",), (True, True), (0, 0), (False, False), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        BotFrames(("a",), pcm, ("",), (True,), (0,), (False,), 0.0)


async def test_every_call_hears_its_own_row_of_the_tick(tmp_path: Path) -> None:
    """Three calls share each tick of an echoing engine: each must get back its own tone, not a neighbour's."""
    engine = LoopbackEngine(max_calls=4)
    token = "t" * 32
    ctx = ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token), MemoryCallStore(), engine)
    handle = await ServiceHandle(ctx).start()
    ws_url = handle.http_url.replace("http://", "ws://") + MEDIA_PATH
    tones = [400.0, 1000.0, 2200.0]
    ticks_before = {phase: metric("kame_media_fanout_seconds_count", phase=phase) for phase in FANOUT_PHASES}
    t = np.arange(3 * 8000) / 8000
    try:
        reports = await asyncio.gather(
            *(
                simulate_call(
                    ws_url,
                    (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32),
                    auth_token=token,
                    public_url=None,
                    out_wav=tmp_path / f"{hz:.0f}.wav",
                    hold_after=0.5,
                )
                for hz in tones
            )
        )
    finally:
        await engine.stop()
        await handle.aclose()
    for hz, report in zip(tones, reports, strict=True):
        assert report.outcome == "completed", report.errors
        assert report.bot_seconds_received > 2.0
        assert abs(dominant_hz(tmp_path / f"{hz:.0f}.wav") - hz) < 20, hz
    # every tick that played audio was timed in each of its phases, once per tick (not once per call)
    ticks = {p: metric("kame_media_fanout_seconds_count", phase=p) - ticks_before[p] for p in FANOUT_PHASES}
    assert len(set(ticks.values())) == 1, ticks
    # ~3.5 s of audio each, ~44 ticks that all three calls share (once per call would be ~130)
    assert 30 <= ticks["send"] <= 60, ticks


@pytest.mark.parametrize(("seat_s", "silent_s"), [(0.5, 0.0), (0.0, 1.5)])
async def test_first_audio_is_what_the_caller_can_hear_from_the_start_event(seat_s: float, silent_s: float) -> None:
    """kame_first_audio_seconds and the record's first_audio_s: from the `start` event as read (seating the call
    is the caller's wait too: a slow Redis, a remote engine) to the first frame above the turn threshold. The
    echo of a silent caller is "voiced" from its first tick; counted then, the figure read ~0.1 s while the
    caller heard nothing, and a seat's time was left out."""
    engine = LoopbackEngine(max_calls=2)
    engine.open_delay_s = seat_s
    token = "t" * 32
    store = MemoryCallStore()
    handle = await ServiceHandle(ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token),
                                               store, engine)).start()  # fmt: skip
    t = np.arange(3 * 8000) / 8000
    caller = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    caller[: int(silent_s * 8000)] = 0.0
    count, total = metric("kame_first_audio_seconds_count"), metric("kame_first_audio_seconds_sum")
    try:
        report = await simulate_call(handle.http_url.replace("http://", "ws://") + MEDIA_PATH, caller,
                                     auth_token=token, public_url=None, hold_after=0.5)  # fmt: skip
        await until(lambda: metric("kame_first_audio_seconds_count") == count + 1, within=5)
        record = await store.get(report.call_sid)
    finally:
        await engine.stop()
        await handle.aclose()
    assert report.outcome == "completed", report.errors
    first = metric("kame_first_audio_seconds_sum") - total
    expected = seat_s + silent_s  # and an echo's tick or two
    assert expected <= first <= expected + 0.5, first
    assert report.first_audio_latency_s is not None and abs(report.first_audio_latency_s - first) < 0.3
    assert record is not None and record.first_audio_s == pytest.approx(first)


@dataclass
class DeafPeer:
    sock: socket.socket
    call_sid: str
    send_media: Callable[[int], Awaitable[None]]  # media packet number k


async def _deaf_twilio(base_url: str, token: str) -> DeafPeer:
    """A Twilio that opens its stream and talks, but never reads what we send (a raw socket with a tiny
    receive buffer, so its backlog reaches the server quickly)."""
    async with aiohttp.ClientSession() as http:  # the voice webhook first, like Twilio
        call_sid, account_sid = "CA" + secrets.token_hex(16), "AC" + "0" * 32
        form = {"CallSid": call_sid, "AccountSid": account_sid, "From": "+15550001", "To": "+15550002"}
        url = base_url + VOICE_PATH
        sig = RequestValidator(token).compute_signature(url, form)
        async with http.post(url, data=form, headers={SIGNATURE_HEADER: sig}) as r:
            stream = parse_connect_stream(await r.text())
    host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    path = urlsplit(stream.url).path  # the call's own stream URL
    sig = RequestValidator(token).compute_signature(websocket_signature_url(base_url, path), {})
    upgrade = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n"
        f"{SIGNATURE_HEADER}: {sig}\r\n\r\n"
    )
    await loop.sock_sendall(sock, upgrade.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += await loop.sock_recv(sock, 1)  # exactly the handshake; nothing after it is ever read
    assert head.startswith(b"HTTP/1.1 101"), head

    async def send(text: str) -> None:  # one masked text frame, as a client must send
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        header = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
        await loop.sock_sendall(sock, header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    stream_sid = "MZ" + secrets.token_hex(16)
    await send(tm.connected_msg())
    await send(tm.start_msg(stream_sid, call_sid, account_sid, dict(stream.parameters), seq=1))
    return DeafPeer(sock, call_sid, lambda k: send(tm.media_msg(stream_sid, k + 2, k + 1, 20 * k, b"\x55" * 160)))


async def test_a_peer_that_stops_reading_never_stalls_the_other_calls(caplog: pytest.LogCaptureFixture) -> None:
    engine = LoopbackEngine(max_calls=4)
    token = "t" * 32
    store = MemoryCallStore()
    config = ServiceConfig(
        host="127.0.0.1",
        port=0,
        twilio_auth_token=token,
        outbound_backlog_bytes=2048,
        media_send_buffer_bytes=4096,
        silent_socket_s=1.5,
    )
    handle = await ServiceHandle(ServerContext(config, store, engine)).start()
    ws_url = handle.http_url.replace("http://", "ws://") + MEDIA_PATH
    dropped_before = metric("kame_media_outbound_dropped_frames_total")
    deaf = await _deaf_twilio(handle.http_url, token)

    async def keep_talking() -> None:  # the deaf peer keeps sending, so only its reading is at fault
        for k in range(10**6):
            try:
                await deaf.send_media(k)
            except OSError:
                return  # the server gave up on it
            await asyncio.sleep(0.02)

    talker = asyncio.create_task(keep_talking())
    t = np.arange(8 * 8000) / 8000
    try:
        report = await simulate_call(
            ws_url, (0.3 * np.sin(2 * np.pi * 700 * t)).astype(np.float32),
            auth_token=token, public_url=None, hold_after=0.5,
        )
        async with asyncio.timeout(10):
            # The store has no change feed to wait on: poll it.
            while (record := await store.get(deaf.call_sid)) is None or record.end_reason is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    finally:
        talker.cancel()
        deaf.sock.close()
        await engine.stop()
        await handle.aclose()
    assert record.end_reason == "stalled_peer"
    assert metric("kame_media_outbound_dropped_frames_total") > dropped_before
    warned = [r for r in caplog.records if r.getMessage().startswith("peer is not reading")]
    assert warned and all(getattr(r, "call_id", None) == deaf.call_sid for r in warned)
    # Meanwhile the good call got all its audio, on time.
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_played > 7.5  # played in real time: nothing held back behind the deaf peer


def test_a_ticks_levels_are_each_rows_level() -> None:
    rows = np.stack([np.zeros(640, np.float32), np.full(640, 0.1, np.float32), np.full(640, -1.0, np.float32)])
    np.testing.assert_allclose(levels_dbfs(rows), [level_dbfs(row) for row in rows], atol=1e-4)
    assert levels_dbfs(rows)[0] == -180.0 and abs(levels_dbfs(rows)[1] + 20.0) < 1e-3


async def test_each_call_drains_and_filters_by_its_own_row(tiny_checkpoint: Path) -> None:
    """The fan-out's decisions per call follow that call's own row: a backed-up call's speech is sent and its
    silence drained whatever its neighbour's row holds; and after a gap a call's next words start from a
    clean filter (the speech before the gap, kept, began them with a click of it)."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (sid_a, _):
        sid_b, params = await phone.answer(http)
        ws_b = await phone.open_stream(http, sid_b)
        await ws_b.send_str(tm.start_msg("MZ2", sid_b, "AC1", params))
        await until(lambda: sid_b in phone.ctx.streams and phone.ctx.streams[sid_b].playing, "b streaming")
        fanout = phone.ctx.fanout
        await fanout.aclose()  # from here the test is the engine
        a, b = phone.ctx.streams[sid_a], phone.ctx.streams[sid_b]
        payloads: list[bytes] = []

        async def read_b() -> None:
            async for m in ws_b:
                if m.type == aiohttp.WSMsgType.TEXT and (event := json.loads(m.data))["event"] == "media":
                    payloads.append(base64.b64decode(event["media"]["payload"]))

        reader = asyncio.create_task(read_b())
        base = b.state.frames_sent  # what the engine's fan-out sent b before it stopped (read as they come)
        t = np.arange(FRAME_SAMPLES) / 24000
        speech = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        silence = np.zeros(FRAME_SAMPLES, np.float32)

        async def tick(row_a: np.ndarray, row_b: np.ndarray, voiced_b: bool = True) -> None:
            await fanout.deliver(BotFrames((sid_a, sid_b), np.stack([row_a, row_b]), ("", ""), (True, voiced_b),
                                           (0, 0), (False, False), time.monotonic()))  # fmt: skip

        try:
            b.playout.until = time.monotonic() + 1.0  # b's Twilio queue is a second deep (a stall)
            sent_a, sent_b = a.state.frames_sent, b.state.frames_sent
            drained = metric("kame_media_playout_drained_frames_total")
            await tick(speech, silence)  # b's pause beside a talking a: b's pause is drained
            assert (a.state.frames_sent, b.state.frames_sent) == (sent_a + 1, sent_b)
            assert metric("kame_media_playout_drained_frames_total") == drained + 1
            await tick(silence, speech)  # b talks beside a silent a: b's speech goes out
            assert (a.state.frames_sent, b.state.frames_sent) == (sent_a + 2, sent_b + 1)

            b.playout.until = 0.0
            await tick(silence, speech)
            await tick(silence, silence, voiced_b=False)  # b's line goes quiet (a held reply)
            tone = (0.3 * np.sin(2 * np.pi * 1500 * t)).astype(np.float32)
            await tick(silence, tone)
            async with asyncio.timeout(5):  # b's three frames: speech, speech, then after the gap the tone
                while len(payloads) < base + 3:  # noqa: ASYNC110 - polls what the reader saw
                    await asyncio.sleep(0.02)
        finally:
            reader.cancel()
            await ws_b.send_str(tm.stop_msg("MZ2", 10**6, sid_b, "AC1"))
            await ws_b.close()
    fresh = float_to_ulaw(Downsampler24to8().process(tone))
    assert len(payloads) == base + 3
    assert payloads[-1] == bytes(fresh)  # as from a filter that never heard the speech before the gap

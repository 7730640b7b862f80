"""End to end over loopback: the real aiohttp service, the tiny KAME engine, the simulated Twilio caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest

from engine.oracle_buffer import DraftTokens
from telephony import twilio_messages as tm
from telephony.call_leg import BOT_TURN_FLUSH_WORDS
from telephony.config import ConfigError, ServiceConfig
from telephony.server import STATUS_PATH, VOICE_PATH
from telephony.sim_caller import simulate_call
from telephony.twilio_rest import TwilioCredentials, TwilioRest
from telephony.twiml import parse_connect_stream

from .phone_fixtures import flite_wav, metric, new_call_sid, running_phone
from .polling import until
from .twilio_rest_server import serve_twilio_rest


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flite_wav("Hello, what time does the store open on Monday?", tmp_path_factory.mktemp("speech") / "q.wav")


async def test_a_call_end_to_end(tiny_checkpoint: Path, question_wav: Path, tmp_path: Path) -> None:
    completed = metric("kame_calls_total", outcome="completed")
    first_audio = metric("kame_first_audio_seconds_count")
    calls_timed, seconds_timed = metric("kame_call_duration_seconds_count"), metric("kame_call_duration_seconds_sum")
    async with running_phone(tiny_checkpoint) as phone:
        report = await simulate_call(
            phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base,
            out_wav=tmp_path / "reply.wav", hold_after=1.0, dtmf=[("7", 0.5)],
        )
        await phone.settled()
        record = await phone.store.get(report.call_sid)
    assert report.outcome == "completed", report.errors
    assert set(report.custom_parameters) == {"token", "agent", "to", "from"}
    assert report.custom_parameters["agent"] == "default"
    # The bot talked back in real time: about one 80 ms frame per 80 ms of call, after the first frame.
    assert report.bot_seconds_received > 0.6 * report.call_seconds
    assert report.first_audio_latency_s is not None and 0 < report.first_audio_latency_s < report.call_seconds
    assert report.marks_received > 0
    assert len(report.marks_echoed) + report.marks_unplayed == report.marks_received  # echoed once played
    assert report.invalid_messages == 0
    assert (tmp_path / "reply.wav").stat().st_size > 1000
    assert record is not None and record.state == "ended" and record.end_reason == "completed"
    assert record.stream_sid == report.stream_sid and record.first_audio_s is not None
    assert record.dtmf == ["7"]
    assert metric("kame_calls_total", outcome="completed") == completed + 1
    assert metric("kame_first_audio_seconds_count") == first_audio + 1
    # One call length, in seconds, from the start event to the stop: what the caller measured, give or take.
    assert metric("kame_call_duration_seconds_count") == calls_timed + 1
    duration = metric("kame_call_duration_seconds_sum") - seconds_timed
    assert 0.5 * report.call_seconds < duration < report.call_seconds + 2.0, (duration, report.call_seconds)


async def test_voice_webhook_signatures(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        url = phone.base + VOICE_PATH
        params = {"CallSid": new_call_sid(), "From": "+1555", "To": "+1666"}
        good = phone.sign(url, params)
        async with http.post(url, data=params, headers={"X-Twilio-Signature": good}) as r:
            assert r.status == 200
            stream = parse_connect_stream(await r.text())
            assert stream.url == phone.stream_url(params["CallSid"])
            assert stream.status_callback == phone.base + STATUS_PATH
            assert len(stream.parameters["token"]) >= 24
        rejected = metric("kame_webhook_rejections_total", endpoint="voice", reason="bad_signature")
        missing = metric("kame_webhook_rejections_total", endpoint="voice", reason="missing_signature")
        async with http.post(url, data=params) as r:
            assert r.status == 403
        forged = {"X-Twilio-Signature": good[:-4] + "AAAA"}
        async with http.post(url, data=params, headers=forged) as r:
            assert r.status == 403
        tampered = dict(params, From="+1999")  # signed params changed in flight
        async with http.post(url, data=tampered, headers={"X-Twilio-Signature": good}) as r:
            assert r.status == 403
        other_url = phone.sign("https://evil.example.com" + VOICE_PATH, params)
        async with http.post(url, data=params, headers={"X-Twilio-Signature": other_url}) as r:
            assert r.status == 403
        # An absolute-form request line (no proxy in front): routed all the same, and no URL Twilio signed.
        host_port = phone.base.removeprefix("http://")
        reader, writer = await asyncio.open_connection(*host_port.split(":"))
        body = urlencode(params).encode()
        writer.write(f"POST {url} HTTP/1.1\r\nHost: {host_port}\r\nX-Twilio-Signature: {good}\r\n"
                     "Content-Type: application/x-www-form-urlencoded\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"403", status_line  # refused, not a 500 with a traceback
        assert metric("kame_webhook_rejections_total", endpoint="voice", reason="missing_signature") == missing + 1
        assert metric("kame_webhook_rejections_total", endpoint="voice", reason="bad_signature") == rejected + 4
        no_sid = {"From": "+1"}
        async with http.post(url, data=no_sid, headers={"X-Twilio-Signature": phone.sign(url, no_sid)}) as r:
            assert r.status == 400  # signed but no CallSid


async def test_media_upgrade_needs_signature_and_admission(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        wrong_path = phone.sign(phone.base + "/x", {})
        for headers in ({}, {"X-Twilio-Signature": "forged"}, {"X-Twilio-Signature": wrong_path}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await http.ws_connect(phone.ws_url, headers=headers)
            assert err.value.status == 403
        # Signed, but the start carries a token that the voice webhook never issued: closed, not served.
        rejected = metric("kame_calls_total", outcome="rejected")
        calls_timed = metric("kame_call_duration_seconds_count")
        answered, _ = await phone.answer(http)
        ws = await phone.open_stream(http, answered)
        await ws.send_str(tm.connected_msg())
        await ws.send_str(tm.start_msg("MZ1", answered, "AC1", {"token": "guess"}))
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert metric("kame_calls_total", outcome="rejected") == rejected + 1
        assert metric("kame_call_duration_seconds_count") == calls_timed  # never started: no call length
        assert phone.engine.free_slots == 2
        # A call never answered: no stream is awaited on its URL, so not even the socket opens.
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await phone.open_stream(http)
        assert refused.value.status == 403


async def test_busy_at_capacity_without_opening_a_stream(tiny_checkpoint: Path, question_wav: Path) -> None:
    async with running_phone(tiny_checkpoint, max_calls=1) as phone, aiohttp.ClientSession() as http:
        first = asyncio.create_task(
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, hold_after=0.5)
        )
        await asyncio.sleep(1.0)  # the first call holds the only slot
        busy = metric("kame_calls_total", outcome="busy")
        second = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base)
        assert second.outcome == "busy"  # <Reject reason="busy">: a busy signal, the call is never answered
        assert second.stream_sid is None
        assert metric("kame_calls_total", outcome="busy") == busy + 1
        assert (await first).outcome == "completed"
        # Once the first call is over, the line takes calls again.
        call_sid, params = await phone.answer(http)
        assert "token" in params


async def test_reservation_counts_against_capacity(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint, max_calls=1) as phone, aiohttp.ClientSession() as http:
        await phone.answer(http)  # reserved, stream not opened yet
        url = phone.base + VOICE_PATH
        params = {"CallSid": new_call_sid()}
        async with http.post(url, data=params, headers={"X-Twilio-Signature": phone.sign(url, params)}) as r:
            assert '<Reject reason="busy"' in await r.text()


async def test_bad_input_never_disturbs_a_good_call(tiny_checkpoint: Path, question_wav: Path) -> None:
    kinds = ["malformed_json", "binary_frame", "unknown_event", "invalid_message", "invalid_base64", "oversize",
             "media_before_start", "wrong_stream_sid", "duplicate_start", "flooding", "silent_socket"]
    before = {k: metric("kame_twilio_protocol_errors_total", kind=k) for k in kinds}
    async with running_phone(tiny_checkpoint, max_calls=4, silent_socket_s=1.5) as phone, \
            aiohttp.ClientSession() as http:
        good = asyncio.create_task(
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, hold_after=1.0)
        )
        call_sid, params = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)
        await ws.send_str("{not json")
        await ws.send_bytes(b"\x00\x01binary")
        await ws.send_str(json.dumps({"event": "jump", "streamSid": "MZ9"}))
        await ws.send_str(tm.media_msg("MZ9", 1, 1, 0, b"\xff" * 160))  # media before start
        await ws.send_str(tm.start_msg("MZ9", call_sid, "AC1", params))
        await ws.send_str(tm.start_msg("MZ9", call_sid, "AC1", params))  # duplicate start
        await ws.send_str(json.dumps({"event": "media", "streamSid": "MZ9"}))  # no media body
        await ws.send_str(tm.media_msg("MZ" + "f" * 32, 3, 1, 0, b"\xff" * 160))  # another stream's streamSid
        bad64 = json.loads(tm.media_msg("MZ9", 4, 2, 20, b"\xff" * 160))
        bad64["media"]["payload"] = "%%%not base64%%%"
        await ws.send_str(json.dumps(bad64))
        await ws.send_str(tm.media_msg("MZ9", 5, 3, 40, b"\xff" * 9000))  # oversize payload
        for i in range(300):  # 6 s of audio in an instant: faster than real time
            await ws.send_str(tm.media_msg("MZ9", 6 + i, 4 + i, 60 + 20 * i, b"\x7f" * 160))
        # Then the socket goes silent: the server gives up on it after silent_socket_s.
        closed = await ws.receive(timeout=10)
        assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) or ws.closed or True
        while not ws.closed:
            m = await ws.receive(timeout=10)
            if m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                break
        # A message over the socket's size limit closes that socket only.
        call2, params2 = await phone.answer(http)
        ws2 = await phone.open_stream(http, call2)
        await ws2.send_str(tm.start_msg("MZ2", call2, "AC1", params2))
        await ws2.send_str("x" * (70 * 1024))
        while True:
            m = await ws2.receive(timeout=10)
            if m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                break
        report = await good
        assert report.outcome == "completed", report.errors
        assert report.bot_seconds_received > 0.6 * report.call_seconds
        await phone.settled()
        ended = await phone.store.get(call_sid)
        assert ended is not None and ended.end_reason == "silent_socket"
    after = {k: metric("kame_twilio_protocol_errors_total", kind=k) for k in kinds}
    grew = {k for k in kinds if after[k] > before[k]}
    assert grew == set(kinds), set(kinds) - grew
    assert after["flooding"] - before["flooding"] >= 200  # each dropped packet counted


async def test_big_frames_are_refused_unparsed_past_the_streams_text_rate(tiny_checkpoint: Path,
                                                                          question_wav: Path) -> None:
    """Every text frame was parsed as JSON before any limit, and a 60 KiB frame of numbers costs the shared
    event loop ~8 ms: one socket (before its start, no token needed) sending them stalled every call's audio
    for seconds (review, session 28). Past the stream's text rate a frame is refused unparsed, counted as a
    drop, and the flood ends the socket as any flood does; the good call beside it is heard throughout."""
    drops = metric("kame_stream_messages_dropped_total", event="text")
    parsed = metric("kame_twilio_protocol_errors_total", kind="invalid_message")  # (a mark without its fields)
    frame = json.dumps({"event": "mark", "streamSid": "MZ9", "mark": {"name": "m"}, "pad": [7] * 20_000})
    assert 60_000 < len(frame) < 64 * 1024
    async with running_phone(tiny_checkpoint, max_calls=2) as phone, aiohttp.ClientSession() as http:
        good = asyncio.create_task(
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, hold_after=1.0)
        )
        call_sid, _ = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)
        sent = 0
        with contextlib.suppress(ConnectionResetError, RuntimeError):  # closed under us as flooding
            for _ in range(1200):
                await ws.send_str(frame)
                sent += 1
        async with asyncio.timeout(10):
            while not ws.closed:
                await ws.receive()
        assert ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION  # ended as flooding
        report = await good
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.6 * report.call_seconds
    assert metric("kame_stream_messages_dropped_total", event="text") - drops > 1000
    # Parsed: the text burst (256 KiB) and what the rate (64 KiB/s) let through while they came.
    assert metric("kame_twilio_protocol_errors_total", kind="invalid_message") - parsed < 40, sent


@pytest.mark.parametrize("start_held", [False, True], ids=["server_busy_after_start", "network_held_start"])
async def test_audio_in_a_burst_after_a_stall_at_the_start_is_not_taken_for_a_flood(
    tiny_checkpoint: Path, start_held: bool
) -> None:
    """Twilio sends audio in real time from the socket's opening, and two stalls at a call's start deliver it
    in a burst: the server busy with `start` (claiming the seat, adopting the record on a slow Redis), or the
    network holding `start` and its audio up together. The guard counted from the first packet (then from
    `start` as read) and dropped the caller's first words as a flood; it counts from the upgrade."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        flooding = metric("kame_twilio_protocol_errors_total", kind="flooding")
        call_sid, params = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)
        if not start_held:
            await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        await asyncio.sleep(1.6 if start_held else 2.5)  # the stall
        if start_held:
            await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        packets = 80 if start_held else 100
        for i in range(packets):  # the packets Twilio sent meanwhile, all at once
            await ws.send_str(tm.media_msg("MZ1", 2 + i, 1 + i, 20 * i, b"\x7f" * 160))
        await ws.send_str(tm.stop_msg("MZ1", 2 + packets, call_sid, "AC1"))
        async with asyncio.timeout(10):
            while not ws.closed:
                await ws.receive()
        await phone.settled()
        assert metric("kame_twilio_protocol_errors_total", kind="flooding") == flooding
        record = await phone.store.get(call_sid)
        assert record is not None and record.end_reason == "completed"


async def test_a_second_stream_for_a_live_call_is_refused_and_the_first_plays_on(tiny_checkpoint: Path) -> None:
    """A second socket on a live call's stream URL (a replayed upgrade, a second Twilio socket) is refused
    before the upgrade, never swapped in, and never hears the call. Before, it took the call over."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        second = metric("kame_webhook_rejections_total", endpoint="media", reason="second_socket")
        call_sid, params = await phone.answer(http)
        ws1 = await phone.open_stream(http, call_sid)
        await ws1.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        await asyncio.sleep(0.5)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await phone.open_stream(http, call_sid)
        assert refused.value.status == 409
        assert metric("kame_webhook_rejections_total", endpoint="media", reason="second_socket") == second + 1
        got = 0
        for i in range(25):  # the first stream still carries the call, both ways
            await ws1.send_str(tm.media_msg("MZ1", 2 + i, 1 + i, 20 * i, b"\xff" * 160))
        while got < 3:
            m = await ws1.receive(timeout=5)
            assert m.type == aiohttp.WSMsgType.TEXT
            got += json.loads(m.data)["event"] == "media"
        assert len(phone.ctx.streams) == 1 and phone.engine.free_slots == 1  # one seat for the call
        await ws1.send_str(tm.stop_msg("MZ1", 99, call_sid, "AC1"))
        await ws1.send_str(tm.stop_msg("MZ1", 100, call_sid, "AC1"))  # stop twice: still one ending
        await ws1.close()
        await phone.settled()
        record = await phone.store.get(call_sid)
        assert record is not None and record.state == "ended" and record.end_reason == "completed"
        assert record.stream_sid == "MZ1"
        assert phone.engine.free_slots == 2 and not phone.ctx.streams


async def test_a_stream_starting_after_the_callers_final_status_is_refused_not_counted_twice(
    tiny_checkpoint: Path
) -> None:
    """The caller hangs up while Twilio opens the socket: the final status callback and the stream's `start`
    come on two connections, either first. Ended as no_stream with its reservation left live, the call's late
    `start` was admitted, wrote "streaming" over the ended record and was counted again as completed (review,
    session 28). The callback now uses the reservation up as it ends the record: the late start is refused."""
    from telephony.server import CALL_STATUS_PATH

    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        no_stream = metric("kame_calls_total", outcome="no_stream", agent="default")
        completed = metric("kame_calls_total", outcome="completed", agent="default")
        call_sid, params = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)  # Twilio's socket is open, its start not read yet
        url = phone.base + CALL_STATUS_PATH
        form = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32, "CallStatus": "completed"}
        async with http.post(url, data=form, headers={"X-Twilio-Signature": phone.sign(url, form)}) as r:
            assert r.status == 204
        await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        async with asyncio.timeout(10):
            while not ws.closed:
                await ws.receive()
        assert ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION  # not admitted
        await phone.settled()
        record = await phone.store.get(call_sid)
        assert record is not None and (record.state, record.end_reason) == ("ended", "no_stream")
        assert metric("kame_calls_total", outcome="no_stream", agent="default") == no_stream + 1
        assert metric("kame_calls_total", outcome="completed", agent="default") == completed
        assert phone.ctx.capacity_left == 2  # no seat held by it


async def test_stream_status_callback(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        url = phone.base + STATUS_PATH
        params = {"CallSid": new_call_sid(), "StreamSid": "MZ1", "StreamEvent": "stream-error", "StreamError": "x"}
        before = metric("kame_twilio_stream_events_total", event="stream-error")
        async with http.post(url, data=params, headers={"X-Twilio-Signature": phone.sign(url, params)}) as r:
            assert r.status == 204
        async with http.post(url, data=params) as r:
            assert r.status == 403
        assert metric("kame_twilio_stream_events_total", event="stream-error") == before + 1


async def test_eight_concurrent_calls(tiny_checkpoint: Path, question_wav: Path) -> None:
    async with running_phone(tiny_checkpoint, max_calls=8) as phone:
        reports = await asyncio.gather(*[
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, hold_after=0.5)
            for _ in range(8)
        ])
    assert [r.outcome for r in reports] == ["completed"] * 8
    assert len({r.call_sid for r in reports}) == 8
    for r in reports:
        assert r.bot_seconds_received > 0.5 * r.call_seconds, r


def test_refuses_to_serve_without_a_token_unless_insecure_dev() -> None:
    with pytest.raises(ConfigError, match="TWILIO_AUTH_TOKEN"):
        ServiceConfig(host="127.0.0.1").check()
    with pytest.raises(ConfigError, match="loopback only"):
        ServiceConfig(host="0.0.0.0", insecure_dev=True).check()
    ServiceConfig(host="127.0.0.1", insecure_dev=True).check()


def test_a_short_admin_token_is_refused_on_a_public_port() -> None:
    """The admin API reads every call's transcript: a short bearer token on a port others reach is guessable."""
    public = {"host": "0.0.0.0", "twilio_auth_token": "t" * 32, "public_url": "https://phone.example.com"}
    with pytest.raises(ConfigError, match="ADMIN_TOKEN must be at least 16 characters"):
        ServiceConfig(**public, admin_token="admin-secret").check()  # type: ignore[arg-type]
    ServiceConfig(**public, admin_token="f" * 32).check()  # type: ignore[arg-type]
    ServiceConfig(**public).check()  # type: ignore[arg-type]  # none: the admin API is off
    ServiceConfig(host="127.0.0.1", twilio_auth_token="t" * 32, admin_token="admin").check()  # loopback: a test rig




async def test_an_engine_reset_clears_the_audio_queued_at_twilio(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        call_sid, params = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)
        await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
        seq = 2

        async def next_event() -> str:
            nonlocal seq
            await ws.send_str(tm.media_msg("MZ1", seq, seq - 1, 20 * seq, b"\xff" * 160))
            seq += 1
            m = await ws.receive(timeout=5)
            return json.loads(m.data)["event"]

        while await next_event() != "media":
            pass
        session = phone.engine._sessions[call_sid]
        # A token the model cannot embed makes the batched tick fail: every slot is reset, and the
        # audio already queued at Twilio for this call is now stale.
        phone.engine.frame_loop._slots[session.row].oracle.set_candidate(99, DraftTokens([10**6], settled=1))
        events = [await next_event() for _ in range(40)]
        assert "clear" in events
        assert events[events.index("clear") + 1 :].count("media") > 0  # and the call goes on
        await ws.send_str(tm.stop_msg("MZ1", 999, call_sid, "AC1"))
        await ws.close()
        await phone.settled()


async def test_an_engine_falling_behind_takes_no_calls_until_it_keeps_time(
    tiny_checkpoint: Path, question_wav: Path
) -> None:
    """A node that cannot keep its 80 ms ticks turns not-ready and answers busy, instead of seating another
    call that would slow every seated one; the seated call goes on, and the node recovers by itself."""
    async with running_phone(tiny_checkpoint, max_calls=2) as phone, aiohttp.ClientSession() as http:
        first = asyncio.create_task(
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, hold_after=3.0)
        )
        async with asyncio.timeout(10):
            while phone.engine.free_slots != 1:  # noqa: ASYNC110 - the seat is taken on the server side
                await asyncio.sleep(0.02)
        # The last 2 s as the ticker reports a starved loop: every tick past its frame.
        stats, now = phone.engine.frame_loop.stats, time.monotonic()
        for i in range(25):
            stats.record_tick(0.12, True, now=now - 1.9 + i * 0.076)
        async with http.get(phone.base + "/readyz") as r:
            assert r.status == 503 and (await r.json())["checks"]["model_loaded"] is False
        assert metric("kame_engine_falling_behind") == 1
        busy = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base)
        assert busy.outcome == "busy" and busy.stream_sid is None
        # Its own ticks keep time: within the 2 s window the node is ready again.
        try:
            await until(lambda: phone.ready(http), "ready again once its own ticks keep time", within=6)
        except AssertionError:
            if stats.falling_behind():  # on the engine's own ticks by now: the injected ones are out of its window
                own = [late for at, late in stats.recent if at > now]
                pytest.skip(f"this machine cannot keep the tiny engine's 80 ms ({sum(own)} of {len(own)} ticks "
                            "late): recovering cannot be seen here")  # fmt: skip
            raise
        assert metric("kame_engine_falling_behind") == 0
        _, params = await phone.answer(http)
        assert "token" in params
        report = await first  # held to the suite's real-time bar, below
        assert report.outcome == "completed" and report.bot_seconds_received > 0.6 * report.call_seconds


async def test_a_call_answered_before_the_engine_fell_behind_still_gets_its_stream(tiny_checkpoint: Path) -> None:
    """Falling behind stops new calls at the webhook; a call the webhook already answered (seat reserved,
    token given) must not then be refused at its stream's upgrade: the caller would hear a failed call
    (seen in the soak on a loaded 2-core box)."""
    async with running_phone(tiny_checkpoint, max_calls=2) as phone, aiohttp.ClientSession() as http:
        sid, params = await phone.answer(http)
        stats, now = phone.engine.frame_loop.stats, time.monotonic()
        for i in range(25):  # the last 2 s as a starved loop reports them
            stats.record_tick(0.12, True, now=now - 1.9 + i * 0.076)
        assert not phone.engine.ready
        ws = await phone.open_stream(http, sid)
        await ws.send_str(tm.start_msg("MZlate", sid, "AC1", params))
        async with asyncio.timeout(5):
            while True:
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                if json.loads(msg.data).get("event") == "media":
                    break
        await ws.send_str(tm.stop_msg("MZlate", 99, sid, "AC1"))
        await ws.close()
        await phone.settled()
        record = await phone.store.get(sid)
        assert record is not None and record.stream_sid == "MZlate"


def test_falling_behind_is_judged_on_the_last_two_seconds_of_ticks() -> None:
    from engine.frame_loop import LoopStats

    stats = LoopStats()
    assert not stats.falling_behind(now=100.0)
    for i in range(25):  # 2 s of ticks, 5 of them late: exactly a fifth is still keeping time
        stats.record_tick(0.05, i % 5 == 0, now=98.0 + i * 0.08)
    assert not stats.falling_behind(now=100.0)
    stats.record_tick(0.2, True, now=100.0)
    assert stats.falling_behind(now=100.0)
    assert not stats.falling_behind(now=102.5)  # idle since (idle ticks are not recorded): not behind
    fresh = LoopStats()
    for i in range(5):  # too few ticks to judge
        fresh.record_tick(0.2, True, now=100.0 + i * 0.08)
    assert not fresh.falling_behind(now=100.4)


async def test_a_caller_who_hangs_up_on_their_last_word_still_has_it_recorded(tiny_checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    """"... goodbye" and an immediate hang-up: no 0.6 s of silence ever ended that utterance, so the STT
    never made it final and the call's record had no caller turn at all. The back-end ends it as it closes,
    and the call's end waits (bounded) for it to reach the record."""
    from knowledge.backend import BackendConfig, BackendServices

    wav = flite_wav("I would like to cancel my order please, goodbye.", tmp_path / "bye.wav")
    backend = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await backend.warm_up(1)
    async with running_phone(tiny_checkpoint, backend=backend) as phone:
        report = await simulate_call(phone.ws_url, wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=0.0)  # fmt: skip
        await phone.settled()
        record = await phone.store.get(report.call_sid)
    assert report.outcome == "completed", report.errors
    assert record is not None
    said = " ".join(t.text for t in record.turns if t.role == "caller")
    assert "goodbye" in said or "order" in said, record.turns


async def test_the_bots_words_reach_the_live_record_while_the_caller_is_silent(tiny_checkpoint: Path) -> None:
    """The bot's words went to the record only when the caller's next utterance ended: a caller on hold
    left the live record without the bot's side for as long, and a node lost meanwhile lost it."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http, \
            phone.started_call(http) as (call_sid, ws):
        async with asyncio.timeout(10):
            while call_sid not in phone.ctx.streams:  # noqa: ASYNC110 - the server side's seat
                await ws.send_str(tm.media_msg("MZ1", 2, 1, 20, b"\xff" * 160))
                await asyncio.sleep(0.02)
        session = phone.ctx.streams[call_sid]
        for i in range(BOT_TURN_FLUSH_WORDS + 5):  # the bot talks on (beside the tiny model's own pieces)
            session.note_bot_text(f"\u2581word{i}")
        bot = ""
        async with asyncio.timeout(5):
            while "word140" not in bot:
                await asyncio.sleep(0.05)  # the write is handed to a task
                await phone.store.flush()
                record = await phone.store.get(call_sid)
                assert record is not None and record.state == "streaming"
                bot = " ".join(t.text or "" for t in record.turns if t.role == "bot")
        assert "word0 " in bot + " " and "word140" in bot


async def test_a_call_past_its_maximum_length_gives_its_seat_back(tiny_checkpoint: Path, question_wav: Path) -> None:
    """A line left open (a robocaller looping, a phone off the hook) held its GPU seat for good: past
    --max-call-minutes the call ends, through Twilio's REST API when there are credentials (the call ends
    there: no fallback played), else by closing the stream (Twilio then plays the agent's fallback)."""
    before = metric("kame_calls_total", outcome="max_duration", agent="default")
    async with running_phone(tiny_checkpoint, max_call_s=2.0) as phone:
        started = time.monotonic()
        report = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=20.0)  # fmt: skip
        await phone.settled()
        record = await phone.store.get(report.call_sid)
        # The seat is back (the loop's own count: the engine's says 0 while it falls behind, on a loaded box).
        assert phone.engine.frame_loop.free_slots == 2
    assert report.server_hung_up and time.monotonic() - started < 8.0
    assert record is not None and record.end_reason == "max_duration"
    assert metric("kame_calls_total", outcome="max_duration", agent="default") - before == 1

    account = "AC" + "3" * 32
    hung_up = metric("kame_call_actions_total", action="end", trigger="max_duration", result="ok")
    async with serve_twilio_rest(account, account, "rest-secret") as twilio:
        rest = TwilioRest(TwilioCredentials(account, account, "rest-secret", twilio.base_url))
        try:
            async with running_phone(tiny_checkpoint, max_call_s=2.0, twilio_rest=rest) as phone:
                report = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token,
                                             public_url=phone.base, hold_after=20.0)  # fmt: skip
                await phone.settled()
                record = await phone.store.get(report.call_sid)
        finally:
            await rest.aclose()
    assert [(sid, form.get("Status")) for sid, form in twilio.updates] == [(report.call_sid, "completed")]
    assert record is not None and record.end_reason == "max_duration"
    assert metric("kame_call_actions_total", action="end", trigger="max_duration", result="ok") - hung_up == 1
    with pytest.raises(ConfigError, match="KAME_MAX_CALL_MINUTES"):
        ServiceConfig(host="127.0.0.1", twilio_auth_token="t", max_call_s=-60.0).check()


async def test_a_call_hung_up_at_its_maximum_length_keeps_that_outcome_when_twilios_stop_comes_first(
    tiny_checkpoint: Path,
) -> None:
    """Twilio ends the call as the REST hang-up asks and stops its stream, and that `stop` can overtake the REST
    answer: the stop made the call "completed", and the receive loop's end cancelled the hang-up under way with
    the watchdog, so its action was never counted (review, session 22). The stream's end now waits for the
    answer, as for the agent's own actions."""
    account = "AC" + "4" * 32
    outcome = metric("kame_calls_total", outcome="max_duration", agent="default")
    hung_up = metric("kame_call_actions_total", action="end", trigger="max_duration", result="ok")
    async with serve_twilio_rest(account, account, "rest-secret") as twilio:
        twilio.update_delay_s = 4.0  # the REST answer comes after Twilio's stop
        rest = TwilioRest(TwilioCredentials(account, account, "rest-secret", twilio.base_url))
        try:
            async with running_phone(tiny_checkpoint, max_call_s=1.5, twilio_rest=rest) as phone, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                call_sid, params = await phone.answer(http)
                ws = await phone.open_stream(http, call_sid)
                await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
                await asyncio.sleep(3.5)  # past its maximum length: the hang-up is asked for, not yet answered
                assert not twilio.updates
                await ws.send_str(tm.stop_msg("MZ1", 2, call_sid, "AC1"))  # Twilio ended the call: its stop
                await phone.settled()
                await ws.close()
                record = await phone.store.get(call_sid)
        finally:
            await rest.aclose()
    assert [(sid, form.get("Status")) for sid, form in twilio.updates] == [(call_sid, "completed")]
    assert record is not None and record.end_reason == "max_duration"
    assert metric("kame_calls_total", outcome="max_duration", agent="default") - outcome == 1
    assert metric("kame_call_actions_total", action="end", trigger="max_duration", result="ok") - hung_up == 1

"""The engine behind a socket (`engine/remote.py`): edges take seats on one engine server, each call hears its
own audio, a broken or hostile peer costs only itself, and an engine server that dies ends its calls."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from engine.interface import (
    FRAME_SAMPLES,
    BotFrames,
    CallerTranscript,
    EngineClosed,
    EngineFull,
    EngineNotice,
    OracleUpdate,
)
from engine.link_wire import (
    PROTOCOL_VERSION,
    Address,
    LinkError,
    LinkRefused,
    audio_message,
    edge_tls,
    event_message,
    frames_message,
    json_message,
    parse_audio,
    parse_event,
    parse_frames,
)
from engine.queues import FreshCarry
from engine.remote import EDGE_EVENTS_QUEUE, RemoteEngine
from telephony.server import MEDIA_PATH
from telephony.sim_caller import simulate_call

from .link_fixtures import (
    TLS_CERT,
    TOKEN,
    edge_service,
    engine_keeps_time,
    http_status,
    process_env,
    start_cli,
    stop_processes,
    tone,
)
from .phone_fixtures import dominant_hz, metric
from .polling import until
from .redis_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def _body(message: bytes) -> bytes:
    return message[5:]  # past the length and the kind byte


def test_messages_cross_intact_and_times_cross_as_ages() -> None:
    pcm = np.random.default_rng(1).standard_normal(FRAME_SAMPLES).astype(np.float32)
    pcm = np.clip(pcm, -1, 1) * 0.5
    call_id, got = parse_audio(_body(audio_message("CA-ü", pcm)))
    assert call_id == "CA-ü" and got.dtype == np.float32
    np.testing.assert_allclose(got, pcm, rtol=0, atol=1 / 32767)  # 16-bit PCM on the wire
    loud = np.array([np.nan, np.inf, -np.inf, 3.0, -3.0] + [0.0] * (FRAME_SAMPLES - 5), np.float32)
    _, got = parse_audio(_body(audio_message("CA1", loud)))
    assert got[:5].tolist() == [0.0, 1.0, -1.0, 1.0, -1.0]  # NaN is silence, the rest clips: never a wrap
    with pytest.raises(ValueError, match="audio of 4 bytes"):
        parse_audio(_body(audio_message("CA1", np.zeros(2, np.float32))))

    for output in (CallerTranscript("what time", True, 100.0), OracleUpdate("nine", 100.0, 7),
                   EngineNotice("llm_error", "timeout"), None):  # fmt: skip
        sent_at, received_at = 100.5, 2000.0  # two clocks: only the 0.5 s age crosses
        call_id, back = parse_event(_body(event_message("CA1", output, sent_at)), received_at)
        assert call_id == "CA1"
        if isinstance(output, CallerTranscript | OracleUpdate):
            assert back == type(output)(**{**_fields(output), "at": received_at - 0.5})
        else:
            assert back == output

    ramp = np.linspace(-1, 1, 3 * FRAME_SAMPLES, dtype=np.float32).reshape(3, -1)
    frames = BotFrames(("a", "b", "c"), ramp,
                       ("x", "", "z"), (True, False, True), (4, 5, 6), (False, True, False), 50.0)  # fmt: skip
    back_frames = parse_frames(_body(frames_message(frames, [0, 2], 50.25)), 900.0)
    assert back_frames.call_ids == ("a", "c") and back_frames.texts == ("x", "z")
    assert back_frames.voiced == (True, True) and back_frames.indices == (4, 6) and back_frames.fresh == (False, False)
    np.testing.assert_allclose(back_frames.pcm, frames.pcm[[0, 2]], rtol=0, atol=1 / 32767)
    assert back_frames.produced_at == pytest.approx(899.75)
    # An edge that missed ticks: their restart marks ride on its calls' next rows (engine/queues.FreshCarry).
    carry = FreshCarry()
    carry.dropped(["a", "b", "c"], [False, True, True])
    sent = frames_message(frames, [0, 2], 50.25, ["e-a", "c"], fresh=carry.carry(["e-a", "c"], [False, False]))
    assert parse_frames(_body(sent), 900.0).fresh == (False, True)
    assert carry.carry(["b", "c"], [False, False]) == (True, False)  # each mark rides once


def _fields(output: CallerTranscript | OracleUpdate) -> dict[str, object]:
    return {name: getattr(output, name) for name in output.__slots__}


def test_addresses() -> None:
    assert Address.parse("unix:/run/kame/engine.sock") == Address(unix_path="/run/kame/engine.sock")
    assert Address.parse("tcp://10.0.0.5:7000") == Address(host="10.0.0.5", port=7000)
    assert Address.parse("[::1]:7000") == Address(host="::1", port=7000)
    assert Address.parse("unix:/x").local_only and Address.parse("127.0.0.1:1").local_only
    assert not Address.parse("tcp://10.0.0.5:7000").local_only
    assert Address.parse("tls://engine.internal:7070") == Address(host="engine.internal", port=7070, tls=True)
    assert str(Address.parse("tls://engine.internal:7070")) == "tls://engine.internal:7070"
    for bad in ("unix:", "engine.local", "tcp://host:port", "tls://host"):
        with pytest.raises(ValueError):
            Address.parse(bad)


def test_serve_refuses_a_malformed_engine_address_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kame_phone.cli import main

    assert main(["serve", "--insecure-dev", "--engine", "nowhere"]) == 2
    assert "--engine: engine address 'nowhere'" in capsys.readouterr().err


async def test_two_edges_share_one_engine_and_each_call_hears_its_own_row(tmp_path: Path, engine_server) -> None:
    """An echoing engine behind the link, two edge services on it: three calls, three tones, none mixed up."""
    server, address = await engine_server(4)
    edges = [await RemoteEngine.connect(address, token=None, seats=2, name=f"edge-{k}") for k in range(2)]
    handles = [await edge_service(e) for e in edges]
    assert [e.max_calls for e in edges] == [2, 2] and server.seats_granted == 4
    plan = [(handles[0], 400.0), (handles[1], 1000.0), (handles[1], 2200.0)]  # edge 1 gets two calls
    try:
        reports = await asyncio.gather(
            *(
                simulate_call(
                    h.http_url.replace("http://", "ws://") + MEDIA_PATH, tone(hz, 3.0), auth_token=TOKEN,
                    public_url=None, out_wav=tmp_path / f"{hz:.0f}.wav", hold_after=0.5,
                )
                for h, hz in plan
            )
        )  # fmt: skip
    finally:
        for h in handles:
            await h.aclose()
        for e in edges:
            await e.stop()
    for (_, hz), report in zip(plan, reports, strict=True):
        assert report.outcome == "completed", report.errors
        assert report.bot_seconds_received > 2.0
        assert abs(dominant_hz(tmp_path / f"{hz:.0f}.wav") - hz) < 20, hz


async def test_a_long_sip_caller_id_is_cut_not_allowed_to_fail_the_edge(engine_server) -> None:
    """Twilio's `From` may be a SIP URI with long parameters. It went into the call's setup as it came, and
    the engine link refuses setups over 100 characters by dropping the edge that sent it: one such caller
    ended every call of its edge. It is now cut to fit, and the call beside it goes on."""
    server, address = await engine_server(2)
    engine = await RemoteEngine.connect(address, token=None, seats=2)
    handle = await edge_service(engine)
    sip = "sip:" + "caller" * 40 + "@pbx.example.com;transport=tls"
    url = handle.http_url.replace("http://", "ws://") + MEDIA_PATH
    try:
        reports = await asyncio.gather(
            simulate_call(url, tone(500.0, 3.0), auth_token=TOKEN, public_url=None, from_number=sip, hold_after=0.5),
            simulate_call(url, tone(900.0, 3.0), auth_token=TOKEN, public_url=None, hold_after=0.5),
        )
    finally:
        await handle.aclose()
        await engine.stop()
    assert [r.outcome for r in reports] == ["completed", "completed"], [r.errors for r in reports]
    assert all(r.bot_seconds_received > 2.0 for r in reports)
    froms = sorted(s.from_number or "" for s in server.engine.setups.values())
    assert froms == sorted([sip[:100], "+15005550006"])


async def test_a_call_action_that_failed_at_the_edge_reaches_the_calls_engine_and_a_bad_one_drops_the_peer(
    engine_server,
) -> None:
    """A transfer Twilio refused: the edge tells the call's back-end, on the engine's side of the link. An
    action the link does not know is a broken peer (dropped), as any malformed message is."""
    server, address = await engine_server(2)
    edge = await RemoteEngine.connect(address, token=None, seats=1)
    bad_message = metric("kame_engine_link_errors_total", kind="bad_message")
    try:
        call = await edge.open_call("CA-act")
        call.action_failed("transfer", "error")
        (seated,) = server.engine.timelines.values()  # under the engine's own name for the call (ids are per edge)
        await until(lambda: seated.actions_failed == [("transfer", "error")], within=5)
        reader, writer = await asyncio.open_unix_connection(address.unix_path)
        hello = b'{"version":%d,"token":"","seats":1,"name":"junk"}' % PROTOCOL_VERSION
        writer.write(_link_message(b"H", hello))
        await _read_link_message(reader)  # welcome
        writer.write(_link_message(b"X", b'{"call_id":"CA-act","action":"rm -rf","result":"error"}'))
        await writer.drain()
        assert await reader.read() == b""  # the server hung up on it
        assert metric("kame_engine_link_errors_total", kind="bad_message") == bad_message + 1
        assert seated.actions_failed == [("transfer", "error")]  # nothing of its
        assert edge.ready and not edge.failed
    finally:
        await edge.stop()


async def test_seats_are_granted_once_and_refusals_say_why(tmp_path: Path, engine_server) -> None:
    _, address = await engine_server(3, tcp=True, token=TOKEN)
    bad_token = metric("kame_engine_link_errors_total", kind="bad_token")
    with pytest.raises(LinkRefused, match="wrong token"):
        await RemoteEngine.connect(address, token="nope", seats=1)
    with pytest.raises(LinkRefused, match="wrong token"):
        await RemoteEngine.connect(address, token="jeton-été", seats=1)
    assert metric("kame_engine_link_errors_total", kind="bad_token") == bad_token + 2
    bad_hello = metric("kame_engine_link_errors_total", kind="bad_hello")
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(struct.pack(">I", 3) + b"H[]")  # JSON, but not a hello
    assert await reader.read() == b""
    writer.close()
    assert metric("kame_engine_link_errors_total", kind="bad_hello") == bad_hello + 1
    a = await RemoteEngine.connect(address, token=TOKEN, seats=2)
    b = await RemoteEngine.connect(address, token=TOKEN, seats=5)  # asks for more than is left
    assert (a.max_calls, b.max_calls) == (2, 1)
    with pytest.raises(LinkError, match="no seats left"):
        await RemoteEngine.connect(address, token=TOKEN, seats=1)
    calls = [await a.open_call("CA1"), await a.open_call("CA2")]
    assert a.free_slots == 0
    with pytest.raises(EngineFull):
        await a.open_call("CA3")  # this edge's seats are taken, though the engine has one left for b
    await b.open_call("CA4")
    await calls[0].close()
    await asyncio.sleep(0.1)  # the close crosses the link
    await a.open_call("CA3")
    await b.stop()
    await asyncio.sleep(0.1)
    c = await RemoteEngine.connect(address, token=TOKEN, seats=1)  # b's seat came back when it left
    assert c.max_calls == 1
    await c.stop()
    await a.stop()


async def test_a_broken_peer_is_dropped_and_the_other_edge_keeps_its_calls(tmp_path: Path, engine_server) -> None:
    server, address = await engine_server(2)
    good = await RemoteEngine.connect(address, token=None, seats=1)
    bad_message = metric("kame_engine_link_errors_total", kind="bad_message")
    bad_audio = metric("kame_engine_link_errors_total", kind="bad_audio")
    try:
        call = await good.open_call("CA-good")
        ticks = aiter(good.bot_frames())
        # A peer with seats that sends one malformed audio frame (dropped), then a length no peer sends.
        reader, writer = await asyncio.open_unix_connection(address.unix_path)
        hello = b'{"version":%d,"token":"","seats":1,"name":"junk"}' % PROTOCOL_VERSION
        writer.write(struct.pack(">I", len(hello) + 1) + b"H" + hello)
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        assert b'"seats":1' in await reader.readexactly(n)  # welcome
        writer.write(audio_message("CA-x", np.zeros(10, np.float32)))
        writer.write(b"\xff\xff\xff\xffA")
        await writer.drain()
        assert await reader.read() == b""  # the server hung up on it
        assert metric("kame_engine_link_errors_total", kind="bad_audio") == bad_audio + 1
        assert metric("kame_engine_link_errors_total", kind="bad_message") == bad_message + 1
        assert server.seats_granted == 1  # its seat is free again
        for _ in range(3):
            call.push_audio(np.full(FRAME_SAMPLES, 0.25, np.float32))
        async with asyncio.timeout(5):
            while True:  # the good edge's call still gets its audio back
                tick = await anext(ticks)
                if tick.call_ids == ("CA-good",) and tick.voiced[0] and np.allclose(tick.pcm[0], 0.25, atol=1e-4):
                    break
        assert good.ready and not good.failed
    finally:
        await good.stop()


def _link_message(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body) + 1) + kind + body


async def _read_link_message(reader: asyncio.StreamReader) -> tuple[bytes, dict]:  # type: ignore[type-arg]
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    data = await reader.readexactly(n)
    return data[:1], json.loads(data[1:])


async def _misbehaving_engine(behave, version: int = 5) -> tuple[asyncio.Server, Address]:  # type: ignore[no-untyped-def]
    """A peer that speaks the link as engine-serve does up to its welcome (2 seats), then does `behave`. At
    protocol 5 by default: from 6 an engine speaks every second, which these peers do not."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_link_message(reader)  # the hello
        writer.write(_link_message(b"W", b'{"version":%d,"seats":2}' % version))
        try:
            await behave(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, Address(host="127.0.0.1", port=server.sockets[0].getsockname()[1])


async def test_an_engine_that_breaks_the_link_unexpectedly_is_lost_and_its_calls_told() -> None:
    """A message no engine of ours sends, of a shape the reader did not expect (a status that is a list,
    not an object), must end the link as lost, like a reset: calls told, health failed, no call seated on
    it later. Before, the reader task died alone and the edge looked ready with nobody reading."""
    async def seat_then_garble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, opened = await _read_link_message(reader)
        assert kind == b"O"
        writer.write(_link_message(b"R", b'{"call_id":"%s","ok":true}' % opened["call_id"].encode()))
        await asyncio.sleep(0.2)
        writer.write(_link_message(b"S", b"[1]"))
        await reader.read()  # until the edge hangs up

    server, address = await _misbehaving_engine(seat_then_garble)
    lost = metric("kame_engine_link_errors_total", kind="lost")
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        call = await edge.open_call("CA-seated")
        async with asyncio.timeout(5):
            outputs = [o async for o in call.outputs()]
        assert [(type(o), o.kind) for o in outputs] == [(EngineNotice, "engine_lost")]
        assert edge.failed and not edge.ready and edge.free_slots == 0
        assert metric("kame_engine_link_errors_total", kind="lost") == lost + 1
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(edge.open_call("CA-later"), 1)
    finally:
        await edge.stop()
        server.close()


async def test_a_calls_outputs_on_the_edge_are_bounded_when_nobody_takes_them() -> None:
    """Drafts come up to 12.5 a second per call; an edge whose media session is behind kept every one in an
    unbounded queue. Now, as with a local engine, the oldest go and the newest are kept."""
    async def seat_then_chatter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, opened = await _read_link_message(reader)
        writer.write(_link_message(b"R", b'{"call_id":"%s","ok":true}' % opened["call_id"].encode()))
        for i in range(1000):
            writer.write(event_message(opened["call_id"], OracleUpdate(f"draft {i}", time.monotonic(), i),
                                       time.monotonic()))  # fmt: skip
        await writer.drain()
        await reader.read()

    server, address = await _misbehaving_engine(seat_then_chatter)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        call = await edge.open_call("CA-behind")
        await until(lambda: call.dropped >= 1000 - EDGE_EVENTS_QUEUE, "the drafts to arrive")
        await call.close()
        kept = [o async for o in call.outputs()]
        assert len(kept) <= EDGE_EVENTS_QUEUE and kept[-1].candidate == 999  # the newest kept
        assert edge.ready  # a call's backlog is that call's
    finally:
        await edge.stop()
        server.close()


async def test_an_engine_that_never_answers_a_seat_request_does_not_hold_the_caller(monkeypatch) -> None:
    closes: list[str] = []

    async def read_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            kind, body = await _read_link_message(reader)
            if kind == b"C":
                closes.append(body["call_id"])

    monkeypatch.setattr("engine.remote.SEAT_ANSWER_TIMEOUT_S", 0.5)
    server, address = await _misbehaving_engine(read_and_say_nothing)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        with pytest.raises(EngineClosed, match="did not answer"):
            await asyncio.wait_for(edge.open_call("CA-waiting"), 5)
        await until(lambda: closes == ["CA-waiting"], "the edge gives back a seat granted too late")
        assert edge.free_slots == 2  # nothing held for it
        # Whoever opened it gone before the answer (its socket's handler cancelled): given back as well.
        opening = asyncio.create_task(edge.open_call("CA-gone"))
        await asyncio.sleep(0.1)
        opening.cancel()
        await until(lambda: closes == ["CA-waiting", "CA-gone"], "the edge gives back a seat nobody waits for")
        assert edge.free_slots == 2
    finally:
        await edge.stop()
        server.close()


async def test_a_link_lost_as_a_seat_is_granted_refuses_the_call_and_the_edge_holds_no_stream() -> None:
    """The engine grants the seat and the link drops in the same read: the seat went with the link. The
    open raised KeyError, which the media session did not expect: the stream stayed in the edge's books and
    its seat was never given back. It is now EngineClosed, and the caller's stream is refused cleanly."""
    async def seat_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            kind, body = await _read_link_message(reader)
            if kind == b"O":
                answer = json.dumps({"call_id": body["call_id"], "ok": True, "error": None}).encode()
                writer.write(_link_message(b"R", answer))
                await writer.drain()
                return  # closed at once: the answer and the end of the link arrive together

    server, address = await _misbehaving_engine(seat_then_hang_up)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    handle = await edge_service(edge)
    try:
        report = await asyncio.wait_for(simulate_call(
            handle.http_url.replace("http://", "ws://") + MEDIA_PATH, tone(300.0, 1.0), auth_token=TOKEN,
            public_url=None, hold_after=0.2,
        ), 15)  # fmt: skip
        assert report.server_hung_up
        assert not handle.ctx.streams  # nothing held for the refused stream
        # Its record has the outcome: left ringing, Twilio's status callback counted it again as no_stream.
        record = await handle.ctx.store.get(report.call_sid)
        assert record is not None and (record.state, record.end_reason) == ("ended", "engine_full")
    finally:
        await handle.aclose()
        await edge.stop()
        server.close()


async def test_a_call_whose_drain_timed_out_while_its_seat_was_granted_gives_it_all_back() -> None:
    """SIGTERM's drain times out while a remote engine is still seating a call (it may take up to 10 s): the
    drain ended the session before it knew its call, so the seat the engine granted afterwards was kept, the
    stream stayed in the edge's books and its record said streaming for a day."""
    closes: list[str] = []

    async def seat_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            kind, body = await _read_link_message(reader)
            if kind == b"O":
                await asyncio.sleep(1.5)  # the drain's 0.5 s runs out meanwhile
                answer = json.dumps({"call_id": body["call_id"], "ok": True, "error": None}).encode()
                writer.write(_link_message(b"R", answer))
            elif kind == b"C":
                closes.append(body["call_id"])

    server, address = await _misbehaving_engine(seat_late)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    handle = await edge_service(edge)
    try:
        call = asyncio.create_task(simulate_call(
            handle.http_url.replace("http://", "ws://") + MEDIA_PATH, tone(300.0, 4.0), auth_token=TOKEN,
            public_url=None, hold_after=0.2,
        ))  # fmt: skip
        await until(lambda: bool(handle.ctx.streams), "the stream to reach its seating")
        (sid,) = handle.ctx.streams
        await handle.drain(timeout_s=0.5)
        await until(lambda: closes == [sid], "the late seat given back to the engine")
        assert not handle.ctx.streams
        record = await handle.ctx.store.get(sid)
        assert record is not None and (record.state, record.end_reason) == ("ended", "drain_timeout")
        report = await asyncio.wait_for(call, 15)
        assert report.server_hung_up
    finally:
        await handle.aclose()
        await edge.stop()
        server.close()


async def test_over_tls_a_call_crosses_and_an_untrusted_engine_is_refused(engine_server) -> None:
    """tls://: the edge checks the engine's certificate (a test-only self-signed one in tests/data) and the
    call's audio goes both ways through TLS; an edge that does not trust it is refused for good."""
    server, address = await engine_server(1, tls=True)
    assert address.tls
    with pytest.raises(LinkRefused, match="not trusted"):
        await RemoteEngine.connect(address, token=None, seats=1, tls=edge_tls())  # the system's CAs only
    edge = await RemoteEngine.connect(address, token=None, seats=1, tls=edge_tls(str(TLS_CERT)))
    try:
        writer = edge._writer
        assert writer is not None and writer.get_extra_info("ssl_object") is not None  # it is TLS
        call = await edge.open_call("CA-tls")
        ticks = aiter(edge.bot_frames())
        for _ in range(3):
            call.push_audio(np.full(FRAME_SAMPLES, 0.25, np.float32))
        async with asyncio.timeout(5):
            while True:  # the loopback engine's echo came back through TLS
                tick = await anext(ticks)
                if tick.call_ids == ("CA-tls",) and tick.voiced[0] and np.allclose(tick.pcm[0], 0.25, atol=1e-4):
                    break
    finally:
        await edge.stop()


def test_engine_serve_wants_a_certificate_for_tls(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kame_phone.cli import main

    assert main(["engine-serve", "--listen", "tls://127.0.0.1:0", "--checkpoint", str(tmp_path)]) == 2
    assert "needs --tls-cert and --tls-key" in capsys.readouterr().err
    missing = ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.pem")]
    assert main(["engine-serve", "--listen", "tls://127.0.0.1:0", *missing, "--checkpoint", str(tmp_path)]) == 2
    assert "cannot use the TLS certificate/key" in capsys.readouterr().err


async def test_an_edge_that_stops_reading_loses_its_ticks_not_the_others(tmp_path: Path, engine_server) -> None:
    # Small socket buffers and backlog, so a peer that never reads is found out within a few ticks.
    _, address = await engine_server(2, backlog_bytes=8_000, socket_buffer_bytes=4_096)
    good = await RemoteEngine.connect(address, token=None, seats=1)
    dropped = metric("kame_engine_link_dropped_total", what="bot_frames")
    # A raw socket that reads its welcome and nothing after (an asyncio reader would buffer 128 KB first).
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(deaf, address.unix_path)
        async def recv_message() -> bytes:
            data = b""
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                data += await loop.sock_recv(deaf, 1)
            return data[4:]

        hello = b'{"version":%d,"token":"","seats":1,"name":"deaf"}' % PROTOCOL_VERSION
        opened = b'{"call_id":"CA-deaf"}'
        await loop.sock_sendall(deaf, struct.pack(">I", len(hello) + 1) + b"H" + hello)
        assert (await recv_message()).startswith(b"W")
        await loop.sock_sendall(deaf, struct.pack(">I", len(opened) + 1) + b"O" + opened)
        assert b'"ok":true' in await recv_message()  # seated: its audio is taken from now on
        # one frame of caller audio: from now on the deaf edge's call has a row in every tick
        await loop.sock_sendall(deaf, audio_message("CA-deaf", np.full(FRAME_SAMPLES, 0.1, np.float32)))
        call = await good.open_call("CA-good")
        ticks = aiter(good.bot_frames())
        got = 0
        async with asyncio.timeout(10):
            while got < 40:  # 3.2 s of ticks: the deaf edge's backlog passes the limit well before
                call.push_audio(np.full(FRAME_SAMPLES, 0.25, np.float32))
                tick = await anext(ticks)
                got += tick.call_ids == ("CA-good",)
        assert metric("kame_engine_link_dropped_total", what="bot_frames") > dropped
        assert good.ready and not good.failed
    finally:
        deaf.close()
        await good.stop()


async def test_a_draining_engine_keeps_its_calls_and_takes_no_new_ones(tmp_path: Path, engine_server) -> None:
    server, address = await engine_server(4)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        call = await edge.open_call("CA-up")
        ticks = aiter(edge.bot_frames())
        draining = asyncio.create_task(server.drain(timeout_s=30))
        async with asyncio.timeout(5):
            while not edge.draining:  # noqa: ASYNC110 - set by the link's receiver
                await asyncio.sleep(0.01)
        assert not edge.ready and edge.free_slots == 0  # readyz 503 and no admissions on this edge
        with pytest.raises(EngineClosed, match="draining"):
            await edge.open_call("CA-new")
        with pytest.raises(LinkError, match="draining"):
            await RemoteEngine.connect(address, token=None, seats=1)
        call.push_audio(np.full(FRAME_SAMPLES, 0.5, np.float32))
        async with asyncio.timeout(5):
            while "CA-up" not in (await anext(ticks)).call_ids:  # the seated call still streams
                pass
        assert not draining.done()
        await call.close()
        assert await asyncio.wait_for(draining, 5) == 0  # the drain ends with the last call
        assert not edge.failed  # draining is not a lost link
    finally:
        await edge.stop()


async def test_a_drain_waits_for_a_call_being_seated_as_it_began(engine_server) -> None:
    """A call past the draining check when the drain began is seated: the drain waited only for seated calls,
    ended at "0 calls" while its back-end was starting, and the restart that followed cut it."""
    server, address = await engine_server(2)
    server.engine.start_delay_s = 1.0  # its seat taken, its back-end starts (an STT, an LLM client)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        opening = asyncio.create_task(edge.open_call("CA-seating"))
        await until(lambda: server.engine.free_slots == 1, "the seat taken", within=5)
        draining = asyncio.create_task(server.drain(timeout_s=30))
        call = await asyncio.wait_for(opening, 10)  # seated, though the drain began meanwhile
        await asyncio.sleep(0.3)
        assert not draining.done()  # it waits for this call as for any seated one
        await call.close()
        assert await asyncio.wait_for(draining, 5) == 0
    finally:
        await edge.stop()


async def test_an_edge_gone_mid_seating_keeps_its_seats_until_the_engine_has_them_back(engine_server) -> None:
    """An edge dropped while a call of its was being seated: its seats went to the next edge at once, while
    the engine still held that call, and every open of the new edge was refused "full" meanwhile."""
    server, address = await engine_server(2)
    server.engine.start_delay_s = 1.5
    old = await RemoteEngine.connect(address, token=None, seats=2, name="old")
    new: RemoteEngine | None = None
    try:
        opening = asyncio.create_task(old.open_call("CA-seating"))
        await until(lambda: server.engine.free_slots == 1, "the seat taken", within=5)
        opening.cancel()
        await old.stop()  # the edge goes while the engine seats its call
        with pytest.raises(LinkError, match="no seats left"):  # the engine still holds that call's seat
            await RemoteEngine.connect(address, token=None, seats=2, name="new")
        await until(lambda: server.engine.free_slots == 2, "the engine's seats back", within=10)
        new = await RemoteEngine.connect(address, token=None, seats=2, name="new")
        server.engine.start_delay_s = 0.0
        calls = [await new.open_call(f"CA-{i}") for i in range(2)]  # every seat it was granted is a seat
        assert new.max_calls == 2 and len(calls) == 2
    finally:
        await old.stop()
        if new is not None:
            await new.stop()


async def test_a_tcp_link_notices_a_peer_gone_without_a_word(engine_server) -> None:
    """A partition or a dead host: nothing arrives, nothing fails. The engine read a welcomed edge without a
    deadline and TCP retried its writes for many minutes, keeping the edge's seats and refusing its reconnect
    "full". Both ends now give up on unacknowledged data after PEER_GONE_S, and probe an idle link. (Dropping
    packets on loopback needs privileges these tests do not take: the settings are what is checked.)"""
    import socket as sockets

    from engine.link_wire import PEER_GONE_S

    server, address = await engine_server(2, tcp=True)
    edge = await RemoteEngine.connect(address, token=None, seats=1)
    try:
        await until(lambda: len(server._edges) == 1, "the edge welcomed", within=5)
        assert edge._writer is not None
        ends = [edge._writer.get_extra_info("socket"),
                next(iter(server._edges)).writer.get_extra_info("socket")]  # fmt: skip
        for sock in ends:
            assert sock.getsockopt(sockets.SOL_SOCKET, sockets.SO_KEEPALIVE) == 1
            assert sock.getsockopt(sockets.IPPROTO_TCP, sockets.TCP_USER_TIMEOUT) == PEER_GONE_S * 1000
    finally:
        await edge.stop()


async def test_an_open_right_behind_its_close_is_seated_once_the_close_is_done(engine_server) -> None:
    """An edge cancels a call's open (its caller went) and the call comes back at once: open, close, open, all
    read before the first seating ran. The second open was ignored as a twin of the first, whose seat the close
    then took, and the edge waited 10 s for an answer and failed the call (review, session 26)."""
    server, address = await engine_server(2)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        assert edge._writer is not None
        opened, closed = json_message(b"O", {"call_id": "CA-flap"}), json_message(b"C", {"call_id": "CA-flap"})
        edge._writer.write(opened + closed + opened)  # one read on the engine's side
        await until(lambda: server.calls == 1 and not any(e.opening or e.closing for e in server._edges),
                    "the call seated again after its close", within=5)  # fmt: skip
    finally:
        await edge.stop()


async def test_a_call_reopened_as_the_engine_starts_draining_gives_its_old_seat_back(engine_server) -> None:
    """The edge drops a call's session when its stream comes back and opens it again, sending no close: the
    engine swaps the seat. Refused as draining, the old seat stayed, held by a call the edge no longer knew,
    and the drain waited out its whole timeout for it (review, session 26)."""
    server, address = await engine_server(2)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        await edge.open_call("CA-back")
        assert server.calls == 1
        draining = asyncio.create_task(server.drain(timeout_s=5.0))  # runs before the server reads the reopen
        with pytest.raises(EngineClosed, match="draining"):
            await edge.open_call("CA-back")  # the same call's stream reconnecting
        assert await asyncio.wait_for(draining, 2) == 0  # no call left behind: the drain ends at once
        assert server.calls == 0
    finally:
        await edge.stop()


async def test_an_engine_not_keeping_time_tells_its_edges_to_admit_no_new_calls(engine_server) -> None:
    """An engine-serve missing its 80 ms frames said so on its own /readyz only: the edges read its state at
    their hello, and went on admitting calls that slowed every seated one (review, session 22). It now says
    so every second on the link; the edges give no seat to admission (they stay in rotation and answer busy:
    all of them share the engine, and out of rotation at once every call would get the load balancer's
    error), a call its webhook already answered still opens, and they take calls again once it keeps time."""
    server, address = await engine_server(4)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        assert edge.ready and edge.free_slots == 2 and edge.link_version == PROTOCOL_VERSION >= 6
        server.engine.behind = True
        await until(lambda: edge.engine_behind, "the edge told the engine is behind", within=5)
        assert edge.free_slots == 0 and edge.ready and not edge.failed
        call = await edge.open_call("CA-answered")  # admitted before: still seated
        server.engine.behind = False
        await until(lambda: not edge.engine_behind, "the edge told the engine keeps time", within=5)
        assert edge.free_slots == 1
        await call.close()
    finally:
        await edge.stop()


async def test_seats_freed_while_the_engine_was_behind_are_offered_once_it_keeps_time(engine_server) -> None:
    """Seats freed while the engine is not ready are not offered (they would be taken for calls it cannot
    carry); nothing offered them when it became ready again, so an edge granted less than it asked stayed
    short, and callers heard busy beside idle seats, until another edge happened to leave (review, session 28)."""
    server, address = await engine_server(4)
    other = await RemoteEngine.connect(address, token=None, seats=2, name="other")
    short = await RemoteEngine.connect(address, token=None, seats=4, name="short")
    try:
        assert (other.max_calls, short.max_calls) == (2, 2)
        server.engine.behind = True
        await until(lambda: short.engine_behind, "the edges told the engine is behind", within=5)
        await other.stop()  # its 2 seats come free while the engine is behind: kept back
        await until(lambda: server.seats_granted == 2, "the other edge's seats back", within=5)
        await asyncio.sleep(0.3)
        assert short.max_calls == 2
        server.engine.behind = False
        await until(lambda: short.max_calls == 4, "the freed seats offered to the edge short of them", within=5)
        assert server.seats_granted == 4
    finally:
        await short.stop()


async def test_an_engine_that_goes_silent_is_taken_for_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition or a frozen engine host sends no reset: an idle edge, which wrote nothing that could fail,
    stayed ready for ever and every call routed to it waited out its seat request (review, session 22). The
    engine speaks at least every second (protocol 6); silent for SILENT_LINK_S, the link is lost."""
    import engine.remote as remote

    monkeypatch.setattr(remote, "SILENT_LINK_S", 0.5)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # welcomed, then never a word (the host froze)

    server, address = await _misbehaving_engine(silent, PROTOCOL_VERSION)
    lost = metric("kame_engine_link_errors_total", kind="lost")
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        assert edge.ready
        await until(lambda: edge.failed, "the silent link taken for lost", within=5)
        assert not edge.ready and edge.free_slots == 0
        assert metric("kame_engine_link_errors_total", kind="lost") == lost + 1
    finally:
        await edge.stop()
        server.close()


# ---------------------------------------------------------------------------------------------------------
# Real processes: `kame-phone engine-serve` with the tiny model, `kame-phone serve --engine` in front of it


async def test_engine_serve_and_an_edge_process_answer_calls_drain_and_notice_a_dead_engine(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    sock, engine_http, edge_port = tmp_path / "engine.sock", free_port(), free_port()
    model = ["--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--stt", "none", "--llm", "none", "--greedy"]
    engine_proc = start_cli(
        ["engine-serve", "--listen", f"unix:{sock}", "--http-port", str(engine_http), "--max-calls", "2", *model],
        process_env(), tmp_path / "engine.log",
    )
    edge_proc = start_cli(  # it does not wait for the engine: it retries until the engine listens
        ["serve", "--port", str(edge_port), "--engine", f"unix:{sock}", "--max-calls", "2"],
        process_env(TWILIO_AUTH_TOKEN=TOKEN, PUBLIC_URL=f"http://127.0.0.1:{edge_port}", KAME_METRICS_PORT="0"),
        tmp_path / "edge.log",
    )
    edge = f"http://127.0.0.1:{edge_port}"
    try:
        async with aiohttp.ClientSession() as http:
            async def both_ready() -> bool:
                engine_ready = await http_status(http, f"http://127.0.0.1:{engine_http}/readyz")
                return (engine_ready, await http_status(http, edge + "/readyz")) == (200, 200)

            await until(both_ready, "engine and edge ready", 90, every=0.1)
            report = await simulate_call(edge.replace("http://", "ws://") + MEDIA_PATH, tone(300, 2.0),
                                         auth_token=TOKEN, public_url=None, hold_after=0.5)  # fmt: skip
            assert report.outcome == "completed", report.errors
            assert report.bot_seconds_received > 1.5
            async with http.get(f"http://127.0.0.1:{engine_http}/metrics") as r:
                text = await r.text()
            assert "kame_engine_link_edges 1.0" in text
            ticks = [line for line in text.splitlines() if line.startswith("kame_engine_tick_seconds_count")]
            assert ticks and float(ticks[0].split()[-1]) > 20  # the engine's own metrics, on its own port

            during_drain: dict[str, object] = {}

            async def drain_then_kill_engine() -> None:
                await asyncio.sleep(1.5)
                engine_proc.send_signal(signal.SIGTERM)  # a drain: the call goes on, the edge stops admitting
                await asyncio.sleep(1.5)
                during_drain["engine_alive"] = engine_proc.poll() is None
                during_drain["edge_ready"] = await http_status(http, edge + "/readyz")
                during_drain["edge_health"] = await http_status(http, edge + "/healthz")
                during_drain["engine_ready"] = await http_status(http, f"http://127.0.0.1:{engine_http}/readyz")
                engine_proc.send_signal(signal.SIGKILL)  # then it dies under the call

            await engine_keeps_time(http, f"http://127.0.0.1:{engine_http}")  # behind after the first call: busy
            killer = asyncio.create_task(drain_then_kill_engine())
            started = time.monotonic()
            report = await asyncio.wait_for(
                simulate_call(edge.replace("http://", "ws://") + MEDIA_PATH, tone(300, 20.0), auth_token=TOKEN,
                              public_url=None, hold_after=0.5),
                30,
            )  # fmt: skip
            ended_after = time.monotonic() - started
            await killer
            assert during_drain == {"engine_alive": True, "edge_ready": 503, "edge_health": 200, "engine_ready": 503}
            assert report.server_hung_up and 3.0 < ended_after < 10  # up through the drain, ended with the engine
            assert report.bot_seconds_received > 0.6 * 3.0  # the 3 s to the engine's death (a slow box: 80 %)
            assert await http_status(http, edge + "/healthz") == 503  # the edge asks to be restarted
            assert await http_status(http, edge + "/readyz") == 503
    finally:
        stop_processes([edge_proc, engine_proc])
    assert "engine link to unix:" in (tmp_path / "edge.log").read_text()  # it said which engine it lost


async def test_a_caller_who_hangs_up_on_their_last_word_is_heard_across_the_link(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """"... goodbye" and an immediate hang-up, the engine on the far side of the link: the edge's close
    reached the engine, whose back-end made the utterance final as it closed, but the edge had already
    ended the call's outputs and the engine had cancelled their pump. The engine now sends what the call
    says as it closes, then its end, and the edge listens for them (bounded)."""
    from engine.link_server import EngineServer
    from engine.sampling import SamplingOverrides
    from engine.service import EngineConfig, LocalEngine
    from knowledge.backend import BackendConfig, BackendServices

    from .phone_fixtures import flite_wav

    wav = flite_wav("I would like to cancel my order please, goodbye.", tmp_path / "bye.wav")
    backend = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await backend.warm_up(1)
    engine = await LocalEngine.load(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=2,
                                                 warmup_ticks=2, sampling=SamplingOverrides(greedy=True)),
                                    backend)  # fmt: skip
    await engine.start()
    server = EngineServer(engine, token=None)
    address = await server.listen(Address(unix_path=str(tmp_path / "engine.sock")))
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    handle = await edge_service(edge)
    try:
        report = await asyncio.wait_for(simulate_call(
            handle.http_url.replace("http://", "ws://") + MEDIA_PATH, wav, auth_token=TOKEN, public_url=None,
            hold_after=0.0,
        ), 30)  # fmt: skip
        await until(lambda: not handle.ctx.streams, "the call's end")
        record = await handle.ctx.store.get(report.call_sid)
    finally:
        await handle.aclose()
        await edge.stop()
        await server.aclose()
        await engine.stop()
    assert report.outcome == "completed", report.errors
    assert record is not None
    said = " ".join(t.text for t in record.turns if t.role == "caller")
    assert "goodbye" in said or "order" in said, record.turns


async def test_a_rolling_upgrade_keeps_edges_and_engines_of_protocols_3_and_4_linked(engine_server) -> None:
    """Protocol 4 added one message (X, a failed call action). Refusing 3 outright cut every edge not yet
    upgraded off an upgraded engine (and the other way round) until the whole fleet matched. Now an engine
    welcomes a 3 as 3, and an edge told "3" by an older engine speaks 3 and never sends it X."""
    _, address = await engine_server(2)
    reader, writer = await asyncio.open_unix_connection(address.unix_path)
    writer.write(_link_message(b"H", b'{"version":3,"token":"","seats":1,"name":"old-edge"}'))
    kind, welcome = await _read_link_message(reader)
    writer.close()
    assert kind == b"W" and welcome == {"version": 3, "seats": 1}

    got: list[bytes] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:  # an engine of protocol 3
        try:
            _, hello = await _read_link_message(r)
            if hello["version"] != 3:
                w.write(_link_message(b"W", b'{"error":"version mismatch","permanent":true,"version":3}'))
                return
            w.write(_link_message(b"W", b'{"version":3,"seats":2}'))
            while True:
                (n,) = struct.unpack(">I", await r.readexactly(4))
                message = await r.readexactly(n)
                got.append(message[:1])
                if message[:1] == b"O":  # seated
                    call_id = json.loads(message[1:])["call_id"]
                    w.write(_link_message(b"R", json.dumps({"call_id": call_id, "ok": True, "error": None}).encode()))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    old = await asyncio.start_server(serve, "127.0.0.1", 0)
    edge = await RemoteEngine.connect(Address(host="127.0.0.1", port=old.sockets[0].getsockname()[1]),
                                      token=None, seats=2)  # fmt: skip
    try:
        assert edge.link_version == 3 and edge.ready
        call = await edge.open_call("CA-old")
        call.action_failed("transfer", "error")  # not for a protocol-3 engine
        await asyncio.sleep(0.3)
        assert b"X" not in got and b"O" in got
    finally:
        await edge.stop()
        old.close()


async def test_a_second_engine_on_a_live_engines_socket_is_refused_and_a_stale_one_replaced(engine_server) -> None:
    """asyncio removes a Unix socket file in its way: a second engine-serve on a live one's path took it over
    silently, and the first one's exit then removed the second's socket (every edge restarting after that
    found no engine). A live socket now refuses the second listener (EADDRINUSE), a stale one is replaced,
    and an engine removes its socket on the way out only while the file is still its own."""
    import errno
    import os

    from engine.link_server import EngineServer
    from kame_phone.media_bench import LoopbackEngine

    first, address = await engine_server(2)
    assert address.unix_path is not None
    with pytest.raises(OSError) as refused:
        await EngineServer(LoopbackEngine(max_calls=2), token=None).listen(address)
    assert refused.value.errno == errno.EADDRINUSE and "another process is listening" in str(refused.value)
    edge = await RemoteEngine.connect(address, token=None, seats=1, name="still-first")
    assert edge.max_calls == 1 and first.seats_granted == 1  # the first engine still has its socket
    await edge.stop()

    await first.aclose()  # stopped listening, its file left behind: stale
    second_engine = LoopbackEngine(max_calls=2)
    second = EngineServer(second_engine, token=None)
    try:
        await second.listen(address)  # replaced
        first.remove_socket()  # the first's way out: the file is the second's now, and stays
        edge = await RemoteEngine.connect(address, token=None, seats=1, name="second")
        assert second.seats_granted == 1
        await edge.stop()
        second.remove_socket()
        assert not os.path.exists(address.unix_path)  # noqa: ASYNC240 - its own: removed
    finally:
        await second.aclose()
        await second_engine.stop()

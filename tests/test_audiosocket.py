"""Asterisk's AudioSocket carrier: the wire, then real calls over loopback TCP (real speech in, the tiny model
and real pocketsphinx behind), and attacks on the port while a good call runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from aiohttp import ClientSession, WSServerHandshakeError

from engine.link_wire import Address
from engine.remote import RemoteEngine
from knowledge.backend import BackendConfig, BackendServices
from telephony import audiosocket_wire as wire
from telephony.audiosocket_config import AudioSocketListen, allowed, parse_listeners, parse_networks
from telephony.audiosocket_session import AudioSocketSession, PacedQueue, call_id_for
from telephony.call_store import CallStore, open_call_store
from telephony.config import ConfigError, ServiceConfig
from telephony.framing import InboundFramer
from telephony.mulaw import float_to_ulaw, ulaw_to_pcm16
from telephony.server import VOICE_PATH, ServerContext, ServiceHandle
from telephony.sim_audiosocket import audiosocket_call, caller_slin

from .phone_fixtures import Phone, metric, running_phone
from .polling import until
from .redis_support import REDIS_URL, RedisServer, SlowProxy

LOOPBACK = (AudioSocketListen("127.0.0.1", 0),)


# ---- the wire ----


async def _read(data: bytes) -> wire.Message | None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await wire.read_message(reader)


async def test_messages_round_trip_and_a_clean_end_is_none() -> None:
    assert await _read(wire.encode(wire.KIND_DTMF, b"5")) == wire.Message(wire.KIND_DTMF, b"5")
    assert await _read(wire.hangup()) == wire.Message(wire.KIND_HANGUP, b"")
    assert await _read(b"") is None
    with pytest.raises(asyncio.IncompleteReadError):  # cut inside a message: not a clean end
        await _read(wire.encode(wire.KIND_SLIN, bytes(320))[:100])


async def test_an_oversize_message_is_refused_from_its_header() -> None:
    """A header claiming 64 KiB is refused before a byte of its payload is awaited (a peer that never
    sends it would otherwise hold the read, and the buffer, for as long)."""
    reader = asyncio.StreamReader()
    reader.feed_data(bytes((wire.KIND_SLIN,)) + (0xFFFF).to_bytes(2, "big"))  # no payload, no EOF
    with pytest.raises(wire.AudioSocketError) as err:
        async with asyncio.timeout(1):
            await wire.read_message(reader)
    assert err.value.kind == wire.OVERSIZE


def test_the_first_message_must_be_a_uuid() -> None:
    u = uuid.uuid4()
    assert wire.parse_uuid(wire.Message(wire.KIND_UUID, u.bytes)) == u
    for message, kind in ((wire.Message(wire.KIND_SLIN, bytes(320)), wire.NO_UUID),
                          (wire.Message(wire.KIND_UUID, b"short"), wire.BAD_UUID)):  # fmt: skip
        with pytest.raises(wire.AudioSocketError) as err:
            wire.parse_uuid(message)
        assert err.value.kind == kind


def test_bot_audio_becomes_20ms_slin_messages_exactly() -> None:
    mulaw = float_to_ulaw(np.sin(np.arange(640) / 5).astype(np.float32) * 0.5)
    messages = wire.slin_messages(mulaw)
    assert len(messages) == 4 and all(len(m) == 3 + wire.PACKET_BYTES for m in messages)
    pcm = b"".join(m[3:] for m in messages)
    assert np.array_equal(np.frombuffer(pcm, "<i2"), ulaw_to_pcm16(mulaw))  # μ-law to linear is exact


def test_slin_framing_gives_the_engine_what_mulaw_framing_does() -> None:
    """The same line audio as μ-law (Twilio) and as its exact linear decoding (Asterisk) gives the engine the
    same frames: one resampler, one framer, two line codecs."""
    mulaw = float_to_ulaw(np.random.default_rng(1).uniform(-0.3, 0.3, 8000 // 2).astype(np.float32))
    slin = ulaw_to_pcm16(mulaw).astype("<i2").tobytes()
    a, b = InboundFramer(), InboundFramer.slin()
    frames_a = [f for i in range(0, len(mulaw), 160) for f in a.push(mulaw[i : i + 160])]
    frames_b = [f for i in range(0, len(slin), 320) for f in b.push(slin[i : i + 320])]
    assert len(frames_a) == len(frames_b) == 6
    for fa, fb in zip(frames_a, frames_b, strict=True):
        assert np.allclose(fa.pcm, fb.pcm, atol=1e-6)


def test_the_paced_queue_waits_out_its_cushion_after_running_dry_and_bounds_a_burst() -> None:
    q = PacedQueue(cushion=2, max_messages=10)
    tick = [bytes([i]) for i in range(4)]
    assert q.extend(tick, now=10.0) == 0
    assert q.next(10.0) is None and q.next(10.039) is None  # dry before: two messages' time first
    assert q.next(10.04) == bytes([0])
    q.extend([b"a"], now=10.05)  # not dry: no new wait
    assert [q.next(10.06) for _ in range(4)] == [*tick[1:], b"a"]
    assert q.next(10.1) is None and len(q) == 0 and q.gone == q.queued == 5
    q.extend(tick, now=11.0)
    assert q.next(11.0) is None and q.next(11.04) == bytes([0])  # ran dry: the cushion again
    assert q.extend([b"x"] * 9, now=11.05) == 2 and len(q) == 10  # a burst: the oldest go
    assert q.next(11.06) == bytes([3])
    q.clear()
    assert q.gone == q.queued
    q.extend(tick, now=12.0)
    assert q.next(12.0) is None  # cleared (a barge-in): the cushion again


def test_listeners_and_networks_parse_or_say_why() -> None:
    assert parse_listeners("0.0.0.0:9092=sales, [::]:9093") == (
        AudioSocketListen("0.0.0.0", 9092, "sales"), AudioSocketListen("::", 9093, None))
    for bad in ("9092", "host:port", "host:70000", ":9092"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listeners(bad)
    private = parse_networks("private")
    assert allowed("10.1.2.3", private) and allowed("::ffff:192.168.1.9", private) and allowed("::1", private)
    assert not allowed("8.8.8.8", private) and not allowed("not-an-ip", private)
    assert allowed("8.8.8.8", parse_networks("any"))
    with pytest.raises(ValueError, match="not a network"):
        parse_networks("10.0.0.0/8,nonsense")
    assert parse_networks(" ") == ()  # unset: loopback only
    assert allowed("127.0.0.1", ()) and allowed("::1", ()) and not allowed("10.1.2.3", ())


def test_a_listener_beyond_loopback_needs_its_allowlist_said_and_ports_do_not_clash() -> None:
    """No credentials on AudioSocket: behind a load balancer's SNAT "private" is anyone, so a listener off
    loopback is refused until --audiosocket-allow names the PBX. Two listeners (or a listener and the HTTP or
    metrics port) on one port are refused at start-up, not as a bind error."""
    wide = (AudioSocketListen("0.0.0.0", 9019),)
    with pytest.raises(ConfigError, match="set --audiosocket-allow"):
        ServiceConfig(host="127.0.0.1", audiosocket=wide).check()
    ServiceConfig(host="127.0.0.1", audiosocket=wide, audiosocket_allow=parse_networks("10.20.0.0/16")).check()
    for listeners, clash in (((AudioSocketListen("127.0.0.1", 8080),), "--port"),
                             ((AudioSocketListen("127.0.0.1", 9019), AudioSocketListen("127.0.0.1", 9019, "b")),
                              "--audiosocket 127.0.0.1:9019")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"is {clash}'s too"):
            ServiceConfig(host="127.0.0.1", port=8080, audiosocket=listeners).check()


async def test_a_listener_open_to_every_address_is_warned_of(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--audiosocket-allow any` on a listener off loopback: anyone who reaches the port places calls (no
    credentials), and no line said so (review, session 29). Each listener's line says who may call it."""
    caplog.set_level(logging.INFO)
    for allow, callers, warned in (("any", "0.0.0.0/0, ::/0", True), ("10.20.0.0/16", "10.20.0.0/16", False)):
        caplog.clear()
        async with running_phone(tiny_checkpoint, audiosocket=(AudioSocketListen("0.0.0.0", 0),),
                                 audiosocket_allow=parse_networks(allow)):  # fmt: skip
            pass
        said = [r.getMessage() for r in caplog.records if r.name == "telephony.audiosocket_server"]
        assert any("AudioSocket listening on 0.0.0.0:" in m and m.endswith(f"callers from {callers}")
                   for m in said), said  # fmt: skip
        assert any("open to every address" in m for m in said) is warned, said


async def test_a_node_without_twilio_credentials_answers_audiosocket_and_refuses_twilio(
    tiny_checkpoint: Path,
) -> None:
    """AudioSocket alone needs no Twilio account; such a node refuses every Twilio webhook (fails closed,
    never an unchecked one). Without AudioSocket the token stays required."""
    with pytest.raises(ConfigError, match="TWILIO_AUTH_TOKEN"):
        ServiceConfig(host="127.0.0.1").check()
    ServiceConfig(host="127.0.0.1", audiosocket=LOOPBACK).check()
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK) as phone, ClientSession() as http:
        phone.ctx.config = dataclasses.replace(phone.ctx.config, twilio_auth_token=None)
        async with http.post(phone.base + VOICE_PATH, data={"CallSid": "CA" + "0" * 32}) as resp:
            assert resp.status == 403
        with pytest.raises(WSServerHandshakeError) as refused:
            await http.ws_connect(phone.ws_url)
        assert refused.value.status == 403
        report = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 25, hold_s=0.5)
    assert report.bot_audio and not report.hung_up_by_service


# ---- calls ----


def _port(phone: Phone) -> int:
    return phone.handle.audiosocket.ports[0]


async def test_a_pbx_call_over_audiosocket_end_to_end(tiny_checkpoint: Path, question_wav: Path) -> None:
    """Real speech as Asterisk sends it (8 kHz 16-bit linear, 20 ms messages): the STT hears the caller's
    words, the bot's audio comes back paced at 20 ms a message, and the call's record says who answered
    and how it ended, under the call's own id."""
    backend = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await backend.warm_up(1)
    before = metric("kame_calls_total", outcome="completed", agent="default")
    async with running_phone(tiny_checkpoint, backend=backend, audiosocket=LOOPBACK) as phone:
        report = await audiosocket_call("127.0.0.1", _port(phone), caller_slin(question_wav), hold_s=3.0,
                                        dtmf="5")  # fmt: skip
        await phone.settled()
        record = await phone.store.get(call_id_for(report.call_uuid))
    assert not report.hung_up_by_service
    assert report.first_sound_s is not None  # the bot's audio reached the caller
    assert len(report.bot_audio) % wire.PACKET_BYTES == 0
    gaps = np.diff(report.arrivals)
    assert 0.015 < float(np.median(gaps)) < 0.025, "paced one message every 20 ms, not a tick's four at once"
    assert record is not None and record.agent == "default" and record.end_reason == "completed"
    assert record.stream_sid == str(report.call_uuid) and record.dtmf == ["5"]
    said = " ".join(t.text for t in record.turns if t.role == "caller").lower()
    assert any(w in said for w in ("store", "open", "monday", "time")), record.turns
    assert metric("kame_calls_total", outcome="completed", agent="default") == before + 1


async def test_a_call_ended_at_its_maximum_length_says_so_under_its_own_id(
    tiny_checkpoint: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The watchdog's lines (maximum length, silent socket) carried no call id over AudioSocket: its task began
    before the call's first message gave the id (review, session 29)."""
    from .phone_fixtures import json_logging

    with json_logging(capfd) as json_lines:
        async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK, max_call_s=1.0) as phone:
            report = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 200, hold_s=0.5)
            await phone.settled()
        lines = json_lines()
    sid = call_id_for(report.call_uuid)
    assert report.hung_up_by_service
    ended = [r for r in lines if "past its maximum length" in r["msg"]]
    assert ended and all(r["call_id"] == sid for r in ended), ended


async def test_audiosocket_listeners_pick_their_agent(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from knowledge.agents import AgentDirectory

    from .phone_fixtures import write_agents

    agents = AgentDirectory.from_file(write_agents(tmp_path, """
        [agents.sales]
        instructions = "You sell."
        numbers = ["+15550001111"]
    """))  # fmt: skip
    listeners = (AudioSocketListen("127.0.0.1", 0, "sales"),)
    async with running_phone(tiny_checkpoint, agents=agents, audiosocket=listeners) as phone:
        report = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 10, hold_s=0.5)
        await phone.settled()
        record = await phone.store.get(call_id_for(report.call_uuid))
    assert record is not None and record.agent == "sales"


async def test_a_full_node_hangs_up_at_once_and_counts_busy(tiny_checkpoint: Path, question_wav: Path) -> None:
    """Busy is counted and logged, with no record: a dialplan may retry with the same UUID (then answered),
    and a flood of made-up UUIDs against a full node must not write a record each."""
    before = metric("kame_calls_total", outcome="busy", agent="default")
    async with running_phone(tiny_checkpoint, max_calls=1, audiosocket=LOOPBACK) as phone:
        good = asyncio.create_task(audiosocket_call("127.0.0.1", _port(phone), caller_slin(question_wav), hold_s=2))
        await until(lambda: len(phone.ctx.streams) == 1, "the first call seated")
        busy = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 100, hold_s=0)
        report = await good
        await phone.settled()
        assert await phone.store.get(call_id_for(busy.call_uuid)) is None
        await phone.keeping_time()  # a loaded box's engine answers busy while it is behind
        retried = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 25, hold_s=0.5,
                                         call_uuid=busy.call_uuid)  # fmt: skip
    assert busy.hung_up_by_service and not busy.bot_audio
    assert retried.bot_audio and not retried.hung_up_by_service
    assert metric("kame_calls_total", outcome="busy", agent="default") == before + 1
    assert report.first_sound_s is not None and not report.hung_up_by_service


async def test_outside_the_allowed_networks_is_refused_before_a_byte_is_read(tiny_checkpoint: Path) -> None:
    before = metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="not_allowed")
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK,
                             audiosocket_allow=parse_networks("10.0.0.0/8")) as phone:  # fmt: skip
        report = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 50, hold_s=0)
        assert not phone.ctx.streams
    assert report.hung_up_by_service and not report.bot_audio
    assert metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="not_allowed") == before + 1


# ---- attacks while a good call runs ----


async def _raw(port: int, data: bytes, *, flood: bool = False) -> None:
    """Send `data` (then, with `flood`, 10 s of audio as fast as the socket takes it), and read until the
    service closes the connection (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(15):
            for _ in range(500 if flood else 0):
                writer.write(wire.encode(wire.KIND_SLIN, bytes(320)) * 10)
                await writer.drain()
            while await reader.read(65536):
                pass
    except ConnectionError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_attacks_on_the_audiosocket_port_leave_a_good_call_alone(
    tiny_checkpoint: Path, question_wav: Path,
) -> None:
    """While a good call runs: a header claiming 64 KiB, audio before any UUID, a socket that never sends
    its UUID, a flood faster than real time, unknown message kinds, and a second connection with the good
    call's own UUID. Each is closed with its error counted; the good call hears the bot and ends normally."""
    errors = {k: metric("kame_audiosocket_protocol_errors_total", kind=k)
              for k in (wire.OVERSIZE, wire.NO_UUID, "no_start", wire.FLOODING, wire.UNKNOWN_KIND)}  # fmt: skip
    second = metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="second_stream")
    flooding = metric("kame_calls_total", outcome="flooding", agent="default")
    good_uuid = uuid.uuid4()
    async with running_phone(tiny_checkpoint, max_calls=6, audiosocket=LOOPBACK, start_timeout_s=2.0) as phone:
        port = _port(phone)
        good = asyncio.create_task(audiosocket_call("127.0.0.1", port, caller_slin(question_wav), hold_s=4.0,
                                                    call_uuid=good_uuid))  # fmt: skip
        await until(lambda: call_id_for(good_uuid) in phone.ctx.streams, "the good call seated")
        oversize = bytes((wire.KIND_SLIN,)) + (0xFFFF).to_bytes(2, "big") + bytes(100)
        unknown = wire.encode(0x42, b"x" * 10) * 2000  # far past the invalid-message limit
        await asyncio.gather(
            _raw(port, wire.encode(wire.KIND_UUID, uuid.uuid4().bytes) + oversize),
            _raw(port, wire.encode(wire.KIND_SLIN, bytes(320))),
            _raw(port, b""),  # never sends its UUID: closed after the start timeout
            _raw(port, wire.encode(wire.KIND_UUID, uuid.uuid4().bytes), flood=True),
            _raw(port, wire.encode(wire.KIND_UUID, uuid.uuid4().bytes) + unknown),
            _raw(port, wire.encode(wire.KIND_UUID, good_uuid.bytes) + wire.encode(wire.KIND_SLIN, bytes(320))),
        )
        report = await good
        await phone.settled()
        record = await phone.store.get(call_id_for(good_uuid))
        assert len(phone.ctx.streams) == 0 and phone.ctx.unstarted_sockets == 0
    for kind, was in errors.items():
        assert metric("kame_audiosocket_protocol_errors_total", kind=kind) > was, kind
    assert metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="second_stream") == second + 1
    assert metric("kame_calls_total", outcome="flooding", agent="default") >= flooding + 1
    assert report.first_sound_s is not None and not report.hung_up_by_service
    assert record is not None and record.end_reason == "completed"
    assert float(np.median(np.diff(report.arrivals))) < 0.025  # still paced, never stalled for long


async def test_talking_over_queued_speech_empties_our_queue(tiny_checkpoint: Path, question_wav: Path) -> None:
    """The queue is ours (Asterisk plays on arrival): a caller talking over 0.4 s of queued bot speech gets it
    dropped at once, once they have talked half a second; the same queue over the caller's silence stays."""
    loud = wire.encode(wire.KIND_SLIN, (np.sin(np.arange(160) / 3) * 8000).astype("<i2").tobytes())
    clears = metric("kame_media_playout_clears_total")
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK) as phone:
        call_uuid = uuid.uuid4()
        caller = [bytes(320)] * 150 + caller_slin(question_wav)  # 3 s of silence, then the question
        connected = time.monotonic()
        call = asyncio.create_task(audiosocket_call("127.0.0.1", _port(phone), caller, hold_s=1.0,
                                                    call_uuid=call_uuid))  # fmt: skip
        await until(lambda: call_id_for(call_uuid) in phone.ctx.streams, "seated")
        session = phone.ctx.streams[call_id_for(call_uuid)]
        assert isinstance(session, AudioSocketSession)

        jumps: list[int] = []  # messages gone from the queue between two looks, 10 ms apart

        async def stale_speech() -> None:  # a backlog that stands, as after a stall
            while not call.done():
                gone = session.outbox.gone
                while len(session.outbox) < 20:
                    session.outbox.extend([loud], time.monotonic())
                await asyncio.sleep(0.01)
                jumps.append(session.outbox.gone - gone)

        filler = asyncio.create_task(stale_speech())
        await asyncio.sleep(0.5)
        jumps.clear()  # from here: the call's start (its row's fresh start clears the queue once) is behind
        await asyncio.sleep(max(0.3, connected + 2.4 - time.monotonic()))  # still in the caller's silence
        assert metric("kame_media_playout_clears_total") == clears  # silence under a queue: nothing dropped
        quiet_jumps = max(jumps)
        await call
        filler.cancel()
    assert metric("kame_media_playout_clears_total") > clears
    assert quiet_jumps < 10 <= max(jumps)  # paced one by one over the silence, then dropped at once


async def test_a_peer_that_never_reads_is_ended_in_seconds_beside_a_good_call(
    tiny_checkpoint: Path, question_wav: Path
) -> None:
    """A PBX leg that keeps sending its audio but reads none of the bot's: the kernel's send buffer, left to
    autotune, took megabytes (minutes of audio) before the call could see it, and the call held its seat that
    long, its bot audio minutes stale (review, session 26). Capped as Twilio's sockets are, it is ended as a
    stalled peer within seconds, and a good call beside it goes on."""
    # silent_socket_s bounds how long a peer may stall; at 4 s, not 2, a loaded box's loop pause is not taken for
    # the deaf peer falling silent (it ended as silent_socket once, its messages unread behind the pause).
    async with running_phone(tiny_checkpoint, max_calls=2, audiosocket=LOOPBACK, silent_socket_s=4.0) as phone:
        good = asyncio.create_task(audiosocket_call("127.0.0.1", _port(phone), caller_slin(question_wav), hold_s=8))
        deaf_uuid = uuid.uuid4()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing: its window closes at once
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", _port(phone)))
        _, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(wire.encode(wire.KIND_UUID, deaf_uuid.bytes))
            loud = (np.sin(np.arange(wire.PACKET_BYTES // 2) / 3) * 8000).astype("<i2").tobytes()
            started = time.monotonic()
            deaf_sid = call_id_for(deaf_uuid)
            await until(lambda: deaf_sid in phone.ctx.streams, "the deaf call seated")
            while deaf_sid in phone.ctx.streams and time.monotonic() - started < 40:
                writer.write(wire.encode(wire.KIND_SLIN, loud))  # it keeps talking: only its reading is at fault
                await asyncio.sleep(wire.PACKET_S)
            ended_after = time.monotonic() - started
        finally:
            writer.close()
        report = await good
        await phone.settled()
        record = await phone.store.get(deaf_sid)
    assert ended_after < 30, ended_after  # minutes before
    assert record is not None and record.end_reason == "stalled_peer", record
    assert report.first_sound_s is not None and not report.hung_up_by_service


async def test_a_call_the_shared_engine_turns_away_leaves_its_uuid_free_to_retry(engine_server, prefix: str) -> None:
    """The edge's seat count said free, and the shared engine (engine-serve) refused the seat: draining, its word
    still on the way. The call was written ended engine_full and its UUID kept claimed, so the dialplan's retry
    (here, or on the next node) was refused as a replay: a real caller turned away (review, session 26). Now it is
    as a busy answer: no record, the claim given back."""
    server, address = await engine_server(2, tcp=True)
    held = await RemoteEngine.connect(address, token=None, seats=1)  # another edge's call keeps the drain going
    proxy = SlowProxy(address.port, 1.0)  # the engine's word reaches this edge a second late
    await proxy.start()
    edge = await RemoteEngine.connect(Address(host="127.0.0.1", port=proxy.port), token=None, seats=1)
    store = open_call_store(REDIS_URL, key_prefix=prefix)
    config = ServiceConfig(host="127.0.0.1", port=0, audiosocket=LOOPBACK)
    handle = await ServiceHandle(ServerContext(config, store, edge)).start()
    full = metric("kame_calls_total", outcome="engine_full", agent="default")
    try:
        call = await held.open_call("CA-held")
        draining = asyncio.create_task(server.drain(timeout_s=30))
        await asyncio.sleep(0.2)  # the engine drains; this edge hears of it in a second
        assert edge.free_slots == 1
        turned_away = await audiosocket_call("127.0.0.1", handle.audiosocket.ports[0], [bytes(320)] * 150, hold_s=0)
        assert turned_away.hung_up_by_service and not turned_away.bot_audio
        assert metric("kame_calls_total", outcome="engine_full", agent="default") == full + 1
        sid = call_id_for(turned_away.call_uuid)
        await store.flush()
        await until(lambda: _released(store, sid), "the UUID free to claim again")
        assert await store.get(sid) is None
        await call.close()
        await asyncio.wait_for(draining, 5)
    finally:
        await handle.aclose()
        await store.aclose()
        await edge.stop()
        await held.stop()
        await proxy.aclose()


async def _released(store: CallStore, sid: str) -> bool:
    if not await store.claim(sid, "probe"):
        return False
    await store.release_claim(sid, "probe")
    return True


async def test_a_finished_calls_uuid_is_refused_and_its_record_kept(tiny_checkpoint: Path) -> None:
    """A UUID that already has a record is a replay (Asterisk makes a fresh one each call): taking it would
    write a stranger's audio, words and outcome into that call's record."""
    replayed = metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="replayed")
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK) as phone:
        first = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 25, hold_s=0.5, dtmf="1")
        await phone.settled()
        before = await phone.store.get(call_id_for(first.call_uuid))
        await phone.keeping_time()  # (behind, a slow box's engine answers busy first: by design, no replay seen)
        again = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 50, hold_s=0, dtmf="9",
                                       call_uuid=first.call_uuid)  # fmt: skip
        await phone.settled()
        after = await phone.store.get(call_id_for(first.call_uuid))
    assert again.hung_up_by_service and not again.bot_audio
    assert before is not None and before == after and after.dtmf == ["1"] and after.end_reason == "completed"
    assert metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="replayed") == replayed + 1


async def test_two_nodes_offered_one_uuid_at_once_answer_it_once(tiny_checkpoint: Path, prefix: str) -> None:
    """Two nodes on one Redis, each offered the same UUID at the same moment (a dialplan retrying on the
    next node, or a replay aimed at both): one answers, the other refuses it as a replay, and the record
    holds the one call."""
    replayed = metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="replayed")
    stores = [open_call_store(REDIS_URL, key_prefix=prefix) for _ in range(2)]
    try:
        async with (
            running_phone(tiny_checkpoint, audiosocket=LOOPBACK, store=stores[0], node_id="node-a") as a,
            running_phone(tiny_checkpoint, audiosocket=LOOPBACK, store=stores[1], node_id="node-b") as b,
        ):
            call_uuid = uuid.uuid4()
            reports = await asyncio.gather(*(
                audiosocket_call("127.0.0.1", _port(p), [bytes(320)] * 25, hold_s=0.5, call_uuid=call_uuid)
                for p in (a, b)))  # fmt: skip
            await a.settled()
            await b.settled()
            record = await stores[0].get(call_id_for(call_uuid))
    finally:
        for store in stores:
            await store.aclose()
    answered = [r for r in reports if not r.hung_up_by_service]
    assert len(answered) == 1 and answered[0].bot_audio
    assert metric("kame_webhook_rejections_total", endpoint="audiosocket", reason="replayed") == replayed + 1
    assert record is not None and record.end_reason == "completed"
    assert record.node == ("node-a" if reports[0] is answered[0] else "node-b")


async def test_with_redis_down_a_call_is_answered_unchecked_and_counted(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The replay check needs Redis; a Redis that is down must not turn every PBX call away: the call is
    answered, and the skipped check is counted (its record waits for Redis like every other write)."""
    server = RedisServer(tmp_path)
    await server.start()
    store = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    unchecked = metric("kame_audiosocket_unchecked_calls_total")
    try:
        async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK, store=store) as phone:
            await server.kill()
            report = await audiosocket_call("127.0.0.1", _port(phone), [bytes(320)] * 25, hold_s=0.5)
            assert store.pending_ops > 0  # type: ignore[attr-defined]
    finally:
        store.close_timeout_s = 0.2  # type: ignore[attr-defined]
        await store.aclose()  # gives up on the call's record: Redis never came back
        await server.kill()
    assert not report.hung_up_by_service and report.bot_audio
    assert metric("kame_audiosocket_unchecked_calls_total") == unchecked + 1


async def test_a_channel_at_another_rate_ends_at_once_as_misconfigured(tiny_checkpoint: Path) -> None:
    """Asterisk sending 16 kHz (a kind of its own) would have every message refused: the call ends at once,
    not after a flood's worth of errors, and says why."""
    wrong = metric("kame_audiosocket_protocol_errors_total", kind=wire.WRONG_RATE)
    misconfigured = metric("kame_calls_total", outcome="misconfigured", agent="default")
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK) as phone:
        started = time.monotonic()
        await _raw(_port(phone), wire.encode(wire.KIND_UUID, uuid.uuid4().bytes) + wire.encode(0x12, bytes(640)) * 50)
        took = time.monotonic() - started
        assert not phone.ctx.streams
    assert took < 5.0  # well inside the 15 s a flood's end would take
    assert metric("kame_audiosocket_protocol_errors_total", kind=wire.WRONG_RATE) == wrong + 1
    assert metric("kame_calls_total", outcome="misconfigured", agent="default") == misconfigured + 1


async def test_a_flood_of_tiny_audio_messages_ends_the_call_and_spares_the_loop(
    tiny_checkpoint: Path, question_wav: Path,
) -> None:
    """One-sample audio messages carry almost no seconds, so the real-time guard let thousands a second
    through, each a trip through the framer on the event loop every call shares. They are capped by count:
    the flood ends as `flooding` and a good call beside it keeps its pace."""
    flooding = metric("kame_calls_total", outcome="flooding", agent="default")
    async with running_phone(tiny_checkpoint, max_calls=2, audiosocket=LOOPBACK) as phone:
        good = asyncio.create_task(audiosocket_call("127.0.0.1", _port(phone), caller_slin(question_wav), hold_s=2))
        await until(lambda: len(phone.ctx.streams) == 1, "the good call seated")
        # 3000 one-sample messages: 0.4 s of audio, inside the real-time guard's burst, so only their count
        # gives them away.
        tiny = wire.encode(wire.KIND_SLIN, b"\0\0") * 3000
        await _raw(_port(phone), wire.encode(wire.KIND_UUID, uuid.uuid4().bytes) + tiny)
        report = await good
    assert metric("kame_calls_total", outcome="flooding", agent="default") == flooding + 1
    assert report.first_sound_s is not None and not report.hung_up_by_service
    assert float(np.median(np.diff(report.arrivals))) < 0.025


async def test_audiosocket_connections_that_never_start_do_not_block_twilio_streams(
    tiny_checkpoint: Path,
) -> None:
    """Each carrier has its own cap of connections awaiting their start: a host inside --audiosocket-allow
    holding AudioSocket connections open without a UUID must not turn every Twilio upgrade away."""
    async with running_phone(tiny_checkpoint, audiosocket=LOOPBACK, max_unstarted_streams=4) as phone, \
            ClientSession() as http:  # fmt: skip
        held = [await asyncio.open_connection("127.0.0.1", _port(phone)) for _ in range(6)]
        try:
            await until(lambda: phone.ctx.unstarted["audiosocket"] == 4, "the AudioSocket cap full")
            ws = await phone.awaiting_stream(http)  # a Twilio upgrade still gets its socket
            assert not ws.closed and phone.ctx.unstarted["media"] == 1
            await ws.close()
        finally:
            for _, writer in held:
                writer.close()

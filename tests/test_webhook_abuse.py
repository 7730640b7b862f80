"""Webhooks under attack, on the real service (loopback, a model-free echoing engine): bodies that never
arrive or are not Twilio's, captured webhooks replayed, a captured media-upgrade signature used to hold the
sockets that wait for their `start`, crafted SIP addresses in a routed `To`. Each test checks that a good call
still gets through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import aiohttp
import pytest
from twilio.request_validator import RequestValidator

from engine.interface import MAX_SETUP_TEXT
from kame_phone.media_bench import LoopbackEngine
from knowledge.agents import AgentDirectory
from telephony import server as server_module
from telephony.call_store import MemoryCallStore
from telephony.cluster import stream_url_for
from telephony.config import ServiceConfig
from telephony.server import CALL_STATUS_PATH, MAX_ROUTED_TEXT, MEDIA_PATH, VOICE_PATH, ServerContext, ServiceHandle
from telephony.signatures import SIGNATURE_HEADER
from telephony.sim_caller import simulate_call
from telephony.sim_playout import caller_packets
from telephony.twiml import parse_connect_stream

from .link_fixtures import tone
from .phone_fixtures import TalksUntil, metric, write_agents
from .polling import until

TOKEN = "auth-" + secrets.token_hex(8)
FORGED_START = {"accountSid": "AC1", "streamSid": "MZ1", "tracks": ["inbound"], "customParameters": {},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}


async def _captured_upgrade(http: aiohttp.ClientSession, h: ServiceHandle) -> tuple[str, str]:
    """A call answered whose stream has not started, its stream URL (on this loopback node) and Twilio's upgrade
    signature on it, as an attacker reading headers in those seconds would hold them."""
    status, twiml = await _voice(http, h.http_url, _sid())
    assert status == 200 and "<Connect" in twiml, twiml
    url = h.http_url.replace("http://", "ws://") + urlsplit(parse_connect_stream(twiml).url).path
    return url, RequestValidator(TOKEN).compute_signature(url, {})


def _sid() -> str:
    return "CA" + secrets.token_hex(16)


@contextlib.asynccontextmanager
async def _service(
    max_calls: int = 2, agents: AgentDirectory | None = None, **config: object
) -> AsyncIterator[ServiceHandle]:
    engine = LoopbackEngine(max_calls=max_calls)
    cfg = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=TOKEN, **config)  # type: ignore[arg-type]
    handle = await ServiceHandle(ServerContext(cfg, MemoryCallStore(), engine, agents=agents)).start()
    try:
        yield handle
    finally:
        await engine.stop()
        await handle.aclose()


async def _signed_post(http: aiohttp.ClientSession, url: str, form: dict[str, str] | bytes) -> tuple[int, str]:
    """A webhook as Twilio sends it: `form` posted to `url`, signed with the account's token. A form given as
    bytes is the body as it goes on the wire, signed over its fields as the server decodes them."""
    if isinstance(form, bytes):
        fields = dict(parse_qsl(form.decode(errors="replace"), keep_blank_values=True))
        signature = RequestValidator(TOKEN).compute_signature(url, fields)
        headers = {SIGNATURE_HEADER: signature, "Content-Type": "application/x-www-form-urlencoded"}
    else:
        headers = {SIGNATURE_HEADER: RequestValidator(TOKEN).compute_signature(url, form)}
    async with http.post(url, data=form, headers=headers) as r:
        return r.status, await r.text()


async def _voice(http: aiohttp.ClientSession, base: str, sid: str, to: str = "+15550002") -> tuple[int, str]:
    """Twilio's voice webhook for call `sid` to `to`, signed."""
    form = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": to}
    return await _signed_post(http, base + VOICE_PATH, form)


async def _raw_post(port: int, head: bytes, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST " + VOICE_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def test_bodies_that_never_arrive_are_cut_off_and_calls_still_come_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp's keep-alive timer runs only between requests: a POST's headers with a body that never came held
    its connection for good, and as many as the connection cap shut out every webhook and stream after them.
    Each is answered 408 once the body is BODY_READ_S late, and the connection goes."""
    monkeypatch.setattr(server_module, "BODY_READ_S", 0.5)
    slow = metric("kame_webhook_rejections_total", endpoint="voice", reason="slow_body")
    async with _service(max_idle_connections=4, keepalive_timeout_s=30.0) as h, aiohttp.ClientSession() as http:
        held = [await _raw_post(h.port, b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 30000\r\n",
                                b"CallSid=CA") for _ in range(4)]  # fmt: skip
        try:
            for reader, _ in held:
                answer = await asyncio.wait_for(reader.read(), 5)  # answered, and the connection closed
                assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            status, twiml = await _voice(http, h.http_url, _sid())
        finally:
            for _, writer in held:
                writer.close()
    assert status == 200 and parse_connect_stream(twiml).parameters["token"]
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="slow_body") == slow + 4


async def test_an_oversized_webhook_body_is_a_counted_413() -> None:
    oversize = metric("kame_webhook_rejections_total", endpoint="voice", reason="oversize")
    async with _service() as h, aiohttp.ClientSession() as http:
        async with http.post(h.http_url + VOICE_PATH, data={"CallSid": "CA" + "0" * 40_000}) as r:
            status = r.status
    assert status == 413
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="oversize") == oversize + 1


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (b"application/x-www-form-urlencoded", b"CallSid=\xff\xfe"),  # not UTF-8
        (b"application/x-www-form-urlencoded; charset=bogus-42", b"CallSid=x"),
        (b"multipart/form-data", b"--x\r\n"),  # no boundary
        (b"multipart/form-data; boundary=zz", b"garbage"),
        (b"multipart/form-data; boundary=zz",
         b'--zz\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n\r\nhello\r\n--zz--\r\n'),
        (b"application/json", b'{"CallSid": 1}'),
    ],
)  # fmt: skip
async def test_a_body_twilio_never_sends_is_a_counted_400_not_a_traceback(
    content_type: bytes, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Each of these was a 500 with a traceback at ERROR (about 15 log lines a request, from anyone, with no
    credentials), unseen by kame_webhook_rejections_total; the file part crashed inside the signature check."""
    caplog.set_level(logging.INFO)
    malformed = metric("kame_webhook_rejections_total", endpoint="voice", reason="malformed")
    async with _service() as h, aiohttp.ClientSession() as http:
        head = (b"X-Twilio-Signature: bogus\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nConnection: close\r\n")  # fmt: skip
        reader, writer = await _raw_post(h.port, head, body)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        status, _ = await _voice(http, h.http_url, _sid())  # a good call comes in as before
    assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="malformed") == malformed + 1
    assert status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text[-2000:]


async def test_a_flood_of_unsigned_webhooks_is_counted_each_and_logged_sampled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone can post to /twilio/*: 300 unsigned or forged requests on one keep-alive connection are each
    counted, but logged only as a sample (a line each was a log flood, and on a slow log sink a loop stall)."""
    caplog.set_level(logging.INFO)
    missing = metric("kame_webhook_rejections_total", endpoint="voice", reason="missing_signature")
    bad = metric("kame_webhook_rejections_total", endpoint="voice", reason="bad_signature")
    async with _service() as h, aiohttp.ClientSession() as http:
        for i in range(300):
            headers = {SIGNATURE_HEADER: "forged"} if i % 2 else {}
            async with http.post(h.http_url + VOICE_PATH, data={"CallSid": _sid()}, headers=headers) as resp:
                assert resp.status == 403
        status, _ = await _voice(http, h.http_url, _sid())  # a good call comes in as before
    assert status == 200
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="missing_signature") == missing + 150
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="bad_signature") == bad + 150
    lines = [r for r in caplog.records if "refused (" in r.getMessage()]
    assert 2 <= len(lines) <= 8, len(lines)  # the 1st, 10th and 100th of each kind


async def test_a_call_whose_reservation_expired_unclaimed_is_ended_by_its_final_status() -> None:
    """Its stream never started (not opened; the caller had the agent's fallback, or hung up): Twilio's final
    call status, after the reservation expired, ends the record as no_stream. Taken for a stream started
    elsewhere (the expired CallSid is used up against replays), it stayed "ringing" for good."""
    async with _service(reservation_ttl_s=0.3) as h, aiohttp.ClientSession() as http:
        sid = _sid()
        status, _ = await _voice(http, h.http_url, sid)
        assert status == 200
        await asyncio.sleep(0.6)  # the reservation expired unclaimed
        form = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "CallStatus": "completed"}
        status, _ = await _signed_post(http, h.http_url + CALL_STATUS_PATH, form)
        assert status == 204
        await h.ctx.store.flush()
        record = await h.ctx.store.get(sid)
    assert record is not None and (record.state, record.end_reason) == ("ended", "no_stream")


async def test_a_captured_webhook_replayed_after_its_reservation_expired_gets_no_seat() -> None:
    """A signed webhook whose stream never started (hung up while ringing, say) was answered again after its
    reservation expired: a new token and a seat, every 8 s, for as long as its holder cared to replay it. On a
    one-seat node that shut the real caller out."""
    replayed = metric("kame_webhook_rejections_total", endpoint="voice", reason="replayed")
    async with _service(max_calls=1, reservation_ttl_s=0.5) as h, aiohttp.ClientSession() as http:
        sid = _sid()
        status, first = await _voice(http, h.http_url, sid)
        assert status == 200 and parse_connect_stream(first).parameters["token"]
        await asyncio.sleep(0.8)  # its stream never came: the reservation expired
        status, again = await _voice(http, h.http_url, sid)  # the replay, byte for byte
        _, real = await _voice(http, h.http_url, _sid())
    assert status == 200 and "<Hangup" in again and "<Connect" not in again
    assert metric("kame_webhook_rejections_total", endpoint="voice", reason="replayed") == replayed + 1
    assert "<Connect" in real  # the seat is the real caller's


async def test_one_captured_upgrade_signature_cannot_keep_real_calls_streams_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A media upgrade's signature never expires (and was the same for every call, before per-call URLs). Its
    holder kept the unstarted cap full, reopening each socket as the start timeout closed it, and every real
    call's upgrade was refused (8 of 8 in the review). One captured for a call never answered (or long over)
    now opens nothing. Those of calls awaiting their stream (the attacker racing Twilio) could still fill the
    cap for those seconds: the oldest unstarted socket makes room. A `start` with a newline in the callSid is
    refused as malformed, never written into the log as a line of its own."""
    caplog.set_level(logging.INFO)
    async with _service(max_calls=8, max_unstarted_streams=4, start_timeout_s=5.0) as h, \
            aiohttp.ClientSession() as http:  # fmt: skip
        ws_url = h.http_url.replace("http://", "ws://") + MEDIA_PATH
        never = stream_url_for(ws_url, _sid())
        for _ in range(20):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(never, headers={SIGNATURE_HEADER: RequestValidator(TOKEN).compute_signature(
                    never, {})})  # fmt: skip
            assert refused.value.status == 403 and h.ctx.unstarted_sockets == 0
        captured = [await _captured_upgrade(http, h) for _ in range(5)]  # calls whose stream has not started
        stop = asyncio.Event()

        async def hold(url: str, signature: str) -> None:
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.ws_connect(url, headers={SIGNATURE_HEADER: signature}) as ws:
                        while not stop.is_set() and not ws.closed:  # no `start`, ever
                            with contextlib.suppress(TimeoutError):
                                await ws.receive(timeout=0.2)
                await asyncio.sleep(0.05)

        url, signature = captured.pop()
        async with http.ws_connect(url, headers={SIGNATURE_HEADER: signature}) as ws:
            start = {**FORGED_START, "callSid": "CAx\nforged admin login ok"}
            await ws.send_str(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": start}))
            with contextlib.suppress(TimeoutError):
                await ws.receive(timeout=0.5)  # a malformed start: counted, the socket left to its start timeout
        holders = [asyncio.create_task(hold(url, signature)) for url, signature in captured]
        try:
            await until(lambda: h.ctx.unstarted_sockets == 4, within=5)  # the cap is full
            await asyncio.sleep(1.2)  # and its sockets over a second old (younger ones are never closed)
            reports = []
            for _ in range(3):  # real calls, one after another, while the holders reopen what is closed
                reports.append(await simulate_call(ws_url, tone(440.0, 1.0), auth_token=TOKEN, public_url=None,
                                                   hold_after=0.3))  # fmt: skip
        finally:
            stop.set()
            await asyncio.gather(*holders, return_exceptions=True)
    assert [r.outcome for r in reports] == ["completed"] * 3, [r.errors for r in reports]
    assert all(r.bot_seconds_received > 0.5 for r in reports)
    assert "\nforged admin login ok" not in caplog.text  # never a log line of its own


async def test_the_metrics_listener_caps_its_connections_and_closes_idle_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics port (and engine-serve's health port) kept every connection an hour, uncapped: any peer on
    the pod network held a thousand sockets (2,000 file descriptors in the review), which the calls need."""
    from telephony import metrics_http

    monkeypatch.setattr(metrics_http, "INTERNAL_KEEPALIVE_S", 0.5)
    async with _service(metrics_port=0) as h, aiohttp.ClientSession() as http:
        assert h.metrics is not None and h.metrics._runner is not None
        server = h.metrics._runner.server
        assert server is not None
        idle = [await asyncio.open_connection(h.metrics.host, h.metrics.port) for _ in range(100)]
        try:
            await asyncio.sleep(0.1)
            assert len(server.connections) <= metrics_http.INTERNAL_MAX_CONNECTIONS
            await until(lambda: not server.connections, within=5)  # idle ones closed after the keep-alive
            async with http.get(f"http://{h.metrics.host}:{h.metrics.port}/metrics") as r:
                assert r.status == 200 and "kame_calls_active" in await r.text()
        finally:
            for _, writer in idle:
                writer.close()


async def test_sockets_whose_start_is_refused_do_not_hold_the_unstarted_cap() -> None:
    """The holder of captured upgrade signatures sends a `start` with a made-up token on each socket and never
    answers the close: the refused sockets counted as unstarted for the close handshake's 2 s, and never being
    "awaiting start" either, could not be closed for a newer upgrade: real calls' streams got 503."""
    async with _service(max_calls=10, max_unstarted_streams=4, start_timeout_s=5.0) as h, \
            aiohttp.ClientSession() as http:  # fmt: skip
        ws_url = h.http_url.replace("http://", "ws://") + MEDIA_PATH
        stop = asyncio.Event()
        captured = [await _captured_upgrade(http, h) for _ in range(6)]  # calls whose stream has not started

        async def hold(k: int) -> None:
            await asyncio.sleep(k * 0.08)  # staggered, as sockets come: six upgrades in one instant are a burst
            url, signature = captured[k]
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                    ws = await http.ws_connect(url, headers={SIGNATURE_HEADER: signature}, autoclose=False)
                    start = {**FORGED_START, "callSid": url.rsplit("/", 1)[1], "customParameters": {"token": "made-up"}}
                    await ws.send_str(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ1",
                                                  "start": start}))  # fmt: skip
                    await asyncio.sleep(0.5)  # does not read: the server's close goes unanswered meanwhile
                    await ws.close()
                    continue  # then again
                await asyncio.sleep(0.5)  # an upgrade refused: again at the same pace (never a tight loop)

        holders = [asyncio.create_task(hold(k)) for k in range(6)]
        try:
            await asyncio.sleep(0.5)
            reports = [await simulate_call(ws_url, tone(440.0, 1.0), auth_token=TOKEN, public_url=None,
                                           hold_after=0.3) for _ in range(3)]  # fmt: skip
        finally:
            stop.set()
            await asyncio.gather(*holders, return_exceptions=True)
    assert [r.outcome for r in reports] == ["completed"] * 3, [r.errors for r in reports]


# --- a routed `To`: its length cap and crafted SIP addresses ---------------------------------------------

SIP_SALES = "sip:sales@example.sip.twilio.com"
ROUTED_AGENTS = f"""
[agents.default]
instructions = "You answer the phone for Example Inc."

[agents.sales]
numbers = ["{SIP_SALES}"]
instructions = "You sell Example's widgets."
"""


def _routed_agents(tmp_path: Path) -> AgentDirectory:
    return AgentDirectory.from_file(write_agents(tmp_path, ROUTED_AGENTS))


def _padded(address: str, length: int) -> str:
    """`address` with a URI parameter making it `length` characters: the same address to routing."""
    return address if length == len(address) else address + ";x-pad=" + "p" * (length - len(address) - 7)


def _agent_of(status: int, twiml: str) -> str | int:
    """The agent a webhook's answer streams the call to; else its HTTP status, or a 200's other TwiML."""
    if status != 200:
        return status
    return parse_connect_stream(twiml).parameters["agent"] if "<Stream" in twiml else twiml[:300]


@pytest.mark.parametrize(
    ("length", "agent"),
    [(len(SIP_SALES), "sales"), (MAX_ROUTED_TEXT, "sales"), (MAX_ROUTED_TEXT + 1, "default"), (5000, "default")],
)
async def test_a_routed_to_over_its_cap_is_answered_by_the_default_agent(
    tmp_path: Path, length: int, agent: str
) -> None:
    """A `To` over MAX_ROUTED_TEXT is not matched against the agents' addresses (the matching's work on a
    32 KB field is bounded): the call is the default agent's, even where the address in it is claimed. At
    the cap and under it, the claiming agent answers. The TwiML and the call's record say which."""
    directory = _routed_agents(tmp_path)
    to = _padded(SIP_SALES, length)
    assert len(to) == length and directory.agents.for_call(to).name == "sales"  # the address alone: sales
    async with _service(agents=directory) as h, aiohttp.ClientSession() as http:
        sid = _sid()
        status, twiml = await _voice(http, h.http_url, sid, to=to)
        await h.ctx.store.flush()
        record = await h.ctx.store.get(sid)
    assert _agent_of(status, twiml) == agent
    assert record is not None and record.agent == agent and record.to_number == to[:MAX_SETUP_TEXT]


def _crafted(to: str) -> bytes:
    """A `To` as it goes on the wire (percent-encoded as UTF-8)."""
    return quote(to, safe="").encode()


def _voice_form(sid: str, to: bytes) -> bytes:
    """The voice webhook's body for call `sid`, its `To` the bytes `to` as they are."""
    return urlencode({"CallSid": sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001"}).encode() + b"&To=" + to


# Each crafted `To` (the form field's bytes on the wire) and the answer it gets: the agent streamed to, or an
# HTTP status. No crafted user or host reaches the sales agent; an upper-case scheme does (RFC 3261: the scheme
# compares case-insensitively), being the same address.
CRAFTED_TOS: dict[str, tuple[bytes, str | int]] = {
    "two-ats": (_crafted("sip:sales@evil.example@example.sip.twilio.com"), "default"),
    "escaped-at-in-user": (_crafted("sip:sales%40example.sip.twilio.com@x"), "default"),
    "escaped-at-on-our-host": (_crafted("sip:sales%40evil.example@example.sip.twilio.com"), "default"),
    "upper-case-scheme": (_crafted("SIP:sales@example.sip.twilio.com"), "sales"),
    "5000-chars": (_crafted(_padded(SIP_SALES, 5000)), "default"),
    "5000-char-host": (_crafted("sip:sales@" + "a" * 4990 + ".example"), "default"),
    "nul-in-user": (_crafted("sip:sales\x00@example.sip.twilio.com"), "default"),
    "nul-first": (_crafted("\x00" + SIP_SALES), "default"),
    "control-chars-after-host": (_crafted(SIP_SALES + "\x07\x1b[2J\x7f"), "default"),
    "sip-escapes-not-utf8": (_crafted("sip:%ff%fe@example.sip.twilio.com"), "default"),
    "sip-escape-cut-short": (_crafted("sip:sales%4@example.sip.twilio.com"), "default"),
    "form-escape-not-utf8": (b"sip%3Asales%FF%40example.sip.twilio.com", "default"),
    "raw-bytes-not-utf8": (b"sip:sales\xff\xfe@example.sip.twilio.com", 400),
}


async def test_crafted_sip_tos_get_clean_answers_while_a_good_call_streams(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Signed voice webhooks whose `To` is a crafted SIP address (an '@' hidden in the user, escaped or not,
    control characters, percent-escapes that are not UTF-8, 5000 characters), all at once while a call to
    the sales agent's address streams: each is streamed to the default agent (an upper-case scheme, the same
    address, to the sales agent; bytes that are not UTF-8 are refused 400), never a 500 nor a traceback, and
    the call goes on hearing the bot, then ends normally with its record whole."""
    caplog.set_level(logging.INFO)
    caller, good_sid = TalksUntil(asyncio.Event(), tuple(caller_packets(tone(440.0, 1.0)))), _sid()
    async with _service(max_calls=len(CRAFTED_TOS) + 1, agents=_routed_agents(tmp_path)) as h, \
            aiohttp.ClientSession() as http:  # fmt: skip
        ws_url = h.http_url.replace("http://", "ws://") + MEDIA_PATH
        call = asyncio.create_task(simulate_call(ws_url, caller, auth_token=TOKEN, public_url=None,
                                                 custom_sid=good_sid, to_number=SIP_SALES))  # fmt: skip
        sids = {name: _sid() for name in CRAFTED_TOS}
        try:
            await until(lambda: good_sid in h.ctx.streams, "the good call streaming", within=15)
            answers = await asyncio.gather(*(_signed_post(http, h.http_url + VOICE_PATH, _voice_form(sids[name], to))
                                             for name, (to, _) in CRAFTED_TOS.items()))  # fmt: skip
            streamed_throughout = good_sid in h.ctx.streams
        finally:
            caller.done.set()
            report = await call
        await asyncio.wait_for(h.ctx.no_streams.wait(), 10)  # the call's end written on the server's side
        await h.ctx.store.flush()
        good = await h.ctx.store.get(good_sid)
        records = {name: await h.ctx.store.get(sid) for name, sid in sids.items()}
    got = {name: _agent_of(status, twiml) for name, (status, twiml) in zip(CRAFTED_TOS, answers, strict=True)}
    assert got == {name: answer for name, (_, answer) in CRAFTED_TOS.items()}
    recorded = {name: record.agent if record else None for name, record in records.items()}
    assert recorded == {name: answer if answer != 400 else None for name, (_, answer) in CRAFTED_TOS.items()}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text[-2000:]
    # The good call: streaming all along, the bot heard after the attack as before, ended by its caller.
    assert streamed_throughout
    assert report.outcome == "completed" and not report.server_hung_up, report.errors
    assert report.custom_parameters["agent"] == "sales"
    assert caller.bot_after_s > 0.5, (caller.done_at, caller.bot_after_s)
    assert good is not None and (good.state, good.end_reason, good.agent) == ("ended", "completed", "sales")
    assert good.to_number == SIP_SALES and good.stream_sid == report.stream_sid

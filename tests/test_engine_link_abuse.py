"""The engine link under attack (issue 13, finding 7), each while a good call runs through an edge on the same
engine: peers that never say a proper hello, an edge (holding the shared token) that names another edge's call,
and a peer of another protocol version. Also: the one-line exits of `serve` and `engine-serve`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.interface import FRAME_SAMPLES, CallSetup
from engine.link_server import HELLO_TIMEOUT_S, MAX_HANDSHAKES, MAX_UNAUTHENTICATED
from engine.link_wire import PROTOCOL_VERSION, Address, LinkRefused, edge_tls
from engine.remote import RemoteEngine
from telephony.server import MEDIA_PATH, ServiceHandle
from telephony.sim_caller import CallReport, simulate_call

from .link_fixtures import TLS_CERT, TOKEN, edge_service, tone
from .phone_fixtures import dominant_hz, metric
from .redis_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _errors(kind: str) -> float:
    return metric("kame_engine_link_errors_total", kind=kind)


async def _good_call(edge: ServiceHandle, hz: float, out: Path) -> CallReport:
    ws_url = edge.http_url.replace("http://", "ws://") + MEDIA_PATH
    return await simulate_call(ws_url, tone(hz, 4.0), auth_token=TOKEN, public_url=None, out_wav=out, hold_after=0.5)


def _assert_heard(report: CallReport, hz: float, out: Path) -> None:
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.6 * 4.5  # the whole call (a slow box makes 80 % of real time)
    assert abs(dominant_hz(out) - hz) < 20


async def _read_or_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Whatever the engine said before it hung up (b"" if nothing); fails if it keeps the connection open."""
    async with asyncio.timeout(within):
        try:
            return await reader.read()
        except ConnectionResetError:  # hung up with our unread bytes in its buffer
            return b""


async def test_peers_without_a_proper_hello_cost_the_engine_nothing_while_a_call_runs(
    tmp_path: Path, engine_server, caplog: pytest.LogCaptureFixture
) -> None:
    """Peers that never say a proper hello cost the engine no memory, no edge's place and no log line each (every
    one is counted; a sample of each kind is logged), while a call runs."""
    caplog.set_level(logging.INFO, logger="engine.link_server")
    _, address = await engine_server(2, tcp=True, token=TOKEN)
    edge_engine = await RemoteEngine.connect(address, token=TOKEN, seats=1)
    edge = await edge_service(edge_engine)
    out = tmp_path / "good.wav"
    call = asyncio.create_task(_good_call(edge, 700.0, out))
    try:
        await asyncio.sleep(0.5)  # the good call is up
        # 1. Forty peers each announce a 32 MiB hello and start sending it (4 MiB each, 160 MiB in all).
        #    Before: each was read whole into memory for up to 5 s. Now: refused at the length, a few KB.
        counted = _errors("bad_hello") + _errors("unauthenticated_cap")
        rss = _rss_mib()
        chunk = memoryview(bytes(4 << 20))

        async def huge_hello() -> bytes:
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(struct.pack(">I", 32 << 20) + b"H")
            with contextlib.suppress(ConnectionError):
                writer.write(chunk)
                await writer.drain()
            said = await _read_or_closed(reader, 1.5)  # hung up on at once, not after a timeout
            writer.close()
            return said

        said = await asyncio.gather(*(huge_hello() for _ in range(40)))
        assert _rss_mib() - rss < 48, f"RSS {rss:.0f} -> {_rss_mib():.0f} MiB"
        assert _errors("bad_hello") + _errors("unauthenticated_cap") - counted == 40
        assert all(b"seats" not in s for s in said)

        # 2. Forty peers connect and say nothing: MAX_UNAUTHENTICATED are held (each until HELLO_TIMEOUT_S),
        #    each newer one closing the oldest with a reason; and an edge joins while they are held (refusing
        #    the newest instead let a few silent sockets keep every edge out).
        capped = _errors("unauthenticated_cap")
        silent = [await asyncio.open_connection(address.host, address.port) for _ in range(40)]
        joined = await RemoteEngine.connect(address, token=TOKEN, seats=1)
        await joined.stop()
        answers = await asyncio.gather(*(_read_or_closed(r, HELLO_TIMEOUT_S + 2.0) for r, _ in silent))
        refused = [a for a in answers if b"too many connections" in a]
        assert len(refused) == 40 - MAX_UNAUTHENTICATED + 1  # the edge's connection made room too
        assert _errors("unauthenticated_cap") - capped == 40 - MAX_UNAUTHENTICATED + 1
        for _, w in silent:
            w.close()
        # 3. Hellos of the right size that no JSON reader or seat count takes: each is a bad hello, not a
        #    traceback, whatever the token.
        bad_hellos = _errors("bad_hello")
        for body in (b"[" * 4000, b'{"version":%d,"seats":1e400}' % PROTOCOL_VERSION, b'{"seats":"many"}', b"[1]"):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(struct.pack(">I", len(body) + 1) + b"H" + body)
            assert b"seats" not in await _read_or_closed(reader, 2.0)
            writer.close()
        assert _errors("bad_hello") - bad_hellos == 4
        # The slots are free again: a real edge still joins.
        late = await RemoteEngine.connect(address, token=TOKEN, seats=1)
        assert late.max_calls == 1
        await late.stop()
        _assert_heard(await call, 700.0, out)
        refusals = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert 3 <= len(refusals) <= 12, [r.getMessage() for r in refusals]  # of 117 refused peers
    finally:
        call.cancel()
        await edge.aclose()
        await edge_engine.stop()


async def test_tls_handshakes_have_a_cap_and_an_edge_still_joins(engine_server) -> None:
    """Over tls:// the server did each handshake before any cap saw the peer: a peer could hold as many sockets
    (and key exchanges) as it opened, 2 s each. Handshakes now have a cap of their own (the oldest goes for a
    newer one): eighty peers that connect and never say a TLS word hold 64 sockets, and an edge still joins."""
    _, address = await engine_server(2, tls=True, token=TOKEN)
    capped, bad = _errors("unauthenticated_cap"), _errors("bad_hello")
    silent = [await asyncio.open_connection(address.host, address.port) for _ in range(80)]  # no ClientHello
    joined = await RemoteEngine.connect(address, token=TOKEN, seats=1, tls=edge_tls(str(TLS_CERT)))
    assert joined.max_calls == 1
    await joined.stop()
    await asyncio.gather(*(_read_or_closed(r, HELLO_TIMEOUT_S + 2.0) for r, _ in silent))  # all hung up on
    assert _errors("unauthenticated_cap") - capped == 80 - MAX_HANDSHAKES + 1  # the edge made room too
    assert _errors("bad_hello") - bad == MAX_HANDSHAKES - 1  # the rest: no handshake in 2 s
    for _, w in silent:
        w.close()


async def test_an_edge_cannot_take_or_hear_another_edges_call(engine_server) -> None:
    """Two edges name the same call id (a token holder could pick any): each has its own seat and its own audio,
    and one closing its call leaves the other's up. Before, the second open took the first edge's seat."""
    server, address = await engine_server(2, tcp=True, token=TOKEN)
    a = await RemoteEngine.connect(address, token=TOKEN, seats=1, name="a")
    b = await RemoteEngine.connect(address, token=TOKEN, seats=1, name="b")
    try:
        call_a = await a.open_call("CA-same")
        call_b = await b.open_call("CA-same")
        assert server.calls == 2
        ticks_a, ticks_b = aiter(a.bot_frames()), aiter(b.bot_frames())

        async def hears(ticks, call, level: float) -> None:
            async with asyncio.timeout(5):
                while True:
                    call.push_audio(np.full(FRAME_SAMPLES, level, np.float32))
                    tick = await anext(ticks)
                    assert tick.call_ids in ((), ("CA-same",))  # never a row of the other edge
                    if tick.call_ids and np.allclose(tick.pcm[0], level, atol=1e-4):
                        return

        await asyncio.gather(hears(ticks_a, call_a, 0.25), hears(ticks_b, call_b, 0.5))
        await call_b.close()
        for _ in range(100):  # B's close reaches the engine
            if server.calls == 1:
                break
            await asyncio.sleep(0.05)
        assert server.calls == 1
        await hears(ticks_a, call_a, 0.125)  # A's call is still seated and still its own
        assert a.ready and not a.failed
    finally:
        await a.stop()
        await b.stop()


async def test_a_peer_of_another_protocol_version_is_refused_naming_both(tmp_path: Path, engine_server) -> None:
    _, address = await engine_server(1, tcp=True, token=TOKEN)
    bad_version = _errors("bad_version")
    # An edge of the release before (its hello has no version).
    reader, writer = await asyncio.open_connection(address.host, address.port)
    hello = json.dumps({"token": TOKEN, "seats": 1, "name": "old-edge"}).encode()
    writer.write(struct.pack(">I", len(hello) + 1) + b"H" + hello)
    answer = json.loads((await _read_or_closed(reader, 2.0))[5:])
    writer.close()
    assert answer["permanent"] is True
    assert f"this engine speaks {PROTOCOL_VERSION}, the edge 1" in answer["error"]
    assert _errors("bad_version") == bad_version + 1

    # An engine of the release before: it welcomes without a version. The edge refuses it for good...
    async def old_engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack(">I", await r.readexactly(4))
        await r.readexactly(n)
        welcome = b'{"seats":1}'
        w.write(struct.pack(">I", len(welcome) + 1) + b"W" + welcome)
        await w.drain()
        await r.read()

    old = await asyncio.start_server(old_engine, "127.0.0.1", 0)
    old_address = Address(host="127.0.0.1", port=old.sockets[0].getsockname()[1])
    try:
        try:
            await RemoteEngine.connect(old_address, token=TOKEN, seats=1)
            raise AssertionError("an engine of another version was accepted")
        except LinkRefused as e:
            assert f"this edge speaks {PROTOCOL_VERSION}, the engine 1" in str(e)
        # ... and so does `serve` in front of it: exit 2 with one line, no retry loop, no traceback.
        env = dict(os.environ, KAME_ENGINE_TOKEN=TOKEN)
        env.pop("TWILIO_AUTH_TOKEN", None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kame_phone.cli", "serve", "--insecure-dev", "--port", str(free_port()),
            "--metrics-port", str(free_port()), "--engine", f"tcp://127.0.0.1:{old_address.port}",
            cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        old.close()
    assert proc.returncode == 2, err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("kame-phone: engine at ") and "version mismatch" in last, err.decode()
    assert "Traceback" not in err.decode()


def _run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "kame_phone.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})  # fmt: skip
    return proc.returncode, proc.stderr


def test_a_port_in_use_and_a_missing_listen_address_end_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _run("serve", "--insecure-dev", "--port", str(port), "--metrics-port", str(free_port()),
                         "--engine", "tcp://127.0.0.1:9")  # fmt: skip
        assert code == 2 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("kame-phone serve: cannot listen:"), err
        assert "address already in use" in err
        code, err = _run("engine-serve", "--listen", "unix:/tmp/kame-unused.sock", "--http-port", str(port))
        assert code == 2 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("kame-phone engine-serve: cannot listen:"), err
    # An address not on this host (a copied config, an AudioSocket listener on a PBX's address): it was a
    # traceback and exit 1, restarted for ever (review, session 29). 192.0.2.1 is TEST-NET-1, on no host.
    code, err = _run("serve", "--insecure-dev", "--port", str(free_port()), "--metrics-port", str(free_port()),
                     "--engine", "tcp://127.0.0.1:9", "--audiosocket", "192.0.2.1:9019", "--audiosocket-allow",
                     "192.0.2.0/24")  # fmt: skip
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kame-phone serve: cannot listen:") and "192.0.2.1" in last, err
    code, err = _run("engine-serve", env={"KAME_ENGINE_LISTEN": ""})
    assert code == 2 and err.strip() == "kame-phone engine-serve: --listen (or KAME_ENGINE_LISTEN) is required"
    code, err = _run("engine-serve", env={"KAME_ENGINE_LISTEN": "nowhere"})  # the variable is read
    assert code == 2 and "'nowhere'" in err and "Traceback" not in err, err
    # Each found out at the bind, once the model had loaded, with a traceback (review, session 30).
    code, err = _run("engine-serve", "--listen", "tcp://127.0.0.1:99999")
    assert code == 2 and err.strip().endswith("the port must be 0-65535"), err
    code, err = _run("engine-serve", "--listen", "unix:/nonexistent/dir/e.sock")
    assert code == 2 and err.strip() == "kame-phone engine-serve: --listen unix:/nonexistent/dir/e.sock: its folder " \
        "does not exist", err
    code, err = _run("engine-serve", "--listen", "tcp://0.0.0.0:9", env={"KAME_ENGINE_TOKEN": "hunter2"})
    assert code == 2 and "KAME_ENGINE_TOKEN must be at least 16 characters" in err and "hunter2" not in err, err


async def test_a_calls_setup_crosses_the_link_and_a_malformed_one_costs_only_its_sender(engine_server) -> None:
    """The agent and numbers the edge chose reach the engine's back-end with the open; an edge sending a
    setup that is not short strings is dropped, the other edge's call goes on."""
    server, address = await engine_server(2, tcp=True, token=TOKEN)
    good = await RemoteEngine.connect(address, token=TOKEN, seats=1, name="good")
    try:
        call = await good.open_call("CA-agent", CallSetup(agent="sales", to_number="+15550002222",
                                                          from_number="+15550001111"))  # fmt: skip
        (engine_id,) = [cid for cid in server.engine.setups if cid.startswith("CA-agent@")]
        assert server.engine.setups[engine_id] == CallSetup("sales", "+15550002222", "+15550001111")
        bad_message = _errors("bad_message")
        reader, writer = await asyncio.open_connection(address.host, address.port)
        hello = json.dumps({"version": PROTOCOL_VERSION, "token": TOKEN, "seats": 1, "name": "bad"}).encode()
        opened = json.dumps({"call_id": "CA-x", "setup": {"agent": "x" * 10_000}}).encode()
        writer.write(struct.pack(">I", len(hello) + 1) + b"H" + hello)
        writer.write(struct.pack(">I", len(opened) + 1) + b"O" + opened)
        said = await _read_or_closed(reader, 5.0)  # welcomed, then dropped
        writer.close()
        assert b'"seats":1' in said and b"CA-x" not in said
        assert _errors("bad_message") == bad_message + 1
        ticks = aiter(good.bot_frames())
        async with asyncio.timeout(5):
            while True:
                call.push_audio(np.full(FRAME_SAMPLES, 0.25, np.float32))
                tick = await anext(ticks)
                if tick.call_ids == ("CA-agent",) and np.allclose(tick.pcm[0], 0.25, atol=1e-4):
                    break
    finally:
        await good.stop()


async def test_a_flood_from_one_host_evicts_its_own_connections_not_an_edges_hello(engine_server) -> None:
    """Over the cap of peers awaiting their hello, the oldest of all went: a host opening silent connections
    fast enough evicted every edge's connection before its hello (0 of 10 edges joined at 2000 connections a
    second, review session 28). The oldest of the host holding the most goes now: the flood evicts its own."""
    from engine.link_wire import json_message, read_message

    _, address = await engine_server(2, tcp=True, token=TOKEN)
    reader, writer = await asyncio.open_connection(address.host, address.port)  # an edge far away: hello late
    flood = [await asyncio.open_connection(address.host, address.port, local_addr=("127.0.0.2", 0))
             for _ in range(4 * MAX_UNAUTHENTICATED)]  # fmt: skip
    try:
        await asyncio.sleep(0.3)  # every one accepted and waiting (or evicted) by now
        writer.write(json_message(b"H", {"version": PROTOCOL_VERSION, "token": TOKEN, "seats": 1, "name": "far"}))
        kind, body = await asyncio.wait_for(read_message(reader), 5)
        welcome = json.loads(bytes(body))
        assert kind == b"W" and "error" not in welcome, welcome
        answers = await asyncio.gather(*(_read_or_closed(r, 0.5) for r, _ in flood[:-MAX_UNAUTHENTICATED]))
        assert all(b"too many connections" in a for a in answers)  # the flood's older ones made the room
    finally:
        writer.close()
        for _, w in flood:
            w.close()

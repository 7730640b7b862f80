"""An edge rollout on the split layout (ops/k8s-split/edge-patch.yaml: maxSurge 0, one edge asking for all of
the engine's seats). The draining edge held every seat, the unused ones included, until it exited, so the new
edge was refused ("no seats left") for as long as the longest call in progress (up to the 600 s drain) plus
its 10 s retry backoff: no edge was ready and every new call was refused, on every deploy. Now a draining edge
gives back what its calls do not use at once and each other seat as its call ends (protocol 5), and an edge
refused for seats asks again every second."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from engine import remote
from engine.interface import FRAME_SAMPLES, EngineFull
from engine.link_wire import LinkFull
from engine.remote import RemoteEngine
from kame_phone.app import SEATS_RETRY_S, connect_engine
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call

from .link_fixtures import TOKEN, engine_keeps_time, http_status, process_env, start_cli, stop_processes, tone
from .polling import until
from .redis_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def _held(server) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(calls held, seats) per edge, oldest first; and the partition is never overdrawn."""
    edges = sorted(server._edges, key=lambda e: e.number)
    assert server.seats_granted <= server.engine.max_calls
    assert all(e.in_use <= e.seats for e in edges)
    return [(e.in_use, e.seats) for e in edges]


async def _streams(edge: RemoteEngine, call, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """The call's audio goes on crossing the link, tick after tick, for `seconds`."""
    ticks = aiter(edge.bot_frames())
    heard, until_t = 0, time.monotonic() + seconds
    async with asyncio.timeout(seconds + 5):
        while time.monotonic() < until_t:
            call.push_audio(np.full(FRAME_SAMPLES, 0.25, np.float32))
            heard += call.call_id in (await anext(ticks)).call_ids
    assert heard >= seconds / 0.08 * 0.5, heard
    assert not call.closed


async def test_a_draining_edge_gives_back_its_unused_seats_at_once_and_the_rest_as_its_calls_end(
    engine_server,
) -> None:
    server, address = await engine_server(2)
    a = await RemoteEngine.connect(address, token=None, seats=2, name="edge-a")
    b: RemoteEngine | None = None
    joining = asyncio.create_task(connect_engine(argparse.Namespace(engine=str(address), max_calls=2)))
    try:
        call = await a.open_call("CA-long")
        await asyncio.sleep(4.0)  # on the general backoff its next try would be 3.5 s away (at 7.5 s)
        assert not joining.done()  # refused for seats: edge-a holds both
        started = time.monotonic()
        a.give_back_seats()  # edge-a drains (SIGTERM): its unused seat goes back now
        b = await asyncio.wait_for(joining, 5)
        joined_after = time.monotonic() - started
        assert b.max_calls == 1 and joined_after < 2.5, joined_after  # asks every second, not on the backoff
        await until(lambda: a.max_calls == 1, "edge-a told it holds 1 seat")
        assert _held(server) == [(1, 1), (0, 1)]
        assert a.free_slots == 0  # a draining edge advertises nothing
        await _streams(a, call, 1.5)  # the draining edge's call goes on, undisturbed
        with pytest.raises(EngineFull):
            await a.open_call("CA-late")  # its kept seat is taken and none is free: never more calls than seats
        b_first = await b.open_call("CA-b1")
        with pytest.raises(EngineFull):
            await b.open_call("CA-b2")  # edge-a's seat is still its call's
        assert _held(server) == [(1, 1), (1, 1)]

        await call.close()  # edge-a's call ends: its seat goes to edge-b, which asked for two
        await until(lambda: b.max_calls == 2, "edge-b granted the other seat", within=5)
        assert a.max_calls == 0 and _held(server) == [(0, 0), (1, 2)]
        b_second = await b.open_call("CA-b2")
        await _streams(b, b_second, 0.5)
        assert not b_first.closed
        await a.stop()
        await until(lambda: len(server._edges) == 1, "edge-a gone")
        assert server.seats_granted == 2  # its seats were given back once, not freed twice
    finally:
        joining.cancel()
        await a.stop()
        if b is not None:
            await b.stop()


async def test_an_edge_of_protocol_4_still_links_works_and_keeps_its_seats_until_it_leaves(
    engine_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-upgrade: an edge of the release before (protocol 4) on an engine of 5. It is welcomed as 4 and its
    calls work; draining, it says nothing (an engine of 4 would drop a link sending "D"), so its seats stay
    its until it leaves, and then go to the edge of 5 that asked for more than it got."""
    server, address = await engine_server(3)
    with monkeypatch.context() as m:
        m.setattr(remote, "PROTOCOL_VERSION", 4)
        old = await RemoteEngine.connect(address, token=None, seats=2, name="old-edge")
    new = await RemoteEngine.connect(address, token=None, seats=2, name="new-edge")
    try:
        assert (old.link_version, old.max_calls, new.max_calls) == (4, 2, 1)
        call = await old.open_call("CA-old")
        old.give_back_seats()  # no "D" on a protocol-4 link: the engine would drop it as a broken peer
        await _streams(old, call, 1.0)
        assert _held(server) == [(1, 2), (0, 1)] and new.max_calls == 1
        with pytest.raises(LinkFull, match="no seats left"):
            await RemoteEngine.connect(address, token=None, seats=1)
        await call.close()
        await old.stop()
        await until(lambda: new.max_calls == 2, "new-edge granted the seats old-edge left", within=5)
        assert _held(server) == [(0, 2)]
    finally:
        await old.stop()
        await new.stop()


async def test_an_engine_of_protocol_4_is_not_sent_a_drain(engine_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edge of 5 on an engine of 4 speaks 4: no "D" (the old engine drops a link on a kind it does not know)."""
    import engine.link_server as link_server

    monkeypatch.setattr(link_server, "COMPATIBLE_VERSIONS", (3, 4))
    monkeypatch.setattr(link_server, "PROTOCOL_VERSION", 4)
    server, address = await engine_server(2)
    edge = await RemoteEngine.connect(address, token=None, seats=2)
    try:
        assert edge.link_version == 4
        call = await edge.open_call("CA-1")
        edge.give_back_seats()
        await _streams(edge, call, 1.0)
        assert _held(server) == [(1, 2)] and edge.ready and not edge.failed
    finally:
        await edge.stop()


# ---------------------------------------------------------------------------------------------------------
# Real processes: `kame-phone engine-serve` (tiny model, 2 seats) and two `kame-phone serve --engine` edges


async def test_an_edge_rollout_seats_the_new_edge_within_seconds_while_the_old_ones_call_goes_on(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    sock, engine_http = tmp_path / "engine.sock", free_port()
    model = ["--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--stt", "none", "--llm", "none", "--greedy"]
    engine_proc = start_cli(
        ["engine-serve", "--listen", f"unix:{sock}", "--http-port", str(engine_http), "--max-calls", "2", *model],
        process_env(), tmp_path / "engine.log",
    )
    procs = [engine_proc]

    def edge(name: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        env = process_env(TWILIO_AUTH_TOKEN=TOKEN, PUBLIC_URL=f"http://127.0.0.1:{port}", KAME_METRICS_PORT="0")
        proc = start_cli(["serve", "--port", str(port), "--engine", f"unix:{sock}", "--max-calls", "2"], env,
                      tmp_path / f"{name}.log")  # fmt: skip
        procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    old_proc, old = edge("old-edge")
    try:
        async with aiohttp.ClientSession() as http:
            await until(lambda: _ready(http, old), "the old edge ready", 90, every=0.1)
            new_proc, new = edge("new-edge")  # maxSurge 0 in spirit: it finds every seat taken, and retries
            call = asyncio.create_task(
                simulate_call(old.replace("http://", "ws://") + MEDIA_PATH, tone(300, 14.0), auth_token=TOKEN,
                              public_url=None, hold_after=0.5)
            )  # fmt: skip
            await asyncio.sleep(6.0)  # the call is up; the new edge has been refused for seats meanwhile
            assert await http_status(http, new + "/readyz") != 200 and not call.done()
            old_proc.send_signal(signal.SIGTERM)  # the rollout drains the old edge
            drained_at = time.monotonic()
            await until(lambda: _ready(http, new), "the new edge ready", 15, every=0.1)
            ready_after = time.monotonic() - drained_at
            assert not call.done() and old_proc.poll() is None  # the old edge's call is still up
            report = await asyncio.wait_for(call, 30)
            assert report.outcome == "completed", report.errors
            assert report.bot_seconds_received > 0.6 * 14.0  # heard through the drain (not cut at 6 s)
            # Seated on the refused edge's next try (every SEATS_RETRY_S), not after the call (8 s more, checked
            # above) nor a link error's backoff (4 s then 8 s by now). 1 s here idle; CI's busy box took 3.02 s.
            assert ready_after < SEATS_RETRY_S + 4.0, ready_after
            assert old_proc.wait(20) == 0
            # Behind after that call on a slow box, the engine has its edges answer busy, by design.
            await engine_keeps_time(http, f"http://127.0.0.1:{engine_http}")
            reports = await asyncio.gather(*(  # the old edge's seats are all the new one's now
                simulate_call(new.replace("http://", "ws://") + MEDIA_PATH, tone(hz, 2.0), auth_token=TOKEN,
                              public_url=None, hold_after=0.5)
                for hz in (400.0, 900.0)
            ))  # fmt: skip
            assert [r.outcome for r in reports] == ["completed", "completed"], [r.errors for r in reports]
    finally:
        stop_processes(procs)
    assert "gave back 1 seat(s)" in (tmp_path / "engine.log").read_text()


async def _ready(http: aiohttp.ClientSession, base: str) -> bool:
    return await http_status(http, base + "/readyz") == 200


async def test_a_draining_edge_keeps_the_seats_its_reservations_were_promised(engine_server) -> None:
    """A webhook answered just before the SIGTERM promised this edge's seat to a caller whose stream is on its
    way: the unused seats go back once such reservations have started or expired, not before (else the
    caller, promised a seat, gets busy)."""
    server, address = await engine_server(2)
    edge = await RemoteEngine.connect(address, token=None, seats=2, name="edge-a")
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=TOKEN, reservation_ttl_s=1.5)
    handle = await ServiceHandle(ServerContext(config, MemoryCallStore(), edge)).start()
    url = handle.http_url.replace("http://", "ws://") + MEDIA_PATH
    call = asyncio.create_task(simulate_call(url, tone(400.0, 4.0), auth_token=TOKEN, public_url=None,
                                             hold_after=0.5))
    try:
        await until(lambda: len(handle.ctx.streams) == 1, "the call streaming on the edge")
        assert await handle.ctx.cluster.reserve("CA" + "1" * 32) is not None  # a caller on the way
        draining = asyncio.create_task(handle.drain(30.0))
        await asyncio.sleep(0.8)
        assert edge.max_calls == 2 and _held(server) == [(1, 2)]  # the promised seat is kept
        await until(lambda: edge.max_calls == 1, "the unused seat given back once the reservation expired",
                    within=5)
        assert _held(server) == [(1, 1)]
        report = await call
        assert report.outcome == "completed", report.errors  # the draining edge's call went on to its end
        await asyncio.wait_for(draining, 10)
    finally:
        call.cancel()
        await handle.aclose()
        await edge.stop()

"""The frame loop and the model in a child process (`EngineConfig.engine_process`): calls, oracles and
resets cross the pipe, the parent's metrics see the child's ticks, and a dead engine process is noticed."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from engine import frame_loop_process
from engine.frame_loop_process import ChildSpec, FrameLoopProcess
from engine.interface import FRAME_SAMPLES, EngineClosed, EngineError, EngineNotice
from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call

from .hf_hub_server import serve_hub
from .phone_fixtures import json_logging, metric
from .polling import until
from .redis_support import free_port

ROOT = Path(__file__).resolve().parents[1]


async def _engine(checkpoint: Path, slots: int = 2) -> LocalEngine:
    return await _engine_from(str(checkpoint), slots)


async def _engine_from(checkpoint: str, slots: int = 2) -> LocalEngine:
    config = EngineConfig(
        checkpoint=checkpoint, device="cpu", max_calls=slots, warmup_ticks=2, engine_process=True,
        sampling=SamplingOverrides(greedy=True),
    )
    engine = await LocalEngine.load(config)
    assert engine.bundle is None  # nothing of the model in this process
    await engine.start()
    return engine


async def _engine_lost_told(call: Any, within: float) -> None:
    """Until the call's outputs say `engine_lost` (a broken engine tells each seated call)."""
    async with asyncio.timeout(within):
        async for out in call.outputs():
            if isinstance(out, EngineNotice) and out.kind == "engine_lost":
                return
    raise AssertionError("the call's outputs ended without engine_lost")


async def test_a_phone_call_is_answered_by_an_engine_in_its_own_process(tiny_checkpoint: Path) -> None:
    engine = await _engine(tiny_checkpoint)
    token = "k" * 32
    ticks_before = metric("kame_engine_tick_seconds_count")
    handle = await ServiceHandle(
        ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token), MemoryCallStore(), engine)
    ).start()
    t = np.arange(2 * 8000) / 8000
    try:
        report = await simulate_call(
            handle.http_url.replace("http://", "ws://") + MEDIA_PATH,
            (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32),
            auth_token=token, public_url=None, hold_after=0.5,
        )
    finally:
        await handle.aclose()
        await engine.stop()
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 1.5 and report.first_audio_latency_s is not None
    assert metric("kame_engine_tick_seconds_count") > ticks_before + 20  # the child's ticks, counted here


async def test_an_oracle_crosses_into_the_engine_process(tiny_checkpoint: Path) -> None:
    engine = await _engine(tiny_checkpoint)
    lags_before = metric("kame_oracle_lag_seconds_count")
    try:
        call = await engine.open_call("CA-oracle")
        call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))
        triggered = time.monotonic()
        call._on_oracle("the store opens at nine", triggered, 5, True)
        async with asyncio.timeout(5):
            while not engine.frame_loop.oracle_fed:  # noqa: ASYNC110 - filled by the pipe's reader thread
                await asyncio.sleep(0.02)
        ((call_id, candidate, fed_at, lag, wait),) = list(engine.frame_loop.oracle_fed)
        assert (call_id, candidate) == ("CA-oracle", 5)
        assert fed_at >= triggered and 0 <= wait <= lag < 1.0  # one clock on both sides of the pipe
        assert metric("kame_oracle_lag_seconds_count") == lags_before + 1
        assert metric("kame_oracle_slot_wait_seconds_count") >= 1  # observed here, from the child's sample
        await call.close()
        assert engine.free_slots == 2
    finally:
        await engine.stop()


async def test_the_engine_process_refuses_bad_caller_audio_here_as_a_thread_does(tiny_checkpoint: Path) -> None:
    """Integer samples are refused at once, in this process, as by an engine in a thread: they were cast to float
    and sent, 32767x too loud, and the child clipped them to a square wave (the thread raised)."""
    engine = await _engine(tiny_checkpoint)
    try:
        call = await engine.open_call("CA-int16")
        loud = (np.ones(FRAME_SAMPLES) * 1000).astype(np.int16)
        with pytest.raises(ValueError, match="expected float samples"):
            call.push_audio(loud)
        with pytest.raises(ValueError, match="expected float samples"):  # the pipe's own end, as the link's might
            engine.frame_loop.push_audio(call.row, "CA-int16", loud)
        with pytest.raises(ValueError, match=f"expected {FRAME_SAMPLES} samples"):
            call.push_audio(np.zeros(FRAME_SAMPLES // 2, np.float32))
        call.push_audio(np.full(FRAME_SAMPLES, np.nan, np.float32))  # silenced, not refused
        call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))
        await call.close()
        assert engine.frame_loop.alive and engine.free_slots == 2
    finally:
        await engine.stop()


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
async def test_a_turn_heard_only_as_its_final_is_held_by_the_forced_delay(
    tiny_checkpoint: Path, engine_process: bool
) -> None:
    """A final transcript with no partial before it (pocketsphinx, when one burst holds the words and the silence
    after them) ended no turn: the forced response delay was skipped, the reply began at the next tick (review,
    session 29)."""
    config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=1, warmup_ticks=1,
                          engine_process=engine_process, forced_delay_ms=240.0)  # fmt: skip
    engine = await LocalEngine.load(config)
    await engine.start()
    try:
        call = await engine.open_call("CA-final")
        frames = engine.bot_frames()
        async with asyncio.timeout(10):
            await anext(frames)  # seated and ticking
            while not engine._frames.empty():  # (what was made before the turn)
                await anext(frames)
        call._on_transcript("what time do you open", True, time.monotonic())
        call._on_oracle("We open at nine.", time.monotonic(), 1, True)
        voiced: list[bool] = []
        async with asyncio.timeout(10):
            while len(voiced) < 8:
                got = await anext(frames)
                voiced += [v for cid, v in zip(got.call_ids, got.voiced, strict=True) if cid == "CA-final"]
        # 240 ms: three ticks held silent after the turn (one made as it came may still speak), then the reply.
        assert voiced.count(False) >= 2, voiced
        await call.close()
    finally:
        await engine.stop()


async def test_one_calls_bad_oracle_never_ends_the_engine_process(tiny_checkpoint: Path) -> None:
    """Every call on the GPU shares the child: text no tokenizer takes (lone UTF-16 surrogates, which JSON
    from an LLM or an engine-link peer can carry) or a command that fails must cost at most that command."""
    engine = await _engine(tiny_checkpoint)
    try:
        bad, good = await engine.open_call("CA-bad"), await engine.open_call("CA-good")
        for call in (bad, good):
            call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))
        bad._on_oracle("call me \ud83d\ude00 or \udc00", time.monotonic(), 1, True)
        engine.frame_loop._send(("oracle", 99, "CA-bad", 2, "no such row", None, True))  # type: ignore[union-attr]
        good._on_oracle("the store opens at nine", time.monotonic(), 3, True)
        async with asyncio.timeout(5):
            while {s[:2] for s in engine.frame_loop.oracle_fed} != {("CA-bad", 1), ("CA-good", 3)}:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert not engine.failed and engine.frame_loop._process.is_alive()  # type: ignore[union-attr]
        await bad.close()
        await good.close()
        assert engine.free_slots == 2
    finally:
        await engine.stop()


async def test_an_engine_whose_every_tick_fails_is_broken_its_calls_told_and_liveness_failed(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault that sticks (a CUDA error, a lost device; here a real weight cut short, so every step's text
    lookup fails): failing ticks are fast, so the engine kept time, stayed ready and seated calls on silence,
    with a traceback every 80 ms. After 2 s of failures it is broken: its calls told, health failed."""
    config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=2, warmup_ticks=2,
                          sampling=SamplingOverrides(greedy=True))  # fmt: skip
    engine = await LocalEngine.load(config)
    await engine.start()

    async def caller() -> None:
        while True:
            call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))
            await asyncio.sleep(0.08)

    feeding: asyncio.Task[None] | None = None
    try:
        call = await engine.open_call("CA-stuck")
        assert engine.bundle is not None and engine.ready
        emb = engine.bundle.lm.text_emb
        emb.weight.data = emb.weight.data[:1]
        feeding = asyncio.create_task(caller())
        await _engine_lost_told(call, within=10)
        assert engine.failed and not engine.ready
        assert engine.frame_loop.broken is not None and "IndexError" in engine.frame_loop.broken
        assert metric("kame_engine_slots") == 0  # its seats are not capacity any more (--no-engine-process)
        # A stream its webhook already answered is refused at once, not seated on a loop that told its calls
        # engine_lost already and never will again (review, session 22).
        with pytest.raises(EngineClosed, match="broken"):
            engine.frame_loop.join("CA-late", None)
    finally:
        if feeding is not None:
            feeding.cancel()
        await engine.stop()
    failures = [r for r in caplog.records if "engine tick failed" in r.getMessage()]
    assert 1 <= len(failures) <= 3, len(failures)  # not a traceback per tick


def _child_that_breaks_after_warmup(conn: Any, spec: Any, warmup_ticks: int, *rest: Any) -> None:
    """The real engine child, with a fault that sticks once it is up (as the in-process test above: a text
    weight cut short, so every tick with a call fails). Runs in the spawned child: module-level, importable."""

    start = frame_loop_process._ChildFrameLoop.start

    def start_then_break(self: Any, ticks: int = 4) -> None:
        start(self, ticks)
        emb = self.batch.lm.text_emb
        emb.weight.data = emb.weight.data[:1]

    frame_loop_process._ChildFrameLoop.start = start_then_break  # type: ignore[method-assign]
    frame_loop_process._child_main(conn, spec, warmup_ticks, *rest)


async def test_an_engine_process_whose_every_tick_fails_exits_and_its_calls_are_told(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In its own process, a broken engine says why and exits (code 70), so the parent's death path ends its
    calls, fails health, and the device's memory is freed for the restart."""

    monkeypatch.setattr(frame_loop_process, "_child_main", _child_that_breaks_after_warmup)
    engine = await _engine(tiny_checkpoint)

    async def caller() -> None:
        while True:
            call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))
            await asyncio.sleep(0.08)

    feeding: asyncio.Task[None] | None = None
    try:
        call = await engine.open_call("CA-broken-child")
        feeding = asyncio.create_task(caller())
        await _engine_lost_told(call, within=15)
        assert engine.failed and not engine.ready
        process = engine.frame_loop._process  # type: ignore[attr-defined]
        process.join(5)
        assert process.exitcode == frame_loop_process.EXIT_BROKEN
    finally:
        if feeding is not None:
            feeding.cancel()
        await engine.stop()
    said = [r.getMessage() for r in caplog.records if "the engine process is broken" in r.getMessage()]
    assert len(said) == 1 and "IndexError" in said[0], said  # the child's reason, logged here once


async def test_a_first_start_downloads_the_checkpoint_apart_from_the_load_deadline(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an empty cache the engine process first downloads the checkpoint (~16 GB for 7B). That counted
    against the 600 s start deadline: a first start below ~27 MB/s was killed and restarted, downloading
    again, for good. Here the download (a slow Hub stand-in, 2 x 8 s) outlasts a 12 s load deadline, and the
    engine still comes up, having fetched each file once."""
    monkeypatch.setattr(frame_loop_process, "START_TIMEOUT_S", 12.0)
    async with serve_hub(tiny_checkpoint, "acme/kame-test", trickle_s=8.0) as (hub, endpoint):
        # The spawned engine process reads these at import: a fresh cache, the stand-in as the Hub.
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        started = time.monotonic()
        engine = await _engine_from("acme/kame-test")
        took = time.monotonic() - started
        try:
            assert engine.frame_loop.alive and engine.free_slots == 2
        finally:
            await engine.stop()
    assert took > 16.0  # the download really was longer than the load deadline
    files = sorted(p.name for p in os.scandir(tiny_checkpoint))
    assert sorted(hub.downloads) == files, hub.downloads


class _ChildStandIn:
    """What `_await_start` uses of the child's `multiprocessing.Process` (the deadlines are the unit here)."""

    exitcode: int | None = None
    killed = False

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return not self.killed


def _starting(checkpoint: str) -> tuple[FrameLoopProcess, Any, Any, _ChildStandIn]:
    loop = FrameLoopProcess(ChildSpec(checkpoint, "cpu", 2, None, SamplingOverrides(), 0.0, 4))
    ours, theirs = multiprocessing.Pipe()
    loop._process = child = _ChildStandIn()  # type: ignore[assignment]
    return loop, ours, theirs, child


def test_the_start_deadlines_time_a_download_apart_from_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_loop_process, "FETCH_TIMEOUT_S", 30.0)
    loop, ours, theirs, _ = _starting("acme/kame")  # a Hub repo id: the child may download it first
    theirs.send(("fetched",))
    theirs.send(("ready", "sampling", "memory"))
    assert loop._await_start(ours, timeout=5.0) == ("ready", ["sampling", "memory"])

    # A download longer than the load's deadline is fine; the load's deadline runs from its end.
    loop, ours, theirs, child = _starting("acme/kame")
    threading.Timer(0.6, theirs.send, args=(("fetched",),)).start()
    began = time.monotonic()
    with pytest.raises(EngineError, match="did not come up"):
        loop._await_start(ours, timeout=0.4)
    assert time.monotonic() - began >= 0.95 and child.killed

    # A directory (or random weights) downloads nothing: no download's allowance, the load's deadline at once.
    loop, ours, _, child = _starting(str(tmp_path))
    began = time.monotonic()
    with pytest.raises(EngineError, match="did not come up"):
        loop._await_start(ours, timeout=0.4)
    assert time.monotonic() - began < 5.0 and child.killed
    monkeypatch.setattr(frame_loop_process, "FETCH_TIMEOUT_S", 0.4)  # a download that crawls past its own
    loop, ours, _, child = _starting("acme/kame")
    began = time.monotonic()
    with pytest.raises(EngineError, match="did not fetch its checkpoint"):
        loop._await_start(ours, timeout=600.0)
    assert time.monotonic() - began < 5.0 and child.killed


def test_a_child_that_dies_or_is_stopped_while_downloading_ends_the_start() -> None:
    loop, ours, theirs, _ = _starting("acme/kame")
    theirs.close()  # died (the pipe's far end gone)
    with pytest.raises(EngineError, match="died while starting"):
        loop._await_start(ours, timeout=600.0)
    loop, ours, _, child = _starting("acme/kame")
    threading.Timer(0.3, loop.abort_start).start()  # SIGTERM while it downloads: killed, not waited out
    with pytest.raises(EngineError, match="stopped while starting"):
        loop._await_start(ours, timeout=600.0)
    assert child.killed


async def test_sigterm_while_the_engine_process_loads_gives_up_the_load(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A stop during the model's load (a rollout, a scale-down) cancelled the wait but not the load: `serve`
    logged "stopped", then went on loading the model in its engine process to the end (minutes for 7B, past
    the orchestrator's grace) before it could exit. The engine process is now killed and serve exits."""
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAME_", "TWILIO_", "PUBLIC_URL", "REDIS_"))}
    metrics_port = free_port()
    argv = [sys.executable, "-m", "kame_phone.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
            "--metrics-port", str(metrics_port), "--insecure-dev", "--checkpoint", str(tiny_checkpoint),
            "--engine-process", "--stt", "none", "--llm", "none"]  # fmt: skip
    with log_path.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=env, stdout=out, stderr=out)
    try:
        await until(lambda: "listening on" in log_path.read_text(), "serve to listen (the load starts)", 60)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                scraped = await r.text()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "stopped" in text
    assert re.search(r"engine process \d+ ready", text) is None, text[-3000:]  # killed before it was up
    # A loading engine offers no seats (its --max-calls counted as free ones on the capacity panel and alerts).
    assert re.search(r"^kame_engine_slots 0\.0$", scraped, re.M), scraped[:2000]


@contextlib.asynccontextmanager
async def _hung_tick(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[LocalEngine, Any]]:
    """An in-process engine with one call whose tick hangs (until the end), yielded once it is not ready."""
    monkeypatch.setattr("engine.service.HUNG_S", 4.0)  # 30 s in production
    config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=2, warmup_ticks=2,
                          sampling=SamplingOverrides(greedy=True))  # fmt: skip
    engine = await LocalEngine.load(config)
    await engine.start()
    gate = threading.Event()
    hook = None
    try:
        call = await engine.open_call("CA-hung")
        await until(lambda: engine.frame_loop.stats.ticks > 5, "the call's first ticks")
        assert engine.ready and not engine.failed
        assert engine.bundle is not None
        hook = engine.bundle.lm.text_emb.register_forward_pre_hook(lambda *_: gate.wait(30))  # the next tick hangs
        await until(lambda: not engine.ready, "not ready once the loop is stalled", within=6)
        yield engine, call
    finally:
        gate.set()
        if hook is not None:
            hook.remove()
        await engine.stop()


async def test_a_hung_tick_turns_the_engine_not_ready_then_fails_liveness(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick that never returns (a GPU hang, a deadlock) records no deadline miss: the engine looked healthy
    and went on seating calls onto a dead loop. With calls seated and no tick for 2 s it is not ready; after
    HUNG_S its liveness fails, so the orchestrator restarts it."""
    async with _hung_tick(tiny_checkpoint, monkeypatch) as (engine, call):
        assert not engine.failed and engine.free_slots == 0  # no new calls; not restarted for a short stall
        await until(lambda: engine.failed, "liveness failing once it is hung", within=8)
        call.push_audio(np.zeros(FRAME_SAMPLES, np.float32))


async def test_a_hung_tick_stays_hung_when_its_callers_hang_up(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers hang up on the dead air of a hung tick: the stall was measured only while calls were seated, so
    the emptied engine was ready again, seated the next callers onto the dead loop, and never failed liveness
    on a quiet node (review, session 28). The stall outlives its calls until the loop shows it is alive."""
    async with _hung_tick(tiny_checkpoint, monkeypatch) as (engine, call):
        await call.close()  # the caller hangs up on the silence
        await asyncio.sleep(0.5)
        assert not engine.ready and engine.free_slots == 0  # no new caller onto the dead loop
        await until(lambda: engine.failed, "liveness failing once it is hung, with nobody seated", within=8)


def test_a_stall_left_by_its_calls_clears_once_the_loop_shows_it_is_alive() -> None:
    """A slow tick (not a hang) as the last caller leaves: the stall is kept only until the loop goes round
    again, an idle round (`beat`, sent by an engine process too) or a recorded tick; a healthy idle engine is
    never restarted for it."""
    from engine.frame_loop import STALLED_S, LoopStats

    stats = LoopStats()
    stats.seated(1, now=0.0)
    stats.record_tick(0.08, False, now=1.0)
    assert stats.stalled_s(now=1.0 + STALLED_S + 1) > STALLED_S
    stats.seated(0, now=1.0 + STALLED_S + 1)  # its caller left on the silence
    assert stats.stalled_s(now=10.0) == pytest.approx(9.0)  # still stalled, since the last tick
    stats.seated(1, now=10.0)  # a new caller: the stall goes on, not from now
    assert stats.stalled_s(now=10.5) == pytest.approx(9.5)
    stats.seated(0, now=10.5)
    stats.beat()  # the loop went round idle: not hung after all
    assert stats.stalled_s(now=20.0) == 0.0
    stats.seated(1, now=20.0)
    assert stats.stalled_s(now=20.5) == pytest.approx(0.5)


async def test_an_idle_engine_process_beats_so_a_stall_left_behind_clears(tiny_checkpoint: Path) -> None:
    """The parent sees an engine process's ticks only while calls are seated: an idle child's beat is what
    clears a stall its last calls left (else a healthy idle engine would be restarted at HUNG_S)."""
    engine = await _engine(tiny_checkpoint)
    try:
        stats = engine.frame_loop.stats
        stats.stall_from = time.monotonic() - 10.0  # as if its last callers had left a slow tick
        assert stats.stalled_s() > 9
        await until(lambda: stats.stall_from is None, "the idle child's beat", within=3)
        assert stats.stalled_s() == 0.0 and engine.ready
    finally:
        await engine.stop()


async def test_a_dead_engine_process_ends_its_calls_and_fails_liveness(tiny_checkpoint: Path) -> None:
    engine = await _engine(tiny_checkpoint)
    token = "k" * 32
    store = MemoryCallStore()
    handle = await ServiceHandle(
        ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token), store, engine)
    ).start()
    t = np.arange(20 * 8000) / 8000  # a long call: the engine dies in the middle of it

    async def kill_engine_soon() -> None:
        await asyncio.sleep(2.0)
        engine.frame_loop._process.kill()  # type: ignore[union-attr]

    try:
        killer = asyncio.create_task(kill_engine_soon())
        report = await asyncio.wait_for(
            simulate_call(
                handle.http_url.replace("http://", "ws://") + MEDIA_PATH,
                (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32),
                auth_token=token, public_url=None, hold_after=0.5,
            ),
            15,
        )
        await killer
        await until(lambda: metric("kame_engine_slots") == 0, "a dead engine to offer no seats", 5)
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.http_url + "/healthz") as r:
                health = r.status
            async with http.get(handle.http_url + "/readyz") as r:
                ready = r.status
    finally:
        await handle.aclose()
        await engine.stop()
    assert report.server_hung_up and report.call_seconds < 10  # the call ended with its engine
    record = await store.get(report.call_sid)
    assert record is not None
    assert record.end_reason == "engine_lost"
    assert engine.failed and not engine.ready
    assert (health, ready) == (503, 503)  # the orchestrator restarts the process; no call is routed here


async def test_a_stalled_engine_process_never_blocks_the_caller(tiny_checkpoint: Path) -> None:
    """Pushing audio to an engine process that is frozen (SIGSTOP) returns at once: what the pipe cannot take
    is shed and counted, and the call goes on when the process does."""
    engine = await _engine(tiny_checkpoint)
    process = engine.frame_loop._process  # type: ignore[union-attr]
    assert process is not None and process.pid is not None
    try:
        call = await engine.open_call("CA-frozen")
        frames = aiter(engine.bot_frames())
        os.kill(process.pid, signal.SIGSTOP)
        frame = np.zeros(FRAME_SAMPLES, np.float32)
        started = time.monotonic()
        for _ in range(300):  # ~2.3 MB: far more than the pipe's buffer
            call.push_audio(frame)
        assert time.monotonic() - started < 1.0
        assert engine.frame_loop.audio_shed > 0  # type: ignore[union-attr]
        os.kill(process.pid, signal.SIGCONT)
        async with asyncio.timeout(10):
            while True:
                tick = await anext(frames)
                if "CA-frozen" in tick.call_ids:
                    break
        assert engine.ready
    finally:
        os.kill(process.pid, signal.SIGCONT)
        await engine.stop()


def test_a_parent_slow_to_read_does_not_make_the_engine_process_late(tiny_checkpoint: Path) -> None:
    """A tick's message (its calls' audio, ~7.7 KB a call) is larger than the pipe holds at a few calls: sent
    from the tick, the tick waited for the parent's reader, so a parent busy elsewhere (its phone edge, its
    STT, under one GIL) made the child's frames late, which the child process exists to prevent (review,
    session 22). The child's own sender thread takes them; none is lost, in order."""
    loop = FrameLoopProcess(ChildSpec(str(tiny_checkpoint), "cpu", 8, None, SamplingOverrides(greedy=True), 0.0, 4))
    loop.start(warmup_ticks=2)
    timings: list[tuple[float, bool]] = []
    ticks: list[float] = []
    dispatch = loop._dispatch
    paused = threading.Event()

    def slow_reader(kind: str, body: list) -> None:  # type: ignore[type-arg]
        if kind == "tick":
            ticks.append(time.monotonic())
            if not paused.is_set():
                paused.set()
                time.sleep(1.5)  # the parent's reader held up: nothing read from the pipe meanwhile
        elif kind == "timing":
            timings.append((body[0], body[1]))
        dispatch(kind, body)

    loop._dispatch = slow_reader  # type: ignore[method-assign]
    try:
        for row in range(8):
            loop.join(f"CA-{row}", None)
        time.sleep(3.0)
    finally:
        loop.stop()
    assert paused.is_set()
    assert max(elapsed for elapsed, _ in timings) < 0.5, max(elapsed for elapsed, _ in timings)  # never 1.5 s
    # The held ticks came through after the pause, none lost: 3 s of ticks at the child's own pace (at batch 8 a
    # slow box's tick is over 80 ms), with room for the joins' first ticks.
    per_tick = max(0.08, statistics.median(elapsed for elapsed, _ in timings))
    assert len(ticks) >= 0.6 * 3.0 / per_tick, (len(ticks), per_tick)


def test_the_engine_childs_log_lines_come_out_as_the_services_own(capfd: pytest.CaptureFixture[str]) -> None:
    """Under --log-json the engine process's lines (a broken engine, random weights) were Python's last-resort
    ones, bare messages a log pipeline could not parse; it now logs as its parent was set up to."""
    with json_logging(capfd) as json_lines:
        loop = FrameLoopProcess(ChildSpec("random:tiny", "cpu", 1, None, SamplingOverrides(), 0.0, 4))
        loop.start(1)
        loop.stop()
        lines = json_lines()
    assert any(r["logger"] == "engine.checkpoint" and "RANDOM WEIGHTS" in r["msg"] and r["level"] == "warning"
               for r in lines), lines  # fmt: skip


@pytest.mark.parametrize("side", ["parent", "child"])
def test_a_message_that_cannot_be_pickled_is_dropped_and_the_pipe_goes_on(side: str) -> None:
    """A message the pipe cannot carry (a bug: something unpicklable in it) killed the sender thread, and every
    later message waited in its queue for good, the other process alive and never fed. That one is dropped and
    logged; the next ones arrive."""
    from engine.pipe_sender import ParentSender, PipeSender

    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    if side == "parent":
        sender = ParentSender(writer, "push", 8, name="test")
        send = sender.put
    else:
        child = PipeSender(writer, name="test")
        sender, send = child, child
    import ctypes

    send(("oracle", lambda: None))  # not picklable
    send(("turn", ctypes.pointer(ctypes.c_int(1))))  # not picklable either, and a ValueError at that
    send(("leave", "CA1"))
    assert reader.poll(5) and reader.recv() == ("leave", "CA1")
    sender.close()
    reader.close()
    writer.close()


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
async def test_a_restart_in_a_tick_the_consumer_missed_is_marked_on_its_next(
    tiny_checkpoint: Path, engine_process: bool
) -> None:
    """A row's restart (its call's first frame, an engine reset) is marked on one frame only; a consumer behind
    lost that tick with the oldest, and never cleared the audio queued from before the restart nor started its
    resampler afresh. The mark now rides on the call's next frame delivered."""
    config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=2, warmup_ticks=1,
                          engine_process=engine_process, frames_queue_ticks=2,
                          sampling=SamplingOverrides(greedy=True))  # fmt: skip
    engine = await LocalEngine.load(config)
    await engine.start()
    try:
        ticks = aiter(engine.bot_frames())
        await engine.open_call("CA-late")
        await until(lambda: engine._frames_dropped >= 2, "the consumer fell behind", within=10)
        async with asyncio.timeout(10):
            marks = []
            while len(marks) < 2:
                tick = await anext(ticks)
                if "CA-late" in tick.call_ids:
                    marks.append(tick.fresh[tick.call_ids.index("CA-late")])
        assert marks == [True, False]  # its first frame was dropped: the next one delivered says so, once
    finally:
        await engine.stop()


def test_a_failed_start_leaves_no_child_and_can_be_tried_again(tmp_path: Path) -> None:
    """A start that failed (a bad checkpoint here; a GPU out of memory on the H100) waited for its child and
    forgot it: a second start tried again (it returned at once, doing nothing, with the child's pipe open)."""
    from engine.checkpoint import CheckpointError

    loop = FrameLoopProcess(ChildSpec(str(tmp_path), "cpu", 1, None, SamplingOverrides(), 0.0, 4))
    for _ in range(2):
        with pytest.raises(CheckpointError, match="not a KAME checkpoint"):
            loop.start(warmup_ticks=1)
        assert loop._process is None and loop._conn is None
        assert not [p for p in multiprocessing.active_children() if p.name == "kame-engine"]
    loop.stop()  # after failed starts: nothing to stop, no error

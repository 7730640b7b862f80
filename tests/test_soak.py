"""Soak: `kame-phone serve` as deployed (engine process, pocketsphinx, Redis store, a local LLM) takes calls in a
loop for ten minutes (KAME_SOAK_SECONDS). Each process's memory and open files must come back to where they were
after the warm-up, and every call must have its whole record in the store.

A leak per call is what this catches: a socket, a task, a decoder or a KV row kept after hang-up grows with the
number of calls, ~250 here, where a short test sees only noise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from kame_phone.node_bench import QUESTIONS, _llm_server, _scrape, _speak
from kame_phone.serve_process import free_port, serve_process
from telephony.sim_caller import CallReport, simulate_call

from .polling import until
from .redis_support import RedisServer

SOAK_S = float(os.environ.get("KAME_SOAK_SECONDS", "600"))
# Its own time limit: the suite's 300 s per test would cut the soak short (it did, in CI).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_S) + 300)]
WARMUP_S = min(60.0, SOAK_S / 5)  # decoder pools, allocator arenas and caches fill during the first calls
CALLERS = 2  # at once, each dialling again as soon as its call ends
RSS_SLACK_MIB = 32.0  # allocator noise; a leak of 150 KiB a call would pass this only under ~200 calls
FD_SLACK = 2
# redis-py keeps every connection its pool opened: how many follows the most commands the node had in flight at
# once (a heartbeat, the store's writer, a sweep, a record read), not the number of calls. Bounded, not flat: a
# leak of one a call would pass this within the first few dozen calls.
REDIS_CONNECTIONS_MAX = 12


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _fd_targets(pid: int) -> dict[int, str]:
    """Each open file's target, sockets named by their TCP peers (what a failed bound prints: which kind grew)."""
    peers = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                peers[f[9]] = f"tcp {int(f[1].rsplit(':', 1)[1], 16)}->{int(f[2].rsplit(':', 1)[1], 16)} st{f[3]}"
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                target = peers.get(target[8:-1], target)
            out[int(fd)] = target
    return out


def _children(pid: int) -> list[int]:
    """Direct children (the engine process; the multiprocessing resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def _serve_pid(port: int) -> int:
    """The serve process listening on `port` (found by its command line: the bench helper keeps no handle)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and str(port).encode() in argv and b"kame_phone.cli" in argv:
                    return int(entry.name)
    raise AssertionError("serve process not found")


def _usage(pids: list[int], redis_port: int) -> dict[int, tuple[float, int, int]]:
    """Per process: (RSS MiB, open files but Redis connections, Redis connections)."""
    out = {}
    for pid in pids:
        targets = list(_fd_targets(pid).values())
        redis = sum(t.startswith("tcp ") and t.split()[1].endswith(f"->{redis_port}") for t in targets)
        out[pid] = (_rss_mib(pid), len(targets) - redis, redis)
    return out


async def _seats_back(redis_url: str, node_key: str, slots: float) -> float:
    """The node's free seats as published in Redis once idle: every seat a call took must come back (a leaked
    engine slot or reservation stays taken). Polled: the heartbeat publishes once a second."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 15
        while True:
            free = float(await client.hget(node_key, "free") or -1)
            if free == slots or time.monotonic() > deadline:
                return free
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()


async def _idle(session: aiohttp.ClientSession, metrics_url: str) -> None:
    """Until no call is up on the node and the store has written what it had (then counts are comparable)."""
    async def idle() -> bool:
        m = await _scrape(session, metrics_url)
        return m.get("kame_calls_active", 0) == 0 and m.get("kame_call_store_pending_ops", 0) == 0

    await until(idle, "calls to end and the store to write them", 30, every=0.5)
    await asyncio.sleep(2.0)  # sockets in close, the engine's seat release


async def test_calls_in_a_loop_keep_memory_and_files_flat_and_every_record(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    await redis.start()
    wavs = [await asyncio.to_thread(_speak, q, tmp_path / f"q{i}.wav") for i, q in enumerate(QUESTIONS)]
    from engine.tiny_checkpoint import make_tiny_checkpoint

    checkpoint = await asyncio.to_thread(make_tiny_checkpoint, tmp_path / "tiny")
    port, metrics_port = free_port(), free_port()
    base, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    ws_url = base.replace("http://", "ws://") + "/twilio/media"
    argv = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port), "--insecure-dev",
            "--checkpoint", str(checkpoint)]  # fmt: skip
    reports: list[CallReport] = []

    async def caller(i: int, until: float) -> None:
        n = 0
        while time.monotonic() < until:
            report = await simulate_call(ws_url, wavs[(i + n) % len(wavs)], auth_token=None, public_url=None,
                                         hold_after=1.0)  # fmt: skip
            reports.append(report)
            n += 1
            if report.outcome == "busy":  # a node that falls behind answers busy (by design): redial later
                await asyncio.sleep(2.0)

    try:
        async with _llm_server(300.0) as llm_url:
            env = dict(os.environ, OPENAI_BASE_URL=llm_url, OPENAI_API_KEY="none", KAME_LLM_MODEL="soak",
                       REDIS_URL=redis.url, ADMIN_TOKEN="soak-admin", KAME_NODE_ID="soak")  # fmt: skip
            env.pop("TWILIO_AUTH_TOKEN", None)
            async with serve_process(argv, env, base, tmp_path / "serve.log"), aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)  # none of the test's own connections stays open
            ) as session:
                serve = _serve_pid(port)
                engine_pids = _children(serve)
                await asyncio.gather(*(caller(i, time.monotonic() + WARMUP_S) for i in range(CALLERS)))
                await _idle(session, metrics_url)
                pids = [serve, *_children(serve)]
                assert len(pids) > len(engine_pids) - 1 >= 0
                baseline = _usage(pids, redis.port)
                baseline_files = {pid: _fd_targets(pid) for pid in pids}
                # Counters from here, like memory: start-up on a 2-core box (the model loading, the STT
                # decoders built) can delay one Redis heartbeat past its timeout; the soak is about what follows.
                warm_metrics = await _scrape(session, metrics_url)
                warm = len(reports)
                curve = []
                soak_end = time.monotonic() + SOAK_S - WARMUP_S
                loops = asyncio.gather(*(caller(i, soak_end) for i in range(CALLERS)))
                while not loops.done():
                    curve.append(_usage(pids, redis.port))
                    await asyncio.wait({loops}, timeout=15)
                await loops
                await _idle(session, metrics_url)
                final = _usage(pids, redis.port)
                final_files = {pid: _fd_targets(pid) for pid in pids}
                metrics = await _scrape(session, metrics_url)
                free_seats = await _seats_back(redis.url, "kame:node:soak", metrics["kame_engine_slots"])
                headers = {"Authorization": "Bearer soak-admin"}
                records = []
                for r in reports:
                    async with session.get(f"{base}/calls/{r.call_sid}", headers=headers) as resp:
                        records.append((r, resp.status, await resp.json()))
    finally:
        await redis.kill()

    soaked = len(reports) - warm
    print(f"\n{len(reports)} calls ({soaked} after warm-up); pid: (RSS MiB, files, Redis connections) baseline "
          f"{baseline} final {final}")
    for sample in curve[:: max(1, len(curve) // 10)]:
        print("  ", sample)
    for pid in final_files:
        print(f"pid {pid} files opened/closed since the baseline:",
              {fd: (baseline_files[pid].get(fd), t) for fd, t in final_files[pid].items()
               if baseline_files[pid].get(fd) != t},
              sorted(set(baseline_files[pid]) - set(final_files[pid])))  # fmt: skip
    outcomes = [r.outcome for r in reports]
    completed = outcomes.count("completed")
    misses = "kame_engine_deadline_misses_total"
    late = metrics.get(misses, 0) - warm_metrics.get(misses, 0)
    print(f"outcomes: {completed} completed, {outcomes.count('busy')} busy; {late:.0f} late ticks after warm-up")
    assert set(outcomes) <= {"completed", "busy"}, [r for r in reports if r.outcome not in ("completed", "busy")][:3]
    # Busy is by design while the engine misses its 80 ms frames, and how often a 2-core box shared by the
    # engine, the STT, the callers and the LLM does so is the box's business (a third of the calls on a slow
    # day). What the soak holds the node to: enough calls got through to show a leak, and once idle every
    # seat is free again, so busy never came from seats a call kept.
    assert completed >= CALLERS * (SOAK_S - WARMUP_S) / 15, f"only {completed} calls completed"
    assert metrics["kame_engine_slots_busy"] == 0 and free_seats == metrics["kame_engine_slots"], (
        f"seats not back once idle: {metrics['kame_engine_slots_busy']:.0f} engine slots busy, "
        f"{free_seats:.0f} of {metrics['kame_engine_slots']:.0f} free in Redis"
    )
    for pid, (rss, fds, redis_connections) in final.items():
        peak = max(s[pid][0] for s in curve)
        assert rss - baseline[pid][0] <= RSS_SLACK_MIB, f"pid {pid}: RSS {baseline[pid][0]:.0f} -> {rss:.0f} MiB"
        assert peak - baseline[pid][0] <= 2 * RSS_SLACK_MIB, f"pid {pid}: RSS peaked at {peak:.0f} MiB"
        grown = {fd: t for fd, t in final_files[pid].items() if baseline_files[pid].get(fd) != t}
        assert fds - baseline[pid][1] <= FD_SLACK, f"pid {pid}: {baseline[pid][1]} -> {fds} open files; new: {grown}"
        assert redis_connections <= REDIS_CONNECTIONS_MAX, f"pid {pid}: {redis_connections} Redis connections"
    for name in ("kame_call_store_dropped_ops_total", "kame_redis_errors_total"):
        assert metrics.get(name, 0) == warm_metrics.get(name, 0), name
    lost = [(r.call_sid, status) for r, status, _ in records if status != 200]
    assert not lost, f"{len(lost)} records lost: {lost[:5]}"
    for r, _, record in records:
        assert record["state"] == "ended" and record["end_reason"] == r.outcome, record
        if r.outcome == "busy":
            continue
        assert record["stream_sid"] and record["started_at"] and record["ended_at"], record
        assert record["first_audio_s"] is not None, record

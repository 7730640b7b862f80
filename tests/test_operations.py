"""Operating the service: admin API auth, health and readiness, metrics moved by a real call, JSON logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import redis.asyncio as aioredis

from telephony.call_store import open_call_store
from telephony.logs import JsonFormatter, call_id_var, setup_logging
from telephony.server import VOICE_PATH
from telephony.sim_audiosocket import audiosocket_call
from telephony.sim_caller import simulate_call

from .phone_fixtures import flite_wav, running_phone
from .polling import until
from .redis_support import REDIS_URL, RedisServer, free_port, redis_errors

ROOT = Path(__file__).resolve().parents[1]

ISSUE_METRICS = [
    "kame_first_audio_seconds", "kame_turn_latency_seconds", "kame_turn_overlaps_total", "kame_oracle_lag_seconds",
    "kame_engine_tick_seconds", "kame_engine_deadline_misses_total", "kame_engine_slots_busy", "kame_calls_active",
    "kame_calls_total", "kame_twilio_protocol_errors_total", "kame_llm_errors_total", "kame_redis_errors_total",
    # asked for by SRE: the LLM error ratio's denominator, what is lost or queued under load, call length
    "kame_llm_requests_total", "kame_stt_dropped_frames_total", "kame_call_store_dropped_ops_total",
    "kame_call_store_pending_ops", "kame_call_duration_seconds",
]


@pytest.fixture(scope="module")
def hello_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flite_wav("Hello, I would like to check my order.", tmp_path_factory.mktemp("speech") / "hello.wav")


def _metric_value(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_admin_api_health_and_metrics_after_a_call(tiny_checkpoint: Path, hello_wav: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    async with running_phone(tiny_checkpoint, admin_token="admin-secret", metrics_port=0) as phone, \
            aiohttp.ClientSession() as http:
        async with http.get(phone.base + "/healthz") as r:
            assert r.status == 200
        async with http.get(phone.base + "/readyz") as r:
            body = await r.json()
            assert r.status == 200 and body["ready"] and body["capacity_left"] == 2
        async with http.get(phone.handle.metrics_url) as r:
            before = await r.text()
        report = await simulate_call(phone.ws_url, hello_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=0.5)
        assert report.outcome == "completed"
        await phone.settled()
        async with http.get(phone.handle.metrics_url) as r:
            after = await r.text()
        for name in ISSUE_METRICS:
            assert f"# TYPE {name.removesuffix('_total')}" in after, name
        completed = '{agent="default",outcome="completed"}'
        calls = "kame_calls_total"
        assert _metric_value(after, calls, completed) == _metric_value(before, calls, completed) + 1
        assert _metric_value(after, "kame_first_audio_seconds_count") == \
            _metric_value(before, "kame_first_audio_seconds_count") + 1
        assert _metric_value(after, "kame_call_duration_seconds_count") == \
            _metric_value(before, "kame_call_duration_seconds_count") + 1
        assert _metric_value(after, "kame_engine_tick_seconds_count") > _metric_value(
            before, "kame_engine_tick_seconds_count")
        assert _metric_value(after, "kame_engine_slots") == 2

        refused = "kame_webhook_rejections_total"
        for headers in ({}, {"Authorization": "Bearer wrong-guess"}, {"Authorization": "admin-secret"}):
            async with http.get(phone.base + "/calls", headers=headers) as r:
                assert r.status == 401
            async with http.get(phone.base + f"/calls/{report.call_sid}", headers=headers) as r:
                assert r.status == 401
        # Each refusal counted by why, and logged (sampled) with the route, never the token tried.
        async with http.get(phone.handle.metrics_url) as r:
            counted = await r.text()
        for reason, n in (("missing_token", 4), ("bad_token", 2), ("disabled", 0)):
            labels = f'{{endpoint="admin",reason="{reason}"}}'
            assert _metric_value(counted, refused, labels) == _metric_value(after, refused, labels) + n, reason
            assert refused + labels in counted  # every series exported from the start, for rate() and alerts
        lines = [r.getMessage() for r in caplog.records if "admin request" in r.getMessage()]
        assert any("GET /calls refused (bad_token) from 127.0.0.1" in line for line in lines), lines
        assert not any("wrong-guess" in r.getMessage() or "admin-secret" in r.getMessage() for r in caplog.records)
        auth = {"Authorization": "Bearer admin-secret"}
        async with http.get(phone.base + "/calls", headers=auth) as r:
            assert r.status == 200
            calls = (await r.json())["calls"]
            assert [c["call_sid"] for c in calls] == [report.call_sid]
            assert "turns" not in calls[0] and calls[0]["counts"]["turns"] >= 1  # a summary; the record below
        async with http.get(phone.base + f"/calls/{report.call_sid}", headers=auth) as r:
            record = await r.json()
            assert record["state"] == "ended" and record["first_audio_s"] > 0
            assert record["stream_sid"] == report.stream_sid
            assert any(t["role"] == "bot" for t in record["turns"])
        async with http.get(phone.base + "/calls/CA" + "0" * 32, headers=auth) as r:
            assert r.status == 404


async def test_a_store_outage_leaves_the_node_ready_and_answering(tiny_checkpoint: Path, hello_wav: Path) -> None:
    """Every node shares one Redis. Were readiness to require it, an outage would take every node out of
    rotation at once and fail every new call; the write-behind store and local admission ride it out, so
    /readyz reports the store and stays ready, and a call placed during the outage is answered."""
    dead = open_call_store("redis://127.0.0.1:1/0", socket_timeout_s=0.5)
    async with running_phone(tiny_checkpoint, store=dead) as phone, aiohttp.ClientSession() as http:
        async with http.get(phone.base + "/readyz") as r:
            body = await r.json()
            assert r.status == 200 and body["ready"] and body["store_reachable"] is False
            assert body["checks"] == {"model_loaded": True, "not_draining": True}
        report = await simulate_call(phone.ws_url, hello_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=0.5)
        assert report.outcome == "completed" and report.bot_seconds_received > 1.0, report.errors
        async with http.get(phone.base + "/healthz") as r:
            assert r.status == 200


def test_json_logs_carry_the_call_id(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(json_lines=True)
    try:
        log = logging.getLogger("telephony.test")
        token = call_id_var.set("CA" + "1" * 32)
        log.warning("stream started")
        call_id_var.reset(token)
        log.warning("no call here")
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["call_id"] == "CA" + "1" * 32 and lines[0]["msg"] == "stream started"
    assert lines[1]["call_id"] is None and lines[1]["level"] == "warning"
    assert isinstance(JsonFormatter().format(logging.makeLogRecord({"msg": "x"})), str)


async def test_redis_stopped_and_restarted_mid_call_loses_nothing(
    tiny_checkpoint: Path, hello_wav: Path, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path)
    await redis.start()
    store = open_call_store(redis.url, key_prefix="kame-test-outage:", socket_timeout_s=0.5, retry_max_s=0.2)
    errors_before = redis_errors()
    try:
        async with running_phone(tiny_checkpoint, store=store) as phone:
            call = asyncio.create_task(simulate_call(
                phone.ws_url, hello_wav, auth_token=phone.token, public_url=phone.base, hold_after=2.0,
                dtmf=[("4", 1.5), ("2", 3.0)],
            ))
            await asyncio.sleep(1.0)
            await redis.kill()  # Redis goes away in the middle of the call
            await asyncio.sleep(2.5)
            await redis.start()  # and comes back (its AOF kept what it had acknowledged)
            report = await call
            assert report.outcome == "completed", report.errors
            assert report.bot_seconds_received > 0.6 * report.call_seconds  # the call never noticed
            await phone.settled()
            record = await store.get(report.call_sid)
    finally:
        await store.aclose()
        await redis.kill()
    assert redis_errors() > errors_before  # the outage was counted
    assert record is not None
    assert record.state == "ended" and record.end_reason == "completed"  # written after the restart
    assert record.stream_sid == report.stream_sid and record.first_audio_s is not None  # before the outage
    assert record.dtmf == ["4", "2"]  # the first during the outage, the second after
    assert any(t.role == "bot" for t in record.turns)


class ServeProcess:
    """`kame-phone serve` (all-in-one, the tiny model in its engine process) as an operator runs it."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path, base: str) -> None:
        self.proc, self.log, self.base = proc, log, base

    @property
    def ws_url(self) -> str:
        return self.base.replace("http://", "ws://") + "/twilio/media"

    async def streaming(self, calls: int = 1) -> None:
        """Until `calls` calls hold a seat (of --max-calls 2): /readyz's capacity_left drops with each stream."""
        async with aiohttp.ClientSession() as http:
            async def seated() -> bool:
                async with http.get(self.base + "/readyz") as r:
                    return (await r.json())["capacity_left"] == 2 - calls

            await until(seated, f"{calls} calls streaming", 30, every=0.1)

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    async def exit_code(self, within: float) -> int:
        try:
            return await asyncio.wait_for(self.proc.wait(), within)
        except TimeoutError:
            raise AssertionError(f"serve still running after {within:g} s: {self.said()[-3000:]}") from None


@asynccontextmanager
async def serve_process(checkpoint: Path, tmp_path: Path, *flags: str, env: dict[str, str] | None = None,
                        ready: bool = True, insecure_dev: bool = True) -> AsyncIterator[ServeProcess]:
    """Started with this checkout first on its path (the venv's editable install may point elsewhere), and
    waited for until /readyz says 200 unless `ready` is False; killed if a test leaves it running."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KAME_", "TWILIO_", "PUBLIC_URL", "REDIS_"))}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kame_phone.cli", "serve", *(["--insecure-dev"] if insecure_dev else []), "--port",
            str(port), "--metrics-port", "0", "--checkpoint", str(checkpoint), "--device", "cpu", "--stt", "none",
            "--llm", "none", "--greedy", "--max-calls", "2", *flags]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=clean | (env or {}), stdout=out,
                                                    stderr=out)  # fmt: skip
    serve = ServeProcess(proc, log, f"http://127.0.0.1:{port}")
    try:
        if ready:
            async with aiohttp.ClientSession() as http:
                async def is_ready() -> bool:
                    assert proc.returncode is None, serve.said()[-3000:]
                    try:
                        async with http.get(serve.base + "/readyz") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await until(is_ready, "serve to be ready", 120, every=0.2)
        yield serve
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_serve_exits_non_zero_once_its_engine_process_died(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A dead engine process only turned /healthz 503: k8s restarts the pod on it, but Docker (compose's
    `restart: unless-stopped`) never restarts a container that is merely unhealthy, so the node stayed up
    refusing every call. serve now exits non-zero, and any restart policy brings it back."""
    async with serve_process(tiny_checkpoint, tmp_path) as serve:
        found = re.search(r"engine process (\d+) ready", serve.said())
        assert found, serve.said()[-3000:]
        os.kill(int(found.group(1)), signal.SIGKILL)
        code = await serve.exit_code(30)
    assert code != 0, serve.said()[-3000:]
    assert "the engine failed" in serve.said()


def _long_call(serve: ServeProcess, seconds: float = 60.0) -> asyncio.Task:  # type: ignore[type-arg]
    t = np.arange(int(seconds * 8000)) / 8000
    audio = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    return asyncio.create_task(simulate_call(serve.ws_url, audio, auth_token=None, public_url=None, hold_after=0.5))


async def test_serve_drains_for_its_drain_timeout_then_ends_the_calls(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """serve's drain was fixed at 600 s (engine-serve had --drain-timeout): an operator with a shorter grace
    period had calls cut by the SIGKILL instead of ended, and a test rig waited 10 minutes. Now
    --drain-timeout / KAME_DRAIN_TIMEOUT set it: calls still up after it are ended (drain_timeout)."""
    async with serve_process(tiny_checkpoint, tmp_path, env={"KAME_DRAIN_TIMEOUT": "1.5"}) as serve:
        call = _long_call(serve)
        await serve.streaming()
        started = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        code = await serve.exit_code(30)
        took = time.monotonic() - started
        report = await asyncio.wait_for(call, 10)
    assert code == 0, serve.said()[-3000:]
    assert 1.5 <= took < 15, took
    assert report.server_hung_up and report.call_seconds < 30
    assert "draining 1 calls (up to 2s)" in serve.said()


async def test_serve_answers_audiosocket_calls_and_drains_them(
    tiny_checkpoint: Path, tmp_path: Path, question_wav: Path,
) -> None:
    """The operator's path: KAME_AUDIOSOCKET on serve, `kame-phone audiosocket-call` playing the PBX (the bot's
    reply written as a WAV), and a SIGTERM drain that ends an AudioSocket call still up (Asterisk hangs up)."""
    port = free_port()
    env = {"KAME_AUDIOSOCKET": f"127.0.0.1:{port}", "KAME_DRAIN_TIMEOUT": "1.5"}
    async with serve_process(tiny_checkpoint, tmp_path, env=env) as serve:
        assert f"AudioSocket listening on 127.0.0.1:{port}" in serve.said()
        out = tmp_path / "bot.wav"
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kame_phone.cli", "audiosocket-call", "--to", f"127.0.0.1:{port}", "--wav",
            str(question_wav), "--out", str(out), "--hold-after", "1", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=os.environ | {"PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        said = (await asyncio.wait_for(cli.communicate(), 60))[0].decode()
        assert cli.returncode == 0, said
        assert "hung up by the caller" in said and out.stat().st_size > 8000, said  # over half a second of reply
        call = asyncio.create_task(audiosocket_call("127.0.0.1", port, [bytes(320)] * 50, hold_s=60.0))
        await serve.streaming()
        serve.proc.send_signal(signal.SIGTERM)
        code = await serve.exit_code(30)
        report = await asyncio.wait_for(call, 10)
    assert code == 0, serve.said()[-3000:]
    assert report.hung_up_by_service and report.bot_audio


async def test_an_audiosocket_only_node_answers_its_pbx_and_stays_out_of_twilio_routing(
    tiny_checkpoint: Path, tmp_path: Path, prefix: str,
) -> None:
    """No TWILIO_AUTH_TOKEN, AudioSocket only, beside a Redis the Twilio nodes share: it answers Asterisk, refuses
    Twilio's webhook (403, never an unchecked one), and never lists itself among Redis's nodes, so no other node routes
    a Twilio call to a seat whose stream it would refuse. It still heartbeats (alive:<id>), so the other nodes
    never take its calls for a crashed node's."""
    port = free_port()
    env = {"KAME_AUDIOSOCKET": f"127.0.0.1:{port}", "REDIS_URL": REDIS_URL, "KAME_REDIS_PREFIX": prefix,
           "KAME_NODE_ID": "pbx-only"}  # fmt: skip
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        async with serve_process(tiny_checkpoint, tmp_path, env=env, insecure_dev=False) as serve:
            report = await audiosocket_call("127.0.0.1", port, [bytes(320)] * 25, hold_s=0.5)
            async with aiohttp.ClientSession() as http, \
                    http.post(serve.base + VOICE_PATH, data={"CallSid": "CA" + "0" * 32}) as voice:  # fmt: skip
                assert voice.status == 403
            await asyncio.sleep(1.5)  # past a heartbeat, had there been one
            assert not await redis.exists(f"{prefix}node:pbx-only")
            assert "pbx-only" not in await redis.zrange(f"{prefix}nodes", 0, -1)
            assert await redis.exists(f"{prefix}alive:pbx-only")  # up: the other nodes' sweep leaves its calls be
            assert "answering AudioSocket only" in serve.said()
    finally:
        await redis.aclose()
    assert report.bot_audio and not report.hung_up_by_service


@pytest.mark.parametrize(("argv", "env", "said"), [
    (["--drain-timeout", "-1"], {}, "--drain-timeout (KAME_DRAIN_TIMEOUT) must be 0 or more seconds, got -1"),
    ([], {"KAME_DRAIN_TIMEOUT": "soon"}, "KAME_DRAIN_TIMEOUT='soon' is refused: not a number"),
    ([], {"KAME_DRAIN_TIMEOUT": "inf"}, "KAME_DRAIN_TIMEOUT='inf' is refused: not a finite number"),
    (["--audiosocket", "9092"], {}, "--audiosocket: an AudioSocket listener is HOST:PORT[=AGENT], got '9092'"),
    (["--audiosocket", "127.0.0.1:9092=nosuch"], {}, "names an agent the agents file does not have"),
    (["--audiosocket", "127.0.0.1:9092", "--metrics-port", "9092"], {},
     "--audiosocket 127.0.0.1:9092: port 9092 is --metrics-port's too"),
    (["--audiosocket", "0.0.0.0:9019"], {}, "listens beyond loopback: set --audiosocket-allow"),
    ([], {"KAME_AUDIOSOCKET": "127.0.0.1:9019", "KAME_AUDIOSOCKET_ALLOW": "10.0.0.0/33"},
     "--audiosocket-allow: not a network (CIDR, 'private' or 'any'): '10.0.0.0/33'"),
])  # fmt: skip
def test_serve_refuses_a_bad_flag_in_one_line(
    argv: list[str], env: dict[str, str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kame_phone.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--insecure-dev", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


async def test_a_second_sigterm_during_the_drain_ends_the_calls_and_exits(
    tiny_checkpoint: Path, tmp_path: Path, prefix: str
) -> None:
    """A second SIGTERM (or ^C) during a drain did nothing: serve went on waiting up to --drain-timeout for
    calls that may last minutes. Now it ends them at once (drain_timeout, as the timeout does) and exits."""
    env = {"REDIS_URL": REDIS_URL, "KAME_REDIS_PREFIX": prefix}
    async with serve_process(tiny_checkpoint, tmp_path, env=env) as serve:  # --drain-timeout: 600 s
        call = _long_call(serve)
        await serve.streaming()
        serve.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(2.0)
        assert serve.proc.returncode is None and not call.done()  # draining: the call goes on
        started = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        code = await serve.exit_code(30)
        took = time.monotonic() - started
        report = await asyncio.wait_for(call, 10)
    assert code == 0, serve.said()[-3000:]
    assert took < 10 and report.server_hung_up, took
    store = open_call_store(REDIS_URL, key_prefix=prefix)
    try:
        record = await store.get(report.call_sid)
    finally:
        await store.aclose()
    assert record is not None and (record.state, record.end_reason) == ("ended", "drain_timeout")


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler of its own for SIGTERM (SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


async def test_a_sigterm_early_in_start_up_stops_serve_at_once(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """As PID 1 of a container without an init, a process ignores every signal it has no handler for; serve
    installed its handlers only after its imports and its HTTP start, so a SIGTERM in those first seconds (a
    rollout, a scale-down) was lost, and the pod waited out its grace period for the SIGKILL. main() now
    catches SIGTERM first thing and exits 143 until the drain handler replaces it.

    This test's serve is not PID 1, where the default action would kill it (status -15) and prove nothing;
    so it checks that serve catches SIGTERM from its first moments (SigCgt), then that the signal it sends
    then, during the imports, ends serve at once by that handler (143): a caught signal works as PID 1 too."""
    async with serve_process(tiny_checkpoint, tmp_path, ready=False) as serve:
        started = time.monotonic()
        await until(lambda: _catches_sigterm(serve.proc.pid), "serve to catch SIGTERM", 30, every=0.005)
        caught_after = time.monotonic() - started
        serve.proc.send_signal(signal.SIGTERM)
        code = await serve.exit_code(5)
    assert "listening on" not in serve.said(), serve.said()[-2000:]  # it was still starting up
    # Caught before the heavy imports (torch's take seconds on a slow box): 0.05 s here, 0.2 s under load.
    assert code == 143 and caught_after < 2.0, (code, caught_after, serve.said()[-2000:])

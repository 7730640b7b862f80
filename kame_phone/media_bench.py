"""The media-path benchmark: how many simulated Twilio calls one process carries in real time.

    kame-phone bench media --calls 200 --seconds 20 --json media.json

The real service (webhook, signed WebSocket upgrade, `MediaStreamSession`, framing, resampling, μ-law,
metrics, the in-memory call store) runs in this process on 127.0.0.1 with a `LoopbackEngine` in place of
the model: one shared task ticks every 80 ms and echoes each call's last caller frame back as voiced bot
audio, all calls in one `BotFrames` as the real engine does, so the outbound volume is realistic and
engine compute is nil. The callers run in a separate
process (spawned), so their CPU is not charged to the server: each one answers like Twilio (signed
voice webhook, TwiML, signed upgrade, `connected`, `start`, 20 ms μ-law `media` at real-time pace,
mark echoes, `stop`) and counts the bot's frames.

Measured over the steady state (every call streaming): the server process's CPU time, per call; the
`kame_media_inbound_seconds` / `kame_media_outbound_seconds` histograms (percentiles interpolated
linearly inside Prometheus buckets, so they are only as fine as the buckets; the share within 5 ms is
exact, 5 ms being a bucket edge); the same two paths measured exactly end to end ("wire": caller send ->
engine push, engine output -> caller receive, matched frame by frame on the machine-wide monotonic
clock, so kernel and event-loop queueing count too, which the histograms start or stop too late to see);
event-loop lag; and whether every call received its bot audio in time. The rest of the machine's CPU use
is reported too: on a shared box the latencies are only clean when it is near zero.
The loopback engine lives here, in the harness; it is not a test double.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import multiprocessing
import os
import platform
import secrets
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from prometheus_client import REGISTRY
from twilio.request_validator import RequestValidator

from engine.interface import FRAME_SAMPLES, FRAME_SECONDS, BotFrames, EngineClosed, EngineFull, EngineOutput
from telephony import twilio_messages as tm
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.metrics import FANOUT_PHASES
from telephony.mulaw import float_to_ulaw
from telephony.server import VOICE_PATH, ServerContext, ServiceHandle, freeze_startup_heap
from telephony.signatures import SIGNATURE_HEADER, websocket_signature_url
from telephony.twiml import parse_connect_stream

PACKET_SECONDS = 0.02  # one Twilio media message: 160 bytes of 8 kHz μ-law
PACKET_BYTES = 160
KEPT_UP_SHARE = 0.95  # a call kept up if it received this share of its expected bot frames
LATE_GAP_S = FRAME_SECONDS + 0.02  # a bot frame later than this after the previous one drains a 20 ms cushion
TAIL_S = 2 * FRAME_SECONDS  # the caller listens this long after its last packet, then sends `stop`
TARGET_MS = 5.0
LAST_BUCKET_MS = 50.0  # the media histograms' largest finite bucket
INBOUND_METRIC = "kame_media_inbound_seconds"
OUTBOUND_METRIC = "kame_media_outbound_seconds"
FANOUT_METRIC = "kame_media_fanout_seconds"  # per tick, by phase: where the outbound time goes


# ---------------------------------------------------------------------------------------------------------
# The loopback engine


class LoopbackSession:
    """One call's seat: remembers the caller's last frame; the engine's ticker echoes it every 80 ms."""

    def __init__(self, engine: LoopbackEngine, call_id: str) -> None:
        self.call_id = call_id
        self._engine = engine
        self._queue: asyncio.Queue[EngineOutput | None] = asyncio.Queue()
        self.last: np.ndarray | None = None
        self.index = 0
        self._closed = False
        # time.monotonic() of every caller frame pushed and every bot frame produced, in order: matched with
        # the caller process's send/receive times (CLOCK_MONOTONIC is one clock for the whole machine)
        self.pushed_at: list[float] = []
        self.produced_at: list[float] = []
        self.actions_failed: list[tuple[str, str]] = []

    def push_audio(self, pcm: np.ndarray) -> None:
        self.pushed_at.append(time.monotonic())
        self.last = pcm

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        while (item := await self._queue.get()) is not None:  # no events: the loopback has no back-end
            yield item

    def action_failed(self, action: str, result: str) -> None:
        self.actions_failed.append((action, result))  # no back-end to tell: kept, for the link's tests

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._forget(self.call_id)
        self._queue.put_nowait(None)


class LoopbackEngine:
    """The `Engine` protocol with no model: a real-time echo of every open call, from one shared ticker."""

    def __init__(self, max_calls: int, on_count: Callable[[int], None] | None = None) -> None:
        self._max_calls = max_calls
        self._on_count = on_count  # told the number of open calls whenever it changes
        self._sessions: dict[str, LoopbackSession] = {}
        self.timelines: dict[str, LoopbackSession] = {}  # every call ever seated, by call id (= CallSid)
        self.setups: dict[str, object] = {}  # each call's CallSetup as it reached the engine
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False
        self.tick_late_s: list[float] = []  # how late each tick woke, against its deadline
        self.tick_busy_s: list[float] = []  # time spent emitting, per tick
        self.missed_ticks = 0  # ticks skipped because the loop was over a frame late
        self.frames_emitted = 0
        self.backlog_max = 0  # deepest the tick queue got (1 = the fan-out keeps up)
        self._frames: asyncio.Queue[BotFrames | None] = asyncio.Queue()
        self.open_delay_s = 0.0  # seating a call takes this long (a remote engine across a slow link)
        self.start_delay_s = 0.0  # then, its seat taken, this long again (a model engine's back-end starting)
        self.behind = False  # as a model's engine missing its 80 ms frames says (not ready; calls still seat)

    @property
    def max_calls(self) -> int:
        return self._max_calls

    @property
    def free_slots(self) -> int:
        return self._max_calls - len(self._sessions)

    @property
    def ready(self) -> bool:
        return not self._stopped and not self.behind

    @property
    def failed(self) -> bool:
        return False

    async def open_call(self, call_id: str, setup: object = None) -> LoopbackSession:
        if self.open_delay_s:
            await asyncio.sleep(self.open_delay_s)
        if self._stopped:
            raise EngineClosed("loopback engine stopped")
        if len(self._sessions) >= self._max_calls:
            raise EngineFull(f"all {self._max_calls} slots taken")
        session = self._sessions[call_id] = self.timelines[call_id] = LoopbackSession(self, call_id)
        self.setups[call_id] = setup
        self._count_changed()
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_forever(), name="loopback-ticker")
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        return session

    def _forget(self, call_id: str) -> None:
        self._sessions.pop(call_id, None)
        self._count_changed()

    def _count_changed(self) -> None:
        if self._on_count is not None:
            self._on_count(len(self._sessions))

    async def stop(self) -> None:
        self._stopped = True
        for session in list(self._sessions.values()):
            await session.close()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        self._frames.put_nowait(None)

    async def bot_frames(self) -> AsyncIterator[BotFrames]:
        while (frames := await self._frames.get()) is not None:
            yield frames

    def _emit(self) -> None:
        """One tick: every call with caller audio gets it back, all rows in one `BotFrames`."""
        sessions = [s for s in self._sessions.values() if s.last is not None]
        if not sessions:
            return
        now = time.monotonic()
        pcm = np.empty((len(sessions), FRAME_SAMPLES), dtype=np.float32)
        for row, session in enumerate(sessions):
            pcm[row] = session.last
            session.produced_at.append(now)
        n = len(sessions)
        self._frames.put_nowait(
            BotFrames(
                call_ids=tuple(s.call_id for s in sessions),
                pcm=pcm,
                texts=("",) * n,
                voiced=(True,) * n,
                indices=tuple(s.index for s in sessions),
                fresh=tuple(s.index == 0 for s in sessions),
                produced_at=now,
            )
        )
        for session in sessions:
            session.index += 1
        self.frames_emitted += n
        self.backlog_max = max(self.backlog_max, self._frames.qsize())

    async def _tick_forever(self) -> None:
        deadline = time.monotonic()
        while True:
            deadline += FRAME_SECONDS
            delay = deadline - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            woke = time.monotonic()
            self.tick_late_s.append(woke - deadline)
            if woke - deadline > FRAME_SECONDS:  # a whole frame late: don't burst to catch up
                skipped = int((woke - deadline) / FRAME_SECONDS)
                self.missed_ticks += skipped
                deadline += skipped * FRAME_SECONDS
            self._emit()
            self.tick_busy_s.append(time.monotonic() - woke)


@dataclass
class EngineTimeline:
    """One call's engine-side times (a `LoopbackSession`'s lists, or their copy from the engine process)."""

    pushed_at: list[float]
    produced_at: list[float]


@dataclass
class EngineSideReport:
    """What the loopback engine measured, wherever it ran."""

    timelines: dict[str, EngineTimeline]
    tick_late_s: list[float]
    missed_ticks: int
    backlog_max: int
    cpu_pct: float | None = None  # of one core; only when the engine ran in its own process

    @classmethod
    def of(cls, engine: LoopbackEngine, cpu_pct: float | None = None) -> EngineSideReport:
        return cls(
            # Behind the engine link a call is "<CallSid>@e<edge>" (call ids are per edge): keyed by CallSid.
            {cid.split("@")[0]: EngineTimeline(s.pushed_at, s.produced_at) for cid, s in engine.timelines.items()},
            engine.tick_late_s, engine.missed_ticks, engine.backlog_max, cpu_pct,
        )  # fmt: skip


def _engine_link_main(conn: Connection, socket_path: str, max_calls: int) -> None:
    """The engine-link mode's engine process: the loopback engine behind an `EngineServer` on a Unix socket,
    as `kame-phone engine-serve` serves the model. Reports its own times and CPU when told the run is over."""
    from engine.link_server import EngineServer
    from engine.link_wire import Address

    async def main() -> None:
        engine = LoopbackEngine(max_calls=max_calls)
        server = EngineServer(engine, token=None)
        await server.listen(Address(unix_path=socket_path))
        freeze_startup_heap()
        cpu0, wall0 = time.process_time(), time.monotonic()
        conn.send("listening")
        await asyncio.to_thread(conn.recv)  # the run is over
        cpu_pct = 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
        await server.aclose()
        await engine.stop()
        conn.send(EngineSideReport.of(engine, cpu_pct))

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# The simulated callers (in their own process)


@dataclass(frozen=True)
class CallerPlan:
    base_url: str  # http://127.0.0.1:port
    auth_token: str = field(repr=False)
    calls: int
    seconds: float
    stagger_s: float  # calls start spread over this long, in a random order
    seed: int = 0
    compress: int = 0  # offer permessage-deflate with this window (0: don't, as Twilio)
    more_urls: tuple[str, ...] = ()  # further edges: call k dials edge k mod (1 + len(more_urls))


@dataclass
class CallResult:
    call_sid: str = ""
    completed: bool = False
    error: str | None = None
    media_sent: int = 0
    bot_frames: int = 0
    marks_echoed: int = 0
    clears: int = 0
    late_gaps: int = 0  # bot frames that came more than LATE_GAP_S after the previous one
    max_gap_s: float = 0.0
    compressed: bool = False  # permessage-deflate was negotiated
    sent_at: list[float] = field(default_factory=list, repr=False)  # time.monotonic() of each media packet sent
    bot_at: list[float] = field(default_factory=list, repr=False)  # ... and of each bot media message received


def speech_like_packets(seconds: float = 3.0) -> list[bytes]:
    """A periodic 'voice': 125 Hz harmonics, syllables at 4 Hz, 2.2 s on, 0.8 s off (caller turns end)."""
    rate = 8000
    t = np.arange(round(seconds * rate)) / rate
    voice = sum(np.sin(2 * np.pi * 125 * k * t) / k for k in range(1, 13))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    envelope[t >= seconds - 0.8] = 0.0
    x = voice * envelope
    x *= 0.1 / np.sqrt(np.mean(x[t < seconds - 0.8] ** 2))  # -20 dBFS RMS while talking
    data = float_to_ulaw(x.astype(np.float32))
    return [data[i : i + PACKET_BYTES] for i in range(0, len(data), PACKET_BYTES)]


def _media_template(stream_sid: str) -> str:
    # tm.media_msg's exact output, as a %-template: no json.dumps or base64 per packet on the caller side.
    return (
        '{"event":"media","sequenceNumber":"%d","media":{"track":"inbound","chunk":"%d",'
        '"timestamp":"%d","payload":"%s"},"streamSid":"' + stream_sid + '"}'
    )


class _Callers:
    def __init__(self, plan: CallerPlan) -> None:
        self.plan = plan
        self.validator = RequestValidator(plan.auth_token)
        packets = speech_like_packets()
        self.payloads = [base64.b64encode(p).decode("ascii") for p in packets]
        sid = "MZ" + "0" * 32
        assert _media_template(sid) % (7, 3, 40, self.payloads[0]) == tm.media_msg(sid, 7, 3, 40, packets[0])
        self.send_lag_s: list[float] = []  # how late each media packet left, against its schedule

    async def run(self) -> list[CallResult]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            t0 = time.monotonic() + 0.2
            # Real calls start whenever their callers dial, so their 20 ms packet clocks have unrelated phases.
            # Evenly spaced starts (10 ms apart for 200 calls over 2 s) would put half the calls' packets on
            # the same instant and the other half 10 ms later: bursts of 100 messages no real trunk sends.
            rng = np.random.default_rng(self.plan.seed)
            starts = np.sort(rng.uniform(0.0, self.plan.stagger_s, self.plan.calls))
            urls = (self.plan.base_url, *self.plan.more_urls)
            return await asyncio.gather(
                *(self._call(session, t0 + float(at), urls[k % len(urls)]) for k, at in enumerate(starts))
            )

    async def _call(self, session: aiohttp.ClientSession, start_at: float, base_url: str) -> CallResult:
        result = CallResult()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        try:
            await self._dial(session, result, base_url)
        except (aiohttp.ClientError, OSError, ValueError, ET.ParseError, asyncio.TimeoutError) as e:
            result.error = f"{type(e).__name__}: {e}"[:200]
        return result

    async def _dial(self, session: aiohttp.ClientSession, result: CallResult, base_url: str) -> None:
        plan = self.plan
        call_sid, account_sid, stream_sid = (prefix + secrets.token_hex(16) for prefix in ("CA", "AC", "MZ"))
        result.call_sid = call_sid
        form = {"CallSid": call_sid, "AccountSid": account_sid, "From": "+15005550006", "To": "+15005550001"}
        voice_url = base_url + VOICE_PATH
        headers = {SIGNATURE_HEADER: self.validator.compute_signature(voice_url, form)}
        async with session.post(voice_url, data=form, headers=headers) as resp:
            body = await resp.text()
            if resp.status != 200:
                result.error = f"voice webhook answered HTTP {resp.status}"
                return
        stream = parse_connect_stream(body)
        signed = websocket_signature_url(base_url, urlsplit(stream.url).path)
        headers = {SIGNATURE_HEADER: self.validator.compute_signature(signed, {})}
        async with session.ws_connect(stream.url, headers=headers, compress=plan.compress) as ws:
            result.compressed = bool(ws.compress)
            seq = [0]  # shared with the receiver: mark echoes take sequence numbers too

            def next_seq() -> int:
                seq[0] += 1
                return seq[0]

            await ws.send_str(tm.connected_msg())
            await ws.send_str(tm.start_msg(stream_sid, call_sid, account_sid, stream.parameters, seq=next_seq()))
            receiver = asyncio.create_task(self._receive(ws, stream_sid, result, next_seq))
            try:
                template = _media_template(stream_sid)
                payloads, n = self.payloads, len(self.payloads)
                t0 = time.monotonic()
                for k in range(round(plan.seconds / PACKET_SECONDS)):
                    due = t0 + k * PACKET_SECONDS
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    now = time.monotonic()
                    self.send_lag_s.append(now - due)
                    if ws.closed:
                        result.error = "server closed the stream early"
                        return
                    result.sent_at.append(now)
                    await ws.send_str(template % (next_seq(), k + 1, k * 20, payloads[k % n]))
                    result.media_sent += 1
                await asyncio.sleep(TAIL_S)
                await ws.send_str(tm.stop_msg(stream_sid, next_seq(), call_sid, account_sid))
                await asyncio.wait_for(receiver, 10.0)  # the server hangs up on `stop`
                result.completed = result.error is None
            finally:
                receiver.cancel()

    async def _receive(
        self, ws: aiohttp.ClientWebSocketResponse, stream_sid: str, result: CallResult, next_seq: Callable[[], int]
    ) -> None:
        last: float | None = None
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            event = data.get("event")
            if event == "media":
                now = time.monotonic()
                result.bot_at.append(now)
                result.bot_frames += 1
                if last is not None:
                    gap = now - last
                    result.max_gap_s = max(result.max_gap_s, gap)
                    result.late_gaps += gap > LATE_GAP_S
                last = now
            elif event == "mark":  # echo at once: the harness plays nothing
                with contextlib.suppress(ConnectionResetError):  # the server may be hanging up
                    await ws.send_str(tm.mark_msg(stream_sid, next_seq(), data["mark"]["name"]))
                    result.marks_echoed += 1
            elif event == "clear":
                result.clears += 1


def _caller_main(conn: Connection, plan: CallerPlan) -> None:
    conn.send(run_callers(plan))
    conn.close()


async def _in_caller_process(plan: CallerPlan, timeout_s: float) -> dict[str, Any]:
    """Run the callers in a fresh (spawned) process, so none of their CPU is charged to this one."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_caller_main, args=(theirs, plan), name="media-bench-callers", daemon=True)
    proc.start()
    theirs.close()  # ours then reads EOF if the child dies
    try:
        if not await asyncio.to_thread(ours.poll, timeout_s):
            raise RuntimeError(f"the caller process gave no result in {timeout_s:.0f}s")
        try:
            return await asyncio.to_thread(ours.recv)
        except EOFError:
            raise RuntimeError(f"the caller process died (exit code {proc.exitcode})") from None
    finally:
        ours.close()
        await asyncio.to_thread(_join_or_kill, proc)


def run_callers(plan: CallerPlan) -> dict[str, Any]:
    """The caller process's entry point: place every call, return the per-call results and own costs."""
    callers = _Callers(plan)
    freeze_startup_heap()  # the callers must not pause for the collector any more than the server does
    cpu0, wall0 = time.process_time(), time.monotonic()
    results = asyncio.run(callers.run())
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    lag = np.asarray(callers.send_lag_s) * 1000 if callers.send_lag_s else np.zeros(1)
    return {
        "results": [asdict(r) for r in results],
        "cpu_pct": 100 * cpu / wall,
        "send_lag_p99_ms": float(np.percentile(lag, 99)),
        "send_lag_max_ms": float(lag.max()),
    }


# ---------------------------------------------------------------------------------------------------------
# Server-side measurement


def _histogram(name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) per bucket of a histogram in the default registry."""
    for metric in REGISTRY.collect():
        if metric.name == name:
            return [(float(s.labels["le"]), s.value) for s in metric.samples if s.name == name + "_bucket"]
    raise KeyError(name)


def _histograms_by(name: str, label: str) -> dict[str, list[tuple[float, float]]]:
    """`_histogram` for each value of `label` of a labelled histogram (none observed yet: empty)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for metric in REGISTRY.collect():
        if metric.name == name:
            for s in metric.samples:
                if s.name == name + "_bucket":
                    out.setdefault(s.labels[label], []).append((float(s.labels["le"]), s.value))
    return out


def _host_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, all cores, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan, math.nan
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


@dataclass
class _Snapshot:
    wall: float
    cpu: float  # this process
    host_busy: float  # the whole machine
    host_steal: float
    inbound: list[tuple[float, float]]
    outbound: list[tuple[float, float]]
    fanout: dict[str, list[tuple[float, float]]]  # by phase

    @classmethod
    def take(cls) -> _Snapshot:
        busy, steal = _host_cpu_s()
        return cls(
            time.monotonic(), time.process_time(), busy, steal, _histogram(INBOUND_METRIC), _histogram(OUTBOUND_METRIC),
            _histograms_by(FANOUT_METRIC, "phase"),
        )


def bucket_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (seconds) of the observations between two snapshots of one histogram, interpolated
    linearly inside its bucket, as Prometheus' histogram_quantile does; None if nothing was observed.
    Past the last finite bucket it returns that bucket's bound (a lower bound of the truth)."""
    deltas = [(le, a - b) for (le, a), (_, b) in zip(after, before, strict=True)]
    total = deltas[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cumulative in deltas:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower


def share_within(before: list[tuple[float, float]], after: list[tuple[float, float]], bound_s: float) -> float | None:
    """Exact share of observations at or under `bound_s`, which must be a bucket edge."""
    deltas = {le: a - b for (le, a), (_, b) in zip(after, before, strict=True)}
    total = deltas[math.inf]
    return None if total <= 0 else deltas[bound_s] / total


class _LoopLag:
    """Sleeps 10 ms over and over and records how late it wakes: the event loop's scheduling lag."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, lag s)

    async def run(self) -> None:
        while True:
            due = time.monotonic() + 0.01
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.samples.append((now, now - due))

    def between(self, t0: float, t1: float) -> np.ndarray:
        return np.array([lag for t, lag in self.samples if t0 <= t <= t1] or [0.0])


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "numpy": np.__version__,
    }


def wire_latencies(
    results: list[CallResult], timelines: Mapping[str, EngineTimeline], t0: float, t1: float
) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-frame latencies across the two processes, for frames the engine saw within [t0, t1] (s):

    inbound: the caller sending a frame's last packet -> the frame pushed to the engine;
    outbound: the engine producing a frame -> the caller receiving its media message.
    Unlike the histograms these include the kernel and the time a message waits for a busy event loop.
    """
    per_frame = round(FRAME_SECONDS / PACKET_SECONDS)
    inbound: list[float] = []
    outbound: list[float] = []
    for r in results:
        seat = timelines.get(r.call_sid)
        if seat is None:
            continue
        for j, pushed in enumerate(seat.pushed_at[: len(r.sent_at) // per_frame]):
            if t0 <= pushed <= t1:
                inbound.append(pushed - r.sent_at[(j + 1) * per_frame - 1])
        for produced, received in zip(seat.produced_at, r.bot_at, strict=False):
            if t0 <= produced <= t1:
                outbound.append(received - produced)
    return np.asarray(inbound), np.asarray(outbound)


def _pct_ms(samples: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(samples, q)) * 1000, 3) if len(samples) else None


def _met(share: float | None) -> bool | None:
    """p99 <= 5 ms, decided exactly: 5 ms is a bucket edge, so this needs no interpolation."""
    return None if share is None else share >= 0.99


def _round(x: float) -> float | None:  # None where /proc/stat could not be read
    return round(x, 1) if math.isfinite(x) else None


def _phase_quantiles(a: _Snapshot, b: _Snapshot, q: float) -> dict[str, float | None]:
    """The q-quantile (ms) of each fan-out phase between two snapshots (a phase not yet observed at `a`
    starts from zero)."""
    return {
        phase: _ms(bucket_quantile(a.fanout.get(phase) or [(le, 0.0) for le, _ in after], after, q))
        for phase, after in b.fanout.items()
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


async def run_media_bench(
    calls: int = 200, seconds: float = 20.0, log: Callable[[str], object] = print, *, compress: int = 0,
    engine_link: bool = False, edges: int = 1,
) -> dict:
    """Run the benchmark; print a short table through `log` and return the figures.

    `compress` > 0 makes the callers offer permessage-deflate (aiohttp's client default; Twilio's
    Media Streams client is not known to), to see what it costs the server when it is accepted.
    `engine_link` puts the loopback engine in a process of its own behind the engine link
    (engine/remote.py), as `serve --engine` edges use a shared engine: the wire figures then include the
    link's two hops. `edges` > 1 (implies the link) runs that many edge processes on the one engine, the
    calls dealt round-robin, as a node carrying more calls than one edge process would run them.
    """
    assert calls >= 1 and seconds >= 4 * FRAME_SECONDS and 1 <= edges <= calls, (calls, seconds, edges)
    stagger = min(2.0, seconds / 4)
    if edges > 1:
        measured, caller, engine_side = await _run_edge_processes(calls, seconds, stagger, compress, edges, log)
    else:
        measured, caller, engine_side = await _run_in_process(calls, seconds, stagger, compress, engine_link, log)
    steady_state, a, b = measured.steady_state, measured.a, measured.b
    run_start, run_end = measured.run_start, measured.run_end
    window = b.wall - a.wall
    cpu = b.cpu - a.cpu
    lag = measured.lag_ms
    results = [CallResult(**r) for r in caller["results"]]
    expected = int(seconds / FRAME_SECONDS)
    kept_up = [r for r in results if r.completed and r.bot_frames >= KEPT_UP_SHARE * expected]
    tick_late = np.asarray(engine_side.tick_late_s or [0.0]) * 1000
    errors = sorted({r.error for r in results if r.error})
    wire_in, wire_out = wire_latencies(results, engine_side.timelines, a.wall, b.wall)
    report: dict[str, Any] = {
        "calls": calls,
        "seconds": seconds,
        "steady_state": steady_state,  # False: figures cover the whole run (not every call was up at once)
        "window_s": round(window, 3),
        "server_cpu_pct": round(100 * cpu / window, 1),  # of one core
        "cpu_per_call_ms_per_s": round(1000 * cpu / window / calls, 3),  # CPU ms per second of call
        "cpu_pct_per_call": round(100 * cpu / window / calls, 3),
        "inbound_p50_ms": _ms(bucket_quantile(a.inbound, b.inbound, 0.50)),
        "inbound_p99_ms": _ms(bucket_quantile(a.inbound, b.inbound, 0.99)),
        "inbound_within_5ms": share_within(a.inbound, b.inbound, TARGET_MS / 1000),
        "outbound_p50_ms": _ms(bucket_quantile(a.outbound, b.outbound, 0.50)),
        "outbound_p99_ms": _ms(bucket_quantile(a.outbound, b.outbound, 0.99)),
        "outbound_within_5ms": share_within(a.outbound, b.outbound, TARGET_MS / 1000),
        # where a tick's way out goes (per tick, not per call): the last call of a tick waits for all of it
        "fanout_p50_ms": _phase_quantiles(a, b, 0.50),
        "fanout_p99_ms": _phase_quantiles(a, b, 0.99),
        "run_inbound_p99_ms": _ms(bucket_quantile(run_start.inbound, run_end.inbound, 0.99)),
        "run_outbound_p99_ms": _ms(bucket_quantile(run_start.outbound, run_end.outbound, 0.99)),
        # exact, caller process <-> engine, same clock: kernel and event-loop queueing included
        "inbound_wire_p50_ms": _pct_ms(wire_in, 50),
        "inbound_wire_p99_ms": _pct_ms(wire_in, 99),
        "outbound_wire_p50_ms": _pct_ms(wire_out, 50),
        "outbound_wire_p99_ms": _pct_ms(wire_out, 99),
        "percentiles": "linear interpolation inside Prometheus buckets (0.1,0.25,0.5,1,2,3,5,10,20,50 ms)",
        "loop_lag_p50_ms": round(float(np.percentile(lag, 50)), 3),
        "loop_lag_p99_ms": round(float(np.percentile(lag, 99)), 3),
        "loop_lag_max_ms": round(float(lag.max()), 3),
        "inbound_p99_within_5ms": _met(share_within(a.inbound, b.inbound, TARGET_MS / 1000)),
        "outbound_p99_within_5ms": _met(share_within(a.outbound, b.outbound, TARGET_MS / 1000)),
        "engine_tick_late_p99_ms": round(float(np.percentile(tick_late, 99)), 3),
        "engine_missed_ticks": engine_side.missed_ticks,
        "engine_backlog_max": engine_side.backlog_max,
        "engine_link": engine_link or edges > 1,
        "edges": edges,
        "engine_process_cpu_pct": None if engine_side.cpu_pct is None else round(engine_side.cpu_pct, 1),
        "realtime_ok_fraction": len(kept_up) / calls,
        "realtime_smooth_fraction": sum(r.late_gaps == 0 for r in kept_up) / calls,  # ... and never a late frame
        "calls_completed": sum(r.completed for r in results),
        "frames_expected": expected * calls,
        "frames_received": sum(r.bot_frames for r in results),
        "late_gaps": sum(r.late_gaps for r in results),  # bot frames > 100 ms after the previous one
        "max_gap_ms": round(1000 * max((r.max_gap_s for r in results), default=0.0), 1),
        "media_sent": sum(r.media_sent for r in results),
        "marks_echoed": sum(r.marks_echoed for r in results),
        "ws_deflate_calls": sum(r.compressed for r in results),  # streams that negotiated permessage-deflate
        "caller_cpu_pct": round(caller["cpu_pct"], 1),
        # everything else on the machine over the window (other processes), in % of one core: the figures
        # are only clean when this is near zero
        "other_cpu_pct": _round(
            100 * (b.host_busy - a.host_busy) / window - 100 * cpu / window - caller["cpu_pct"]
            - (engine_side.cpu_pct or 0.0)
        ),
        "steal_pct": _round(100 * (b.host_steal - a.host_steal) / window),
        "caller_send_lag_p99_ms": round(caller["send_lag_p99_ms"], 3),
        "errors": errors[:5],
        "machine": machine(),
    }
    log(format_table(report))
    return report




@dataclass
class _Measured:
    """The edge side's figures: the window they cover (`a`..`b`, the steady state when there was one) and
    the whole run, and the event loop's lag (ms) over the window."""

    steady_state: bool
    a: _Snapshot
    b: _Snapshot
    run_start: _Snapshot
    run_end: _Snapshot
    lag_ms: np.ndarray


def _steady_watch(calls: int, steady: dict[str, _Snapshot]) -> Callable[[int], None]:
    def watch(open_calls: int) -> None:  # the steady state: from the moment every call streams to the first hang-up
        if open_calls == calls and "start" not in steady:
            steady["start"] = _Snapshot.take()
        elif open_calls < calls and "start" in steady and "end" not in steady:
            steady["end"] = _Snapshot.take()

    return watch


def _measured(steady: dict[str, _Snapshot], run_start: _Snapshot, run_end: _Snapshot, probe: _LoopLag) -> _Measured:
    steady_state = "start" in steady and "end" in steady
    a, b = (steady["start"], steady["end"]) if steady_state else (run_start, run_end)
    return _Measured(steady_state, a, b, run_start, run_end, probe.between(a.wall, b.wall) * 1000)


async def _run_in_process(
    calls: int, seconds: float, stagger: float, compress: int, engine_link: bool, log: Callable[[str], object]
) -> tuple[_Measured, dict[str, Any], EngineSideReport]:
    """One edge: the service in this process, the loopback engine here too or behind the link."""
    steady: dict[str, _Snapshot] = {}
    watch = _steady_watch(calls, steady)
    async with contextlib.AsyncExitStack() as stack:
        if engine_link:
            engine, finish_engine = await _linked_engine(stack, calls)
        else:
            engine = LoopbackEngine(max_calls=calls, on_count=watch)
            stack.push_async_callback(engine.stop)

            async def finish_engine() -> EngineSideReport:
                return EngineSideReport.of(engine)

        token = secrets.token_hex(16)
        ctx = ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token), MemoryCallStore(), engine)
        handle = await ServiceHandle(ctx).start()
        stack.push_async_callback(handle.aclose)
        freeze_startup_heap()  # as `kame-phone serve` does once it is up
        mode = ", engine behind the link" if engine_link else ""
        log(f"media bench: {calls} calls x {seconds:g}s, starts staggered over {stagger:g}s{mode}, "
            f"on {handle.http_url}")  # fmt: skip
        probe = _LoopLag()
        lag_task = asyncio.create_task(probe.run())
        watcher = asyncio.create_task(_watch_streams(ctx, watch)) if engine_link else None
        run_start = _Snapshot.take()
        try:
            plan = CallerPlan(handle.http_url, token, calls, seconds, stagger, compress)
            caller = await _in_caller_process(plan, timeout_s=seconds + stagger + 60)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.no_streams.wait(), 10.0)
            run_end = _Snapshot.take()
        finally:
            for task in (lag_task, watcher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        engine_side = await finish_engine()
    return _measured(steady, run_start, run_end, probe), caller, engine_side


@dataclass
class _EdgeReport:
    steady_start: _Snapshot | None
    steady_end: _Snapshot | None
    run_start: _Snapshot
    run_end: _Snapshot
    lag: list[tuple[float, float]]


def _edge_main(conn: Connection, socket_path: str, seats: int, token: str, name: str) -> None:
    """One edge process of the multi-edge mode: the service on the engine link, measuring itself."""
    from engine.link_wire import Address
    from engine.remote import RemoteEngine

    async def main() -> None:
        engine = await RemoteEngine.connect(Address(unix_path=socket_path), token=None, seats=seats, name=name)
        config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token)
        ctx = ServerContext(config, MemoryCallStore(), engine)
        handle = await ServiceHandle(ctx).start()
        freeze_startup_heap()
        steady: dict[str, _Snapshot] = {}
        probe = _LoopLag()
        watch = _steady_watch(seats, steady)
        tasks = [asyncio.create_task(probe.run()), asyncio.create_task(_watch_streams(ctx, watch))]
        run_start = _Snapshot.take()
        conn.send(handle.http_url)
        await asyncio.to_thread(conn.recv)  # the callers are done
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ctx.no_streams.wait(), 10.0)
        run_end = _Snapshot.take()
        for task in tasks:
            task.cancel()
        await engine.stop()
        await handle.aclose()
        conn.send(_EdgeReport(steady.get("start"), steady.get("end"), run_start, run_end, probe.samples))

    asyncio.run(main())


def _merge_windows(pairs: list[tuple[_Snapshot, _Snapshot]]) -> tuple[_Snapshot, _Snapshot]:
    """Several edges' (start, end) snapshots as one pair: the histograms summed (each over its own window),
    CPU summed as rates over the common window (the latest start to the earliest end), the host's from
    the first edge, scaled the same way."""
    start, end = max(a.wall for a, _ in pairs), min(b.wall for _, b in pairs)
    if end <= start:  # no common window: use the widest
        start, end = min(a.wall for a, _ in pairs), max(b.wall for _, b in pairs)
    window = end - start

    def rate(a: _Snapshot, b: _Snapshot, x: Callable[[_Snapshot], float]) -> float:
        return (x(b) - x(a)) / (b.wall - a.wall) * window

    def added(rows: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:  # one histogram's buckets
        return [(le, sum(row[i][1] for row in rows)) for i, (le, _) in enumerate(rows[0])]

    def summed(side: int, name: str) -> list[tuple[float, float]]:
        return added([getattr(pair[side], name) for pair in pairs])

    def phases(side: int) -> dict[str, list[tuple[float, float]]]:
        names = set.intersection(*(set(pair[side].fanout) for pair in pairs))
        return {name: added([pair[side].fanout[name] for pair in pairs]) for name in names}

    a0, b0 = pairs[0]
    first = _Snapshot(start, 0.0, 0.0, 0.0, summed(0, "inbound"), summed(0, "outbound"), phases(0))
    last = _Snapshot(
        end,
        sum(rate(a, b, lambda s: s.cpu) for a, b in pairs),
        rate(a0, b0, lambda s: s.host_busy),
        rate(a0, b0, lambda s: s.host_steal),
        summed(1, "inbound"),
        summed(1, "outbound"),
        phases(1),
    )
    return first, last


async def _run_edge_processes(
    calls: int, seconds: float, stagger: float, compress: int, edges: int, log: Callable[[str], object]
) -> tuple[_Measured, dict[str, Any], EngineSideReport]:
    """Several edge processes on one engine process (the link), the callers dealt round-robin."""
    token = secrets.token_hex(16)
    spawn = multiprocessing.get_context("spawn")
    async with contextlib.AsyncExitStack() as stack:
        path, finish_engine = await _engine_process(stack, calls)
        pipes, procs, urls = [], [], []
        for k in range(edges):
            ours, theirs = spawn.Pipe()
            seats = len(range(k, calls, edges))  # the calls the callers will deal this edge
            proc = spawn.Process(target=_edge_main, args=(theirs, path, seats, token, f"edge-{k}"), daemon=True)
            proc.start()
            theirs.close()
            stack.callback(_join_or_kill, proc)
            if not await asyncio.to_thread(ours.poll, 60):
                raise RuntimeError(f"edge process {k} did not come up")
            urls.append(await asyncio.to_thread(ours.recv))
            pipes.append(ours)
            procs.append(proc)
        log(f"media bench: {calls} calls x {seconds:g}s over {edges} edge processes on one engine process, "
            f"starts staggered over {stagger:g}s")  # fmt: skip
        plan = CallerPlan(urls[0], token, calls, seconds, stagger, compress, more_urls=tuple(urls[1:]))
        caller = await _in_caller_process(plan, timeout_s=seconds + stagger + 60)
        reports: list[_EdgeReport] = []
        for k, conn in enumerate(pipes):
            conn.send("done")
            if not await asyncio.to_thread(conn.poll, 30):
                raise RuntimeError(f"edge process {k} gave no report")
            reports.append(await asyncio.to_thread(conn.recv))
        engine_side = await finish_engine()
    steady_state = all(r.steady_start is not None and r.steady_end is not None for r in reports)
    if steady_state:
        a, b = _merge_windows([(r.steady_start, r.steady_end) for r in reports])  # type: ignore[misc]
    else:
        a, b = _merge_windows([(r.run_start, r.run_end) for r in reports])
    run_start, run_end = _merge_windows([(r.run_start, r.run_end) for r in reports])
    lag = np.array([x for r in reports for t, x in r.lag if a.wall <= t <= b.wall] or [0.0]) * 1000
    return _Measured(steady_state, a, b, run_start, run_end, lag), caller, engine_side


def _join_or_kill(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()

async def _watch_streams(ctx: ServerContext, watch: Callable[[int], None]) -> None:
    """The engine-link mode's steady-state watcher: the engine is in another process, so count streams here."""
    while True:
        watch(len(ctx.streams))
        await asyncio.sleep(0.02)


async def _engine_process(
    stack: contextlib.AsyncExitStack, calls: int
) -> tuple[str, Callable[[], Awaitable[EngineSideReport]]]:
    """Start the loopback engine's process on a Unix socket; (its path, a coroutine function that ends the
    process and returns what the engine measured; call it once the edges have left)."""
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kame-bench-"))
    path = os.path.join(workdir, "engine.sock")
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_engine_link_main, args=(theirs, path, calls), name="media-bench-engine", daemon=True)
    proc.start()
    theirs.close()
    stack.callback(_join_or_kill, proc)
    if not await asyncio.to_thread(ours.poll, 60) or await asyncio.to_thread(ours.recv) != "listening":
        raise RuntimeError("the engine process did not come up")

    async def finish() -> EngineSideReport:
        ours.send("done")
        if not await asyncio.to_thread(ours.poll, 30):
            raise RuntimeError("the engine process gave no report")
        return await asyncio.to_thread(ours.recv)

    return path, finish


async def _linked_engine(
    stack: contextlib.AsyncExitStack, calls: int
) -> tuple[Any, Callable[[], Awaitable[EngineSideReport]]]:
    """The loopback engine's process, and this process connected to it as an edge; (the edge's engine, a
    coroutine function that ends the engine process and returns what it measured)."""
    from engine.link_wire import Address
    from engine.remote import RemoteEngine

    path, finish_engine = await _engine_process(stack, calls)
    engine = await RemoteEngine.connect(Address(unix_path=path), token=None, seats=calls, name="media-bench")
    stack.push_async_callback(engine.stop)

    async def finish() -> EngineSideReport:
        await engine.stop()  # the edge leaves first, so the engine's going away is not a lost link
        return await finish_engine()

    return engine, finish


def format_table(r: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:  # past the last bucket only a lower bound is known
        return "-" if x is None else f">={x:.0f}" if x >= LAST_BUCKET_MS else f"{x:.2f}"

    def exact(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    m = r["machine"]
    server = "server CPU" if r.get("edges", 1) == 1 else f"{r['edges']} edges CPU"
    rows = [
        f"machine            {m['cores']} cores, {m['cpu_model']}; Python {m['python']}, aiohttp {m['aiohttp']}",
        f"window             {r['window_s']:.1f}s {'steady state' if r['steady_state'] else '(whole run)'}",
        f"{server:19s}{r['server_cpu_pct']:.1f}% of a core; per call {r['cpu_per_call_ms_per_s']:.2f} ms/s"
        f" ({r['cpu_pct_per_call']:.3f}% of a core)",
        f"inbound  p50/p99   {ms(r['inbound_p50_ms'])} / {ms(r['inbound_p99_ms'])} ms"
        f"  (<= 5 ms: {pct(r['inbound_within_5ms'])})",
        f"outbound p50/p99   {ms(r['outbound_p50_ms'])} / {ms(r['outbound_p99_ms'])} ms"
        f"  (<= 5 ms: {pct(r['outbound_within_5ms'])})",
        "tick phases        " + ", ".join(
            f"{phase} {ms(r['fanout_p50_ms'].get(phase))}/{ms(r['fanout_p99_ms'].get(phase))}"
            for phase in FANOUT_PHASES
        ) + " ms (p50/p99 per tick)",
        f"wire, exact        in {exact(r['inbound_wire_p50_ms'])} / {exact(r['inbound_wire_p99_ms'])} ms,"
        f" out {exact(r['outbound_wire_p50_ms'])} / {exact(r['outbound_wire_p99_ms'])} ms (p50/p99, caller <-> engine)",
        f"loop lag p50/p99   {r['loop_lag_p50_ms']:.2f} / {r['loop_lag_p99_ms']:.2f} ms"
        f" (max {r['loop_lag_max_ms']:.1f})",
        f"engine             {r['engine_missed_ticks']} ticks missed; ticks woke up to"
        f" {r['engine_tick_late_p99_ms']:.1f} ms late (p99)",
        f"real time          {r['realtime_ok_fraction']:.1%} of calls kept up"
        f" ({r['realtime_smooth_fraction']:.1%} with no late frame); {r['calls_completed']}/{r['calls']}"
        f" completed; bot frames {r['frames_received']}/{r['frames_expected']}; late gaps {r['late_gaps']}"
        f" (max gap {r['max_gap_ms']:.0f} ms)",
        f"caller process     {r['caller_cpu_pct']:.1f}% of a core; send lag p99 {r['caller_send_lag_p99_ms']:.2f} ms",
    ]
    if r.get("engine_process_cpu_pct") is not None:
        rows.append(f"engine process     {r['engine_process_cpu_pct']:.1f}% of a core (loopback engine, link)")
    if r["other_cpu_pct"] is not None:
        rows.append(f"rest of machine    {r['other_cpu_pct']:.1f}% of a core busy, {r['steal_pct']:.1f}% stolen")
    if (r["other_cpu_pct"] or 0) > 20:
        rows.append("WARNING            other processes were busy: latencies and loop lag are not clean")
    if r["errors"]:
        rows.append(f"errors             {'; '.join(r['errors'])}")
    return "\n".join(rows)

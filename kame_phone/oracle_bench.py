"""`kame-phone bench oracle`: how fast a new LLM draft becomes a call's oracle, with many calls at once.

Harness: the real engine (tiny model, CPU, one slot per call), the real per-call back-end (policy,
conversation, streaming OpenAI client), and a local OpenAI-compatible server with a fixed time to first
token, in a process of its own as a real LLM endpoint would be (in ours, its streams charged their CPU
and GIL time to the system under test). The STT is replaced by a scripted caller that says a word every
240-400 ms and ends a sentence every 8 words, so 32 calls fit on a 2-core machine (pocketsphinx costs
~0.13 s of CPU per second of audio). Each caller has its own pace and phase, as independent calls do:
in lockstep, all 32 would ask the LLM on the same tick, a burst no real call mix makes.

Reported: oracle lag (transcript update -> the candidate's boundary token fed to the call's row) minus
the LLM's own time to first token (the server's, request in -> first token out, matched by X-Request-Id):
the delay the system adds on top of the LLM, whose target is <= 80 ms p99 (one frame). It is split into:
request out and first draft handled on our event loop (the client-seen TTFT minus the server's), draft
-> the call's slot (tokenizing, the hop to the engine process), and the wait in the slot for the next
tick (up to one 80 ms frame, by design).
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import platform
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from engine.checkpoint import RANDOM_PREFIX
from engine.heap import freeze_startup_heap
from engine.interface import FRAME_SAMPLES, FRAME_SECONDS
from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from engine.tiny_checkpoint import make_tiny_checkpoint
from knowledge.backend import CallBackend
from knowledge.llm import LlmClient, LlmConfig
from knowledge.oracle_policy import OraclePolicyConfig
from knowledge.stt import SttResult

WORDS = "could you please tell me when the store opens on monday and whether you deliver".split()
ANSWER = "The store opens at nine on Monday and yes we deliver every day of the week including Sundays."


class ScriptedCaller:
    """An STT stand-in: one more word every `word_s` of audio fed; a final every `per_sentence` words.
    `phase_frames` shifts when the first word lands (callers don't all start on the same frame)."""

    def __init__(self, word_s: float = 0.3, per_sentence: int = 8, phase_frames: int = 0) -> None:
        self.frames_per_word = max(1, round(word_s / FRAME_SECONDS))
        self.per_sentence = per_sentence
        self.frames = phase_frames % self.frames_per_word
        self.words: list[str] = []

    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        out = []
        for _ in range(len(pcm24k) // FRAME_SAMPLES):
            self.frames += 1
            if self.frames % self.frames_per_word:
                continue
            self.words.append(WORDS[len(self.words) % len(WORDS)])
            final = len(self.words) == self.per_sentence
            out.append(SttResult(" ".join(self.words), final=final))
            if final:
                self.words = []
        return out

    def flush(self) -> list[SttResult]:
        return []

    def reset(self) -> None:
        self.words = []

    def close(self) -> None:
        pass


class FixedLatencyLlm:
    """A local OpenAI-compatible server: waits `ttft_s` (± up to `jitter_s`, uniform), then streams ANSWER a
    word every `chunk_s`. Its own time to first token (request in -> first chunk written, so its own
    event loop's delays count as the LLM's) is remembered per X-Request-Id."""

    def __init__(self, ttft_s: float, chunk_s: float = 0.02, jitter_s: float = 0.0, seed: int = 0) -> None:
        self.ttft_s, self.chunk_s, self.jitter_s = ttft_s, chunk_s, jitter_s
        self._rng = random.Random(seed)
        self.requests = 0
        self.ttft_by_request: dict[str, float] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        received_at = time.monotonic()
        body = await request.json()
        self.requests += 1
        await asyncio.sleep(self.ttft_s + self._rng.uniform(-self.jitter_s, self.jitter_s))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            for i, word in enumerate(ANSWER.split()):
                delta = {"content": ("" if i == 0 else " ") + word}
                chunk = {"id": "b", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "delta": delta}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0:  # the server's own TTFT, as an LLM server reports it: request in -> first token out
                    self.ttft_by_request[request.headers.get("X-Request-Id", "-")] = time.monotonic() - received_at
                await asyncio.sleep(self.chunk_s)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass  # superseded: the client walked away
        return resp


class _Provider:
    """Opens a real CallBackend per call, with the scripted caller and timing taps on its drafts."""

    def __init__(self, llm: LlmClient, executor: ThreadPoolExecutor, seed: int = 0) -> None:
        self.llm, self.executor = llm, executor
        self.first_draft: dict[tuple[str, int], tuple[float, float]] = {}  # (call, cand) -> (trigger, arrival)
        self._rng = random.Random(seed)

    def follow_engine_ticks(self, pace: threading.Event) -> bool:
        return False  # its STT is the scripted caller's text: nothing on the GPU

    process_tick_signal = None  # nor in a process of its own
    ready = True

    def open_call(self, call_id, on_transcript, on_oracle, on_error, setup=None, on_tool=None):  # type: ignore[no-untyped-def]
        def tapped(text: str, triggered_at: float | None, candidate_id: int, complete: bool) -> None:
            if triggered_at is not None:  # None: a line no request made (none here: no greeting, no tools)
                self.first_draft.setdefault((call_id, candidate_id), (triggered_at, time.monotonic()))
            on_oracle(text, triggered_at, candidate_id, complete)

        caller = functools.partial(
            ScriptedCaller, word_s=self._rng.choice((0.24, 0.32, 0.4)), phase_frames=self._rng.randrange(5)
        )
        return CallBackend(
            call_id, stt_factory=caller, llm=self.llm, executor=self.executor,
            on_transcript=on_transcript, on_oracle=tapped, on_error=on_error, policy=OraclePolicyConfig(),
            on_tool=on_tool,  # no tools are offered (no CallTools): the bench measures drafts only
        )

    async def aclose(self) -> None:
        await self.llm.aclose()
        self.executor.shutdown(wait=False)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def _serve_llm(ttft_s: float, jitter_s: float, port_out: Connection, stop: Event, requests_out: Connection) -> None:
    """The LLM server process: serve until `stop` is set, then report the requests and each one's TTFT."""

    async def main() -> None:
        llm_server = FixedLatencyLlm(ttft_s, jitter_s=jitter_s)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", llm_server.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port_out.send(runner.addresses[0][1])
        await asyncio.to_thread(stop.wait)
        await runner.cleanup()
        requests_out.send((llm_server.requests, llm_server.ttft_by_request))

    asyncio.run(main())


async def run_oracle_bench(
    calls: int = 32,
    seconds: float = 20.0,
    ttft_ms: float = 300.0,
    log=print,  # type: ignore[no-untyped-def]
    *,
    engine_process: bool = False,
    torch_threads: int = 0,
    size: str = "tiny",
    device: str = "cpu",
    context: int | None = None,
    ttft_jitter_ms: float = 0.0,
) -> dict[str, Any]:
    """`size` "tiny" loads a generated tiny checkpoint through the real loader; any other size is
    `random:SIZE` (full-size architecture, random weights: the tick costs what it will in production)."""
    if size != "tiny" and not device.startswith("cuda"):
        raise SystemExit(f"size {size} needs a CUDA GPU (it is ~16 GB in bf16); use --size tiny on CPU")
    mp = multiprocessing.get_context("spawn")
    port_in, port_out = mp.Pipe(duplex=False)
    requests_in, requests_out = mp.Pipe(duplex=False)
    stop = mp.Event()
    server = mp.Process(
        target=_serve_llm, args=(ttft_ms / 1000, ttft_jitter_ms / 1000, port_out, stop, requests_out), daemon=True
    )
    server.start()
    try:
        engine = EngineConfig(
            device=device, max_calls=calls, sampling=SamplingOverrides(), engine_process=engine_process,
            torch_threads=torch_threads, context=context, checkpoint="" if size == "tiny" else RANDOM_PREFIX + size,
        )
        return await _run(engine, seconds, ttft_ms, ttft_jitter_ms, log, port_in, stop, requests_in)
    finally:
        stop.set()
        await asyncio.to_thread(server.join, 10)
        if server.is_alive():
            server.kill()


async def _run(config, seconds, ttft_ms, ttft_jitter_ms, log, port_in, stop, requests_in) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    calls = config.max_calls
    if not await asyncio.to_thread(port_in.poll, 60):
        raise RuntimeError("the LLM server process did not start")
    base_url = f"http://127.0.0.1:{port_in.recv()}/v1"
    llm = LlmClient(LlmConfig(model="bench", base_url=base_url, api_key="none", timeout_s=10.0))
    provider = _Provider(llm, ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-stt"))
    with tempfile.TemporaryDirectory() as tmp:
        if not config.checkpoint:
            config.checkpoint = str(await asyncio.to_thread(make_tiny_checkpoint, Path(tmp) / "tiny"))
        engine = await LocalEngine.load(config, provider)
        await engine.start()  # inside: an engine process loads the checkpoint from the temporary dir
    freeze_startup_heap()  # as `kame-phone serve` does once it is up
    sessions = [await engine.open_call(f"bench-{i:03d}") for i in range(calls)]
    drains = [asyncio.create_task(_drain(s.outputs())) for s in sessions]
    drains.append(asyncio.create_task(_drain(engine.bot_frames())))  # as the phone edge would take them
    silence = np.zeros(FRAME_SAMPLES, dtype=np.float32)
    t0 = time.monotonic()
    next_at = t0
    loop_lag = []  # how late this loop wakes: the back-end's drafts share it
    while time.monotonic() - t0 < seconds:
        for s in sessions:
            s.push_audio(silence)
        next_at += FRAME_SECONDS
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        loop_lag.append(max(0.0, time.monotonic() - next_at))
    fed = list(engine.frame_loop.oracle_fed)
    ticks = list(engine.frame_loop.stats.tick_s)
    misses = engine.frame_loop.stats.deadline_misses
    for s in sessions:
        await s.close()
    for d in drains:
        d.cancel()
    await engine.stop()
    stop.set()
    requests, server_ttft = requests_in.recv() if await asyncio.to_thread(requests_in.poll, 10) else (0, {})

    lags, ttfts, added, on_loop, waits, before_slot = [], [], [], [], [], []
    for item in fed:
        tap = provider.first_draft.get((item.call_id, item.candidate))
        if tap is None:
            continue
        own_ttft = server_ttft.get(f"{item.call_id}-{item.candidate}")
        if own_ttft is None:
            continue
        triggered_at, arrived_at = tap
        lags.append(item.lag)
        ttfts.append(arrived_at - triggered_at)  # as the client saw it: the server's TTFT + our loop's delays
        added.append(item.lag - own_ttft)
        on_loop.append(arrived_at - triggered_at - own_ttft)  # request out, first draft in, on our loop
        waits.append(item.slot_wait)  # in the slot, waiting for a tick
        before_slot.append(item.fed_at - item.slot_wait - arrived_at)  # first draft -> the slot (tokenizing, hops)
    result = {
        "calls": calls, "seconds": seconds, "llm_ttft_ms_configured": ttft_ms,
        "llm_ttft_jitter_ms": ttft_jitter_ms, "llm_requests": requests,
        "candidates_fed": len(lags),
        "oracle_lag_p50_ms": _pct(lags, 50), "oracle_lag_p99_ms": _pct(lags, 99),
        "llm_ttft_client_p50_ms": _pct(ttfts, 50), "llm_ttft_client_p99_ms": _pct(ttfts, 99),
        "lag_minus_ttft_p50_ms": _pct(added, 50), "lag_minus_ttft_p99_ms": _pct(added, 99),
        "on_loop_p50_ms": _pct(on_loop, 50), "on_loop_p99_ms": _pct(on_loop, 99),
        "to_slot_p50_ms": _pct(before_slot, 50), "to_slot_p99_ms": _pct(before_slot, 99),
        "slot_wait_p50_ms": _pct(waits, 50), "slot_wait_p99_ms": _pct(waits, 99),
        "tick_p50_ms": _pct(ticks, 50), "tick_p99_ms": _pct(ticks, 99), "deadline_misses": misses,
        "loop_lag_p50_ms": _pct(loop_lag, 50), "loop_lag_p99_ms": _pct(loop_lag, 99),
        "machine": f"{platform.machine()}, {_cores()} cores",
        "engine": (f"{_model_name(config.checkpoint)} on {config.device}"
                   + (", in its own process" if config.engine_process else ", in-process")),
        "torch_threads": config.torch_threads,
    }
    log(f"# oracle path: {calls} calls for {seconds:.0f} s, LLM TTFT {ttft_ms:.0f} ± {ttft_jitter_ms:.0f} ms"
        f" (the server's own), {result['engine']}")
    log(f"candidates fed: {len(lags)} of {requests} requests")
    log(f"oracle lag p50/p99: {result['oracle_lag_p50_ms']:.0f}/{result['oracle_lag_p99_ms']:.0f} ms; "
        f"LLM TTFT as the client saw it p50/p99: {result['llm_ttft_client_p50_ms']:.0f}/"
        f"{result['llm_ttft_client_p99_ms']:.0f} ms")
    log(f"lag minus TTFT p50/p99: {result['lag_minus_ttft_p50_ms']:.1f}/{result['lag_minus_ttft_p99_ms']:.1f} ms"
        f" (target p99 <= 80 ms); engine tick p50/p99 {result['tick_p50_ms']:.0f}/{result['tick_p99_ms']:.0f} ms,"
        f" {misses} deadline misses")
    log(f"  of which request out + first draft handled on our loop p50/p99 {result['on_loop_p50_ms']:.1f}/"
        f"{result['on_loop_p99_ms']:.1f} ms,")
    log(f"  draft -> slot p50/p99 {result['to_slot_p50_ms']:.1f}/{result['to_slot_p99_ms']:.1f} ms,"
        f" waiting in the slot for a tick {result['slot_wait_p50_ms']:.1f}/{result['slot_wait_p99_ms']:.1f} ms")
    log(f"  the back-end's event loop woke late by p50/p99 {result['loop_lag_p50_ms']:.1f}/"
        f"{result['loop_lag_p99_ms']:.1f} ms")
    return result


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


def _model_name(checkpoint: str) -> str:
    if checkpoint.startswith(RANDOM_PREFIX):
        return checkpoint.removeprefix(RANDOM_PREFIX) + " (random weights)"
    return "tiny model"


def _cores() -> int:
    import os

    return os.cpu_count() or 0

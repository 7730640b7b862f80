"""`kame-phone bench node`: the whole service on this node, as deployed, under N simultaneous phone calls.

    kame-phone bench node --calls 6 [--serve-arg=--engine-process ...] --json node.json

Starts `kame-phone serve` in its own process with its defaults (the STT, engine layout and flags an
operator gets; `--serve-arg` adds flags), the tiny checkpoint unless `--checkpoint` names another, and a
local OpenAI-compatible LLM with a fixed TTFT (a process of its own, `--llm-ttft-ms`). N simulated Twilio
callers in this process dial within 2 s, each says a flite question and holds the line. Reported: how many
calls were served (outcome "completed") and how the others ended; per served call the share of real time its
bot audio kept (received / call length; 1.0 = every 80 ms frame in time); from the service's own /metrics (its
metrics listener), as the dashboard's histogram_quantile reads them (the buckets' deltas over the run,
interpolated inside a bucket, boundaries as scraped): first audio and turn latency p50/p95/p99
(kame_first_audio_seconds, kame_turn_latency_seconds), engine tick p50/p99, oracle lag p50/p99, and deadline
misses, input overruns, STT dropped frames and errors; beside them the callers' own timings
(`first_audio_heard`, `turn_latency_heard`: one sample per call, as the simulated caller heard it); and
/readyz as sampled every 0.5 s during the calls. Figures are at N calls only if every call was served
(`served == calls`); `kame-phone bench node` exits 3 otherwise.

At full size on a GPU (issue 15), with no weights there: `--checkpoint random:moshi-7b`, the STT shaped like
Kyutai's on the same GPU (`--serve-arg=--stt=kyutai`, `KAME_STT_CHECKPOINT=random:stt-2.6b-en`), and
`--voices DIR` made beforehand where flite is (scripts/bench-gpu.sh node).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from telephony.sim_caller import CallReport, simulate_call

from .media_bench import bucket_quantile
from .oracle_bench import _serve_llm
from .serve_process import free_port, serve_process
from .throwaway_env import throwaway_env

QUESTIONS = (
    "Hello, what time does the store open on Monday?",
    "I would like to check the status of my order please.",
    "Can you tell me how much the delivery costs to Boston?",
    "My card was charged twice this morning, can you help me?",
)


def _speak(text: str, out: Path) -> Path:
    if shutil.which("flite") is None:
        raise SystemExit("kame-phone bench node needs Debian's flite for the callers' voices: apt-get install flite")
    subprocess.run(["flite", "-voice", "rms", "-t", text, "-o", str(out)], check=True)
    return out


def caller_voices(directory: Path) -> list[Path]:
    """The callers' questions as WAVs in `directory` (q0.wav, q1.wav, ...): those already there are used as
    they are, so a machine without flite (a GPU box) runs on voices made elsewhere; missing ones are
    spoken with flite and kept."""
    directory.mkdir(parents=True, exist_ok=True)
    wavs = [directory / f"q{i}.wav" for i in range(len(QUESTIONS))]
    for question, wav in zip(QUESTIONS, wavs, strict=True):
        if not wav.is_file():
            _speak(question, wav)
    return wavs


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """Counters as floats, histograms as [(le, cumulative count)], from a Prometheus text exposition."""
    async with session.get(url) as resp:
        text = await resp.text()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            # Summed over any labels, bucket by bucket: the dashboard's `sum by (le)`.
            buckets: dict[float, float] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
            out[family.name] = sorted(buckets.items())
        elif family.type == "counter":  # the parser names the family without its _total
            out[family.name + "_total"] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.type == "gauge":
            out[family.name] = sum(s.value for s in family.samples)
            for sample in family.samples:  # labelled gauges part by part too: name{label=value}
                if sample.labels:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    out[f"{family.name}{{{labels}}}"] = sample.value
    return out


@contextlib.asynccontextmanager
async def _llm_server(ttft_ms: float) -> AsyncIterator[str]:
    mp = multiprocessing.get_context("spawn")
    port_in, port_out = mp.Pipe(duplex=False)
    _requests_in, requests_out = mp.Pipe(duplex=False)
    stop = mp.Event()
    proc = mp.Process(target=_serve_llm, args=(ttft_ms / 1000, 0.0, port_out, stop, requests_out), daemon=True)
    proc.start()
    try:
        if not await asyncio.to_thread(port_in.poll, 60):
            raise RuntimeError("the LLM stand-in did not start")
        yield f"http://127.0.0.1:{port_in.recv()}/v1"
    finally:
        stop.set()
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()


async def _sample_readyz(session: aiohttp.ClientSession, base: str, statuses: list[int]) -> None:
    while True:
        try:
            async with session.get(base + "/readyz") as resp:
                statuses.append(resp.status)
        except aiohttp.ClientError:
            statuses.append(0)
        await asyncio.sleep(0.5)


QUANTILES = (0.5, 0.95, 0.99)  # of first audio and turn latency, server's and callers' alike


def _key(q: float) -> str:
    return f"p{round(q * 100)}_ms"


def _pcts(values: list[float]) -> dict[str, float | None]:
    """The callers' own timings (seconds, one per call) as p50/p95/p99 ms, and how many there were."""
    out: dict[str, float | None] = {_key(q): None for q in QUANTILES}
    if values:
        out.update({_key(q): float(np.percentile(values, q * 100) * 1000) for q in QUANTILES})
    return {**out, "count": len(values)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _whole_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _fmt(figures: dict[str, Any]) -> str:
    ms = "/".join(_whole_ms(figures[_key(q)]) for q in QUANTILES)
    return f"{ms} (n={figures['count']})"


async def run_node_bench(
    calls: int = 6,
    serve_args: list[str] | None = None,
    checkpoint: str | None = None,
    ttft_ms: float = 300.0,
    hold_s: float = 5.0,
    voices: Path | None = None,
    serve_log: Path | None = None,
    ramp_s: float = 2.0,
    log=print,  # type: ignore[no-untyped-def]
) -> dict[str, Any]:
    serve_args = list(serve_args or [])
    with tempfile.TemporaryDirectory(prefix="kame-node-bench-") as tmp:
        work = Path(tmp)
        if checkpoint is None:
            from engine.tiny_checkpoint import make_tiny_checkpoint

            checkpoint = str(await asyncio.to_thread(make_tiny_checkpoint, work / "tiny"))
        wavs = await asyncio.to_thread(caller_voices, voices or work / "voices")
        port, metrics_port = free_port(), free_port()
        base, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
        argv = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port), "--insecure-dev",
                "--checkpoint", checkpoint]
        if calls > 8 and "--max-calls" not in serve_args:  # serve's default seats 8
            argv += ["--max-calls", str(calls)]
        argv += serve_args
        async with _llm_server(ttft_ms) as llm_url:
            # Never joined to a deployment it runs beside (kame_phone/throwaway_env.py); --insecure-dev: no token.
            env = throwaway_env(OPENAI_BASE_URL=llm_url, OPENAI_API_KEY="none", KAME_LLM_MODEL="bench")
            # `--stt kyutai` serves this many calls at once (its batch); every caller needs a row.
            env.setdefault("KAME_STT_MAX_STREAMS", str(max(calls, 16)))
            log(f"serve {' '.join(argv)}")
            serving = serve_process(argv, env, base, serve_log or work / "serve.log")
            async with serving, aiohttp.ClientSession() as session:
                before = await _scrape(session, metrics_url)
                ready: list[int] = []
                sampler = asyncio.create_task(_sample_readyz(session, base, ready))
                log(f"{calls} callers dialling within {ramp_s:g} s ...")
                # Spread over the ramp, as calls arrive: all in one instant, more sockets would await
                # their start than the service admits (max_unstarted_streams, 16), and it refuses the rest.
                starts = np.sort(np.random.default_rng(0).uniform(0.0, ramp_s, calls))

                async def dial(i: int) -> CallReport:
                    await asyncio.sleep(float(starts[i]))
                    return await simulate_call(base.replace("http://", "ws://") + "/twilio/media", wavs[i % len(wavs)],
                                               auth_token=None, public_url=None, hold_after=hold_s)

                reports: list[CallReport] = await asyncio.gather(*(dial(i) for i in range(calls)))
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                await asyncio.sleep(0.5)  # the last calls' metrics
                after = await _scrape(session, metrics_url)
    # hold_s: each caller on the line this long after its question
    return {**_summarise(calls, serve_args, reports, before, after, ready, log), "hold_s": hold_s}


def _summarise(calls, serve_args, reports, before, after, ready, log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def earlier(name: str) -> list[tuple[float, float]]:
        return before.get(name, [(le, 0.0) for le, _ in after[name]])

    def quantile(name: str, q: float) -> float | None:
        """histogram_quantile(q, ...) over the run, as the dashboard computes it, in ms."""
        if name not in after:
            return None
        return _ms(bucket_quantile(earlier(name), after[name], q))

    def histogram(name: str) -> dict[str, float | None]:
        observed = round(after[name][-1][1] - earlier(name)[-1][1]) if name in after else 0
        return {**{_key(q): quantile(name, q) for q in QUANTILES}, "count": observed}

    served = [r for r in reports if r.outcome == "completed"]
    outcome_counts = dict(collections.Counter(r.outcome for r in reports))
    # A call turned away has no audio to keep in time: only served calls have a real-time share.
    realtime = [(r.bot_seconds_received / r.call_seconds if r.call_seconds else 0.0) if r.outcome == "completed"
                else None for r in reports]
    served_realtime = [x for x in realtime if x is not None]
    result = {
        "calls": calls,  # dialled; the figures are at this many calls only if all were served
        "served": len(served),
        "not_served": calls - len(served),
        "outcome_counts": outcome_counts,
        "serve_args": serve_args,
        "outcomes": [r.outcome for r in reports],
        "realtime_share": [None if x is None else round(x, 3) for x in realtime],
        "realtime_share_min": min(served_realtime) if served_realtime else None,  # over served calls
        # The service's own histograms, read as the dashboard reads them (what each measures: its HELP in
        # telephony/metrics.py): the headline figures.
        "first_audio": histogram("kame_first_audio_seconds"),
        "turn_latency": histogram("kame_turn_latency_seconds"),
        # The simulated callers' own timings, one per call that heard it (the caller's clock and socket).
        "first_audio_heard": _pcts([r.first_audio_latency_s for r in reports if r.first_audio_latency_s is not None]),
        "turn_latency_heard": _pcts([r.last_word_latency_s for r in reports if r.last_word_latency_s is not None]),
        "tick_p50_ms": quantile("kame_engine_tick_seconds", 0.5),
        "tick_p99_ms": quantile("kame_engine_tick_seconds", 0.99),
        "deadline_misses": delta("kame_engine_deadline_misses_total"),
        "input_overruns": delta("kame_engine_input_overruns_total"),
        "stt_dropped_frames": delta("kame_stt_dropped_frames_total"),
        # The batched STT's steps (none with pocketsphinx): its share of a GPU it shares with the engine.
        "stt_step_p50_ms": quantile("kame_stt_step_seconds", 0.5),
        "stt_step_p99_ms": quantile("kame_stt_step_seconds", 0.99),
        "stt_catchup_steps": delta("kame_stt_catchup_steps_total"),
        "stt_errors": delta("kame_stt_errors_total"),
        "oracle_lag_p50_ms": quantile("kame_oracle_lag_seconds", 0.5),
        "oracle_lag_p99_ms": quantile("kame_oracle_lag_seconds", 0.99),
        # What the model holds on the GPU as served (weights and every slot's KV cache): what sizes a node.
        "model_bytes": {part: after.get(f"kame_engine_model_bytes{{part={part}}}") for part in ("weights", "kv_cache")},
        "readyz_not_ready": sum(s != 200 for s in ready),
        "readyz_samples": len(ready),
        "cores": os.cpu_count(),
    }
    others = ", ".join(f"{o} {n}" for o, n in sorted(outcome_counts.items()) if o != "completed")
    log(f"calls: {calls} dialled, {result['served']} served" + (f", {result['not_served']} not ({others})"
                                                              if result["not_served"] else ""))
    low = result["realtime_share_min"]
    log(f"real-time share of bot audio per served call: {result['realtime_share']} "
        f"(min {'-' if low is None else f'{low:.2f}'})")
    log(f"first audio p50/p95/p99 ms (kame_first_audio_seconds): {_fmt(result['first_audio'])}; "
        f"as the callers heard it: {_fmt(result['first_audio_heard'])}")
    log(f"turn latency p50/p95/p99 ms (kame_turn_latency_seconds): {_fmt(result['turn_latency'])}; "
        f"as the callers heard it: {_fmt(result['turn_latency_heard'])}")
    tick = f"{_whole_ms(result['tick_p50_ms'])}/{_whole_ms(result['tick_p99_ms'])}"
    log(f"engine tick p50/p99 ms: {tick}, deadline misses "
        f"{result['deadline_misses']:.0f}, input overruns {result['input_overruns']:.0f}; STT dropped frames "
        f"{result['stt_dropped_frames']:.0f}, errors {result['stt_errors']:.0f}, step p50/p99 ms "
        f"{_whole_ms(result['stt_step_p50_ms'])}/{_whole_ms(result['stt_step_p99_ms'])}, catch-up steps "
        f"{result['stt_catchup_steps']:.0f}; oracle lag p50/p99 ms: "
        f"{_whole_ms(result['oracle_lag_p50_ms'])}/{_whole_ms(result['oracle_lag_p99_ms'])}; /readyz not ready "
        f"{result['readyz_not_ready']}/{result['readyz_samples']}")
    held = result["model_bytes"]
    if all(v is not None for v in held.values()):
        log(f"model memory: weights {held['weights'] / 1e9:.2f} GB, KV cache {held['kv_cache'] / 1e9:.2f} GB")
    return result

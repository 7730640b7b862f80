"""`kame-phone bench stt`: the Kyutai STT's batched step, alone and beside a busy Python thread.

Why beside a thread: serve runs the STT's step thread in the process whose asyncio loop carries every
call's media. Each torch op the step launches gives up the GIL and must take it back, and a busy loop holds
it for up to the switch interval (5 ms) each time: on an H200 a 22 ms step became 34-48 ms beside a thread
busy 25-50 % of the time, which is what the whole-node bench at 64 calls showed (STT step p50 51 ms beside
a 52 ms engine tick, so the two no longer fitted one 80 ms frame; docs/benchmarks.md, session 23). The
stand-in thread runs pure Python in 2 ms bursts and sleeps the rest, as a loop does between packets.

Each variant is measured with Mimi's quantizer graphed (as served, engine/mimi_graphs.py) and eager (as
moshi leaves it), on the same engine, so one run gives the A/B on one machine. Also: the step's split
(Mimi's encode, the LM's step; the device synchronised between them) and the host's launches a step (the
top-level torch ops the profiler sees: each is a GIL hand-off).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TextIO

import numpy as np
import torch

from engine.interface import FRAME_SAMPLES
from engine.mimi_graphs import quantizer_eager, quantizer_graphs_captured
from engine.tick_profile import top_level_cpu_op

from .stt_kyutai import KyutaiSttEngine

BUSY_DUTIES = (0.25, 0.5)  # the share of each 2 ms the stand-in loop spends in Python
BURST_S = 0.002


@dataclass
class Timing:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, ms: list[float]) -> Timing:
        p50, p90, p99, top = (round(float(q), 2) for q in np.percentile(ms, [50, 90, 99, 100]))
        return cls(p50, p90, p99, top)


@dataclass
class Variant:
    quantizer: str  # "graphed" (as served) or "eager" (moshi's own)
    captured: bool  # the quantizer's graphs were captured and replayed (False on CPU, or with NO_CUDA_GRAPH=1)
    launches: int  # top-level torch ops a step issues from the host
    encode_ms: float  # Mimi's encode, p50, device synchronised
    lm_ms: float  # the LM's step, p50
    alone: Timing
    busy: dict[str, Timing] = field(default_factory=dict)  # "25%" -> the step beside the busy thread


@dataclass
class SttBenchRow:
    rows: int
    device: str
    variants: list[Variant]


@dataclass
class SttBenchReport:
    source: str
    rows: list[SttBenchRow] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


@contextmanager
def _busy_thread(duty: float) -> Iterator[None]:
    """A thread that holds the GIL `duty` of the time, in bursts, like an asyncio loop under load."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + duty * BURST_S
            while time.perf_counter() < until:
                sum(i * i for i in range(50))
            time.sleep((1 - duty) * BURST_S)

    thread = threading.Thread(target=spin, name="busy-loop-stand-in", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _launches(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if top_level_cpu_op(e))


def _measure(engine: KyutaiSttEngine, feed: Callable[[], None], ticks: int, warmup: int) -> Timing:
    for _ in range(warmup):
        feed()
        engine.step()
    ms = []
    for _ in range(ticks):
        feed()
        started = time.perf_counter()
        engine.step()
        ms.append((time.perf_counter() - started) * 1000)
    return Timing.of(ms)


def _variant(engine: KyutaiSttEngine, quantizer: str, feed: Callable[[], None], pcm: torch.Tensor,
             ticks: int, warmup: int) -> Variant:
    dev = engine.device
    alone = _measure(engine, feed, ticks, warmup)  # the warm-up also captures the quantizer's graphs
    enc, lm = [], []
    with torch.no_grad():
        for _ in range(max(10, ticks // 4)):
            _sync(dev)
            t0 = time.perf_counter()
            codes = engine.mimi.encode(pcm)
            _sync(dev)
            t1 = time.perf_counter()
            engine.lm_gen.step_with_extra_heads(codes)
            _sync(dev)
            enc.append((t1 - t0) * 1000)
            lm.append((time.perf_counter() - t1) * 1000)

        def one_step() -> None:
            engine.lm_gen.step_with_extra_heads(engine.mimi.encode(pcm))
            _sync(dev)

        launches = _launches(one_step)
    busy = {}
    for duty in BUSY_DUTIES:
        with _busy_thread(duty):
            busy[f"{duty:.0%}"] = _measure(engine, feed, ticks, 2)
    return Variant(quantizer, quantizer_graphs_captured(engine.mimi, ("encode",)), launches,
                   round(statistics.median(enc), 2), round(statistics.median(lm), 2), alone, busy)


def _bench_rows(source: str, rows: int, device: str, ticks: int, warmup: int) -> SttBenchRow:
    engine = KyutaiSttEngine(source, device, rows, start=False)
    try:
        engine.warmup()
        streams = [engine.open_stream() for _ in range(rows)]
        audio = (np.random.default_rng(0).standard_normal((rows, FRAME_SAMPLES)) * 0.05).astype(np.float32)

        def feed() -> None:  # a frame for every row: `rows` callers speaking at once
            for i, stream in enumerate(streams):
                stream.feed(audio[i])

        pcm = torch.from_numpy(audio).to(engine.device)[:, None]
        graphed = _variant(engine, "graphed", feed, pcm, ticks, warmup)
        with quantizer_eager(engine.mimi):
            eager = _variant(engine, "eager", feed, pcm, ticks, warmup)
        return SttBenchRow(rows, str(engine.device), [graphed, eager])
    finally:
        engine.close()


def run_stt_bench(source: str, rows_list: list[int], device: str, *, ticks: int = 100, warmup: int = 5,
                  on_row: Callable[[SttBenchReport], None] | None = None, out: TextIO = sys.stdout) -> SttBenchReport:
    report = SttBenchReport(source)
    for rows in rows_list:
        row = _bench_rows(source, rows, device, ticks, warmup)
        report.rows.append(row)
        for v in row.variants:
            busy = ", ".join(f"busy {k} {t.p50_ms:.1f}/{t.p99_ms:.1f}" for k, t in v.busy.items())
            label = v.quantizer if v.captured or v.quantizer == "eager" else "graphed (not captured: eager)"
            print(f"rows {rows:3d}  quantizer {label}  step p50/p99 ms: alone {v.alone.p50_ms:.1f}/"
                  f"{v.alone.p99_ms:.1f}, {busy}; encode {v.encode_ms:.1f} + LM {v.lm_ms:.1f} ms; "
                  f"{v.launches} launches a step", file=out, flush=True)
        if on_row is not None:
            on_row(report)
    return report

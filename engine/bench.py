"""`kame-phone bench engine`: the batched frame loop at a named size with random weights.

Speed does not depend on the weights' values, so random weights give true timings. Every slot is busy
with (random) caller audio and an oracle, as in production, with sampling on. Reported per batch size:
tick p50/p99, real-time factor (80 ms / mean tick), peak GPU memory, and the largest batch whose p99
tick stays within the 80 ms frame. `--phases` then runs more ticks with the device synchronised around
each phase (Mimi encode, main transformer, depformer steps, Mimi decode; the rest is masks, sampling the
text token, bookkeeping and the copy out), to say where a tick goes; those ticks are not in the figures.
`--paced` then runs more ticks each started on an 80 ms clock, as the frame loop serves them (the device
idle between them), reported apart.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .batch import KameBatch
from .checkpoint import load_random
from .heap import served_heap
from .interface import FRAME_SAMPLES, FRAME_SECONDS
from .memory_check import NotEnoughMemory
from .model import KameLM
from .sampling import SamplingConfig
from .tick_profile import SLOW_FACTOR, profile_ticks, slow_ticks
from .weight_quant import Int8Linear, set_int8_matmul, weights_bytes


@dataclass
class BatchResult:
    batch: int
    ticks: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    realtime_factor: float  # 80 ms / mean tick: > 1 keeps up with real time
    peak_gpu_mem_gb: float | None
    kv_cache_gb: float | None
    phases_p50_ms: dict[str, float] | None = None  # with --phases: per phase, then "other" (the rest)
    warmup_s: float | None = None  # the warm-up ticks: CUDA graph capture, and compiling with --compile
    # The collector over the measured ticks, the heap frozen as the engine process serves (engine/heap.py).
    gc_full_collections: int | None = None
    gc_longest_pause_ms: float | None = None
    # Every measured tick, in order: where the slow ones fall (a period says which clock to suspect).
    tick_ms: list[float] = field(default_factory=list)
    # With --profile: the profiled ticks, slow against the rest (engine/tick_profile.py ProfileSummary).
    profile: dict | None = None
    # With --paced: more ticks, each started on an 80 ms clock as the frame loop serves them (the device idle
    # between them), their durations; and the GPU's SM clock (MHz) read after every 10th tick of each run.
    paced_p50_ms: float | None = None
    paced_p99_ms: float | None = None
    paced_tick_ms: list[float] = field(default_factory=list)
    sm_clock_mhz: dict[str, list[int]] = field(default_factory=dict)


PROFILE_TICKS = 60  # profiled ticks per batch: a few slow ones at a 2-5 % tail, a trace under 16 MB at batch 1


@dataclass
class BenchReport:
    size: str
    device: str
    device_name: str
    dtype: str
    context: int
    torch: str
    cuda_graphs: bool
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    int8_matmul: str | None = None  # with int8 weights: the kernel that ran (engine/weight_quant.py)
    weights_gb: float | None = None  # the model's parameters and buffers, as served
    compile_mode: str = "off"
    results: list[BatchResult] = field(default_factory=list)
    max_batch_realtime: int | None = None  # largest batch with p99 <= 80 ms
    out_of_memory: list[int] = field(default_factory=list)  # batches that did not fit the GPU
    pending: list[int] = field(default_factory=list)  # batches not yet run (a report written mid-run)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


PHASES = ("encode", "main", "depformer", "decode")


class _PhaseClock:
    """Wall time of each phase of `KameBatch.step`, the device synchronised before and after each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, list[float]] = {p: [] for p in PHASES}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, phase: str, fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object) -> object:
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args)
            self._sync()
            self.ms[phase].append((time.perf_counter() - t0) * 1000)
            return out

        return timed


@contextmanager
def _timing_phases(kb: KameBatch, clock: _PhaseClock) -> Iterator[None]:
    """Route the step's four phases through `clock` (instance attributes shadow the methods; removed after)."""
    state = kb.lm_gen._streaming_state
    assert state is not None and state.graphed_depth is not None
    main, depth = state.graphed_main, state.graphed_depth
    kb.mimi.encode = clock.wrap("encode", kb.mimi.encode)  # type: ignore[method-assign]
    kb.mimi.decode = clock.wrap("decode", kb.mimi.decode)  # type: ignore[method-assign]
    state.graphed_main = clock.wrap("main", main)  # type: ignore[assignment]
    state.graphed_depth = clock.wrap("depformer", depth)  # type: ignore[assignment]
    try:
        yield
    finally:
        del kb.mimi.encode, kb.mimi.decode
        state.graphed_main, state.graphed_depth = main, depth


def is_out_of_memory(e: BaseException) -> bool:
    """Out of memory, however it surfaces: the engine's own check before the caches are made, CUDA's
    `torch.OutOfMemoryError` from the caching allocator, or a plain RuntimeError from a CUDA graph's capture,
    cuBLAS's workspace or a kernel launch."""
    if isinstance(e, (torch.OutOfMemoryError, NotEnoughMemory)):  # NotEnoughMemory: refused before allocating
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation", "CUDNN_STATUS_ALLOC_FAILED"))


def _leave_streaming(lm: KameLM, mimi) -> None:  # type: ignore[no-untyped-def]
    """After `KameBatch` failed half way (out of memory while streaming allocated its caches, say), some
    modules may be left streaming with no stack to close: out of streaming mode, so the next batch can enter."""
    lm._stop_streaming()
    mimi._stop_streaming()


def bench_batch(
    lm: KameLM, mimi, batch: int, ticks: int, warmup: int, kv_dtype: str = "auto",  # type: ignore[no-untyped-def]
    compile_mode: str = "off", phases: bool = False, log: Callable[[str], None] | None = None,
    profile_dir: Path | None = None, paced: bool = False,
) -> BatchResult:
    kb = None
    try:
        kb = KameBatch(lm, mimi, batch, SamplingConfig(), kv_dtype=kv_dtype, compile_mode=compile_mode)
        trace = None if profile_dir is None else profile_dir / f"engine-{compile_mode}-b{batch}.trace.json.gz"
        return _bench_batch(kb, lm, batch, ticks, warmup, phases, log, trace, paced)
    finally:
        if kb is not None:
            kb.close()
            del kb
        else:
            _leave_streaming(lm, mimi)
        gc.collect()
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()


def _bench_batch(
    kb: KameBatch, lm: KameLM, batch: int, ticks: int, warmup: int, phases: bool,
    log: Callable[[str], None] | None, profile_trace: Path | None = None, paced: bool = False,
) -> BatchResult:
    device = lm.device
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    pcm = (0.1 * rng.standard_normal((batch, FRAME_SAMPLES))).astype(np.float32)
    active = np.ones(batch, dtype=bool)
    oracle_seq = rng.integers(4, min(lm.text_card, 30000), size=64)
    kb.reset_rows(active)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def tick(kb: KameBatch, i: int) -> float:
        oracle = np.full(batch, oracle_seq[i % len(oracle_seq)], dtype=np.int64)
        t0 = time.perf_counter()
        kb.step(pcm, active, oracle)  # ends with a device->host copy, so the GPU work is done
        return time.perf_counter() - t0

    def progress(what: str) -> None:  # where a run cut short by its timeout was (compiling takes minutes)
        if log is not None:
            log(f"      [batch {batch}, {time.perf_counter() - started:.0f} s] {what}")

    progress("warm-up: compiling and capturing (the first tick)")
    t0 = time.perf_counter()
    for i in range(warmup):
        dt = tick(kb, i)
        if i < 2 or dt > 1.0:  # the first ticks compile and capture: say how long each took
            progress(f"warm-up tick {i + 1}/{warmup}: {dt:.1f} s")
    warmup_s = time.perf_counter() - t0
    clocks: dict[str, list[int]] = {}
    _sm_clock_readable(device, log)
    with served_heap() as collector:
        times = []
        for i in range(ticks):
            times.append(tick(kb, warmup + i))
            if i % 10 == 9:  # between two timed ticks: not in either
                _read_sm_clock(device, clocks.setdefault("back-to-back", []))
        peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        phases_p50 = None
        if phases:
            progress(f"{ticks} ticks measured; {ticks} more with the phases timed")
            clock = _PhaseClock(device)
            with _timing_phases(kb, clock):
                totals = [tick(kb, warmup + ticks + i) * 1000 for i in range(ticks)]
            phases_p50 = {p: float(np.median(clock.ms[p])) for p in PHASES}
            phases_p50["other"] = float(
                np.median(np.array(totals) - sum(np.array(clock.ms[p]) for p in PHASES)))
        paced_ms: list[float] = []
        if paced:
            progress(f"{ticks} more ticks on an 80 ms clock, as served")
            paced_ms = _paced_ticks(lambda i: tick(kb, warmup + 2 * ticks + i), ticks, device, clocks)
        # The collector over the figures' ticks only: the profiler below makes garbage of its own.
        gc_full, gc_pause = collector.full_collections, collector.longest_pause_ms
        profiled = None
        if profile_trace is not None:  # after the figures: the profiler's own cost stays out of them
            n = min(ticks, PROFILE_TICKS)
            progress(f"{n} ticks under the profiler")
            first = warmup + 3 * ticks
            try:
                _, summary = profile_ticks(lambda i: tick(kb, first + i), n, device, profile_trace)
                profiled = asdict(summary) | {"verdict": summary.verdict()}
            except Exception as e:  # noqa: BLE001  (the figures above are kept: a GPU session may not come again)
                progress(f"profiling failed: {type(e).__name__}: {e}")
                profiled = {"error": f"{type(e).__name__}: {e}"}
    kv_bytes = kb.memory.kv_cache_bytes  # what the batch sized its caches at
    ms = np.array(times) * 1000
    return BatchResult(
        batch=batch,
        ticks=ticks,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()),
        max_ms=float(ms.max()),
        realtime_factor=float(FRAME_SECONDS * 1000 / ms.mean()),
        peak_gpu_mem_gb=peak,
        kv_cache_gb=kv_bytes / 1e9,
        phases_p50_ms=phases_p50,
        warmup_s=warmup_s,
        gc_full_collections=gc_full,
        gc_longest_pause_ms=gc_pause,
        tick_ms=[round(float(t), 3) for t in ms],
        profile=profiled,
        paced_p50_ms=float(np.percentile(paced_ms, 50)) if paced_ms else None,
        paced_p99_ms=float(np.percentile(paced_ms, 99)) if paced_ms else None,
        paced_tick_ms=[round(t, 3) for t in paced_ms],
        sm_clock_mhz=clocks,
    )


def _read_sm_clock(device: torch.device, into: list[int]) -> None:
    """The GPU's SM clock now (NVML, through torch), if it can be read: a run whose ticks change speed for
    seconds at a time (the H200's batch 1, session 23) says whether the clock moved with them."""
    if device.type != "cuda":
        return
    try:
        into.append(int(torch.cuda.clock_rate(device)))
    except Exception:  # noqa: BLE001  (no NVML on the box: the figures stand without it)
        pass


def _sm_clock_readable(device: torch.device, log: Callable[[str], None] | None) -> None:
    """Read the clock once before the measured ticks (NVML's start-up then falls outside them), and say so
    once if it cannot be read, rather than leave empty lists unexplained."""
    probe: list[int] = []
    _read_sm_clock(device, probe)
    if device.type == "cuda" and not probe and log is not None:
        log("      the GPU's SM clock cannot be read here (NVML: nvidia-ml-py missing?): no clock figures")


def _paced_ticks(tick: Callable[[int], float], n: int, device: torch.device,
                 clocks: dict[str, list[int]]) -> list[float]:
    """`n` ticks each started on an 80 ms clock, as the frame loop serves them; their durations in ms.
    Back to back, the device never idles between ticks; served, a batch-1 tick leaves it idle ~65 ms of
    every 80, and a GPU that lowers its clocks while idle would start each tick slow."""
    out = []
    deadline = time.perf_counter()
    for i in range(n):
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        out.append(tick(i) * 1000)
        if i % 10 == 9:
            _read_sm_clock(device, clocks.setdefault("paced", []))
        # As the frame loop's clock (engine/ticker.py): the grid is kept through a late tick (the next starts
        # at once, the one after on the grid), and re-anchored only when over a frame behind, never a burst.
        deadline += FRAME_SECONDS
        if (now := time.perf_counter()) > deadline + FRAME_SECONDS:
            deadline = now
    return out


def bench_dtype(device: torch.device, name: str | None) -> torch.dtype:
    """`--dtype` (bf16, fp16, fp32), by default bf16 on a GPU and fp32 on CPU."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        name or ("bf16" if device.type == "cuda" else "fp32")
    ]


def run_engine_bench(
    size: str,
    batches: list[int],
    device: str,
    ticks: int = 100,
    warmup: int = 8,
    context: int | None = None,
    dtype: str | None = None,
    kv_dtype: str = "auto",
    compile_mode: str = "off",
    phases: bool = False,
    weights_dtype: str = "auto",
    int8_matmul: str = "auto",
    log=print,
    on_batch: Callable[[BenchReport], None] | None = None,
    profile_dir: str | None = None,
    paced: bool = False,
) -> BenchReport:
    """`on_batch(report)`, if given, after loading and after each batch (measured or out of memory), with
    the figures so far: a run cut short (a timeout) keeps every finished batch's figures."""
    dev = torch.device(device)
    if size != "tiny" and dev.type != "cuda":
        raise SystemExit(f"size {size} needs a CUDA GPU (it is ~16 GB in bf16); use --size tiny on CPU")
    torch_dtype = bench_dtype(dev, dtype)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    bundle = load_random(size, dev, torch_dtype, context, weights_dtype)
    load_s = time.perf_counter() - t0
    lm, mimi = bundle.lm, bundle.mimi
    set_int8_matmul(lm, int8_matmul)  # before any tick: the CUDA graphs and compiled steps keep their kernel
    kernels = {m.kernel for m in lm.modules() if isinstance(m, Int8Linear)}
    report = BenchReport(
        size=size,
        device=str(dev),
        device_name=_device_name(dev),
        dtype=str(torch_dtype).removeprefix("torch."),
        context=lm.transformer.layers[0].self_attn.context,
        torch=torch.__version__,
        cuda_graphs=dev.type == "cuda",
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        int8_matmul=",".join(sorted(kernels)) or None,
        weights_gb=weights_bytes(lm) / 1e9,
        compile_mode=compile_mode,
    )
    weights = f"weights {weights_dtype} ({report.weights_gb:.2f} GB" + (
        f", int8 matmul {report.int8_matmul})" if report.int8_matmul else ")")
    log(f"# {size} on {report.device_name}, {report.dtype}, context {report.context} frames, "
        f"KV {kv_dtype}, {weights}, compile {compile_mode}, torch {torch.__version__}; loaded in {load_s:.0f} s")
    log(f"{'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'RTF':>6} {'peak GB':>8} {'KV GB':>7}")
    report.pending = list(batches)

    def update() -> None:
        fitting = [r.batch for r in report.results if r.p99_ms <= FRAME_SECONDS * 1000]
        report.max_batch_realtime = max(fitting) if fitting else None
        if on_batch is not None:
            on_batch(report)

    update()
    for b in batches:
        report.pending.remove(b)
        if any(b >= o for o in report.out_of_memory):
            log(f"{b:>5} skipped: a batch of {min(report.out_of_memory)} did not fit")
            report.out_of_memory.append(b)
            update()
            continue
        try:
            r = bench_batch(lm, mimi, b, ticks, warmup, kv_dtype, compile_mode, phases,
                            log if compile_mode != "off" else None, Path(profile_dir) if profile_dir else None,
                            paced)
        except (torch.OutOfMemoryError, NotEnoughMemory, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            log(f"{b:>5} out of GPU memory ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            report.out_of_memory.append(b)
            update()
            continue
        report.results.append(r)
        peak = f"{r.peak_gpu_mem_gb:.1f}" if r.peak_gpu_mem_gb is not None else "-"
        log(f"{b:>5} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} {r.max_ms:>8.1f} {r.realtime_factor:>6.2f} "
            f"{peak:>8} {r.kv_cache_gb:>7.2f}")
        if compile_mode != "off":
            log(f"      warm-up (compiling, capturing): {r.warmup_s:.1f} s")
        if r.phases_p50_ms is not None:
            log("      phases p50 ms (device synchronised around each): "
                + ", ".join(f"{p} {ms:.2f}" for p, ms in r.phases_p50_ms.items()))
        if r.paced_p50_ms is not None:
            log(f"      paced on an 80 ms clock, as served: p50 {r.paced_p50_ms:.1f}, p99 {r.paced_p99_ms:.1f}, "
                f"max {max(r.paced_tick_ms):.1f} ms")
        for run, mhz in r.sm_clock_mhz.items():
            if mhz:
                log(f"      SM clock {run}: {min(mhz)}-{max(mhz)} MHz (median {int(np.median(mhz))})")
        if slow := slow_ticks(r.tick_ms):
            gaps = np.diff(slow)
            period = f"; median gap {float(np.median(gaps)):.0f} ticks" if len(gaps) else ""
            log(f"      {len(slow)} ticks over {SLOW_FACTOR} x p50, at ticks {', '.join(map(str, slow[:12]))}"
                f"{' ...' if len(slow) > 12 else ''}{period}")
        if (p := r.profile) is not None and "error" not in p:
            log(f"      profiled {p['ticks']} ticks ({p['work']}): the rest p50 {p['normal_wall_ms']:.1f} ms, "
                f"{p['normal_busy_ms']:.1f} busy; {len(p['slow'])} slow, p50 "
                + (f"{p['slow_wall_ms']:.1f} ms, {p['slow_busy_ms']:.1f} busy" if p["slow"] else "-"))
            log(f"      {p['verdict']}")
            for name, base, late in p["grew"]:
                log(f"        grew {base:.2f} -> {late:.2f} ms a tick: {name[:100]}")
            for name, ms, n in p["top"][:6]:
                log(f"        usual tick: {ms:.2f} ms in {n:.0f} x {name[:100]}")
            for name, ms, n in p.get("idle_before", [])[:6]:  # the host work the device waits on
                log(f"        device idle {ms:.2f} ms a tick ({n:.1f} gaps) before kernels launched by {name[:80]}")
            log(f"      trace: {p['trace']}")
        if r.gc_full_collections:  # the heap frozen as served: a full collection now is the run's own garbage
            log(f"      {r.gc_full_collections} full garbage collections in the measured ticks, longest "
                f"pause {r.gc_longest_pause_ms:.1f} ms")
        update()
    log(f"largest batch with p99 <= 80 ms: {report.max_batch_realtime}")
    return report

"""`kame-phone bench engine`: the batched frame loop at a named size with random weights.

Speed does not depend on the weights' values, so random weights give true timings. Every slot is busy
with (random) caller audio and an oracle, as in production, with sampling on. Reported per batch size:
tick p50/p99, real-time factor (80 ms / mean tick), peak GPU memory, and the largest batch whose p99
tick stays within the 80 ms frame.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .batch import KameBatch
from .checkpoint import load_random
from .interface import FRAME_SAMPLES, FRAME_SECONDS
from .kv_cache import kv_cache_bytes
from .model import KameLM
from .sampling import SamplingConfig


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
    results: list[BatchResult] = field(default_factory=list)
    max_batch_realtime: int | None = None  # largest batch with p99 <= 80 ms

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def bench_batch(lm: KameLM, mimi, batch: int, ticks: int, warmup: int, kv_dtype: str = "auto") -> BatchResult:
    device = lm.device
    kb = KameBatch(lm, mimi, batch, SamplingConfig(), kv_dtype=kv_dtype)
    rng = np.random.default_rng(0)
    pcm = (0.1 * rng.standard_normal((batch, FRAME_SAMPLES))).astype(np.float32)
    active = np.ones(batch, dtype=bool)
    oracle_seq = rng.integers(4, min(lm.text_card, 30000), size=64)
    kb.reset_rows(active)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + ticks):
        oracle = np.full(batch, oracle_seq[i % len(oracle_seq)], dtype=np.int64)
        t0 = time.perf_counter()
        kb.step(pcm, active, oracle)  # ends with a device->host copy, so the GPU work is done
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    kb.close()
    del kb
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
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
        kv_cache_gb=kv_cache_bytes(lm, batch, kv_dtype) / 1e9,
    )


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
    log=print,
) -> BenchReport:
    dev = torch.device(device)
    if size != "tiny" and dev.type != "cuda":
        raise SystemExit(f"size {size} needs a CUDA GPU (it is ~16 GB in bf16); use --size tiny on CPU")
    torch_dtype = bench_dtype(dev, dtype)
    torch.set_grad_enabled(False)
    bundle = load_random(size, dev, torch_dtype, context)
    lm, mimi = bundle.lm, bundle.mimi
    report = BenchReport(
        size=size,
        device=str(dev),
        device_name=_device_name(dev),
        dtype=str(torch_dtype).removeprefix("torch."),
        context=lm.transformer.layers[0].self_attn.context,
        torch=torch.__version__,
        cuda_graphs=dev.type == "cuda",
        kv_dtype=kv_dtype,
    )
    log(f"# {size} on {report.device_name}, {report.dtype}, context {report.context} frames, "
        f"KV {kv_dtype}, torch {torch.__version__}")
    log(f"{'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'RTF':>6} {'peak GB':>8} {'KV GB':>7}")
    for b in batches:
        try:
            r = bench_batch(lm, mimi, b, ticks, warmup, kv_dtype)
        except torch.OutOfMemoryError:
            log(f"{b:>5} out of GPU memory")
            gc.collect()
            torch.cuda.empty_cache()
            break
        report.results.append(r)
        peak = f"{r.peak_gpu_mem_gb:.1f}" if r.peak_gpu_mem_gb is not None else "-"
        log(f"{b:>5} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} {r.max_ms:>8.1f} {r.realtime_factor:>6.2f} "
            f"{peak:>8} {r.kv_cache_gb:>7.2f}")
    fitting = [r.batch for r in report.results if r.p99_ms <= FRAME_SECONDS * 1000]
    report.max_batch_realtime = max(fitting) if fitting else None
    log(f"largest batch with p99 <= 80 ms: {report.max_batch_realtime}")
    return report

"""A node sized past its device is refused before the KV caches are made, in one line that says how many
slots fit (engine/memory_check.py). On an H100 (session 27) 64 slots beside the STT's process failed with
CUDA out-of-memory deep inside moshi, after the load, with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.memory_check import (
    DeviceMemory,
    NotEnoughMemory,
    check_slots_fit,
    device_memory,
    reserve_bytes,
    slots_that_fit,
)

from .redis_support import free_port

ROOT = Path(__file__).resolve().parent.parent
GB = 1_000_000_000


def test_the_h100_that_ran_out_is_refused_and_told_how_many_slots_fit() -> None:
    # Session 27's H100 as the engine found it after its weights: 85.5 GB, the STT's process holding 17.4
    # GB, this process 15.6 GB of weights, 64 int8 slots at context 3000 (51.9 GB of KV).
    h100 = DeviceMemory("cuda:0", free_bytes=52_000_000_000, total_bytes=85_520_000_000, ours_bytes=16_100_000_000)
    kv = 51_904_000_000
    with pytest.raises(NotEnoughMemory) as refused:
        check_slots_fit(h100, kv_cache_bytes=kv, slots=64, width=4096, kv_dtype="int8", context=3000)
    message = str(refused.value)
    fit = slots_that_fit(h100, kv // 64, width=4096)
    assert 0 < fit < 64

    def need(slots: int) -> int:
        return kv // 64 * slots + reserve_bytes("cuda:0", slots, 4096)

    assert need(fit) <= h100.free_bytes < need(fit + 1)  # the number it names really fits, and one more not
    assert message.startswith("64 slots at context 3000 frames need 51.9 GB of KV cache (int8)")
    assert f"{fit} slots would fit" in message and "other processes hold 17.4 GB" in message
    assert "--kv-dtype int8" not in message  # already int8: not offered again
    # What session 11 ran on the same card with nothing beside it (72 int8 slots, peak 75.9 GB) still passes.
    alone = DeviceMemory("cuda:0", free_bytes=69_400_000_000, total_bytes=85_520_000_000, ours_bytes=16_100_000_000)
    check_slots_fit(alone, kv_cache_bytes=58_400_000_000, slots=72, width=4096, kv_dtype="int8", context=3000)


def test_the_host_memory_is_read_on_cpu() -> None:
    import torch

    host = device_memory(torch.device("cpu"))
    assert host is not None and 0 < host.free_bytes <= host.total_bytes


def test_the_engine_bench_records_a_refused_batch_as_out_of_memory_and_goes_on() -> None:
    """A batch the check refuses is that batch out of memory: recorded, larger ones skipped, the rest run."""
    from engine.bench import run_engine_bench

    lines: list[str] = []
    report = run_engine_bench("tiny", [1, 10**6, 2 * 10**6], "cpu", ticks=3, warmup=1, log=lines.append)
    assert [r.batch for r in report.results] == [1] and report.out_of_memory == [10**6, 2 * 10**6]
    assert any(line.startswith("1000000 out of GPU memory (NotEnoughMemory: 1000000 slots at context 64 frames")
               for line in lines), lines


def _serve_refusal(checkpoint: Path, *flags: str) -> str:
    """`serve`'s last line on stderr, once it has exited 2 without a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("TWILIO_AUTH_TOKEN", "REDIS_URL")}
    proc = subprocess.run(
        [sys.executable, "-m", "kame_phone.cli", "serve", "--insecure-dev", "--port", str(free_port()),
         "--metrics-port", str(free_port()), "--checkpoint", str(checkpoint), "--device", "cpu",
         "--stt", "pocketsphinx", "--llm", "none", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_serve_sized_past_its_memory_exits_2_in_one_line(tiny_checkpoint: Path, engine_process: str) -> None:
    last = _serve_refusal(tiny_checkpoint, "--max-calls", "8", "--context", "200000000", engine_process)
    assert last.startswith("kame-phone: 8 slots at context 200000000 frames need "), last
    assert last.endswith("0 slots would fit: a lower --max-calls, or --kv-dtype int8 (one byte a value), "
                         "or a shorter --context"), last


@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_a_bad_checkpoint_is_still_one_line_from_either_engine(tmp_path: Path, engine_process: str) -> None:
    """The child's refusals are raised again in the parent by name: a checkpoint's as before."""
    last = _serve_refusal(tmp_path, engine_process)
    assert last == f"kame-phone: {tmp_path} has no config.json: not a KAME checkpoint directory", last

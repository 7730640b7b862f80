"""The benchmarks run and report what docs/benchmarks.md records (their figures are not asserted here)."""

from __future__ import annotations

import asyncio
import json

from engine.bench import run_engine_bench
from kame_phone.cli import main
from kame_phone.oracle_bench import run_oracle_bench


def test_engine_bench_reports_each_batch(tmp_path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "1,3", "--ticks", "4", "--warmup", "2",
                 "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["ticks"] == 4 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["realtime_factor"] > 0 and r["peak_gpu_mem_gb"] is None
    assert report["size"] == "tiny" and report["context"] == 64


def test_full_size_needs_a_gpu() -> None:
    import pytest

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        run_engine_bench("moshi-7b", [1], "cpu")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        asyncio.run(run_oracle_bench(size="moshi-7b", device="cpu"))


async def test_oracle_bench_measures_lag_against_ttft() -> None:
    result = await run_oracle_bench(calls=2, seconds=3.0, ttft_ms=100.0, log=lambda *_: None)
    assert result["llm_requests"] >= 2 and result["candidates_fed"] >= 2
    assert result["llm_ttft_client_p50_ms"] >= 100.0  # the server's fixed latency is part of what the client sees
    assert result["oracle_lag_p50_ms"] >= result["llm_ttft_client_p50_ms"]
    # Matched to the server's own TTFT by request id: the client cannot see a token before it is sent.
    assert result["on_loop_p50_ms"] >= 0.0 and result["lag_minus_ttft_p50_ms"] >= result["on_loop_p50_ms"]


def test_node_bench_runs_the_service_as_deployed(tmp_path) -> None:
    """`serve` with its defaults in its own process, a local LLM, callers speaking flite: every figure the
    fleet is sized with comes back, read from the service's own /metrics."""
    out = tmp_path / "node.json"
    assert main(["bench", "node", "--calls", "2", "--llm-ttft-ms", "100", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["calls"] == 2 and r["outcomes"] == ["completed", "completed"]
    assert len(r["realtime_share"]) == 2 and all(0 < x <= 1.05 for x in r["realtime_share"])
    assert r["first_audio"]["p50_ms"] is not None and 0 < r["tick_p50_ms"] <= r["tick_p99_ms"]
    assert r["oracle_lag_p50_ms"] is not None  # the local LLM answered and its drafts reached the oracle
    assert r["readyz_samples"] > 0 and r["deadline_misses"] >= 0
    assert r["model_bytes"]["weights"] > 0 and r["model_bytes"]["kv_cache"] > 0


def test_node_bench_with_the_stt_shaped_like_kyutais_and_voices_made_beforehand(tmp_path, monkeypatch) -> None:
    """The whole-node figure's layout for a GPU box without flite or weights: callers' voices made here
    and read from a folder, the Kyutai STT in its layout with random weights (`random:tiny` here;
    `random:stt-2.6b-en` on the GPU), serving every caller; KAME's weights in 8 bits, as the script runs it."""
    from engine.checkpoint import load_kame
    from engine.weight_quant import weights_bytes
    from kame_phone.node_bench import caller_voices

    voices = caller_voices(tmp_path / "voices")
    stamps = [p.stat().st_mtime_ns for p in voices]
    monkeypatch.setenv("KAME_STT_CHECKPOINT", "random:tiny")
    monkeypatch.setenv("KAME_STT_DEVICE", "cpu")
    out = tmp_path / "node.json"
    assert main(["bench", "node", "--calls", "2", "--llm-ttft-ms", "100", "--voices", str(tmp_path / "voices"),
                 "--serve-arg=--stt=kyutai", "--serve-arg=--weights-dtype=int8", "--json", str(out)]) == 0
    assert [p.stat().st_mtime_ns for p in voices] == stamps  # read, not made again
    r = json.loads(out.read_text())
    assert r["outcomes"] == ["completed", "completed"]
    assert r["serve_args"] == ["--stt=kyutai", "--weights-dtype=int8"]
    assert 0 < r["model_bytes"]["weights"] < 0.75 * weights_bytes(load_kame("random:tiny").lm)  # int8, as served
    assert r["stt_errors"] == 0 and r["stt_dropped_frames"] == 0
    assert r["oracle_lag_p50_ms"] is not None  # the random STT's words reached the LLM, its drafts the oracle
    assert "random:tiny" in (tmp_path / "node.serve.log").read_text()  # the service's log, kept beside the figures

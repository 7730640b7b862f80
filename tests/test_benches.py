"""The benchmarks run and report what docs/benchmarks.md records (their figures are not asserted here)."""

from __future__ import annotations

import asyncio
import json
import re

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
    assert all(r["gc_full_collections"] == 0 for r in report["results"])  # the heap frozen as served
    assert all(len(r["tick_ms"]) == 4 and abs(max(r["tick_ms"]) - r["max_ms"]) < 1e-3 for r in report["results"])


def test_paced_ticks_start_on_the_frame_clock_and_a_late_one_does_not_bring_a_burst(tmp_path) -> None:
    import time

    import torch

    from engine.bench import _paced_ticks

    starts: list[float] = []
    slow = {2: 0.12, 6: 0.25}  # tick 2 overruns its frame by 40 ms, tick 6 by over a whole frame

    def tick(i: int) -> float:
        starts.append(time.perf_counter())
        time.sleep(slow.get(i, 0.005))
        return time.perf_counter() - starts[-1]

    clocks: dict[str, list[int]] = {}
    ms = _paced_ticks(tick, 11, torch.device("cpu"), clocks)
    at = [s - starts[0] for s in starts]
    assert len(ms) == 11 and ms[2] >= 120 and ms[6] >= 250
    # As the frame loop's clock: on the 80 ms grid; after tick 2's overrun the next starts at once and the
    # one after back on the grid (4 x 80 ms); tick 6, over a frame late, re-anchors the grid at its end.
    for i, want in ((1, 0.08), (4, 0.32), (5, 0.40), (6, 0.48)):
        assert want - 0.005 <= at[i] <= want + 0.06, (i, at)
    assert 0.16 + 0.12 <= at[3] <= 0.16 + 0.12 + 0.06, at  # at once after tick 2 (started at 0.16, ran 0.12)
    assert at[7] >= at[6] + 0.25 and at[8] - at[7] >= 0.06, at  # re-anchored: no burst (20 ms for a busy box)
    assert clocks == {"paced": []}  # read after the 10th tick; on CPU there is no clock to read

    out = tmp_path / "paced.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "1", "--ticks", "3", "--warmup", "1",
                 "--device", "cpu", "--paced", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert len(r["paced_tick_ms"]) == 3 and 0 < r["paced_p50_ms"] <= r["paced_p99_ms"]


def test_stt_bench_measures_the_step_alone_and_beside_a_busy_thread_with_each_quantizer(tmp_path) -> None:
    out = tmp_path / "stt.json"
    assert main(["bench", "stt", "--batch", "1,2", "--ticks", "6", "--warmup", "2", "--device", "cpu",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["source"] == "random:tiny" and [r["rows"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert [v["quantizer"] for v in row["variants"]] == ["graphed", "eager"]
        assert not any(v["captured"] for v in row["variants"])  # CPU: moshi's CUDAGraphed calls straight through
        for v in row["variants"]:
            assert v["launches"] > 100 and v["encode_ms"] > 0 and v["lm_ms"] > 0  # CPU: nothing graphed
            for t in (v["alone"], *v["busy"].values()):
                assert 0 < t["p50_ms"] <= t["p90_ms"] <= t["p99_ms"] <= t["max_ms"]
            assert set(v["busy"]) == {"25%", "50%"}


def test_slow_ticks_are_found_by_position() -> None:
    from engine.bench import slow_ticks

    assert slow_ticks([10.0, 10.0, 30.0, 10.0, 15.5, 31.0]) == [2, 5]  # over 1.5 x the median (10.0)
    assert slow_ticks([]) == []


def test_the_measured_ticks_see_the_heap_as_served_and_leave_it_as_found() -> None:
    """The engine process freezes its start-up heap (no full collection walks torch and the model between
    two ticks); the bench measured without it. Now its measured ticks run frozen, a collection that still
    happens is counted with its pause, and the heap is unfrozen after."""
    import gc

    from engine.heap import served_heap

    gc.unfreeze()  # whatever an earlier test froze (the oracle bench freezes, as serve does)
    before, callbacks = gc.get_freeze_count(), list(gc.callbacks)
    with served_heap() as watch:
        assert gc.get_freeze_count() > before  # everything alive at the start is beyond the collector
        assert watch.full_collections == 0
        gc.collect()
        assert watch.full_collections == 1 and watch.longest_pause_ms > 0
    assert gc.get_freeze_count() == before and gc.callbacks == callbacks
    gc.freeze()  # a freeze that was there before (a serve process): left in place
    try:
        frozen = gc.get_freeze_count()
        with served_heap():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


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


def test_node_bench_runs_the_service_as_deployed(tmp_path, monkeypatch) -> None:
    """`serve` with its defaults in its own process, a local LLM, callers speaking flite: every figure the
    fleet is sized with comes back, read from the service's own /metrics; first audio and turn latency as
    the dashboard reads them (histogram_quantile of the scrapes' bucket deltas), the callers' beside them."""
    import kame_phone.node_bench as node_bench
    from kame_phone.media_bench import bucket_quantile

    scrapes: list[dict] = []
    real_scrape = node_bench._scrape

    async def recording(session, url):  # type: ignore[no-untyped-def]
        scrapes.append(await real_scrape(session, url))
        return scrapes[-1]

    monkeypatch.setattr(node_bench, "_scrape", recording)
    out = tmp_path / "node.json"
    assert main(["bench", "node", "--calls", "2", "--llm-ttft-ms", "100", "--hold", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["calls"] == 2 and r["outcomes"] == ["completed", "completed"] and r["hold_s"] == 3.0
    log = out.with_suffix(".serve.log").read_text()
    held = [int(m) for m in re.findall(r"stream ended \(completed\): (\d+) packets in", log)]
    assert len(held) == 2 and min(held) >= 150  # the question, then 3 s (150 packets) on the line
    assert r["served"] == 2 and r["not_served"] == 0 and r["outcome_counts"] == {"completed": 2}
    assert len(r["realtime_share"]) == 2 and all(0 < x <= 1.05 for x in r["realtime_share"])
    assert abs(r["realtime_share_min"] - min(r["realtime_share"])) < 1e-3  # the list is rounded, the minimum not
    before, after = scrapes
    assert after["kame_first_audio_seconds"][-1][1] - before["kame_first_audio_seconds"][-1][1] == 2  # a call each
    for figure, histogram in (("first_audio", "kame_first_audio_seconds"),
                              ("turn_latency", "kame_turn_latency_seconds")):
        for q in (0.5, 0.95, 0.99):
            expected = bucket_quantile(before[histogram], after[histogram], q)
            assert r[figure][f"p{round(q * 100)}_ms"] == (None if expected is None else expected * 1000), (figure, q)
    assert r["first_audio"]["count"] == 2 and r["first_audio"]["p50_ms"] is not None
    assert r["first_audio_heard"]["count"] == 2 and r["first_audio_heard"]["p50_ms"] is not None  # the callers'
    assert set(r["turn_latency_heard"]) == {"p50_ms", "p95_ms", "p99_ms", "count"}
    assert 0 < r["tick_p50_ms"] <= r["tick_p99_ms"]
    assert r["oracle_lag_p50_ms"] is not None  # the local LLM answered and its drafts reached the oracle
    assert r["readyz_samples"] > 0 and r["deadline_misses"] >= 0
    assert r["model_bytes"]["weights"] > 0 and r["model_bytes"]["kv_cache"] > 0


def test_node_bench_exits_3_when_a_call_is_not_served(tmp_path, capsys) -> None:
    """Two callers, a service that seats one: the figures are not at 2 calls. The bench says how many were
    served, takes the real-time minimum over those only, writes its JSON and exits 3 with one line saying so."""
    out = tmp_path / "node.json"
    assert main(["bench", "node", "--calls", "2", "--llm-ttft-ms", "100", "--serve-arg=--max-calls=1",
                 "--json", str(out)]) == 3
    r = json.loads(out.read_text())
    assert r["calls"] == 2 and r["served"] == 1 and r["not_served"] == 1
    assert sum(o == "completed" for o in r["outcomes"]) == 1
    refused = next(o for o in r["outcomes"] if o != "completed")
    assert r["outcome_counts"] == {"completed": 1, refused: 1}
    share = r["realtime_share"][r["outcomes"].index("completed")]
    assert r["realtime_share"][r["outcomes"].index(refused)] is None and share > 0
    assert abs(r["realtime_share_min"] - share) < 1e-3  # the served call's alone (rounded in the list)
    assert r["first_audio"]["count"] == 1  # the service saw one call's first audio
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kame-phone bench node:")]
    assert len(err) == 1 and f"1 of 2 calls not served ({refused} 1)" in err[0]


def test_node_bench_summary_reads_first_audio_and_turn_latency_from_the_service_histograms() -> None:
    """The headline first audio and turn latency are histogram_quantile over the scraped buckets' deltas
    (boundaries as the service exports them, summed over labels as `sum by (le)`), p50/p95/p99; the callers'
    own timings sit beside them as *_heard; served and not served calls are counted, the real-time
    minimum is over served calls only."""
    import contextlib

    from kame_phone.node_bench import _scrape, _summarise
    from telephony.sim_playout import CallReport

    def exposition(first: list[float], turn: list[float] | None) -> str:
        bounds = ("0.05", "0.15", "0.7", "2.5", "+Inf")  # none of the service's own: read from the scrape
        lines = ["# HELP kame_first_audio_seconds x", "# TYPE kame_first_audio_seconds histogram"]
        for agent, share in (("a", 0.25), ("b", 0.75)):  # two labelled series, summed bucket by bucket
            lines += [f'kame_first_audio_seconds_bucket{{agent="{agent}",le="{le}"}} {n * share}'
                      for le, n in zip(bounds, first, strict=True)]
        if turn is not None:
            lines += ["# HELP kame_turn_latency_seconds x", "# TYPE kame_turn_latency_seconds histogram"]
            lines += [f'kame_turn_latency_seconds_bucket{{le="{le}"}} {n}' for le, n in zip(bounds, turn, strict=True)]
        return "\n".join(lines) + "\n"

    class Session:
        def __init__(self, text: str) -> None:
            self.text = text

        @contextlib.asynccontextmanager
        async def get(self, url):  # type: ignore[no-untyped-def]
            class Resp:
                async def text(_self) -> str:  # noqa: N805
                    return self.text

            yield Resp()

    # Cumulative counts; over the run: 0, 2, 8, 20, 20 (first audio) and 3, 4, 4, 4, 4 (turn latency, new).
    before = asyncio.run(_scrape(Session(exposition([1, 1, 3, 5, 5], None)), ""))  # type: ignore[arg-type]
    after = asyncio.run(_scrape(Session(exposition([1, 3, 11, 25, 25], [3, 4, 4, 4, 4])), ""))  # type: ignore[arg-type]
    assert after["kame_first_audio_seconds"][0] == (0.05, 1.0)
    reports = [CallReport(outcome="completed", call_seconds=8.0, bot_seconds_received=7.6, first_audio_latency_s=0.2,
                          last_word_latency_s=0.9),
               CallReport(outcome="busy"),
               CallReport(outcome="completed", call_seconds=8.0, bot_seconds_received=7.92, first_audio_latency_s=0.3)]
    lines: list[str] = []
    r = _summarise(3, [], reports, before, after, [200, 503], lines.append)

    def close(figures: dict, expected: dict) -> bool:
        return figures.keys() == expected.keys() and all(
            abs(figures[k] - v) < 1e-6 for k, v in expected.items())

    # p50: rank 10 of 20 in (0.7, 2.5] holding 12 from 8: 0.7 + 1.8 * 2/12; p95: rank 19; p99: rank 19.8.
    assert close(r["first_audio"], {"p50_ms": 1000.0, "p95_ms": 2350.0, "p99_ms": 2470.0, "count": 20})
    # In the first bucket from 0; then (0.05, 0.15] holding 1 from 3.
    assert close(r["turn_latency"], {"p50_ms": 50 * 2 / 3, "p95_ms": 130.0, "p99_ms": 146.0, "count": 4})
    assert close(r["first_audio_heard"], {"p50_ms": 250.0, "p95_ms": 295.0, "p99_ms": 299.0, "count": 2})
    assert r["turn_latency_heard"] == {"p50_ms": 900.0, "p95_ms": 900.0, "p99_ms": 900.0, "count": 1}
    assert r["served"] == 2 and r["not_served"] == 1 and r["outcome_counts"] == {"completed": 2, "busy": 1}
    assert r["realtime_share"] == [0.95, None, 0.99] and r["realtime_share_min"] == 0.95
    assert r["tick_p50_ms"] is None and r["readyz_not_ready"] == 1
    text = "\n".join(lines)
    assert "3 dialled, 2 served, 1 not (busy 1)" in text
    assert "first audio p50/p95/p99 ms (kame_first_audio_seconds): 1000/2350/2470 (n=20)" in text
    assert "as the callers heard it: 250/295/299 (n=2)" in text


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
    assert r["stt_step_p50_ms"] is not None and r["stt_catchup_steps"] >= 0  # the batched STT's share, read
    assert r["oracle_lag_p50_ms"] is not None  # the random STT's words reached the LLM, its drafts the oracle
    serve_log = (tmp_path / "node.serve.log").read_text()
    assert "random:tiny" in serve_log  # the service's log, kept beside the figures
    assert "Kyutai STT steps after each KAME engine tick" in serve_log  # the two take turns on one device


def test_engine_bench_json_holds_each_finished_batch_when_cut_short(tmp_path) -> None:
    """The JSON is rewritten after each batch (a timeout on the GPU kills the bench mid-run): killed once
    the first batch is in, the file holds it, says which batches were left, and parses (written atomically)."""
    import subprocess
    import sys
    import time

    out = tmp_path / "bench.json"
    proc = subprocess.Popen([sys.executable, "-m", "kame_phone.cli", "bench", "engine", "--size", "tiny", "--batch",
                             ",".join(["1"] * 12), "--ticks", "60", "--warmup", "2", "--device", "cpu", "--json",
                             str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and json.loads(out.read_text())["results"]):
            assert proc.poll() is None and time.monotonic() < deadline, "no batch's figures before the run ended"
            time.sleep(0.05)
        assert proc.poll() is None  # still running: the figures came before the end
    finally:
        proc.kill()
        proc.wait()
    report = json.loads(out.read_text())
    assert report["results"][0]["batch"] == 1 and report["results"][0]["ticks"] == 60
    assert len(report["results"]) + len(report["pending"]) == 12 and report["pending"]


def test_engine_bench_records_out_of_memory_and_goes_on(monkeypatch) -> None:
    """Out of memory however CUDA says it (a RuntimeError from a graph's capture, not only
    torch.OutOfMemoryError): the batch is recorded as such, larger ones skipped, smaller ones still run on
    modules left out of streaming mode; the report goes to `on_batch` after loading and after each batch."""
    import pytest
    import torch

    import engine.bench as bench

    real = bench._bench_batch

    def failing(kb, lm, batch, *args):  # type: ignore[no-untyped-def]
        if batch == 3:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
        if batch == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(kb, lm, batch, *args)

    monkeypatch.setattr(bench, "_bench_batch", failing)
    seen: list[tuple[list[int], list[int], list[int]]] = []
    report = run_engine_bench("tiny", [1, 3, 4, 2, 5], "cpu", ticks=3, warmup=1, log=lambda *_: None,
                              on_batch=lambda r: seen.append(([x.batch for x in r.results], list(r.out_of_memory),
                                                              list(r.pending))))
    assert [r.batch for r in report.results] == [1, 2] and report.out_of_memory == [3, 4, 5]
    assert seen[0] == ([], [], [1, 3, 4, 2, 5]) and seen[2] == ([1], [3], [4, 2, 5]) and len(seen) == 6
    assert json.loads(report.to_json())["out_of_memory"] == [3, 4, 5]

    def broken(kb, lm, batch, *args):  # type: ignore[no-untyped-def]
        raise RuntimeError("shape mismatch")  # not memory: the bench fails, as before

    monkeypatch.setattr(bench, "_bench_batch", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_engine_bench("tiny", [1], "cpu", ticks=3, warmup=1, log=lambda *_: None)


async def test_serve_log_is_written_while_serve_runs(tmp_path) -> None:
    """serve's output reaches its log as it comes: a bench that its timeout kills (no `finally`) keeps it."""
    import sys

    from kame_phone.serve_process import _drain

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; print('listening on 127.0.0.1', flush=True); time.sleep(30)",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    log = tmp_path / "serve.log"
    drained = asyncio.create_task(_drain(proc.stdout, log))
    try:
        for _ in range(200):
            if log.exists() and b"listening on" in log.read_bytes():
                break
            await asyncio.sleep(0.05)
        assert log.read_bytes() == b"listening on 127.0.0.1\n" and proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()
    assert (await drained).endswith(b"listening on 127.0.0.1\n")


def test_bench_gpu_parts_fit_a_call_and_end_what_they_leave_running(tmp_path) -> None:
    """scripts/bench-gpu.sh: every part's budget fits one device call (580 s of the tool's 600); a part
    whose bench left a process running that ignores SIGTERM (serve draining) ends it before it returns."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench-gpu.sh"
    parts = dict(line.split() for line in subprocess.run([script, "--parts"], capture_output=True, text=True,
                                                         check=True).stdout.splitlines())
    assert {"batch1", "node-48", "node-64", "kv-cache", "kv-weights", "weights", "stt"} <= parts.keys()
    assert all(0 < int(s) <= 580 for s in parts.values())
    assert subprocess.run([script, "--budget", "node-48"], capture_output=True, text=True).stdout == "275\n"

    fake = tmp_path / "python"  # stands for python3 -m kame_phone.cli bench node: leaves a "serve" behind
    left = tmp_path / "left.pid"
    fake.write_text(f"#!/bin/bash\necho \"args: $*\"\n(trap '' TERM; exec sleep 300) &\necho $! >{left}\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run([script, str(out), "node-48"], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHON=str(fake)))
    assert done.returncode == 0, done.stderr
    pid = int(left.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert "args: -m kame_phone.cli bench node --calls 48" in (out / "node-48.txt").read_text()


def test_max_autotune_lm_autotunes_the_lm_only(monkeypatch) -> None:
    """The autotune parts' mode (bench-gpu.sh batch1-autotune, weights-autotune): the LM's functions under
    max_autotune without coordinate-descent tuning, Mimi's as `default`; `default` itself unchanged."""
    import torch

    import engine.compiled_step as cs
    from engine.batch import KameBatch
    from engine.checkpoint import load_random

    bundle = load_random("tiny", torch.device("cpu"), torch.float32)
    for mode, lm_expected in (("max-autotune-lm", {"fallback_random": True, "max_autotune": True}),
                              ("default", {"fallback_random": True})):
        seen: list[dict[str, bool]] = []
        monkeypatch.setattr(cs, "_compile", lambda fn, options, seen=seen: (seen.append(options), fn)[1])
        KameBatch(bundle.lm, bundle.mimi, 1, compile_mode=mode).close()
        assert seen[:2] == [lm_expected] * 2  # the depformer's steps, the main transformer
        assert seen[2:] and all(o == {"fallback_random": True} for o in seen[2:])  # Mimi's, as default

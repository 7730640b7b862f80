"""`bench engine --profile`: the slow ticks told apart, host late or device busier, from a real profiler run."""

from __future__ import annotations

import gzip
import json
import time

import torch

from engine.tick_profile import AFTER_LAST, TICK, idle_before_launches, profile_ticks, summarise, union_ms
from kame_phone.cli import main


def test_union_merges_overlaps_and_clips_to_the_tick() -> None:
    # µs in, ms out: [0,1000] and [500,1500] merge; [2000,9000] is clipped to the span's end at 3000.
    assert union_ms((0, 3000), [(500, 1500), (0, 1000), (2000, 9000), (4000, 5000)]) == 2.5
    assert union_ms((0, 3000), []) == 0.0


def test_summary_says_which_slow_ticks_were_more_work_and_which_waited() -> None:
    ticks = [(i * 100_000.0, i * 100_000.0 + 10_000) for i in range(10)]
    work = [("main", s, s + 8_000) for s, _ in ticks]
    ticks[3] = (ticks[3][0], ticks[3][0] + 30_000)  # the host late: wall 30 ms, the same 8 ms of work
    _, late = summarise(ticks, work, "device kernels")
    assert late.slow == [3] and late.slow_wall_ms == 30.0 and late.slow_busy_ms == 8.0
    assert "waiting on the host" in late.verdict() and late.normal_busy_ms == 8.0

    ticks[3] = (ticks[3][0], ticks[3][0] + 10_000)
    work.append(("attention", 700_000 + 8_000, 700_000 + 28_000))  # tick 7: 20 ms more of one kernel
    ticks[7] = (700_000.0, 700_000.0 + 30_000)
    _, busy = summarise(ticks, work, "device kernels")
    assert busy.slow == [7] and "more work" in busy.verdict()
    assert busy.grew[0] == ("attention", 0.0, 20.0)
    assert busy.top == [("main", 8.0, 1.0)]  # a usual tick: one 8 ms kernel

    _, blind = summarise(ticks, [], "device kernels")  # no kernel seen: no verdict on them
    assert blind.slow == [7] and "saw no device kernels" in blind.verdict()


def _tick_trace(t0: float, corr0: int, late_graph_us: float) -> list[dict]:
    """One profiled tick as kineto writes it: host ops and launches on thread 1, device work with the
    launches' correlation ids."""
    def x(cat, name, ts, dur, **args):  # type: ignore[no-untyped-def]
        return {"ph": "X", "cat": cat, "name": name, "ts": t0 + ts, "dur": dur, "tid": 1, "args": args}

    c = corr0
    return [
        x("user_annotation", TICK, 0, 8000),
        x("cpu_op", "aten::cdist", 100, 200), x("cuda_runtime", "cudaLaunchKernel", 250, 10, correlation=c),
        x("kernel", "cdist_kernel", 400, 100, correlation=c),
        # a CUDA graph's replay is launched outside any op: charged to the runtime call
        x("cuda_runtime", "cudaGraphLaunch", 1000, 10, correlation=c + 1),
        x("kernel", "gemm", 500 + late_graph_us, 4800, correlation=c + 1),
        x("kernel", "gemm", 5300 + late_graph_us, 1000, correlation=c + 1),
        # the outermost op around a launch, not the one nested in it (starting at the same instant)
        x("cpu_op", "aten::to", 7100, 100), x("cpu_op", "aten::copy_", 7100, 200),
        x("cuda_runtime", "cudaMemcpyAsync", 7150, 10, correlation=c + 2),
        {"ph": "X", "cat": "cpu_op", "name": "aten::other_thread", "ts": t0 + 7000, "dur": 500, "tid": 2},
        x("gpu_memcpy", "Memcpy DtoH", 7400, 100, correlation=c + 2),
    ]


def test_device_idle_is_charged_to_the_host_op_that_launched_the_next_kernel() -> None:
    trace = {"traceEvents": _tick_trace(0, 1, 700) + _tick_trace(10_000, 10, 1700)}
    rows = dict((name, (ms, gaps)) for name, ms, gaps in idle_before_launches(trace))
    # Tick 0: 0-400 waits on cdist, 500-1200 on the graph, 7000-7400 on the copy, 7500-8000 after the last
    # kernel. Tick 1: the graph's kernels 1 ms later (they end clipped at the tick's end, so nothing after).
    assert rows["aten::cdist"] == (0.4, 1.0)
    assert rows["cudaGraphLaunch"] == (1.2, 1.0)  # (0.7 + 1.7) / 2
    assert rows["aten::copy_"] == (0.2, 0.5)  # tick 1's copy fell inside the late graph's kernels: no gap
    assert "aten::to" not in rows
    assert rows[AFTER_LAST] == (0.25, 0.5)
    only_first = dict((n, ms) for n, ms, _ in idle_before_launches(trace, skip=frozenset({1})))
    assert only_first["cudaGraphLaunch"] == 0.7
    assert idle_before_launches({"traceEvents": [e for e in trace["traceEvents"] if e["cat"] != "kernel"
                                                 and e["cat"] != "gpu_memcpy"]}) == []  # CPU: nothing to say


def test_work_running_into_a_tick_from_the_one_before_is_not_a_gap() -> None:
    def x(cat, name, ts, dur, **args):  # type: ignore[no-untyped-def]
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}

    trace = {"traceEvents": [
        x("user_annotation", TICK, 0, 1000), x("user_annotation", TICK, 1000, 1000),
        x("cuda_runtime", "cudaGraphLaunch", 10, 5, correlation=1),
        x("kernel", "long", 20, 1580, correlation=1),  # from 20 µs in tick 0 to 600 µs into tick 1
        x("cuda_runtime", "cudaLaunchKernel", 1700, 5, correlation=2),
        x("kernel", "next", 1800, 100, correlation=2),
    ]}
    rows = {name: ms for name, ms, _ in idle_before_launches(trace)}
    # Tick 0: 20 µs before the graph's kernel, none after (it runs to the end). Tick 1: busy until 1600,
    # then 200 µs before the next kernel and 100 after it: not 800 before it.
    assert rows == {"cudaGraphLaunch": 0.01, "cudaLaunchKernel": 0.1, AFTER_LAST: 0.05}


def test_a_real_profile_finds_the_stalled_tick_and_the_heavier_one(tmp_path) -> None:
    a = torch.randn(256, 256)

    def tick(i: int) -> None:
        for _ in range(4):
            torch.mm(a, a)
        if i == 5:
            time.sleep(0.05)  # the host late: no op runs
        if i == 9:
            for _ in range(40):
                torch.mm(a, a)  # more work

    rows, summary = profile_ticks(tick, 12, torch.device("cpu"), tmp_path / "t.trace.json.gz")
    assert summary.work == "cpu ops" and len(rows) == 12
    assert all(0 <= r.busy_ms <= r.wall_ms + 1e-6 for r in rows)
    assert 5 in summary.slow and 9 in summary.slow
    assert rows[5].idle_ms > 40 and rows[9].busy_ms > 5 * summary.normal_busy_ms
    assert summary.grew[0][0] == "aten::mm"
    events = json.loads(gzip.decompress((tmp_path / "t.trace.json.gz").read_bytes()))["traceEvents"]
    assert sum(e.get("name") == TICK for e in events) == 12


def test_engine_bench_profiles_the_tiny_model_and_writes_the_trace(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "2", "--ticks", "6", "--warmup", "2",
                 "--device", "cpu", "--profile", str(tmp_path), "--json", str(out)]) == 0  # fmt: skip
    p = json.loads(out.read_text())["results"][0]["profile"]
    assert json.loads(out.read_text())["results"][0]["gc_full_collections"] == 0  # the profiler's own garbage apart
    assert p["ticks"] == 6 and p["work"] == "cpu ops" and 0 < p["normal_busy_ms"] <= p["normal_wall_ms"]
    assert p["trace"] == str(tmp_path / "engine-off-b2.trace.json.gz") and p["verdict"]
    events = json.loads(gzip.decompress((tmp_path / "engine-off-b2.trace.json.gz").read_bytes()))["traceEvents"]
    assert sum(e.get("name") == TICK for e in events) == 6
    assert "profiled 6 ticks (cpu ops)" in capsys.readouterr().out


def test_a_profile_that_fails_keeps_the_batch_figures(tmp_path, monkeypatch) -> None:
    """The profile comes after the figures, on a GPU lent for minutes: a profiler failure there must not lose
    the batch's measured ticks."""
    import engine.bench as bench

    def broken(*_a, **_k):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(bench, "profile_ticks", broken)
    report = bench.run_engine_bench("tiny", [1], "cpu", ticks=3, warmup=1, log=lambda *_: None,
                                    profile_dir=str(tmp_path))  # fmt: skip
    (r,) = report.results
    assert r.ticks == 3 and len(r.tick_ms) == 3 and r.profile == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}

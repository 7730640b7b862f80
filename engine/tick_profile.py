"""`bench engine --profile DIR`: where a slow tick's time goes, from one device call.

The batch-1 tail (p99 twice p50 on the H100) has two candidate homes: the device doing more or slower work in
those ticks (clocks, a different kernel, the ring's mask), or the host being late to launch it (the thread
descheduled, Python, a lock), the device idle meanwhile. A profile of ticks under torch.profiler tells them
apart: for each tick, how much of its wall time the device was busy (kernels, copies) and how much it sat idle;
then the slow ticks against the rest, and the kernels that gained most in the slow ones. On CPU the "work" is
the tick's top-level aten ops (the rest is Python), which tests the arithmetic and the trace without a GPU.

The Chrome trace of the profiled ticks is written beside the summary (gzip; open it in Perfetto): ticks are
`kame_tick` ranges on the host timeline.
"""

from __future__ import annotations

import bisect
import gc
import gzip
import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

TICK = "kame_tick"
SLOW_FACTOR = 1.5  # a slow tick: over 1.5 x the median (the bench's printout and the profile alike)
TOP = 12  # kernels listed by their share of a usual tick


def slow_ticks(tick_ms: list[float], factor: float = SLOW_FACTOR) -> list[int]:
    """The indices of the ticks over `factor` times the median: the tail, by position."""
    if not tick_ms:
        return []
    limit = factor * float(np.median(tick_ms))
    return [i for i, t in enumerate(tick_ms) if t > limit]


@dataclass
class TickBreakdown:
    index: int
    wall_ms: float
    busy_ms: float  # the union of the work's intervals within the tick
    idle_ms: float  # wall - busy: the device waiting on the host (or, on CPU, Python between ops)


@dataclass
class ProfileSummary:
    work: str  # "device kernels" or "cpu ops"
    ticks: int
    slow: list[int]  # indices (within the profiled ticks) over SLOW_FACTOR x the median wall time
    normal_wall_ms: float  # medians over the ticks that are not slow
    normal_busy_ms: float
    slow_wall_ms: float | None  # medians over the slow ticks (None: none)
    slow_busy_ms: float | None
    # The work whose time per tick grew most in the slow ticks: (name, ms per normal tick, ms per slow tick).
    grew: list[tuple[str, float, float]] = field(default_factory=list)
    # The work that takes most of a tick that is not slow: (name, ms per tick, calls per tick). Two modes'
    # lists side by side say where one is slower (the main transformer 2 ms slower compiled, on the H100).
    top: list[tuple[str, float, float]] = field(default_factory=list)
    trace: str | None = None  # the gzipped Chrome trace
    # Where a usual tick's device idle time goes (from the trace, on a GPU): each gap before a kernel charged
    # to the host op that launched that kernel (name, idle ms per tick, gaps per tick), largest first.
    idle_before: list[tuple[str, float, float]] = field(default_factory=list)

    def verdict(self) -> str:
        """One line: whether the slow ticks are the device busier or the device idle (the host late)."""
        if not self.normal_busy_ms and not self.slow_busy_ms:  # e.g. a CUDA graph's kernels not traced
            return f"the profiler saw no {self.work}: no breakdown (the trace still has the host's side)"
        if self.slow_wall_ms is None or self.slow_busy_ms is None:
            return "no slow tick among the profiled ones"
        extra = self.slow_wall_ms - self.normal_wall_ms
        busier = self.slow_busy_ms - self.normal_busy_ms
        share = busier / extra if extra > 0 else 0.0
        where = "more work" if share >= 0.5 else "waiting on the host"
        return (f"slow ticks are {extra:.1f} ms longer, {busier:.1f} ms of it {self.work} busy: mostly {where} "
                f"({share:.0%} of the extra time busy)")


def union_ms(span: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` clipped to `span`, in ms (the profiler's times are µs)."""
    lo, hi = span
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1000.0


def summarise(ticks: list[tuple[float, float]], work: list[tuple[str, float, float]], kind: str,
              top: int = 5) -> tuple[list[TickBreakdown], ProfileSummary]:
    """Per-tick breakdown and the slow-against-normal summary, from tick spans and named work intervals
    (both in µs on one clock)."""
    starts = np.array([s for s, _ in ticks])
    per_tick: list[list[tuple[str, float, float]]] = [[] for _ in ticks]
    for name, s, e in work:  # each piece of work to the tick it starts in (ticks do not overlap)
        i = int(np.searchsorted(starts, s, side="right")) - 1
        if 0 <= i < len(ticks) and s < ticks[i][1]:
            per_tick[i].append((name, s, e))
    rows = []
    for i, (span, items) in enumerate(zip(ticks, per_tick, strict=True)):
        wall = (span[1] - span[0]) / 1000.0
        busy = union_ms(span, [(s, e) for _, s, e in items])
        rows.append(TickBreakdown(i, wall, busy, wall - busy))
    slow = slow_ticks([r.wall_ms for r in rows])
    slow_set = set(slow)
    normal = [r for r in rows if r.index not in slow_set]
    slow_rows = [rows[i] for i in slow]
    usual = [r.index for r in normal]

    def per_name(indices: list[int], count: bool = False) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        for i in indices:
            for name, s, e in per_tick[i]:
                sums[name] += 1.0 if count else (e - s) / 1000.0
        return {k: v / max(1, len(indices)) for k, v in sums.items()}

    grew: list[tuple[str, float, float]] = []
    if slow:
        base, late = per_name(usual), per_name(slow)
        names = sorted(set(base) | set(late), key=lambda n: late.get(n, 0) - base.get(n, 0), reverse=True)
        grew = [(n, round(base.get(n, 0.0), 3), round(late.get(n, 0.0), 3)) for n in names[:top]]
    ms, calls = per_name(usual), per_name(usual, count=True)
    top_names = sorted(ms, key=ms.__getitem__, reverse=True)[:TOP]
    summary = ProfileSummary(
        work=kind,
        ticks=len(rows),
        slow=slow,
        normal_wall_ms=float(np.median([r.wall_ms for r in normal])),
        normal_busy_ms=float(np.median([r.busy_ms for r in normal])),
        slow_wall_ms=float(np.median([r.wall_ms for r in slow_rows])) if slow_rows else None,
        slow_busy_ms=float(np.median([r.busy_ms for r in slow_rows])) if slow_rows else None,
        grew=grew,
        top=[(n, round(ms[n], 3), round(calls[n], 2)) for n in top_names],
    )
    return rows, summary


AFTER_LAST = "(after the tick's last kernel)"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_GAP_US = 5.0  # shorter gaps are a launch's own latency, not the host being late


def idle_before_launches(trace: dict, skip: frozenset[int] = frozenset(), top: int = TOP,
                         ) -> list[tuple[str, float, float]]:
    """From a Chrome trace of profiled ticks: each stretch of a tick in which the device sat idle, charged to
    the host op that launched the kernel that ended it (the outermost aten op around the launch; a CUDA
    graph's replay, outside any op, under its runtime call's name). This names the host work a tick waits
    on: e.g. moshi's eager quantizer ops between CUDA graphs (docs/benchmarks.md, session 23). `skip`:
    tick indices left out (the slow ones). Returns (launcher, idle ms per tick, gaps per tick), largest
    first; empty when the trace holds no device work (CPU)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ticks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("name") == TICK and e.get("cat") == "user_annotation")  # fmt: skip
    device = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation")) for e in events
                    if e.get("cat") in DEVICE_CATS)  # fmt: skip
    if not device or not ticks:
        return []
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    # Each thread's top-level ops (not inside another): sorted by start, the longer first on a tie, an op
    # inside the last kept one is nested. A launch is then inside at most one of them: one bisect each.
    spans: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])):
        kept = spans[e.get("tid")]
        if not kept or e["ts"] >= kept[-1][1]:
            kept.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    starts_of = {tid: [s for s, _, _ in kept] for tid, kept in spans.items()}

    def launcher(correlation: object) -> str:
        call = launches.get(correlation)
        if call is None:
            return "(launch not in the trace)"
        tid, at = call.get("tid"), call["ts"]
        i = bisect.bisect_right(starts_of.get(tid, []), at) - 1
        if i >= 0 and spans[tid][i][1] >= at:
            return spans[tid][i][2]
        return call["name"]  # outside any op: a CUDA graph's replay, say

    idle: dict[str, float] = defaultdict(float)
    gaps: dict[str, float] = defaultdict(float)
    starts = [d[0] for d in device]
    ended_by = np.maximum.accumulate([d[1] for d in device])  # the latest end among the first k+1 pieces
    counted = 0
    for i, (lo, hi) in enumerate(ticks):
        if i in skip:
            continue
        counted += 1
        j = int(np.searchsorted(starts, lo, side="left"))
        # Work launched before the tick and still running into it keeps the device busy: not a gap.
        busy_until = min(max(lo, float(ended_by[j - 1])), hi) if j else lo
        while j < len(device) and device[j][0] < hi:
            s, e, correlation = device[j]
            if s - busy_until > MIN_GAP_US:
                name = launcher(correlation)
                idle[name] += (s - busy_until) / 1000.0
                gaps[name] += 1
            busy_until = max(busy_until, min(e, hi))
            j += 1
        if hi - busy_until > MIN_GAP_US:
            idle[AFTER_LAST] += (hi - busy_until) / 1000.0
            gaps[AFTER_LAST] += 1
    n = max(1, counted)
    names = sorted(idle, key=idle.__getitem__, reverse=True)[:top]
    return [(name, round(idle[name] / n, 3), round(gaps[name] / n, 2)) for name in names]


def _device_work(event) -> bool:  # type: ignore[no-untyped-def]
    # (is_user_annotation: not in every torch the GPU boxes may have; the name check covers ours.)
    return (event.device_type == DeviceType.CUDA and event.name != TICK
            and not getattr(event, "is_user_annotation", False))  # fmt: skip


def top_level_cpu_op(event) -> bool:  # type: ignore[no-untyped-def]
    """An aten op the host issued itself (not one inside another): on CPU a tick's work, elsewhere a launch."""
    parent = event.cpu_parent
    return event.name.startswith("aten::") and (parent is None or parent.name == TICK)


def profile_ticks(tick: Callable[[int], object], n: int, device: torch.device, trace: Path | None = None,
                  ) -> tuple[list[TickBreakdown], ProfileSummary]:
    """Run `tick(i)` n times under the profiler; the per-tick breakdown and its summary. With `trace`, the
    Chrome trace is gzipped there."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    enabled = gc.isenabled()
    gc.disable()  # no collection of the profiler's own garbage inside a tick: a slow tick is the engine's
    try:
        with profile(activities=activities) as prof:
            for i in range(n):
                with record_function(TICK):
                    tick(i)
            if cuda:
                torch.cuda.synchronize(device)
    finally:
        if enabled:
            gc.enable()
    events = prof.events()
    # The host's ranges: kineto mirrors a range holding kernels onto the device timeline as well (a user
    # annotation there), which is neither a tick nor work.
    ticks = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == TICK and e.device_type == DeviceType.CPU)  # fmt: skip
    if cuda:  # kernels and copies on the device timeline (a CUDA graph's replayed kernels included)
        work = [(e.name, e.time_range.start, e.time_range.end) for e in events if _device_work(e)]
        kind = "device kernels"
    else:
        work = [(e.name, e.time_range.start, e.time_range.end) for e in events if top_level_cpu_op(e)]
        kind = "cpu ops"
    rows, summary = summarise(ticks, work, kind)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        fd, raw = tempfile.mkstemp(suffix=".json", dir=trace.parent)
        os.close(fd)
        try:
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            summary.trace = str(trace)
            if cuda:  # an extra: if reading the trace fails, the summary and the trace stand without it
                try:
                    with open(raw, "rb") as src:
                        summary.idle_before = idle_before_launches(json.load(src), frozenset(summary.slow))
                except Exception as e:  # noqa: BLE001
                    summary.idle_before = [(f"(not read: {type(e).__name__}: {e})"[:120], 0.0, 0.0)]
        finally:
            os.unlink(raw)
    return rows, summary

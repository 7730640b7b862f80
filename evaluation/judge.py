"""MT-Bench single-answer grading by any OpenAI-compatible chat model.

The prompts are MT-Bench's `single-v1` and, for a question with a reference answer, `single-math-v1`
(Zheng et al. 2023, "Judging LLM-as-a-judge"; FastChat's llm_judge, Apache-2.0): the judge explains,
then rates 1-10 as "[[N]]". The answer it grades is the ASR transcript of the bot's spoken reply, as in
the KAME paper. A failure (an API error, no rating, a rating outside 1-10) is retried; after the last
try the score is missing (None), never 0: a judge outage must not read as a bad model. So is any other
failure, an odd reply from a "compatible" server included: it costs that question's score, never the run.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import openai

from knowledge.llm import refused_param, request_params

from .questions import Question

SYSTEM = "You are a helpful assistant."
_INSTRUCTION = (
    "[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by an AI "
    "assistant to the user question displayed below. Your evaluation should consider {criteria}"
    " Be as objective as possible. After providing your explanation, you must rate the response on a scale of "
    '1 to 10 by strictly following this format: "[[rating]]", for example: "Rating: [[5]]".\n\n'
)
_GENERAL = (
    "factors such as the helpfulness, relevance, accuracy, depth, creativity, and level of detail of the "
    "response. Begin your evaluation by providing a short explanation."
)
_WITH_REFERENCE = (
    "correctness and helpfulness. You will be given a reference answer and the assistant's answer. Begin "
    "your evaluation by comparing the assistant's answer with the reference answer. Identify and correct any "
    "mistakes."
)
_ANSWER = "[The Start of Assistant's Answer]\n{answer}\n[The End of Assistant's Answer]"
_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_LOOSE = re.compile(r"\[(\d+\.?\d*)\]")  # FastChat accepts single brackets too
NO_RATING = "the judge gave no rating [[1-10]]"
NOT_A_COMPLETION = "the judge's answer was not a chat completion"

log = logging.getLogger("kame-phone.eval")


def prompt(question: Question, answer: str) -> str:
    if question.reference:
        return (
            _INSTRUCTION.format(criteria=_WITH_REFERENCE)
            + f"[Question]\n{question.text}\n\n"
            + f"[The Start of Reference Answer]\n{question.reference}\n[The End of Reference Answer]\n\n"
            + _ANSWER.format(answer=answer)
        )
    return _INSTRUCTION.format(criteria=_GENERAL) + f"[Question]\n{question.text}\n\n" + _ANSWER.format(answer=answer)


def parse_rating(text: str) -> float | None:
    """The judge's rating, or None when there is none in 1-10."""
    match = _RATING.search(text) or _RATING_LOOSE.search(text)
    if match is None:
        return None
    value = float(match.group(1))
    return value if 1.0 <= value <= 10.0 else None


@dataclass
class Verdict:
    score: float | None
    explanation: str  # the judge's whole answer (its explanation and the rating)
    attempts: int
    error: str | None = None


@dataclass
class Judge:
    model: str
    base_url: str | None = None
    api_key: str | None = None
    attempts: int = 3
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        # The client retries HTTP 429/5xx and connection errors itself; the loop in grade() retries
        # answers without a rating too.
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", max_retries=2, timeout=120
        )
        self._refused: set[str] = set()  # request parameters the judge model refused (knowledge.llm)

    async def grade(self, question: Question, answer: str) -> Verdict:
        """The judge's verdict; never raises (but for cancellation): every failure is a Verdict with
        `error` set and the score missing."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(question, answer)}]
        error, text = None, ""
        for attempt in range(1, self.attempts + 1):
            try:
                resp = await self._complete(messages)
                reply = reply_text(resp)
                if reply is None:
                    error = NOT_A_COMPLETION
                else:
                    text, score = reply, parse_rating(reply)
                    if score is not None:
                        return Verdict(score, text, attempt)
                    error = NO_RATING
            except Exception as exc:  # noqa: BLE001 - API errors and odd replies alike cost one score, not the run
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.debug("question %s: judge try %d of %d: %s", question.question_id, attempt, self.attempts, error)
            if attempt < self.attempts:
                await asyncio.sleep(self.backoff_s * attempt)
        return Verdict(None, text, self.attempts, error)

    async def _complete(self, messages: list[dict[str, str]]) -> Any:
        """One chat completion. A reasoning model (o-series, gpt-5) refuses `max_tokens` and temperature 0
        with a 400 each: asked again as it takes them (max_completion_tokens; its default temperature), and
        so from then on; not a failed try."""
        while True:
            params = request_params({"temperature": 0, "max_tokens": 2048}, self._refused)
            try:
                return await self._client.chat.completions.create(
                    model=self.model, messages=messages, **params  # type: ignore[arg-type]
                )
            except openai.BadRequestError as exc:
                refused = refused_param(exc)
                if refused is None or refused in self._refused:
                    raise
                self._refused.add(refused)
                log.warning("the judge model %s does not take %r: asked without it", self.model, refused)

    async def aclose(self) -> None:
        await self._client.close()


def reply_text(resp: Any) -> str | None:
    """The text of a chat completion's first choice; None when the reply is not one (an HTML page, a
    choice without a message). Content given as parts (a list) is joined from its text parts."""
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not choices:
        return None
    message = getattr(choices[0], "message", None)
    if message is None:
        return None
    content = getattr(message, "content", None)
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
        return "\n".join(p for p in parts if isinstance(p, str))
    return None

"""MT-Bench single-answer grading by any OpenAI-compatible chat model.

The prompts are MT-Bench's `single-v1` and, for a question with a reference answer, `single-math-v1`
(Zheng et al. 2023, "Judging LLM-as-a-judge"; FastChat's llm_judge, Apache-2.0): the judge explains,
then rates 1-10 as "[[N]]". The answer it grades is the ASR transcript of the bot's spoken reply, as in
the KAME paper. A failure (an API error, no rating, a rating outside 1-10) is retried; after the last
try the score is missing (None), never 0: a judge outage must not read as a bad model.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import openai

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

    async def grade(self, question: Question, answer: str) -> Verdict:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(question, answer)}]
        error, text = None, ""
        for attempt in range(1, self.attempts + 1):
            try:
                resp = await self._client.chat.completions.create(
                    model=self.model, messages=messages, temperature=0, max_tokens=2048  # type: ignore[arg-type]
                )
                text = (resp.choices[0].message.content or "") if resp.choices else ""
                score = parse_rating(text)
                if score is not None:
                    return Verdict(score, text, attempt)
                error = "the judge gave no rating [[1-10]]"
            except openai.OpenAIError as exc:
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
            if attempt < self.attempts:
                await asyncio.sleep(self.backoff_s * attempt)
        return Verdict(None, text, self.attempts, error)

    async def aclose(self) -> None:
        await self._client.close()

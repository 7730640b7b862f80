"""Streaming reply drafts from any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp, ...).

One `LlmClient` (one `openai.AsyncOpenAI`, one connection pool) serves every call of the process.
Every request is counted in `LLM_REQUESTS` when it starts.
Failures are turned into an `LlmError` with a `kind` label, counted in `LLM_ERRORS{kind}` and logged
with the call id. The API key never reaches a log line: it is scrubbed from error messages, because
some servers echo request headers back in their error bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

from . import metrics

log = logging.getLogger(__name__)

ErrorKind = Literal["timeout", "rate_limited", "server_error", "connection", "malformed", "other"]


class LlmError(Exception):
    """A draft request failed; `kind` is its LLM_ERRORS label."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ErrorKind = kind


@dataclass(frozen=True, slots=True)
class LlmConfig:
    model: str
    base_url: str | None = None  # None: the openai package's default (api.openai.com)
    api_key: str = field(default="", repr=False)  # never in a repr, never in a log line
    timeout_s: float = 10.0  # connect / read / write: a stream that stalls this long is a timeout
    max_tokens: int | None = 96  # drafts are <= 30 words; None: let the server decide
    temperature: float | None = None  # None: the server's default (the official code sets none)


def classify_error(exc: BaseException, *, streaming: bool) -> ErrorKind:
    """Map an exception from a chat-completions stream to an error kind.

    `streaming`: the response headers had arrived, so a dropped connection is a broken stream
    ("malformed"), not a refused one ("connection").
    """
    if isinstance(exc, openai.APITimeoutError | asyncio.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code == 429:
            return "rate_limited"
        return "server_error" if exc.status_code >= 500 else "other"
    if isinstance(exc, openai.APIConnectionError):
        return "malformed" if streaming else "connection"
    if isinstance(exc, openai.APIError):
        # An error event inside an otherwise healthy stream: the server gave up mid-answer.
        return "server_error" if streaming else "other"
    if isinstance(exc, json.JSONDecodeError | ValueError | KeyError | TypeError | AttributeError | IndexError):
        return "malformed"
    if isinstance(exc, ConnectionError | OSError):
        return "malformed" if streaming else "connection"
    return "other"


class LlmClient:
    """Shared, async, streaming chat-completions client."""

    def __init__(self, config: LlmConfig, *, client: openai.AsyncOpenAI | None = None) -> None:
        self.config = config
        if client is None:
            if not config.api_key:
                log.warning("no LLM API key set (OPENAI_API_KEY); fine for local servers only")
            client = openai.AsyncOpenAI(
                base_url=config.base_url,
                api_key=config.api_key or "not-set",  # the client refuses an empty key
                timeout=config.timeout_s,
                max_retries=0,  # retries are the back-end's job: a stale retry is worse than none
            )
        self._client = client

    async def aclose(self) -> None:
        await self._client.close()

    async def stream_draft(self, messages: Sequence[dict[str, str]], *, call_id: str = "-") -> AsyncIterator[str]:
        """Yield the cumulative draft text after each streamed chunk that adds text.

        Raises `LlmError` (already counted and logged). Cancellation closes the HTTP stream.
        """
        # Counted before the request is made, so that failed requests are in the denominator of the
        # error ratio (LLM_ERRORS / LLM_REQUESTS) too.
        metrics.LLM_REQUESTS.inc()
        cfg = self.config
        extra: dict[str, Any] = {}
        if cfg.max_tokens is not None:
            extra["max_tokens"] = cfg.max_tokens
        if cfg.temperature is not None:
            extra["temperature"] = cfg.temperature
        started = time.monotonic()
        streaming = False
        text = ""
        try:
            stream = await self._client.chat.completions.create(
                model=cfg.model,
                messages=list(messages),
                stream=True,
                **extra,  # type: ignore[arg-type]
            )
            streaming = True
            async with stream:
                async for chunk in stream:
                    if not chunk.choices:  # e.g. a trailing usage chunk
                        continue
                    piece = chunk.choices[0].delta.content
                    if piece is not None and not isinstance(piece, str):
                        raise TypeError(f"delta.content is {type(piece).__name__}, not str")
                    if not piece:
                        continue
                    if not text:
                        metrics.LLM_TTFT_SECONDS.observe(time.monotonic() - started)
                        piece = piece.lstrip()
                        if not piece:
                            continue
                    text += piece
                    yield text
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind = classify_error(exc, streaming=streaming)
            message = self._scrub(f"{type(exc).__name__}: {exc}")
            metrics.LLM_ERRORS.labels(kind=kind).inc()
            log.warning("call %s: LLM request failed (%s) after %d chars: %s", call_id, kind, len(text), message)
            raise LlmError(kind, message) from None

    def _scrub(self, message: str) -> str:
        key = self.config.api_key
        if key:
            message = message.replace(key, "***")
        return message[:500]

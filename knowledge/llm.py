"""Streaming reply drafts from any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp, ...).

One `LlmClient` (one `openai.AsyncOpenAI`, one connection pool) serves every call of the process.
Every request is counted in `LLM_REQUESTS` when it starts.
Failures are turned into an `LlmError` with a `kind` label, counted in `LLM_ERRORS{kind}` and logged
with the call id. The API key never reaches a log line: it is scrubbed from error messages, because
some servers echo request headers back in their error bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import math
import re
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import openai

from engine.oracle_buffer import well_formed

from . import metrics

log = logging.getLogger(__name__)

# too_long: not a failure (the reply is cut and delivered), counted with them as a server misbehaving.
# empty: a stream that ended with neither text nor a tool call (a reasoning model that spent its budget).
ErrorKind = Literal[
    "timeout", "rate_limited", "server_error", "connection", "malformed", "other", "too_long", "empty"
]


class LlmError(Exception):
    """A draft request failed; `kind` is its LLM_ERRORS label."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ErrorKind = kind
        self.retry_after_s = retry_after_s  # a 429/503's Retry-After: ask again no sooner


MAX_RETRY_AFTER_S = 60.0  # a server asking for longer is still asked again then: a call cannot wait more


def retry_after(exc: BaseException) -> float | None:
    """A 429/503's Retry-After (seconds or an HTTP date), in seconds, at most MAX_RETRY_AFTER_S; else None."""
    if not (isinstance(exc, openai.APIStatusError) and exc.status_code in (429, 503)):
        return None
    value = exc.response.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except Exception:  # a hostile header: a year past datetime's (OverflowError), and whatever else
            return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds)) if math.isfinite(seconds) else None


@dataclass(frozen=True, slots=True)
class LlmConfig:
    model: str
    base_url: str | None = None  # None: the openai package's default (api.openai.com)
    api_key: str = field(default="", repr=False)  # never in a repr, never in a log line
    timeout_s: float = 10.0  # connect / read / write: a stream that stalls this long is a timeout
    # After the first token: keep-alives and empty deltas are reads that succeed, so the per-read timeout never
    # fires on them; a stream without a text piece or tool-call delta for this long is a timeout.
    # Long enough for a self-hosted server's pauses under load (vLLM preempting a sequence for seconds): a
    # healthy reply cut here is delivered as it stands and not asked again.
    idle_timeout_s: float = 5.0
    max_request_s: float = 30.0  # the whole request, however it trickles
    # A reply past this is cut at a word and ends there (a server ignoring max_tokens would stream forever, and
    # each update is re-tokenized whole by the engine).
    max_draft_chars: int = 2000
    max_tokens: int | None = 96  # drafts are <= 30 words; None: let the server decide
    temperature: float | None = None  # None: the server's default (the official code sets none)


def classify_error(exc: BaseException, *, streaming: bool) -> ErrorKind:
    """Map an exception from a chat-completions stream to an error kind.

    `streaming`: the response headers had arrived, so a dropped connection is a broken stream
    ("malformed"), not a refused one ("connection").
    """
    if isinstance(exc, EmptyReplyError):
        return "empty"
    if not streaming and any(isinstance(e, ConnectionRefusedError | socket.gaierror) for e in _chain(exc)):
        return "connection"  # the aiohttp transport reports a refused connect as a connect *timeout*
    transport = _httpx_error(exc)  # raised while reading the body: the client wraps only the send
    if isinstance(exc, openai.APITimeoutError | asyncio.TimeoutError | TimeoutError) or transport == "timeout":
        return "timeout"
    if transport:
        return "malformed" if streaming else "connection"
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code == 429:
            return "rate_limited"
        return "server_error" if exc.status_code >= 500 else "other"
    if isinstance(exc, openai.APIConnectionError):
        return "malformed" if streaming else "connection"
    if isinstance(exc, openai.APIError | LlmStreamError):
        # An error event inside an otherwise healthy stream: the server gave up mid-answer.
        return "server_error" if streaming else "other"
    if isinstance(exc, json.JSONDecodeError | ValueError | KeyError | TypeError | AttributeError | IndexError):
        return "malformed"
    if isinstance(exc, ConnectionError | OSError):
        return "malformed" if streaming else "connection"
    return "other"


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and what caused it, outermost first."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _error_param(exc: BaseException) -> str:
    """The `param` an API error's body names (OpenAI's `{"error": {"param": ...}}`, or the body itself), else ""."""
    body = getattr(exc, "body", None)
    error = body.get("error", body) if isinstance(body, dict) else {}
    return str(error.get("param") or "") if isinstance(error, dict) else ""


def _refuses_tools(exc: BaseException, messages: Sequence[dict[str, Any]] = ()) -> bool:
    """A 4xx that names tools: the server cannot do function calling. Not one that blames a message of the
    history (`param` messages[...]: a tool name the model made up, e.g. `multi_tool_use.parallel`): that
    is one call's request, and taken for the server's refusal it turned tools off for the whole process.
    Nor, unless it names a tool's definition, one whose request carries tool exchanges (vLLM sends `param`
    null): a server without function calling refuses a call's first request, which has none; a later one's
    refusal may be that call's history (a chat template refusing its call ids, say)."""
    if not (isinstance(exc, openai.APIStatusError) and exc.status_code in (400, 422)):
        return False
    if _blames_a_tool(exc):
        return True
    param = _error_param(exc)
    in_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    return not param.startswith("messages") and not in_history and "tool" in str(exc).lower()


def _blames_a_tool(exc: BaseException) -> bool:
    """A 4xx naming one tool's definition (OpenAI: param `tools[0].function.parameters`, "Invalid schema for
    function"): the agent's tool set is at fault, not the server's function calling."""
    return _error_param(exc).startswith("tools[") or "invalid schema for function" in str(exc).lower()


FINISH_GRACE_S = 1.0  # after a chunk with a finish_reason, the stream's end ([DONE]) is awaited this long at most
TOOLS_REFUSED_S = 600.0  # a tool set a model's server refused is not offered to it again for this long

# Parameters some models refuse (OpenAI's reasoning models: o-series, gpt-5): what to send instead (None: drop it).
_PARAM_FALLBACKS: dict[str, str | None] = {"max_tokens": "max_completion_tokens", "temperature": None}
_UNSUPPORTED = re.compile(r"[Uu]nsupported (?:parameter|value): '(\w+)'")


def refused_param(exc: BaseException) -> str | None:
    """The request parameter a 400 says this model does not take (`max_tokens`, `temperature`), else None."""
    if not (isinstance(exc, openai.APIStatusError) and exc.status_code == 400):
        return None
    param = _error_param(exc)
    if param not in _PARAM_FALLBACKS:
        found = _UNSUPPORTED.search(str(exc))
        param = found.group(1) if found else ""
    return param if param in _PARAM_FALLBACKS else None


# A reasoning model's max_completion_tokens also pays for its hidden reasoning: a draft's 96 left nothing for
# the answer (an empty reply, finish_reason "length"). The answer stays short through the prompt.
MIN_COMPLETION_TOKENS = 1024


def request_params(params: dict[str, Any], refused: set[str]) -> dict[str, Any]:
    """`params` as this model takes them: each refused one renamed, or dropped."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name in refused:
            instead = _PARAM_FALLBACKS.get(name)
            if instead == "max_completion_tokens" and isinstance(value, int):
                value = max(value, MIN_COMPLETION_TOKENS)
            if instead is not None:
                out[instead] = value
        else:
            out[name] = value
    return out


def _httpx_error(exc: BaseException) -> str | None:
    """"timeout" or "transport" for the HTTP library's errors (httpx, or httpx2 in newer openai
    releases: matched by name so either works), else None."""
    names = {cls.__name__ for cls in type(exc).__mro__ if cls.__module__.split(".")[0] in ("httpx", "httpx2")}
    if "TimeoutException" in names:
        return "timeout"
    return "transport" if "TransportError" in names else None


class StreamCutError(ValueError):
    """The response body ended before the answer did: a broken stream ("malformed"), never a whole answer."""


class LlmStreamError(Exception):
    """The server sent an error inside an otherwise healthy stream: it gave up mid-answer."""


class EmptyReplyError(Exception):
    """The stream ended well but said nothing: no text, no tool call."""


# A streamed chunk is a few hundred bytes, a tool call's arguments at most a few KB: a line or event past this is
# a broken or hostile server, and buffering it (until its newline, for as long as the deadlines allow) grew
# every call's memory at link speed (400 MB in 10 s).
MAX_STREAM_LINE_BYTES = 256 * 1024
MIN_WHOLE_WORD_KEY_CHARS = 8  # an API key shorter than this is scrubbed from logs only where it stands alone
KEY_HEAD_CHARS = 12  # a key's first characters (10 to 12), anywhere, are scrubbed with whatever key characters follow
# ... for keys this long: real API keys are 20 and more; a shorter one may be a word ("development1"), whose
# head would scrub ordinary words from every log line.
MIN_HEAD_KEY_CHARS = 16


class StreamTooLarge(ValueError):
    """A line or event of the stream past MAX_STREAM_LINE_BYTES: a malformed stream."""


_LINE_END = re.compile(rb"\r\n|\r|\n")  # SSE's three line ends


async def _lines(chunks: AsyncIterator[bytes], cap: int = MAX_STREAM_LINE_BYTES) -> AsyncIterator[str]:
    """The stream's lines (ended by CRLF, LF or CR), none longer than `cap` bytes (else StreamTooLarge)."""
    buffer = bytearray()
    async for chunk in chunks:
        # What is left holds no line end but maybe a last CR (half a CRLF): scanned from there, not from its
        # start. Rescanning it whole on every chunk made a long line sent in small pieces quadratic on the loop.
        start = max(0, len(buffer) - 1)
        buffer += chunk
        cut = 0
        for end in _LINE_END.finditer(buffer, start):
            if end.group() == b"\r" and end.end() == len(buffer):
                break  # maybe the first half of a CRLF split across two chunks: the next one says
            yield bytes(buffer[cut : end.start()]).decode("utf-8", "replace")
            cut = end.end()
        del buffer[:cut]
        if len(buffer) > cap:
            raise StreamTooLarge(f"a line of the LLM's stream past {cap} bytes")
    if buffer:
        yield bytes(buffer).removesuffix(b"\r").decode("utf-8", "replace")


async def _sse_data(lines: AsyncIterator[str], cap: int = MAX_STREAM_LINE_BYTES) -> AsyncIterator[str]:
    """The data of each server-sent event (data lines joined, as the SSE spec says); an `error` event,
    or data holding an "error" object, raises LlmStreamError; an event's data past `cap`, StreamTooLarge."""
    event, data, size = "", [], 0
    async for line in lines:
        if line:
            field_name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field_name == "data":
                data.append(value)
                size += len(value) + 1
                if size > cap:
                    raise StreamTooLarge(f"an event of the LLM's stream past {cap} bytes")
            elif field_name == "event":
                event = value
            continue
        if data:
            yield _event_data(event, data)
        event, data, size = "", [], 0
    if data:  # a last event without its blank line
        yield _event_data(event, data)


def _event_data(event: str, data: list[str]) -> str:
    joined = "\n".join(data)
    if event == "error":
        raise LlmStreamError(joined)  # whole: cut only once the key is scrubbed (`_fail`), never across it
    return joined


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    """A function call the LLM asked for (OpenAI `tool_calls`), whole: its streamed pieces joined."""

    id: str
    name: str
    arguments: str  # JSON text as the LLM wrote it; not yet parsed (it may be bad)


MAX_TOOL_CALLS = 4  # per answer: more is a confused model, not a plan
MAX_TOOL_ARGUMENTS = 8192  # characters; a tool's arguments are a few fields


@dataclass
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: str = ""


def _delta(chunk: Any) -> dict[str, Any]:
    """The delta of a chat-completion chunk ({} for chunks without one: usage, some finishes)."""
    if not isinstance(chunk, dict):
        raise TypeError(f"a stream chunk is {type(chunk).__name__}, not an object")
    if "error" in chunk:
        raise LlmStreamError(str(chunk["error"]))  # bounded by the line cap; cut after scrubbing (`_fail`)
    choices = chunk.get("choices")
    if not choices:  # e.g. a trailing usage chunk
        return {}
    delta = choices[0].get("delta") or {}  # some servers end with a choice without delta
    if not isinstance(delta, dict):
        raise TypeError(f"delta is {type(delta).__name__}, not an object")
    return delta


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    """A chunk's finish_reason ("stop", "length", ...), else None."""
    choices = chunk.get("choices")
    reason = choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
    return str(reason)[:32] if reason else None


def _delta_content(delta: dict[str, Any]) -> str | None:
    """The text a chunk's delta adds; None for deltas without text (role, tool calls, finish)."""
    piece = delta.get("content")
    if piece is not None and not isinstance(piece, str):
        raise TypeError(f"delta.content is {type(piece).__name__}, not str")
    return piece


def _add_tool_call_pieces(delta: dict[str, Any], calls: dict[int, _ToolCallParts]) -> bool:
    """Join a delta's `tool_calls` pieces into `calls` (by index); True if they added to a call's id, name or
    arguments. Empty pieces (`{"index": 0}`) are no progress: counted as such, a server sending them every half
    second held the request open to max_request_s, as empty chunks once did."""
    pieces = delta.get("tool_calls")
    if not pieces:
        return False
    before = sum(len(c.id) + len(c.name) + len(c.arguments) for c in calls.values())
    if not isinstance(pieces, list):
        raise TypeError("delta.tool_calls is not a list")
    for piece in pieces:
        index = piece.get("index", 0) if isinstance(piece, dict) else None
        if not isinstance(index, int) or not 0 <= index < MAX_TOOL_CALLS:
            raise ValueError(f"tool call index {index!r}")
        parts = calls.setdefault(index, _ToolCallParts())
        function = piece.get("function") or {}
        if not isinstance(function, dict):
            raise TypeError("tool_calls[].function is not an object")
        # The id and name come whole in the call's first piece (OpenAI); some servers send them again with every
        # piece, the id even renewed each time (vLLM's gpt-oss path, mlx-openai-server, LocalAI): joined, the id
        # passed its limit and the whole answer, text and all, failed as malformed. The first id is kept, and a
        # name repeated is not added again (one sent in fragments still joins).
        parts.id = parts.id or str(piece.get("id") or "")
        name = str(function.get("name") or "")
        if name != parts.name:
            parts.name += name
        parts.arguments += str(function.get("arguments") or "")
        if len(parts.arguments) > MAX_TOOL_ARGUMENTS or len(parts.name) > 64 or len(parts.id) > 128:
            raise ValueError("a tool call past its size limits")
    return sum(len(c.id) + len(c.name) + len(c.arguments) for c in calls.values()) > before


def _cut_at_word(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, at the end of a word (one longer than `limit` is cut in it)."""
    head = text[: limit + 1]  # the character after the limit tells whether the last word is whole
    cut = head.rsplit(" ", 1)[0] if " " in head else head[:limit]
    return cut.rstrip()


def _aiohttp_transport(timeout_s: float) -> Any:
    """The openai package's aiohttp transport (C HTTP parser; we depend on aiohttp anyway). 32 calls on
    dev-2c, request out -> server p99 11 against 18 ms with the default httpx one, first chunk in 4
    against 6 ms, and less CPU taken from the engine. None (the default transport) where this openai
    release lacks it."""
    try:
        return openai.DefaultAioHttpClient(timeout=timeout_s)
    except (AttributeError, RuntimeError):  # an openai without it, or without its aiohttp extra
        return None


class LlmClient:
    """Shared, async, streaming chat-completions client."""

    def __init__(self, config: LlmConfig, *, client: openai.AsyncOpenAI | None = None) -> None:
        self.config = config
        if client is None:
            if not config.api_key and not config.base_url:
                log.warning("no LLM configured: no OPENAI_BASE_URL (so OpenAI's API) and no OPENAI_API_KEY, so every "
                            "request will fail and calls run on the front-end alone; set them, or --llm none")
            elif not config.api_key:
                log.warning("no LLM API key set (OPENAI_API_KEY); fine for local servers only")
            client = openai.AsyncOpenAI(
                base_url=config.base_url,
                api_key=config.api_key or "not-set",  # the client refuses an empty key
                timeout=config.timeout_s,
                max_retries=0,  # retries are the back-end's job: a stale retry is worse than none
                http_client=_aiohttp_transport(config.timeout_s),
            )
        self._client = client
        # (model, tool definitions) the server answered with a 4xx about tools (vLLM without a tool parser,
        # llama.cpp without --jinja, a tool schema the server rejects), and when: that model is offered that
        # tool set no more, rather than every request failing. Per model and set: one agent's bad schema, or one
        # model without function calling, once turned every agent's tools off for the life of the process. By
        # the definitions, not their names: a schema fixed in the agents file (and reloaded) is offered again;
        # and for TOOLS_REFUSED_S only: a server restarted with function calling gets the tools back.
        self.tools_refused: dict[tuple[str, str], float] = {}
        # Per model, the parameters it refused (a reasoning model: max_tokens, temperature): renamed or dropped
        # from then on, rather than every request of every call failing (agents may name other models).
        self.params_refused: dict[str, set[str]] = {}

    async def aclose(self) -> None:
        await self._client.close()

    async def stream_draft(
        self, messages: Sequence[dict[str, Any]], *, call_id: str = "-", request_id: str | None = None,
        model: str | None = None, tools: Sequence[dict[str, Any]] = (),
    ) -> AsyncIterator[str | ToolCallRequest]:
        """Yield the cumulative draft text after each streamed chunk that adds text; with `tools` (OpenAI
        function specs) offered, then each function call the answer asked for, once the stream is done.

        `request_id` goes out as `X-Request-Id` (vLLM and most gateways log it), so one draft can be
        followed from our logs into the LLM server's.

        Raises `LlmError` (already counted and logged). Cancellation closes the HTTP stream.
        """
        # Counted before the request is made, so that failed requests are in the denominator of the
        # error ratio (LLM_ERRORS / LLM_REQUESTS) too.
        metrics.LLM_REQUESTS.inc()
        cfg = self.config
        params: dict[str, Any] = {}
        if cfg.max_tokens is not None:
            params["max_tokens"] = cfg.max_tokens
        if cfg.temperature is not None:
            params["temperature"] = cfg.temperature
        model = model or cfg.model  # an agent's own model, else the service's
        refused_here = self.params_refused.setdefault(model, set())
        extra = request_params(params, refused_here)
        tool_set = (model, json.dumps(list(tools), sort_keys=True, default=str))
        refused_at = self.tools_refused.get(tool_set)
        if refused_at is not None and time.monotonic() - refused_at > TOOLS_REFUSED_S:
            del self.tools_refused[tool_set]  # asked with them again: the server may take them now
            refused_at = None
        if tools and refused_at is None:
            extra["tools"] = list(tools)
        calls: dict[int, _ToolCallParts] = {}
        retry = False
        started = time.monotonic()
        streaming = False
        text = ""
        finish: str | None = None  # the stream's finish_reason, for the log of an empty reply
        ended = False  # [DONE], or the reply cut at its cap: the stream's own end, not a body that just stopped
        graced = False  # the finish's grace is given: nothing after it (chatter) moves the deadline on again
        unfinished_pieces = False  # pieces came without a finish_reason: one that comes now ends the answer
        loop = asyncio.get_running_loop()
        cap_at = loop.time() + cfg.max_request_s
        try:
            # The client's timeouts are per read: a server that hangs after its headers, or drips keep-alives
            # or empty chunks, would never time out. The first token has a deadline of its own; after it, each
            # text piece or tool-call delta must follow the last within idle_timeout_s, and the whole request
            # must end within max_request_s. The deadline is lifted around each yield, so it never fires while
            # the consumer holds the draft (it would cancel the consumer's own work).
            try:
                async with asyncio.timeout(min(cfg.timeout_s, cfg.max_request_s)) as deadline:

                    def progressed() -> None:
                        deadline.reschedule(min(loop.time() + cfg.idle_timeout_s, cap_at))

                    # The raw response, not the client's parsed stream: its type-driven request transform and
                    # per-chunk model objects took 60% of the back-end's event loop at 32 calls (py-spy, bench
                    # oracle), which delays every other call's request and first draft. The client still does
                    # the connection, auth, timeouts and the HTTP status errors (classified below).
                    async with self._client.chat.completions.with_streaming_response.create(
                        model=model,
                        # In extra_body the conversation is sent as is; as `messages` it would be transformed.
                        messages=[],
                        extra_body={"messages": list(messages)},
                        stream=True,
                        extra_headers={"X-Request-Id": request_id} if request_id else None,
                        **extra,  # type: ignore[arg-type]
                    ) as response:
                        streaming = True
                        # Closed with the response, not left for the garbage collector to finalize.
                        async with contextlib.aclosing(_sse_data(_lines(response.iter_bytes()))) as events:
                            async for data in events:
                                if data == "[DONE]":
                                    ended = True
                                    break
                                chunk = json.loads(data)
                                delta = _delta(chunk)
                                chunk_finish = _finish_reason(chunk)
                                finish = chunk_finish or finish
                                # The first token, text or a function call's first piece (an answer too), is timed
                                # once (`not text and not calls` before it).
                                first = not text and not calls
                                if tool_pieces := _add_tool_call_pieces(delta, calls):
                                    if first:
                                        metrics.LLM_TTFT_SECONDS.observe(time.monotonic() - started)
                                    progressed()
                                piece = _delta_content(delta)
                                if piece and not text:
                                    piece = piece.lstrip()
                                    if piece and not calls:
                                        metrics.LLM_TTFT_SECONDS.observe(time.monotonic() - started)
                                if piece:
                                    text += piece
                                    too_long = len(text) > cfg.max_draft_chars
                                    if too_long:
                                        text = _cut_at_word(text, cfg.max_draft_chars)
                                        calls.clear()  # a call cut off mid-arguments cannot be run
                                        metrics.LLM_ERRORS.labels(kind="too_long").inc()
                                        log.warning("call %s: LLM reply past %d chars: cut at a word there, stream "
                                                    "closed", call_id, cfg.max_draft_chars)  # fmt: skip
                                    deadline.reschedule(None)
                                    yield well_formed(text)  # a surrogate pair split across two chunks
                                    if too_long:
                                        ended = True
                                        break  # closes the stream; the draft ends here
                                    progressed()
                                moved = bool(piece or tool_pieces)
                                if chunk_finish is not None and not graced and (not moved or unfinished_pieces):
                                    # The answer is whole (only [DONE], or a usage chunk, should follow): a server
                                    # that kept the stream open after it made the draft complete only at the idle
                                    # timeout, counted as a failure, with its tool calls thrown away. Once: empty
                                    # chunks every half second after it held the tool calls to max_request_s. Not
                                    # on a gateway that puts a finish_reason on every chunk (every piece so far
                                    # came with one): its pieces keep the idle timeout, or a pause of a second
                                    # between two cut the answer there, as a whole one (review, session 29).
                                    graced = True
                                    deadline.reschedule(min(loop.time() + FINISH_GRACE_S, cap_at))
                                if moved and chunk_finish is None:
                                    unfinished_pieces = True
                if not ended and finish is None:
                    # The body just stopped (a proxy's clean close, HTTP/1.0): half an answer, and tool calls
                    # whose arguments never came, were taken for whole ones and run.
                    raise StreamCutError("the stream ended before its answer did (no finish_reason, no [DONE])")
            except TimeoutError:
                if finish is None:
                    raise
                # Whole at its finish_reason: the server held the stream open past FINISH_GRACE_S after it.
            if not text and not any(parts.name for parts in calls.values()):
                # Not a success: the policy's failure path retries, rather than the caller getting no answer.
                raise EmptyReplyError(f"no text and no tool call (finish_reason {finish})")
            for index, parts in sorted(calls.items()):
                if parts.name:  # a call without a name cannot be run: dropped, as a server's noise
                    # Well-formed as the text is: a split pair in the arguments (an emoji in a search) would
                    # fail every later request of the call, which carries this exchange.
                    yield ToolCallRequest(well_formed(parts.id) or f"call_{index}", well_formed(parts.name),
                                          well_formed(parts.arguments))
        except (asyncio.CancelledError, GeneratorExit):
            # Superseded by a newer draft (the caller said more), or stopped by a call action or the call's
            # end: no outcome. The error ratio leaves these out, or in an outage while callers talk (each
            # request replaced before its error came) it would read a fraction of what fails.
            metrics.LLM_REQUESTS_CANCELLED.inc()
            raise
        except Exception as exc:
            refused = None if streaming else refused_param(exc)
            if refused is not None and refused in extra:
                # Judged on this request as sent: requests made at once all carried it, and the first refusal
                # back marks it for the model; the others were failed (review, session 29).
                if refused not in refused_here:
                    refused_here.add(refused)
                    instead = _PARAM_FALLBACKS[refused]
                    log.warning("the LLM (%s) does not take %r: %s from now on", model, refused,
                                f"sending {instead!r} instead" if instead else "not sent")  # fmt: skip
                retry = True
            elif "tools" in extra and not streaming and _refuses_tools(exc, messages):
                self.tools_refused[tool_set] = time.monotonic()
                names = ", ".join(sorted(str(t.get("function", {}).get("name")) for t in tools))
                if _blames_a_tool(exc):
                    log.error("the LLM (%s) refused a definition among the tools %s (%s): not offered to that "
                              "model for 10 minutes; fix the agents file (a reload offers the fixed one at once)",
                              model, names, self._scrub(str(exc))[:200])  # fmt: skip
                else:
                    log.warning("the LLM server refused function calling for %s (%s): the tools %s are not offered "
                                "to it for 10 minutes; enable it on the server (vLLM: --enable-auto-tool-choice and "
                                "--tool-call-parser; llama.cpp: --jinja)", model, self._scrub(str(exc))[:200],
                                names)  # fmt: skip
                retry = True
            else:
                self._fail(exc, streaming, text, call_id, started)
        if retry:  # the same request, as the server takes it (counted once more)
            again = self.stream_draft(messages, call_id=call_id, request_id=request_id, model=model, tools=tools)
            async with contextlib.aclosing(again) as drafts:  # its HTTP stream closed at once if superseded
                async for draft in drafts:
                    yield draft

    def _fail(self, exc: Exception, streaming: bool, text: str, call_id: str, started: float) -> NoReturn:
        """Count, log and raise a failed request as an LlmError (`text`: what had streamed before it)."""
        kind = classify_error(exc, streaming=streaming)
        if isinstance(exc, TimeoutError) and not str(exc):  # ours (asyncio.timeout): say which deadline
            cfg = self.config
            if time.monotonic() - started >= cfg.max_request_s - 0.01:
                exc = TimeoutError(f"request not done within {cfg.max_request_s:g}s")
            elif text:
                exc = TimeoutError(f"no progress for {cfg.idle_timeout_s:g}s")
            else:
                exc = TimeoutError(f"no first token within {cfg.timeout_s:g}s")
        message = self._scrub(f"{type(exc).__name__}: {exc}")
        metrics.LLM_ERRORS.labels(kind=kind).inc()
        wait = retry_after(exc)
        log.warning("call %s: LLM request failed (%s) after %d chars: %s%s", call_id, kind, len(text), message,
                    "" if wait is None else f" (Retry-After {wait:g}s)")  # fmt: skip
        raise LlmError(kind, message, wait) from None

    def _scrub(self, message: str) -> str:
        """The API key out of a server's text (some echo the request's headers), then cut to 500: in that
        order, or a cut across the key would leave its first part."""
        key = self.config.api_key
        if len(key) >= MIN_WHOLE_WORD_KEY_CHARS:
            message = message.replace(key, "***")
            if len(key) >= MIN_HEAD_KEY_CHARS:  # and a key the server itself cut short: its head and what follows
                head = key[: min(KEY_HEAD_CHARS, len(key) * 2 // 3)]
                message = re.sub(re.escape(head) + r"[\w.~+/=-]*", "***", message)
        elif key:  # a short key (a local server's "x") only where it stands alone: not inside every word
            message = re.sub(rf"(?<![\w-]){re.escape(key)}(?![\w-])", "***", message)
        return message[:500]

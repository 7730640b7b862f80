"""The tools an agent's LLM may call, offered with every request on the call (OpenAI function calling):

- `transfer_call` (the agent has `transfer_to`) and `end_call`: call actions. The phone edge carries them
  out through Twilio's REST API, so they are offered only when the edge says it can (`CallSetup.actions`).
  The bot first says a short line (it becomes the call's oracle), the edge acts once that has played.
- each of the agent's HTTP tools: its JSON arguments are POSTed to its URL (HTTPS, or HTTP on loopback,
  checked when the agents file loads), with a timeout, no redirects, and a cap on the answer's size. The
  answer, or a failure the LLM can talk about, goes back to the LLM as the tool's result.

Every call of a tool is counted in `kame_tool_calls_total{tool,outcome}`. Nothing here raises into the
call: a bad tool call, a failing or slow tool, are results.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from engine.interface import CallAction

from . import metrics
from .agents import Agent, HttpTool
from .llm import ToolCallRequest

log = logging.getLogger(__name__)

TRANSFER_CALL = "transfer_call"
END_CALL = "end_call"
TRANSFER_LINE = "One moment, I'm connecting you to a person now."
GOODBYE_LINE = "Thank you for calling. Goodbye!"
HTTP_TIMEOUT_S = 5.0  # the caller hears the front-end meanwhile, but an answer late by more is stale
MAX_ANSWER_BYTES = 16_384  # a tool's answer goes into every later prompt of the call
MAX_RESULT_CHARS = 4_000  # what of it the LLM sees
MAX_ARGUMENT_DEPTH = 32  # a tool's arguments are a few fields: deeper is a broken or hostile model

_NO_PARAMETERS = {"type": "object", "properties": {}}
_BUILTIN: dict[str, tuple[CallAction, str, str]] = {
    TRANSFER_CALL: ("transfer", TRANSFER_LINE,
                    "Hand the caller to a person. Use it when the caller asks for a person or a human agent, "
                    "or when you cannot help them."),
    END_CALL: ("end", GOODBYE_LINE,
               "Hang up, after a goodbye. Use it only when the caller has said goodbye or has nothing more to "
               "ask."),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolResult:
    name: str  # the tool's name, or "unknown"
    arguments: str
    outcome: str  # one of metrics.TOOL_OUTCOMES
    content: str  # what the LLM is told (the tool message)
    action: CallAction | None = None
    say: str = ""


def _spec(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


class CallTools:
    """One call's tools: its agent's, and the call actions the edge can carry out."""

    def __init__(self, agent: Agent, actions: Sequence[CallAction], http: HttpSession) -> None:
        self._http = http
        self._actions = {name: spec for name, spec in _BUILTIN.items() if spec[0] in actions
                         and (name != TRANSFER_CALL or agent.transfer_to)}  # fmt: skip
        self._http_tools = {tool.name: tool for tool in agent.tools}
        for name in (*self._actions, *self._http_tools):
            metrics.zero_tool_series(name)  # its series exist before its first call

    def specs(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` of a request (empty: none offered)."""
        specs = [_spec(name, description, _NO_PARAMETERS) for name, (_, _, description) in self._actions.items()]
        return specs + [_spec(t.name, t.description, t.parameters) for t in self._http_tools.values()]

    async def run(self, call: ToolCallRequest, *, call_id: str) -> ToolResult:
        """Run one tool call; counted and logged (the tool's name, never its URL or its arguments). Never
        raises (but CancelledError): a tool's failure is a result the LLM is told, not the end of the call's
        tools."""
        try:
            result = await self._run(call)
        except Exception:
            log.exception("call %s: tool %s failed unexpectedly", call_id, self.name_for(call.name))
            result = ToolResult(self.name_for(call.name), call.arguments, "error", "error: the tool failed")
        metrics.TOOL_CALLS.labels(tool=result.name, outcome=result.outcome).inc()
        level = logging.INFO if result.outcome in ("ok", "requested") else logging.WARNING
        log.log(level, "call %s: tool %s: %s", call_id, result.name, result.outcome)
        return result

    def name_for(self, called: str) -> str:
        """The name a call runs under: its own if this call has such a tool, else "unknown"."""
        return called if called in self._actions or called in self._http_tools else "unknown"

    async def _run(self, call: ToolCallRequest) -> ToolResult:
        name = self.name_for(call.name)
        if name == "unknown":
            return ToolResult(name, call.arguments, "unknown_tool", f"error: there is no tool named {call.name!r}")
        arguments = parse_arguments(call.arguments)
        if arguments is None:
            return ToolResult(name, call.arguments, "bad_arguments",
                              f"error: the arguments were not a JSON object (nested at most {MAX_ARGUMENT_DEPTH} deep)")
        if name in self._actions:
            action, line, _ = self._actions[name]
            # "requested", not "done": the edge carries it out once the line has played, and it can still fail.
            return ToolResult(name, call.arguments, "requested", f"requested: {line}", action=action, say=line)
        outcome, content = await self._http.post(self._http_tools[name], arguments)
        return ToolResult(name, call.arguments, outcome, content)


def parse_arguments(text: str) -> dict[str, Any] | None:
    """A tool call's arguments as a JSON object, or None: not JSON, not an object, or nested deeper than
    MAX_ARGUMENT_DEPTH. json.loads takes ~980 nested brackets (8 KB of them fit the size cap), but encoding
    them again (the request's body, the history's sorted key) overflowed the stack deeper in: a RecursionError
    that ended the call's tools task and left its tools "pending" for the rest of the call."""
    try:
        parsed = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    level, depth = [parsed], 1
    while level:  # breadth first, without recursion of our own
        if depth > MAX_ARGUMENT_DEPTH:
            return None
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item)
                 if isinstance(v, dict | list)]
        depth += 1
    return parsed


async def _read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to `limit` bytes. `read(n)` returns what is buffered, not n bytes: an answer arriving in
    several TCP segments or TLS records (most, past a few KB) was cut at the first and taken as whole."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


class HttpSession:
    """The HTTP client every call's tools share (one connection pool), opened on first use."""

    def __init__(self, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def post(self, tool: HttpTool, arguments: dict[str, Any]) -> tuple[str, str]:
        """(outcome, what the LLM is told)."""
        if self._session is None or self._session.closed:
            # No cookie jar: the session is every call's, and a cookie one caller's tool answer set (a login
            # session) was sent with the next caller's request to that host.
            self._session = aiohttp.ClientSession(headers={"User-Agent": "kame-phone"},
                                                  cookie_jar=aiohttp.DummyCookieJar())
        try:
            async with asyncio.timeout(self.timeout_s), self._session.post(
                tool.url, json=arguments, allow_redirects=False  # a redirect could lead off HTTPS, or inside
            ) as response:  # fmt: skip
                body = await _read_at_most(response.content, MAX_ANSWER_BYTES + 1)
                if len(body) > MAX_ANSWER_BYTES:
                    return "too_large", "error: the tool's answer was too large to use"
                if response.status >= 300:
                    return "error", f"error: the tool failed (HTTP {response.status})"
                return "ok", body.decode("utf-8", "replace")[:MAX_RESULT_CHARS]
        except TimeoutError:
            return "timeout", f"error: the tool did not answer within {self.timeout_s:g} seconds"
        except (aiohttp.ClientError, OSError, ValueError):
            return "error", "error: the tool could not be reached"

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

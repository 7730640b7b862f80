"""A real OpenAI-compatible streaming server for tests (aiohttp, SSE): the stand-in for a paid LLM API.

It can be slow, fail, rate-limit, break its stream or send malformed data, and records every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .loopback_http import serve_on_loopback


# --- a real OpenAI-compatible streaming server ------------------------------------------------------
def answer_for(messages: list[dict[str, Any]]) -> str:
    """The server's reply depends on what it was asked: the last user text comes back in it, or the result of
    the tool it called last."""
    if messages[-1]["role"] == "tool":
        return f"The tool says {messages[-1]['content']}."
    last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return f"Sure, about {last_user}, let me help you with that right away."


REASONING_MODEL_REFUSALS = {  # OpenAI's words
    "max_tokens": {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                              "'max_completion_tokens' instead.", "type": "invalid_request_error",
                   "param": "max_tokens", "code": "unsupported_parameter"},
    "temperature": {"message": "Unsupported value: 'temperature' does not support 0.3 with this model. Only the "
                               "default (1) value is supported.", "type": "invalid_request_error",
                    "param": "temperature", "code": "unsupported_value"},
}  # fmt: skip


def _bad_tool_name_in(messages: list[dict[str, Any]]) -> bool:
    names = [call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()]
    return any(re.fullmatch(r"[a-zA-Z0-9_-]+", name) is None for name in names)


@dataclass
class FakeLlm:
    # ok | status | malformed | broken | error_event | split_pair | hang | drip | no_tools | endless | empty
    # | long_line (one data line that never ends, a megabyte a second, for a minute)
    mode: str = "ok"
    status: int = 500
    delay_s: float = 0.0  # before the response starts
    chunk_delay_s: float = 0.0  # between streamed chunks
    requests: list[dict] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)  # each request's X-Request-Id
    failures_left: int | None = None  # fail this many requests as `mode` says, then answer normally
    disconnects: int = 0  # streams the client walked away from
    # A word in the caller's last message -> the tool (name, arguments) the server calls, when it is offered:
    # streamed in pieces as OpenAI does, after `tool_preamble` as text (if set).
    tool_triggers: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    tool_preamble: str = ""
    invent_tools: bool = False  # call the trigger's tool even when it was not offered (models make names up)
    loop_tools: bool = False  # call the first trigger's tool on every request, whatever came last (a broken model)
    raw_arguments: str | None = None  # stream these as the tool call's arguments (cut off at max_tokens, say)
    # Send the call's id (a new one each time) and name again with every piece (vLLM's gpt-oss path, LocalAI).
    repeat_call_ids: bool = False
    tool_copies: int = 1  # the same call this many times in one answer (parallel duplicates some models emit)
    also_call: tuple[str, dict[str, Any]] | None = None  # another call after those, in the same answer
    # Refuse a request carrying tool messages as a strict chat template does (Mistral's: its call ids): a 400
    # naming tools, `param` null (vLLM).
    refuse_tool_history: bool = False
    # Parameters refused as OpenAI's reasoning models refuse them (o-series, gpt-5): one per 400, in this order.
    refuse_params: tuple[str, ...] = ()
    base_url: str = ""
    # Stall mid-answer: before streamed chunk number `stall_at_chunk` (0-based), wait `stall_s` (a server that
    # stops for a while after its first words).
    # Answer a request offering a tool of this name as OpenAI answers a bad schema (a 400 naming the tool).
    refuse_tool: str | None = None
    stall_at_chunk: int | None = None
    stall_s: float = 0.0
    # Before streamed chunk number `drip_at_chunk`: keep-alives and text-less chunks only, for a minute (a server
    # that stops answering mid-stream but keeps the connection busy).
    drip_at_chunk: int | None = None
    retry_after: str | None = None  # the Retry-After header of a "status" answer
    # After the answer's last chunk (with its finish_reason), no [DONE] and no end: the stream held open for a
    # minute (a gateway that keeps the connection).
    hold_after_finish: bool = False
    chatter_after_finish: bool = False  # while held: a chunk with no choices every half second
    chatter_delta: dict[str, Any] | None = None  # ... or, if set, a chunk with this (empty) delta
    finish_every_chunk: bool = False  # finish_reason "stop" on every chunk (some gateways in front of Gemini)
    # The body ends cleanly after the answer's pieces, with no finish_reason and no [DONE] (a proxy's clean close,
    # HTTP/1.0): a cut stream, not a whole answer.
    end_without_done: bool = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        mode = self.mode
        if self.failures_left is not None:
            mode = mode if self.failures_left > 0 else "ok"
            self.failures_left -= 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if mode == "status":
            # Echo the credentials back, as some proxies do: the client must not log them.
            auth = request.headers.get("Authorization", "")
            headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
            return web.json_response({"error": {"message": f"boom (auth {auth})"}}, status=self.status,
                                     headers=headers)  # fmt: skip
        if mode == "bad_history" or _bad_tool_name_in(body["messages"]):
            # OpenAI on a tool name outside [a-zA-Z0-9_-] in the history: ours, not its
            error = {"message": "Invalid 'messages[3].tool_calls[0].function.name': string does not match "
                                "pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]+$'.",
                     "type": "invalid_request_error", "param": "messages[3].tool_calls[0].function.name",
                     "code": "invalid_value"}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        if self.refuse_tool_history and any(m.get("role") == "tool" for m in body["messages"]):
            error = {"message": "Tool call IDs should be alphanumeric strings with length 9", "type": "BadRequestError",
                     "param": None, "code": 400}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        for name in self.refuse_params:
            if name in body and not (name == "temperature" and body[name] == 1):
                return web.json_response({"error": REASONING_MODEL_REFUSALS[name]}, status=400)
        offered = [t["function"]["name"] for t in body.get("tools", ())]
        if self.refuse_tool in offered:
            error = {"message": f"Invalid schema for function '{self.refuse_tool}': 'strin' is not valid under any "
                                "of the given schemas.", "type": "invalid_request_error",
                     "param": f"tools[{offered.index(self.refuse_tool)}].function.parameters",
                     "code": "invalid_function_parameters"}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        if mode == "no_tools" and "tools" in body:  # llama.cpp without --jinja
            error = {"code": 400, "type": "invalid_request_error", "message": "tools param requires --jinja flag"}
            return web.json_response({"error": error}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode in ("hang", "drip"):
            await self._stall(resp, body["model"], drip=mode == "drip")
            return resp
        if mode == "endless":
            await self._endless(resp, body["model"])
            return resp
        if mode == "long_line":
            try:
                await resp.write(b'data: {"choices": [{"delta": {"content": "')
                for _ in range(600):
                    await resp.write(b"a" * 100_000)
                    await asyncio.sleep(0.1)
            except ConnectionError:
                self.disconnects += 1
            return resp
        if mode == "empty":  # a reasoning model that spent max_completion_tokens thinking: no text at all
            for delta, finish in (({"role": "assistant", "content": ""}, None), ({}, "length")):
                chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        call = self._tool_call_for(body)
        if call is not None and mode in ("ok", "split_pair"):
            await self._stream_tool_call(resp, body["model"], *call)
            return resp
        words = answer_for(body["messages"]).split(" ")
        chunk_delay_s = self.chunk_delay_s  # as it was when this request came in
        try:
            for i, word in enumerate(words):
                if i == 3 and mode == "malformed":
                    await resp.write(b'data: {"choices": [{"delta": {"content": "tru\n\n')
                if i == 3 and mode == "broken":
                    assert request.transport is not None
                    request.transport.close()  # mid-body: no terminating chunk
                    return resp
                if i == 3 and mode == "error_event":
                    # Echoing the request's credentials, as some gateways do, with the key across the first 200
                    # characters of the error's text (the client once cut there before scrubbing the key).
                    echo = f"overloaded; request headers: Authorization: {request.headers.get('Authorization', '')}"
                    pad = max(0, 185 - len("{'message': '") - echo.index("Bearer ") - len("Bearer "))
                    error = {"error": {"message": "x" * pad + echo}}
                    await resp.write(f"data: {json.dumps(error)}\n\n".encode())
                if i == 3 and mode == "split_pair":  # an emoji's UTF-16 pair across two chunks, as JSON allows
                    for half in (" \ud83d", "\ude00"):
                        piece = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                 "model": body["model"], "choices": [{"index": 0, "delta": {"content": half}}]}
                        await resp.write(f"data: {json.dumps(piece)}\n\n".encode())
                if i == self.stall_at_chunk:
                    await asyncio.sleep(self.stall_s)
                if i == self.drip_at_chunk:
                    await self._stall(resp, body["model"], drip=True)
                    return resp
                chunk = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "delta": {"content": ("" if i == 0 else " ") + word},
                                 **({"finish_reason": "stop"} if self.finish_every_chunk else {})}],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if chunk_delay_s:
                    await asyncio.sleep(chunk_delay_s)
            if self.hold_after_finish:
                await self._finish_and_hold(resp, body["model"], "stop")
                return resp
            if not self.end_without_done:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            self.disconnects += 1
        return resp

    def _tool_call_for(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        offered = {t["function"]["name"] for t in body.get("tools", ())}
        if self.loop_tools and self.tool_triggers:
            return next(iter(self.tool_triggers.values()))
        last = body["messages"][-1]
        if last["role"] != "user":
            return None  # e.g. a tool's result: answer it in words
        said = last["content"].lower()
        call = next((c for word, c in self.tool_triggers.items()
                     if word in said and (c[0] in offered or self.invent_tools)), None)  # fmt: skip
        # As a model would: a call whose answer is in the history is not made again; one still pending may be.
        answered = {m["tool_call_id"] for m in body["messages"]
                    if m["role"] == "tool" and not str(m["content"]).startswith("pending")}  # fmt: skip
        made = {(c["function"]["name"], c["function"]["arguments"]) for m in body["messages"]
                for c in m.get("tool_calls") or () if c["id"] in answered}  # fmt: skip
        return None if call is not None and (call[0], json.dumps(call[1])) in made else call

    async def _stream_tool_call(self, resp: web.StreamResponse, model: str, name: str, args: dict[str, Any]) -> None:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
            return f"data: {json.dumps(body)}\n\n".encode()

        arguments = json.dumps(args) if self.raw_arguments is None else self.raw_arguments
        pieces = [arguments[i:i + 5] for i in range(0, len(arguments), 5)]  # the arguments arrive in pieces
        if self.mode == "split_pair":  # an emoji in them, its UTF-16 pair across two chunks
            text = json.dumps(args, ensure_ascii=False)
            at = next(i for i, ch in enumerate(text) if ord(ch) > 0xFFFF)
            pieces = [text[:at] + "\ud83d", "\ude00" + text[at + 1:]]
        try:
            if self.tool_preamble:
                await resp.write(chunk({"role": "assistant", "content": self.tool_preamble}))
            for copy in range(self.tool_copies):
                head = {"index": copy, "id": f"call_{copy + 1}", "type": "function",
                        "function": {"name": name, "arguments": ""}}  # fmt: skip
                await resp.write(chunk({"tool_calls": [head]}))
                for n, piece in enumerate(pieces):
                    more: dict[str, Any] = {"index": copy, "function": {"arguments": piece}}
                    if self.repeat_call_ids:
                        more = {"index": copy, "id": f"chatcmpl-tool-{copy}-{n}-" + "x" * 24, "type": "function",
                                "function": {"name": name, "arguments": piece}}  # fmt: skip
                    await resp.write(chunk({"tool_calls": [more]}))
            if self.also_call is not None:
                other = {"index": self.tool_copies, "id": "call_also", "type": "function",
                         "function": {"name": self.also_call[0], "arguments": json.dumps(self.also_call[1])}}
                await resp.write(chunk({"tool_calls": [other]}))
            if self.hold_after_finish:
                await self._finish_and_hold(resp, model, "tool_calls")
                return
            if not self.end_without_done:
                await resp.write(chunk({}, finish="tool_calls") + b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            self.disconnects += 1

    async def _finish_and_hold(self, resp: web.StreamResponse, model: str, finish: str) -> None:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}  # fmt: skip
        try:
            await resp.write(f"data: {json.dumps(body)}\n\n".encode())
            for _ in range(120 if self.chatter_after_finish else 0):
                await asyncio.sleep(0.5)
                choices = [] if self.chatter_delta is None else [{"index": 0, "delta": self.chatter_delta}]
                empty = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                         "choices": choices}  # fmt: skip
                await resp.write(f"data: {json.dumps(empty)}\n\n".encode())
            await asyncio.sleep(60)
        except ConnectionError:
            self.disconnects += 1

    async def _endless(self, resp: web.StreamResponse, model: str) -> None:
        """Words without end (a server ignoring max_tokens), each `chunk_delay_s` apart, for a minute at most."""
        try:
            for i in range(100_000):
                chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                         "choices": [{"index": 0, "delta": {"content": f"{' ' if i else ''}word{i}"}}]}  # fmt: skip
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.chunk_delay_s or 0.001)
                if i * (self.chunk_delay_s or 0.001) > 60:
                    break
        except ConnectionError:
            self.disconnects += 1

    async def _stall(self, resp: web.StreamResponse, model: str, *, drip: bool) -> None:
        """Headers sent, then no token, ever: silence (hang), or a keep-alive comment and a chunk without
        text every 100 ms (drip: every read succeeds, so a per-read timeout never fires)."""
        empty = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}  # fmt: skip
        try:
            for _ in range(600):  # a minute at most
                if drip:
                    await resp.write(b": keep-alive\n\n" + f"data: {json.dumps(empty)}\n\n".encode())
                await asyncio.sleep(0.1)
        except ConnectionError:
            self.disconnects += 1


@contextlib.asynccontextmanager
async def serve_fake_llm() -> AsyncIterator[FakeLlm]:
    """Run a FakeLlm on 127.0.0.1 (a free port); its OpenAI base URL is `server.base_url`."""
    server = FakeLlm()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    async with serve_on_loopback(app) as base_url:
        server.base_url = f"{base_url}/v1"
        yield server

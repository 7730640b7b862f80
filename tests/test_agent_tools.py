"""The agents' tools (issue 12), through the LLM's function calling: transfer_call, end_call and the agent's
own HTTP tools. The real service, the simulated caller speaking flite audio, real pocketsphinx, a local
OpenAI-compatible server that streams tool calls, a local stand-in for Twilio's REST API, and a real HTTP
tool server, all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from engine.interface import CallAction, CallSetup, ToolUse
from engine.link_wire import event_message, parse_event, setup_from_wire
from knowledge.agents import AgentDirectory, Agents, HttpTool
from knowledge.backend import MAX_TOOL_ROUNDS, TOOL_PENDING, BackendConfig, BackendServices, CallBackend
from knowledge.llm import MAX_TOOL_ARGUMENTS, LlmClient, LlmConfig, LlmError, ToolCallRequest
from knowledge.oracle_policy import OraclePolicyConfig
from knowledge.stt import NullSTT, SttResult
from knowledge.tools import GOODBYE_LINE, MAX_ARGUMENT_DEPTH, TRANSFER_LINE, CallTools, HttpSession
from telephony.audiosocket_config import AudioSocketListen
from telephony.audiosocket_session import call_id_for
from telephony.call_store import CallRecord, MemoryCallStore
from telephony.sim_audiosocket import audiosocket_call, caller_slin
from telephony.sim_caller import simulate_call
from telephony.sim_playout import CallReport
from telephony.twilio_rest import TwilioCredentials, TwilioRest

from .llm_server import FakeLlm
from .loopback_http import serve_on_loopback
from .phone_fixtures import flite_wav, metric, new_call_sid, running_phone, write_agents
from .polling import until
from .twilio_rest_server import TwilioRestStandIn, serve_twilio_rest

SALES = "+15550002222"
ACCOUNT = "AC" + "2" * 32


def _agents(tmp_path: Path, tool_url: str) -> AgentDirectory:
    return AgentDirectory.from_file(write_agents(tmp_path, f"""
        [agents.default]
        instructions = "You answer the phone for Acme Dental."

        [agents.sales]
        numbers = ["{SALES}"]
        instructions = "You sell Acme widgets."
        transfer_to = "+15550009999"

        [[agents.sales.tools]]
        name = "order_status"
        description = "Look up an order by its number"
        url = "{tool_url}"
        parameters = {{ type = "object", properties = {{ order_id = {{ type = "string" }} }} }}
    """))


class ToolServer:
    """The agent's CRM: answers, fails, stalls or floods, as the test says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.received: list[dict] = []
        self.base_url = ""
        self.delay_s = 0.0  # before any answer

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        await asyncio.sleep(self.delay_s)
        if self.mode == "fail":
            return web.Response(status=500, text="database down")
        if self.mode == "slow":
            await asyncio.sleep(5)
        if self.mode == "huge":
            return web.Response(text="x" * 100_000)
        if self.mode == "redirect":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if self.mode in ("chunked", "chunked_huge"):  # an answer in pieces, as TCP segments and TLS records come
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            pieces = [b'{"slots": ["9am", ', b'"10am"], "note": "' + b"y" * 3000 + b'"}'] if self.mode == "chunked" \
                else [b"z" * 6000] * 4
            for piece in pieces:
                await resp.write(piece)
                await asyncio.sleep(0.05)
            await resp.write_eof()
            return resp
        return web.json_response({"status": "shipped on Monday"})


@pytest.fixture
async def tool_server() -> AsyncIterator[ToolServer]:
    server = ToolServer()
    app = web.Application()
    app.router.add_post("/order-status", server.handle)
    async with serve_on_loopback(app) as base_url:
        server.base_url = base_url
        yield server


async def _backend(llm: FakeLlm, directory: AgentDirectory) -> BackendServices:
    config = BackendConfig(stt="pocketsphinx", llm_base_url=llm.base_url, llm_api_key="sk-test", llm_model="m")
    backend = BackendServices(config, directory)
    await backend.warm_up(1)
    return backend


def _tool_names(request: dict) -> set[str]:
    return {t["function"]["name"] for t in request.get("tools", ())}


async def _call_with_rest(
    tiny_checkpoint: Path, llm: FakeLlm, directory: AgentDirectory, wav: Path, hold_after: float,
    secret: str = "rest-secret",
) -> tuple:
    """One call to the sales number with Twilio REST credentials (against the stand-in; `secret` other than
    "rest-secret": credentials Twilio refuses)."""
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, "rest-secret") as twilio:
        rest = TwilioRest(TwilioCredentials(ACCOUNT, ACCOUNT, secret, twilio.base_url))
        sid = new_call_sid()
        try:
            backend = await _backend(llm, directory)
            async with running_phone(tiny_checkpoint, backend=backend, agents=directory, twilio_rest=rest) as phone:
                report = await simulate_call(phone.ws_url, wav, auth_token=phone.token, public_url=phone.base,
                                             custom_sid=sid, to_number=SALES, hold_after=hold_after)  # fmt: skip
                await phone.settled()
                record = await phone.store.get(sid)
        finally:
            await rest.aclose()
    return sid, report, record, twilio


async def _sales_call(
    tiny_checkpoint: Path, llm: FakeLlm, directory: AgentDirectory, wav: Path, hold_after: float = 4.0
) -> tuple[CallReport, CallRecord | None]:
    """One call to the sales number, without Twilio REST credentials: its report and its record."""
    sid = new_call_sid()
    backend = await _backend(llm, directory)
    async with running_phone(tiny_checkpoint, backend=backend, agents=directory) as phone:
        report = await simulate_call(phone.ws_url, wav, auth_token=phone.token, public_url=phone.base,
                                     custom_sid=sid, to_number=SALES, hold_after=hold_after)  # fmt: skip
        await phone.settled()
        record = await phone.store.get(sid)
    return report, record


def _acted_after_line(
    sid: str, report: CallReport, record: CallRecord | None, twilio: TwilioRestStandIn, line: str, tool: str,
    end_reason: str,
) -> dict[str, str]:
    """What every call action shows: the call went on until the action, one REST update for it came after the
    bot's line was the oracle and a mark sent after the line had come back; the tool call is recorded with
    its result, and the call's outcome is the action's. Returns the update's form."""
    assert report.outcome == "completed", report.errors
    ((updated, form),) = twilio.updates
    assert updated == sid
    assert record is not None
    said = next(o for o in record.oracle if o.text == line)
    assert said.at < twilio.updated_at[0]
    assert any(name.startswith("line") for name in report.marks_echoed)
    assert [(t.name, t.outcome) for t in record.tools] == [(tool, "ok")]
    assert record.end_reason == end_reason
    return form


async def test_a_caller_who_asks_for_a_person_is_transferred_after_the_bots_line(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"person": ("transfer_call", {})}
    wav = flite_wav("I would like to talk to a person please.", tmp_path / "person.wav")
    requested = metric("kame_tool_calls_total", tool="transfer_call", outcome="requested")
    done = metric("kame_call_actions_total", action="transfer", trigger="tool", result="ok")
    sid, report, record, twilio = await _call_with_rest(tiny_checkpoint, llm_server, directory, wav, hold_after=9.0)
    form = _acted_after_line(sid, report, record, twilio, TRANSFER_LINE, "transfer_call", "transferred")
    assert "<Dial><Number>+15550009999</Number></Dial>" in form["Twiml"]
    # The LLM was offered both call actions and the agent's own tool.
    assert _tool_names(llm_server.requests[0]) == {"transfer_call", "end_call", "order_status"}
    assert metric("kame_tool_calls_total", tool="transfer_call", outcome="requested") == requested + 1
    assert metric("kame_call_actions_total", action="transfer", trigger="tool", result="ok") == done + 1


async def test_a_transfer_twilio_refuses_is_told_to_the_llm_which_speaks_again(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """The caller heard "connecting you" and Twilio refused the transfer: the LLM was told "done", and went
    quiet for the action's 15 s window believing the call handed on. The edge tells the back-end now: the
    tool's result in the history says it failed, and a request comes at once, whose answer the caller hears."""
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"person": ("transfer_call", {})}
    wav = flite_wav("I would like to talk to a person please.", tmp_path / "person.wav")
    sid, report, record, twilio = await _call_with_rest(tiny_checkpoint, llm_server, directory, wav, hold_after=7.0,
                                                        secret="wrong")  # fmt: skip
    assert report.outcome == "completed", report.errors
    assert twilio.refused == 1 and not twilio.updates
    assert record is not None and record.end_reason == "completed"
    assert [(t.name, t.outcome) for t in record.tools] == [("transfer_call", "error")]
    told = [r for r in llm_server.requests
            if any(m["role"] == "tool" and m["content"].startswith("failed: the transfer") for m in r["messages"])]
    assert told, [m for r in llm_server.requests for m in r["messages"] if m["role"] == "tool"]
    # Its answer became the newest oracle after the line: the caller heard more than "connecting you".
    line_at = next(o.at for o in record.oracle if o.text == TRANSFER_LINE)
    assert any(o.at > line_at and o.text != TRANSFER_LINE for o in record.oracle), record.oracle


async def test_end_call_completes_the_call_after_the_goodbye_has_played(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"goodbye": ("end_call", {})}
    wav = flite_wav("Okay goodbye.", tmp_path / "bye.wav")
    sid, report, record, twilio = await _call_with_rest(tiny_checkpoint, llm_server, directory, wav, hold_after=9.0)
    form = _acted_after_line(sid, report, record, twilio, GOODBYE_LINE, "end_call", "ended_by_agent")
    assert form == {"Status": "completed"}


async def test_end_call_hangs_up_an_audiosocket_call_after_the_goodbye_and_transfer_is_not_offered(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """Asterisk's AudioSocket: no REST API, the socket is the call. `end_call` is offered (not
    `transfer_call`: the channel cannot be handed back), and the bot says its goodbye before the service
    hangs up (the goodbye is the oracle before the hang-up, whose audio the caller received)."""
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"goodbye": ("end_call", {})}
    wav = flite_wav("Okay goodbye.", tmp_path / "bye.wav")
    backend = await _backend(llm_server, directory)
    listeners = (AudioSocketListen("127.0.0.1", 0, "sales"),)
    async with running_phone(tiny_checkpoint, backend=backend, agents=directory, audiosocket=listeners) as phone:
        # The caller would hang up 6 s after speaking: the hang-up comes first, soon after the goodbye has played
        # (waiting for the pacer's queue to run dry, the service hung up only at its 10 s deadline, if ever).
        report = await audiosocket_call("127.0.0.1", phone.handle.audiosocket.ports[0], caller_slin(wav),
                                        hold_s=6.0)  # fmt: skip
        await phone.settled()
        record = await phone.store.get(call_id_for(report.call_uuid))
    assert report.hung_up_by_service
    assert record is not None and record.end_reason == "ended_by_agent"
    assert [(t.name, t.outcome) for t in record.tools] == [("end_call", "ok")]
    assert _tool_names(llm_server.requests[0]) == {"end_call", "order_status"}
    said = next(o for o in record.oracle if o.text == GOODBYE_LINE)
    assert record.ended_at is not None and said.at < record.ended_at
    assert record.tools[0].at - said.at > 0.3  # the goodbye was spoken and played before the hang-up


@pytest.mark.parametrize("tool_mode", ["ok", "fail"])
async def test_an_http_tools_result_reaches_the_llms_next_request_and_a_failing_tool_is_survived(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path, tool_mode: str
) -> None:
    """Without REST credentials the call actions are not offered; the agent's own tool is. Its answer (or its
    failure, in words the LLM can use) is the tool message of the next request, whose draft becomes the
    oracle. The call record keeps the tool call; a failing tool is counted and the call goes on."""
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    llm_server.tool_preamble = "Let me check."
    tool_server.mode = tool_mode
    outcome = "ok" if tool_mode == "ok" else "error"
    counted = metric("kame_tool_calls_total", tool="order_status", outcome=outcome)
    wav = flite_wav("Where is my order?", tmp_path / "order.wav")
    report, record = await _sales_call(tiny_checkpoint, llm_server, directory, wav)
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.5 * report.call_seconds  # the call went on, with the bot's audio
    assert _tool_names(llm_server.requests[0]) == {"order_status"}  # no REST credentials: no call actions
    assert tool_server.received == [{"order_id": "4217"}]
    answered = [r for r in llm_server.requests if r["messages"][-1]["role"] == "tool"]
    assert answered, "the tool's result never reached the LLM"
    asked, result = answered[0]["messages"][-2:]
    assert asked["role"] == "assistant" and asked["tool_calls"][0]["function"]["name"] == "order_status"
    assert result["tool_call_id"] == asked["tool_calls"][0]["id"]
    expected = '{"status": "shipped on Monday"}' if tool_mode == "ok" else "error: the tool failed (HTTP 500)"
    assert result["content"] == expected
    assert record is not None
    assert [(t.name, t.arguments, t.outcome) for t in record.tools] == [("order_status", '{"order_id": "4217"}',
                                                                        outcome)]  # fmt: skip
    # The draft answering the result is the newest oracle candidate.
    assert any(o.text == f"The tool says {expected}." for o in record.oracle)
    assert metric("kame_tool_calls_total", tool="order_status", outcome=outcome) == counted + 1


async def test_a_tool_name_the_model_made_up_is_answered_and_the_call_goes_on(
    tiny_checkpoint: Path, llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """Models call tools they were never offered (multi_tool_use.parallel). It is run as "unknown": an error
    the LLM can talk about. The history must say "unknown" too: with the model's own name in it, the API
    refuses every later request of the call (the stand-in checks names as OpenAI does)."""
    directory = _agents(tmp_path, tool_server.base_url + "/order-status")
    llm_server.tool_triggers = {"order": ("multi_tool_use.parallel", {"tool_uses": []})}
    llm_server.invent_tools = True
    wav = flite_wav("Where is my order?", tmp_path / "order.wav")
    report, record = await _sales_call(tiny_checkpoint, llm_server, directory, wav)
    assert report.outcome == "completed", report.errors
    assert tool_server.received == []  # nothing was run under a name nobody offered
    answered = [r for r in llm_server.requests if r["messages"][-1]["role"] == "tool"]
    assert answered, "the tool's result never reached the LLM"
    asked = answered[0]["messages"][-2]
    assert asked["tool_calls"][0]["function"]["name"] == "unknown"
    assert record is not None
    assert [(t.name, t.outcome) for t in record.tools] == [("unknown", "unknown_tool")]
    # The request with the result was accepted: its answer became the newest candidate.
    assert any(o.text.startswith("The tool says error") for o in record.oracle), [o.text for o in record.oracle]


async def test_an_agent_the_backend_lacks_is_answered_as_its_default_and_said(
    tiny_checkpoint: Path, llm_server: FakeLlm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The edge and the back-end read their agents files apart (two processes, a reload between them): the
    edge chose "sales", the back-end has no such agent. The call is answered as the back-end's default, and a
    warning with the call id says why the caller heard another agent."""
    edge = _agents(tmp_path, "https://crm.example.com/order-status")
    (tmp_path / "older").mkdir()
    older = AgentDirectory.from_file(write_agents(tmp_path / "older", """
        [agents.default]
        instructions = "You answer the phone for Acme Dental."
    """))  # fmt: skip
    wav = flite_wav("Hello there.", tmp_path / "hello.wav")
    sid = new_call_sid()
    backend = await _backend(llm_server, older)
    async with running_phone(tiny_checkpoint, backend=backend, agents=edge) as phone:
        report = await simulate_call(phone.ws_url, wav, auth_token=phone.token, public_url=phone.base,
                                     custom_sid=sid, to_number=SALES, hold_after=3.0)  # fmt: skip
        await phone.settled()
        record = await phone.store.get(sid)
    assert report.outcome == "completed", report.errors
    assert record is not None and record.agent == "sales"  # the edge's choice, as recorded
    assert llm_server.requests, "the back-end never asked the LLM"
    system = llm_server.requests[0]["messages"][0]["content"]
    assert "Acme Dental" in system and "widgets" not in system
    said = [r.getMessage() for r in caplog.records if "not in this process's agents file" in r.getMessage()]
    assert len(said) == 1 and sid in said[0] and "'sales'" in said[0], said


@pytest.mark.parametrize(
    ("mode", "outcome", "told"),
    [("slow", "timeout", "error: the tool did not answer within 0.5 seconds"),
     ("huge", "too_large", "error: the tool's answer was too large to use"),
     # 24 KB in 6 KB pieces: the whole of it counted, not its first piece taken as the answer.
     ("chunked_huge", "too_large", "error: the tool's answer was too large to use"),
     ("redirect", "error", "error: the tool failed (HTTP 302)")],
)  # fmt: skip
async def test_a_slow_huge_or_redirecting_tool_becomes_a_result_the_llm_can_talk_about(
    tool_server: ToolServer, tmp_path: Path, mode: str, outcome: str, told: str
) -> None:
    agent = _agents(tmp_path, tool_server.base_url + "/order-status").agents.get("sales")
    http = HttpSession(timeout_s=0.5)
    tools = CallTools(agent, (), http)
    tool_server.mode = mode
    before = metric("kame_tool_calls_total", tool="order_status", outcome=outcome)
    try:
        result = await tools.run(ToolCallRequest("c1", "order_status", '{"order_id": "1"}'), call_id="CA1")
    finally:
        await http.aclose()
    assert (result.outcome, result.content) == (outcome, told)
    assert metric("kame_tool_calls_total", tool="order_status", outcome=outcome) == before + 1


async def test_a_tool_answer_in_pieces_reaches_the_llm_whole(tool_server: ToolServer, tmp_path: Path) -> None:
    """`read(n)` returns what is buffered: an answer in several pieces was cut at the first, as "ok"."""
    agent = _agents(tmp_path, tool_server.base_url + "/order-status").agents.get("sales")
    http = HttpSession()
    tool_server.mode = "chunked"
    try:
        result = await CallTools(agent, (), http).run(ToolCallRequest("c1", "order_status", "{}"), call_id="CA1")
    finally:
        await http.aclose()
    assert result.outcome == "ok"
    assert json.loads(result.content) == {"slots": ["9am", "10am"], "note": "y" * 3000}


async def test_bad_tool_calls_are_results_and_actions_are_offered_only_as_the_edge_can(tmp_path: Path) -> None:
    agent = _agents(tmp_path, "https://crm.example.com/order-status").agents.get("sales")
    http = HttpSession()
    names = {s["function"]["name"] for s in CallTools(agent, ("end",), http).specs()}
    assert names == {"end_call", "order_status"}  # the edge could not transfer
    no_transfer_to = Agents.builtin().get(None)
    assert {s["function"]["name"] for s in CallTools(no_transfer_to, ("transfer", "end"), http).specs()} == {"end_call"}
    tools = CallTools(agent, ("transfer", "end"), http)
    unknown = await tools.run(ToolCallRequest("c1", "rm_rf", "{}"), call_id="CA1")
    assert (unknown.name, unknown.outcome) == ("unknown", "unknown_tool")  # the label never takes the LLM's name
    bad = await tools.run(ToolCallRequest("c2", "order_status", '["not", "an object"]'), call_id="CA1")
    assert bad.outcome == "bad_arguments"
    deep = await tools.run(ToolCallRequest("c4", "order_status", "[" * 5000), call_id="CA1")
    assert deep.outcome == "bad_arguments"  # RecursionError in the parser: a result, not a dead task
    transfer = await tools.run(ToolCallRequest("c3", "transfer_call", ""), call_id="CA1")
    assert (transfer.outcome, transfer.action, transfer.say) == ("requested", "transfer", TRANSFER_LINE)
    await http.aclose()


def _offer(*names: str) -> list[dict]:
    """The tools of a request: functions taking any object of arguments."""
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in names]


@contextlib.asynccontextmanager
async def _llm(llm_server: FakeLlm) -> AsyncIterator[LlmClient]:
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key="k"))
    try:
        yield llm
    finally:
        await llm.aclose()


async def _drafts(llm: LlmClient, said: str, tools: list[dict]) -> list[str | ToolCallRequest]:
    """What one request streams back for the caller's `said`."""
    return [d async for d in llm.stream_draft([{"role": "user", "content": said}], tools=tools)]


async def test_the_llm_client_joins_a_streamed_tool_call(llm_server: FakeLlm) -> None:
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217", "note": "a" * 40})}
    llm_server.tool_preamble = "Let me check."
    tools = _offer("order_status")
    async with _llm(llm_server) as llm:
        out = await _drafts(llm, "my order", tools)
    assert out[0] == "Let me check."
    (call,) = [d for d in out if isinstance(d, ToolCallRequest)]
    assert call.name == "order_status" and json.loads(call.arguments) == {"order_id": "4217", "note": "a" * 40}
    assert llm_server.requests[0]["tools"] == tools


@pytest.mark.parametrize("preamble", ["", "Let me check."])
async def test_an_answer_that_is_a_tool_call_has_its_first_token_timed_once(llm_server: FakeLlm, preamble: str) -> None:
    """kame_llm_ttft_seconds saw only text: an LLM answering with a function call alone was never timed (the
    dashboard's TTFT showed only the answers in words)."""
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "1"})}
    llm_server.tool_preamble = preamble
    timed = metric("kame_llm_ttft_seconds_count")
    async with _llm(llm_server) as llm:
        out = await _drafts(llm, "my order", _offer("order_status"))
    assert any(isinstance(d, ToolCallRequest) for d in out)
    assert metric("kame_llm_ttft_seconds_count") == timed + 1


async def test_a_split_surrogate_pair_in_tool_arguments_becomes_its_character(llm_server: FakeLlm) -> None:
    """As for the answer's text: joined as they came, the two halves were lone surrogates, and the exchange
    they went into made every later request of the call fail."""
    llm_server.mode = "split_pair"
    llm_server.tool_triggers = {"order": ("order_status", {"q": "pizza \U0001f600 please"})}
    async with _llm(llm_server) as llm:
        out = await _drafts(llm, "my order", _offer("order_status"))
    (call,) = [d for d in out if isinstance(d, ToolCallRequest)]
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"q": "pizza \U0001f600 please"}


async def test_a_server_repeating_the_call_id_and_name_in_every_piece_still_gives_one_call(llm_server: FakeLlm) -> None:
    """vLLM's gpt-oss path (and LocalAI, older mlx-openai-server) send the id, renewed, and the name again with
    every piece of a call: joined, the id passed its limit and the whole answer failed as malformed, its text
    too (review, session 22). The first id is kept, the name once."""
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217", "note": "a" * 40})}
    llm_server.repeat_call_ids = True
    async with _llm(llm_server) as llm:
        out = await _drafts(llm, "my order", _offer("order_status"))
    (call,) = [d for d in out if isinstance(d, ToolCallRequest)]
    assert (call.id, call.name) == ("call_1", "order_status")
    assert json.loads(call.arguments) == {"order_id": "4217", "note": "a" * 40}


async def test_a_refusal_of_a_calls_tool_history_leaves_tools_on_for_every_call(llm_server: FakeLlm) -> None:
    """A 400 that mentions tools with `param` null (vLLM) on a request carrying tool exchanges may be that call's
    history (a strict chat template refusing its call ids), not the server refusing function calling: taken for
    that, it turned tools off for every call of the process (review, session 22). A call's first request, with
    no exchange in it, still teaches the client a server without function calling (the test above)."""
    llm_server.refuse_tool_history = True
    history = [{"role": "user", "content": "my order"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0", "type": "function", "function": {"name": "order_status", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_0", "content": "shipped"}]  # fmt: skip
    async with _llm(llm_server) as llm:
        with pytest.raises(LlmError):
            _ = [d async for d in llm.stream_draft(history, tools=_offer("order_status"))]
        assert not llm.tools_refused
        assert await _drafts(llm, "hi", _offer("order_status"))  # a new call's request: tools still offered
    assert "tools" in llm_server.requests[-1]


async def test_a_request_refused_for_its_history_leaves_tools_on(llm_server: FakeLlm) -> None:
    """A 400 that blames a message of the history (a tool name the model made up, as OpenAI words it) is that
    call's request failing. Taken for the server refusing function calling, it turned tools off for every
    call of the process until a restart."""
    llm_server.mode = "bad_history"
    async with _llm(llm_server) as llm:
        with pytest.raises(LlmError):
            await _drafts(llm, "hi", _offer("end_call"))
    assert not llm.tools_refused and len(llm_server.requests) == 1  # not retried without tools either


async def test_a_model_refusing_max_tokens_and_temperature_is_asked_as_it_takes_them(llm_server: FakeLlm) -> None:
    """OpenAI's reasoning models (o-series, gpt-5) refuse `max_tokens` (they take max_completion_tokens) and any
    temperature but 1, with a 400 for each: every request of every call failed, the calls front-end only. The
    client renames or drops what the model refused, once, for that model only, and the draft still comes."""
    llm_server.refuse_params = ("max_tokens", "temperature")
    llm = LlmClient(LlmConfig(model="o4-mini", base_url=llm_server.base_url, api_key="k", temperature=0.3))
    errors = metric("kame_llm_errors_total", kind="other")
    try:
        first = await _drafts(llm, "hi", _offer("end_call"))
        second = await _drafts(llm, "again", _offer("end_call"))
        llm_server.refuse_params = ()
        other = [d async for d in llm.stream_draft([{"role": "user", "content": "x"}], model="gpt-4.1")]
    finally:
        await llm.aclose()
    assert first[-1] == "Sure, about hi, let me help you with that right away." and second and other
    sent = [{k for k in ("max_tokens", "max_completion_tokens", "temperature", "tools") if k in r}
            for r in llm_server.requests]  # fmt: skip
    assert sent == [{"max_tokens", "temperature", "tools"}, {"max_completion_tokens", "temperature", "tools"},
                    {"max_completion_tokens", "tools"}, {"max_completion_tokens", "tools"},
                    {"max_tokens", "temperature"}]  # fmt: skip
    # Under its new name, and at least 1024: a reasoning model's hidden reasoning counts against it (96 left an
    # empty answer); the draft stays short through the prompt.
    assert llm_server.requests[2]["max_completion_tokens"] == 1024
    assert not llm.tools_refused
    assert metric("kame_llm_errors_total", kind="other") == errors


async def test_a_server_without_function_calling_gets_no_tools_and_still_answers(llm_server: FakeLlm) -> None:
    """llama.cpp without --jinja, vLLM without a tool parser: a 400 naming tools. The request is made again
    without them, and later ones offer none (one warning, not an error on every request of every call)."""
    llm_server.mode = "no_tools"
    errors = metric("kame_llm_errors_total", kind="other")
    async with _llm(llm_server) as llm:
        first = await _drafts(llm, "hi", _offer("end_call"))
        second = await _drafts(llm, "again", _offer("end_call"))
    assert first[-1] == "Sure, about hi, let me help you with that right away." and second
    assert llm.tools_refused and ["tools" in r for r in llm_server.requests] == [True, False, False]
    assert metric("kame_llm_errors_total", kind="other") == errors


async def test_one_tool_set_refused_leaves_other_agents_and_models_their_tools(llm_server: FakeLlm) -> None:
    """A schema the server rejects (one agent's typo it did not catch) or a model without function calling:
    that model is offered that tool set no more. It once turned every agent's tools off, transfers and hang-ups
    included, for the life of the process."""
    llm_server.refuse_tool = "order_status"
    async with _llm(llm_server) as llm:
        first = await _drafts(llm, "hi", _offer("order_status", "end_call"))
        again = await _drafts(llm, "again", _offer("order_status", "end_call"))
        other_agent = await _drafts(llm, "hi", _offer("end_call"))
        llm_server.refuse_tool = None
        other_model = [d async for d in llm.stream_draft([{"role": "user", "content": "x"}], model="gpt-4o",
                                                         tools=_offer("order_status", "end_call"))]
    assert first and again and other_agent and other_model
    offered = [sorted(t["function"]["name"] for t in r.get("tools", ())) for r in llm_server.requests]
    assert offered == [["end_call", "order_status"], [], [], ["end_call"], ["end_call", "order_status"]]


async def test_a_refused_tool_set_is_offered_again_once_fixed_or_after_a_while(
    llm_server: FakeLlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log says "fix the agents file": a fixed definition (same names, reloaded) is offered at once, and a
    server restarted with function calling gets the same set back after TOOLS_REFUSED_S, not never."""
    from knowledge import llm as llm_module

    llm_server.refuse_tool = "order_status"
    broken = _offer("order_status")
    fixed = [{"type": "function", "function": {"name": "order_status",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    async with _llm(llm_server) as llm:
        await _drafts(llm, "hi", broken)  # refused, asked again without
        await _drafts(llm, "again", broken)  # not offered
        llm_server.refuse_tool = None
        await _drafts(llm, "fixed", fixed)  # the fixed schema: offered
        monkeypatch.setattr(llm_module, "TOOLS_REFUSED_S", 0.0)
        await _drafts(llm, "later", broken)  # the refusal is old: offered again
    assert ["tools" in r for r in llm_server.requests] == [True, False, False, True, True]


async def test_a_tool_call_past_its_size_limits_is_a_malformed_answer_not_a_tool_run(llm_server: FakeLlm) -> None:
    """An LLM (or a server in between) streaming tool-call arguments without end: the client stops at its cap
    and the request is an LLM error of kind malformed (counted), never a call with megabytes of arguments."""
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "9" * (MAX_TOOL_ARGUMENTS + 10)})}
    malformed = metric("kame_llm_errors_total", kind="malformed")
    async with _llm(llm_server) as llm:
        with pytest.raises(LlmError) as failed:
            await _drafts(llm, "my order", _offer("order_status"))
    assert failed.value.kind == "malformed"
    assert metric("kame_llm_errors_total", kind="malformed") == malformed + 1


async def test_one_callers_tool_cookies_never_reach_another_callers_request() -> None:
    """Every call's tools share one HTTP session: with its default cookie jar, the login session a CRM set for
    one caller went with the next caller's request to it (their order, their account)."""
    cookies: list[str | None] = []

    async def crm(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        response = web.json_response({"status": "ok"})
        response.set_cookie("session", f"caller-{len(cookies)}")
        return response

    app = web.Application()
    app.router.add_post("/crm", crm)
    async with serve_on_loopback(app) as base:
        tool = HttpTool("crm", "the CRM", base.replace("127.0.0.1", "localhost") + "/crm", {"type": "object"})
        http = HttpSession()
        try:
            for _ in range(2):  # two calls, one session
                assert (await http.post(tool, {}))[0] == "ok"
        finally:
            await http.aclose()
    assert cookies == [None, None]


async def test_a_stream_line_without_end_is_malformed_not_a_memory_leak(llm_server: FakeLlm) -> None:
    """A broken gateway streaming one line without end: buffered until its newline, it grew every call's memory
    at link speed until a deadline (400 MB in 10 s). Past the cap it is a malformed answer, at once."""
    llm_server.mode = "long_line"
    malformed = metric("kame_llm_errors_total", kind="malformed")
    async with _llm(llm_server) as llm:
        with pytest.raises(LlmError) as failed:
            await _drafts(llm, "hi", [])
    assert failed.value.kind == "malformed" and "past 262144 bytes" in str(failed.value)
    assert metric("kame_llm_errors_total", kind="malformed") == malformed + 1


async def test_an_answer_whose_stream_stays_open_after_its_finish_is_whole_at_once(llm_server: FakeLlm) -> None:
    """A server that sends its finish_reason and then keeps the stream open (no [DONE], no end): the draft was
    complete only at the idle timeout, counted as a failure, and a tool call it asked for was thrown away."""
    llm_server.hold_after_finish = True
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    timeouts = metric("kame_llm_errors_total", kind="timeout")
    async with _llm(llm_server) as llm:
        async with asyncio.timeout(10):  # (a guard: were the end waited for, each would fail at its 5 s idle timeout)
            text = await _drafts(llm, "hi", [])
            call = await _drafts(llm, "my order", _offer("order_status"))
    assert text and text[-1] == "Sure, about hi, let me help you with that right away."
    assert call == [ToolCallRequest("call_1", "order_status", '{"order_id": "4217"}')]
    assert metric("kame_llm_errors_total", kind="timeout") == timeouts


@pytest.mark.parametrize("chatter", [None, {"tool_calls": [{"index": 0}]}], ids=["no-choices", "empty-tool-piece"])
async def test_chunks_with_nothing_in_them_after_the_finish_do_not_hold_the_tool_call(
    llm_server: FakeLlm, chatter: dict | None
) -> None:
    """After its finish_reason, a server sending an empty chunk every half second: each pushed the finish's
    grace on, so the tool call (handed over at the stream's end) waited the whole request's cap, 30 s. An empty
    tool-call piece (`{"index": 0}`, nothing in it) did the same (review, session 28)."""
    llm_server.hold_after_finish = llm_server.chatter_after_finish = True
    llm_server.chatter_delta = chatter
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    async with _llm(llm_server) as llm:
        started = time.monotonic()
        async with asyncio.timeout(10):
            call = await _drafts(llm, "my order", _offer("order_status"))
        took = time.monotonic() - started
    assert call == [ToolCallRequest("call_1", "order_status", '{"order_id": "4217"}')]
    assert took < 5, took  # the 1 s grace from the finish, not max_request_s


async def test_a_gateway_that_puts_a_finish_reason_on_every_chunk_is_read_to_the_end(llm_server: FakeLlm) -> None:
    """Some gateways (in front of Gemini) say finish_reason "stop" on every chunk: the answer is not cut at the
    first one, it ends at [DONE] as usual."""
    llm_server.finish_every_chunk = True
    llm_server.chunk_delay_s = 0.05
    async with _llm(llm_server) as llm:
        text = await _drafts(llm, "hi", [])
    assert text[-1] == "Sure, about hi, let me help you with that right away."


async def test_a_gateway_with_a_finish_reason_on_every_chunk_may_pause_between_its_pieces(
    llm_server: FakeLlm,
) -> None:
    """Each piece that came with its finish_reason gave the stream only the finish's 1 s grace: a pause of 1.5 s
    cut the answer there, and it was taken for whole, a tool call's arguments with it (review, session 29)."""
    llm_server.finish_every_chunk = True
    llm_server.stall_at_chunk, llm_server.stall_s = 2, 1.5
    errors = metric("kame_llm_errors_total", kind="timeout")
    async with _llm(llm_server) as llm:
        text = await _drafts(llm, "hi", [])
    assert text[-1] == "Sure, about hi, let me help you with that right away."
    assert metric("kame_llm_errors_total", kind="timeout") == errors


@pytest.mark.parametrize("asked", ["hi", "my order"], ids=["text", "tool-call"])
async def test_a_stream_that_just_stops_is_a_broken_answer_not_a_whole_one(llm_server: FakeLlm, asked: str) -> None:
    """A body that ends cleanly with no finish_reason and no [DONE]: its half-said text was made complete and its
    tool call, arguments unfinished, was run (review, session 29). It is a broken stream, counted as such."""
    llm_server.end_without_done = True
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    malformed = metric("kame_llm_errors_total", kind="malformed")
    drafts: list[str | ToolCallRequest] = []
    async with _llm(llm_server) as llm:
        with pytest.raises(LlmError) as failed:
            async for draft in llm.stream_draft([{"role": "user", "content": asked}], tools=_offer("order_status")):
                drafts.append(draft)
    assert failed.value.kind == "malformed" and "ended before its answer did" in str(failed.value)
    assert not any(isinstance(d, ToolCallRequest) for d in drafts)
    assert metric("kame_llm_errors_total", kind="malformed") == malformed + 1


async def test_requests_made_at_once_to_a_model_refusing_max_tokens_all_answer(llm_server: FakeLlm) -> None:
    """Four calls asking at once, before the first refusal came back: the first marked the parameter and asked
    again; the three others failed, each an error, a warning and a call silent through its back-off."""
    llm_server.refuse_params = ("max_tokens",)
    llm_server.delay_s = 0.2  # the four are all sent before any refusal is back
    llm = LlmClient(LlmConfig(model="o4-mini", base_url=llm_server.base_url, api_key="k"))
    errors = metric("kame_llm_errors_total", kind="other")
    try:
        answers = await asyncio.gather(*(_drafts(llm, f"hi {i}", []) for i in range(4)))
    finally:
        await llm.aclose()
    assert all(a and a[-1].startswith("Sure, about hi") for a in answers), answers
    assert metric("kame_llm_errors_total", kind="other") == errors
    assert sum("max_completion_tokens" in r for r in llm_server.requests) == 4


async def test_tool_calls_in_the_record_mask_digits_as_dtmf_is() -> None:
    store = MemoryCallStore(store_transcripts=False)
    await store.create(CallRecord("CA" + "3" * 32))
    await store.append_tool("CA" + "3" * 32, "order_status", '{"card": "4111 1111"}', "ok")
    # A name and an email are the caller's words as much as a card number is: masked too, keys kept.
    await store.append_tool("CA" + "3" * 32, "book", '{"name": "Jane Doe", "email": "jd@ex.com", "n": 42, '
                                                     '"vip": true}', "ok")  # fmt: skip
    await store.append_tool("CA" + "3" * 32, "book", '{"name": "Jane', "bad_arguments")  # not JSON
    await store.append_tool("CA" + "3" * 32, "book", "[" * 500 + "]" * 500, "ok")  # past the recursion limit
    record = await store.get("CA" + "3" * 32)
    assert record is not None and record.tools[0].arguments == '{"card": "**** ****"}'
    assert record.tools[1].arguments == '{"name": "**** ***", "email": "**@**.***", "n": "**", "vip": true}'
    assert record.tools[2].arguments == '{"****": "****'
    assert record.tools[3].arguments == "[" * 500 + "]" * 500  # masked as text: nothing to mask, nothing raised


def test_tool_events_and_call_actions_cross_the_engine_link() -> None:
    use = ToolUse("transfer_call", "{}", "requested", "transfer", TRANSFER_LINE)
    assert parse_event(memoryview(event_message("c1", use, 0.0))[5:], 0.0) == ("c1", use)
    assert setup_from_wire({"agent": "sales", "actions": ["transfer", "end"]}) == CallSetup(
        agent="sales", actions=("transfer", "end"))  # fmt: skip
    with pytest.raises(ValueError, match="actions"):
        setup_from_wire({"agent": "sales", "actions": ["format_disk"]})
    delayed = CallSetup(agent="sales", forced_delay_ms=500.0)
    assert setup_from_wire({"agent": "sales", "forced_delay_ms": 500}) == delayed
    with pytest.raises(ValueError, match="forced_delay_ms"):
        setup_from_wire({"agent": "sales", "forced_delay_ms": "1e9"})


FAST_POLICY = OraclePolicyConfig(backoff_initial_s=0.05, backoff_max_s=0.2)


@contextlib.asynccontextmanager
async def _sales_backend(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path, actions: tuple[CallAction, ...] = (),
    edge: Callable[[CallBackend, ToolUse], None] | None = None,
) -> AsyncIterator[tuple[CallBackend, list[ToolUse]]]:
    """One call's back-end with the sales agent's HTTP tool (the ToolServer) and the call `actions` an edge
    offers, the client against FakeLlm; its tool uses are listed, and handed to `edge` (the edge's part)."""
    agent = _agents(tmp_path, tool_server.base_url + "/order-status").agents.get("sales")
    http = HttpSession()
    executor = ThreadPoolExecutor(max_workers=1)
    used: list[ToolUse] = []

    def on_tool(use: ToolUse) -> None:
        used.append(use)
        if edge is not None:
            edge(backend, use)

    async with _llm(llm_server) as llm:
        backend = CallBackend(
            "CA-tools", stt_factory=NullSTT, llm=llm, executor=executor, on_transcript=lambda *_: None,
            on_oracle=lambda *_: None, policy=FAST_POLICY, tools=CallTools(agent, actions, http), on_tool=on_tool,
        )  # fmt: skip
        await backend.start()
        try:
            yield backend, used
        finally:
            await backend.aclose()
            await http.aclose()
            executor.shutdown()


async def test_a_tool_still_running_is_not_run_again_for_the_callers_next_words(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """KAME drafts again as the caller goes on talking: a draft made before the tool answered did not see it
    called and called it again (a booking or a refund made twice). The call is in the history at once, its
    result pending, and a call identical to one under way is not run twice."""
    tool_server.delay_s = 1.0
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    async with _sales_backend(llm_server, tool_server, tmp_path) as (backend, used):
        backend._handle_transcript(SttResult("where is my order", final=False), time.monotonic())
        await until(lambda: tool_server.received, within=10)
        # More words while it runs: a new draft, whose model (as models do) asks for what it sees pending again.
        backend._handle_transcript(SttResult("where is my order four two one", final=False), time.monotonic())
        await until(lambda: len(llm_server.requests) == 2, within=10)
        backend._handle_transcript(SttResult("where is my order four two one seven", final=True), time.monotonic())
        await until(lambda: used and llm_server.requests[-1]["messages"][-1]["role"] == "tool", within=10)
        await asyncio.sleep(0.3)
    assert tool_server.received == [{"order_id": "4217"}]
    assert [(u.name, u.outcome) for u in used] == [("order_status", "ok")]
    # The drafts made while it ran saw the call, its result pending; the one after it, the answer, after the
    # caller's words (the final goes before a call made while they were still talking).
    tool_messages = [[m["content"] for m in r["messages"] if m["role"] == "tool"] for r in llm_server.requests]
    assert tool_messages[0] == [] and tool_messages[1] == [TOOL_PENDING]
    assert "shipped on Monday" in tool_messages[-1][0]
    assert [m["role"] for m in llm_server.requests[-1]["messages"]][-3:] == ["user", "assistant", "tool"]


async def test_a_tool_answering_while_a_transfer_line_is_said_does_not_spend_the_callers_words(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup answers inside a call action's quiet window (the transfer's line being said): asking then counted
    the caller's words meanwhile as asked, with no request made. If the action never happens (an edge that
    ignores it), nothing asked about them after the window: the caller was never answered."""
    import knowledge.backend as backend_module

    monkeypatch.setattr(backend_module, "ACTION_QUIET_S", 1.0)
    tool_server.delay_s = 0.6
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"}), "person": ("transfer_call", {})}
    async with _sales_backend(llm_server, tool_server, tmp_path, ("transfer",)) as (backend, used):
        backend._handle_transcript(SttResult("where is my order", final=True), time.monotonic())
        await until(lambda: tool_server.received, within=10)
        backend._handle_transcript(SttResult("get me a person", final=True), time.monotonic())
        await until(lambda: any(u.name == "transfer_call" for u in used), within=10)
        backend._handle_transcript(SttResult("hello are you still there", final=True), time.monotonic())
        await until(lambda: any(u.name == "order_status" for u in used), within=10)  # inside the window
        asked = lambda: [r["messages"][-1]["content"] for r in llm_server.requests  # noqa: E731
                         if r["messages"][-1]["role"] == "user"]  # fmt: skip
        await until(lambda: any("still there" in m for m in asked()), "the caller's words asked about", within=10)


async def test_the_same_call_twice_in_one_answer_runs_once(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """Some models emit parallel duplicates: the same call, same arguments, twice in one answer. Only calls
    already running were checked, so both ran (an order looked up, or a table booked, twice; review, session
    22)."""
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "4217"})}
    llm_server.tool_copies = 2
    async with _sales_backend(llm_server, tool_server, tmp_path) as (backend, used):
        backend._handle_transcript(SttResult("where is my order 4217", final=True), time.monotonic())
        await until(lambda: any(r["messages"][-1]["role"] == "tool" for r in llm_server.requests), within=10)
        await asyncio.sleep(0.3)
    assert tool_server.received == [{"order_id": "4217"}]
    assert [(u.name, u.outcome) for u in used] == [("order_status", "ok")]


async def test_arguments_that_are_not_json_go_into_the_history_as_an_empty_object(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """A tool call cut off mid-arguments (max_tokens): vLLM parses every history call's arguments and refused
    every later request of the call. The history says {}; the record keeps what the model sent."""
    llm_server.tool_triggers = {"order": ("order_status", {})}
    llm_server.raw_arguments = '{"order_id": "42'
    async with _sales_backend(llm_server, tool_server, tmp_path) as (backend, used):
        backend._handle_transcript(SttResult("where is my order", final=True), time.monotonic())
        await until(lambda: any(r["messages"][-1]["role"] == "tool" for r in llm_server.requests), within=10)
    asked = next(r for r in llm_server.requests if r["messages"][-1]["role"] == "tool")["messages"][-2]
    (call,) = asked["tool_calls"]
    assert call["function"]["arguments"] == "{}"
    assert [(u.name, u.arguments, u.outcome) for u in used] == [("order_status", '{"order_id": "42', "bad_arguments")]
    assert tool_server.received == []


async def test_a_model_that_keeps_calling_tools_stops_at_the_rounds_cap(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """After MAX_TOOL_ROUNDS answers the tools are no longer offered; a model calling them anyway chained
    requests without end while the caller was silent (763 in a second, in the review). Its calls are dropped."""
    llm_server.tool_triggers = {"order": ("order_status", {"order_id": "1"})}
    llm_server.loop_tools = True
    async with _sales_backend(llm_server, tool_server, tmp_path) as (backend, _used):
        backend._handle_transcript(SttResult("where is my order", final=True), time.monotonic())
        await until(lambda: len(llm_server.requests) > MAX_TOOL_ROUNDS, within=10)
        await asyncio.sleep(1.0)
    assert len(tool_server.received) == MAX_TOOL_ROUNDS
    assert len(llm_server.requests) == MAX_TOOL_ROUNDS + 1  # the last offered none, and its call was dropped
    assert "tools" not in llm_server.requests[-1]


async def test_a_model_retrying_a_failed_transfer_stops_at_the_rounds_cap(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """Told the transfer failed, a model that calls transfer_call again each time chained "connecting you" and
    a REST request without end while the caller waited (33 in 2 s in the review). A failed action is a tool
    round: after MAX_TOOL_ROUNDS the tools are no longer offered."""
    llm_server.tool_triggers = {"person": ("transfer_call", {})}
    llm_server.loop_tools = True

    def refused(backend: CallBackend, _use: ToolUse) -> None:  # the line plays, Twilio refuses, the back-end is told
        asyncio.get_running_loop().call_later(0.05, backend.action_failed, "transfer", "error")

    async with _sales_backend(llm_server, tool_server, tmp_path, ("transfer",), refused) as (backend, acted):
        backend._handle_transcript(SttResult("a person please", final=True), time.monotonic())
        await asyncio.sleep(2.0)  # the caller says nothing more
    assert 1 <= len(acted) <= MAX_TOOL_ROUNDS + 1, len(acted)
    assert "tools" not in llm_server.requests[-1]  # the last request offered none


async def test_arguments_nested_past_the_cap_are_bad_arguments_and_the_calls_tools_go_on(
    llm_server: FakeLlm, tool_server: ToolServer, tmp_path: Path
) -> None:
    """~980 nested objects parse (8 KB of brackets fit the size cap) but encoding them again overflowed the
    stack: the call's tools task died, its tool calls stayed "pending" in the history for good, nothing was
    recorded and no follow-up was asked. Past MAX_ARGUMENT_DEPTH they are bad arguments, and the call goes on."""
    deep = '{"a":' * (MAX_ARGUMENT_DEPTH + 8) + "1" + "}" * (MAX_ARGUMENT_DEPTH + 8)
    llm_server.tool_triggers = {"order": ("order_status", {})}
    llm_server.raw_arguments = deep
    async with _sales_backend(llm_server, tool_server, tmp_path) as (backend, used):
        backend._handle_transcript(SttResult("where is my order", final=True), time.monotonic())
        await until(lambda: any(r["messages"][-1]["role"] == "tool" for r in llm_server.requests), within=10)
    asked = next(r for r in llm_server.requests if r["messages"][-1]["role"] == "tool")["messages"]
    assert asked[-2]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert asked[-1]["content"].startswith("error: the arguments were not a JSON object")
    assert [(u.name, u.outcome) for u in used] == [("order_status", "bad_arguments")]
    assert tool_server.received == []
    # The review's 980 levels (whether the stack overflows there depends on how deep the caller already is), and
    # as deep as the cap, which is still a tool call like any other.
    at_cap = '{"a":' * (MAX_ARGUMENT_DEPTH - 1) + "1" + "}" * (MAX_ARGUMENT_DEPTH - 1)
    http = HttpSession()
    try:
        tools = CallTools(_agents(tmp_path, tool_server.base_url + "/order-status").agents.get("sales"), (), http)
        review = await tools.run(ToolCallRequest("c1", "order_status", '{"a":' * 980 + "1" + "}" * 980), call_id="CA1")
        result = await tools.run(ToolCallRequest("c2", "order_status", at_cap), call_id="CA1")
    finally:
        await http.aclose()
    assert review.outcome == "bad_arguments"
    assert result.outcome == "ok" and len(tool_server.received) == 1


def test_a_call_actions_quiet_window_outlasts_the_edge_carrying_it_out() -> None:
    """The back-end keeps quiet while the edge plays the action's line and makes the REST request; at 15 s the
    window could close first in a slow transfer (a caller speaking then set the LLM talking over the hand-off).
    The edge's worst case, from its own limits: the line's frames (waited twice over should frames stop), two
    mark waits and the pause between, and the REST client's timeout."""
    import knowledge.backend as backend_module
    from telephony import media_session as edge
    from telephony.twilio_rest import _TIMEOUT_S

    assert edge.ACTION_ANSWER_WAIT_S >= _TIMEOUT_S
    for line in (TRANSFER_LINE, GOODBYE_LINE):
        frames = edge.LINE_LEAD_FRAMES + len(line.split()) * edge.FRAMES_PER_WORD
        worst = 2 * frames * edge.FRAME_SECONDS + 2 * (edge.LINE_MARK_WAIT_S + edge.LINE_AFTER_CLEAR_S) \
            + _TIMEOUT_S
        assert backend_module.ACTION_QUIET_S > worst, (line, worst)

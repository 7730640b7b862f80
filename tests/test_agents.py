"""Agents (issue 12): the agents file, the agent a call gets, its instructions and greeting, its busy policy,
reloads, and GET /agents. Through the real service, real pocketsphinx on flite speech and a local
OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from knowledge.agents import AgentDirectory, Agents, AgentsError
from knowledge.backend import BackendConfig, BackendServices
from knowledge.conversation import DEFAULT_SYSTEM_PROMPT
from telephony import twilio_messages as tm
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, VOICE_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call
from telephony.twilio_rest import TwilioCredentials, TwilioRest, TwilioRestError
from telephony.twiml import parse_connect_stream

from .llm_server import FakeLlm
from .phone_fixtures import metric, new_call_sid, running_phone, write_agents
from .polling import until
from .redis_support import free_port
from .twilio_rest_server import serve_twilio_rest

ROOT = Path(__file__).resolve().parents[1]
SALES = "+15550002222"
AGENTS = f"""
[agents.default]
instructions = "You answer the phone for Acme Dental."
greeting = "Thanks for calling Acme Dental."

[agents.sales]
numbers = ["{SALES}"]
instructions = "You sell Acme widgets."
greeting = "Acme sales, how can I help?"
transfer_to = "+15550009999"
dtmf_transfer = "0"
busy = "dial"
llm_model = "sales-model"

[[agents.sales.tools]]
name = "order_status"
description = "Look up an order by its number"
url = "https://crm.example.com/order-status"
parameters = {{ type = "object", properties = {{ order_id = {{ type = "string" }} }}, required = ["order_id"] }}
"""


def test_a_good_file_loads_and_routes_numbers(tmp_path: Path) -> None:
    agents = Agents.load(write_agents(tmp_path, AGENTS))
    assert agents.for_call(SALES).name == "sales"
    assert agents.for_call("+15550001111").name == "default" and agents.for_call(None).name == "default"
    assert agents.for_call("+15550001111", requested="sales").name == "sales"  # ?agent= on an outbound call
    assert agents.for_call(SALES, requested="nobody").name == "sales"
    sales = agents.get("sales")
    assert sales.system_prompt(DEFAULT_SYSTEM_PROMPT).startswith("You sell Acme widgets.\n\n")
    assert sales.system_prompt(DEFAULT_SYSTEM_PROMPT).endswith(DEFAULT_SYSTEM_PROMPT)
    assert [t.name for t in sales.tools] == ["order_status"]
    assert Agents.builtin().get(None).system_prompt(DEFAULT_SYSTEM_PROMPT) == DEFAULT_SYSTEM_PROMPT


SIP_AGENTS = f"""
[agents.default]
instructions = "You answer the phone for Acme Dental."

[agents.sales]
numbers = ["{SALES}"]
instructions = "You sell Acme widgets."
greeting = "Acme sales, how can I help?"

[agents.support]
numbers = ["sip:support@acme.sip.twilio.com"]
instructions = "You answer Acme's support line."
greeting = "Acme support, go ahead."
transfer_to = "sip:{SALES}@pbx.acme.example"
"""


@pytest.mark.parametrize(
    ("to", "agent"),
    [
        # A PBX's trunk into a Twilio SIP Domain: `To` is the INVITE's Request-URI, in any of its forms.
        ("sip:support@acme.sip.twilio.com", "support"),
        ("sip:support@ACME.sip.us1.twilio.com:5061;transport=tls", "support"),
        ("<sips:support@acme.sip.ashburn.twilio.com>", "support"),
        ("sip:Support@acme.sip.twilio.com", "default"),  # SIP users are case-sensitive
        ("sip:support@other.sip.twilio.com", "default"),
        # A SIP call to a number no agent claims as an address goes to that number's agent.
        (f"sip:{SALES}@acme.sip.twilio.com;user=phone", "sales"),
        ("sip:%2B15550002222@acme.sip.twilio.com", "sales"),
        (f"sip:{SALES};npdi;rn=+15550009999@carrier.example;user=phone", "sales"),  # number portability data
        (SALES, "sales"),
        ("client:alice", "default"),
        # A user that names another domain's address is no way into that domain's agent.
        ("sip:sip:support%40acme.sip.twilio.com@beta.sip.twilio.com", "default"),
        ("sip:sip:support@acme.sip.twilio.com@beta.sip.twilio.com", "default"),
        ("sip:support@acme.sip.twilio.com;x=@beta.sip.twilio.com", "default"),
        ("sip:support@acme.sip.twilio.com" + "x" * 2000, "default"),
    ],
)
def test_sip_calls_route_by_address_or_by_the_number_they_dial(tmp_path: Path, to: str, agent: str) -> None:
    agents = Agents.load(write_agents(tmp_path, SIP_AGENTS))
    assert agents.for_call(to).name == agent


def test_a_transfer_to_an_unclaimed_address_on_our_own_sip_domain_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loaded (a phone may be registered there), but said: else the transfer would ring the bot again."""
    text = SIP_AGENTS.replace('transfer_to = "sip:+15550002222@pbx.acme.example"',
                              'transfer_to = "sip:operator@acme.sip.us1.twilio.com"')  # fmt: skip
    with caplog.at_level("WARNING", logger="knowledge.agents"):
        agents = Agents.load(write_agents(tmp_path, text))
    assert agents.get("support").transfer_to == "sip:operator@acme.sip.us1.twilio.com"
    assert any("transfer_to sip:operator@acme.sip.us1.twilio.com is on a SIP Domain this service answers"
               in r.getMessage() for r in caplog.records)  # fmt: skip


def test_a_transfer_to_a_pbx_at_one_of_our_numbers_is_no_loop(tmp_path: Path) -> None:
    """sip:+NUMBER@pbx.acme.example rings the PBX, not us (the same number on our SIP Domain would loop)."""
    agents = Agents.load(write_agents(tmp_path, SIP_AGENTS))
    assert agents.get("support").transfer_to == f"sip:{SALES}@pbx.acme.example"


async def test_a_sip_domain_call_gets_its_agent_through_the_real_webhook_and_stream(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Twilio's webhook for a SIP Domain call, signed, on loopback: the TwiML names the agent claiming the
    address, the record keeps it, and once the stream starts its greeting is the call's first oracle."""
    directory = AgentDirectory.from_file(write_agents(tmp_path, SIP_AGENTS))
    backend = BackendServices(BackendConfig(stt="none", llm_enabled=False), directory)  # says the greeting
    sip_to = "sip:support@acme.sip.us1.twilio.com;transport=tls"
    async with running_phone(tiny_checkpoint, max_calls=1, backend=backend, agents=directory) as phone, \
            aiohttp.ClientSession() as http:
        await phone.keeping_time()
        call_sid = new_call_sid()
        params = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32, "From": "sip:alice@pbx.acme.example",
                  "To": sip_to, "Direction": "inbound", "SipDomain": "acme.sip.twilio.com"}  # fmt: skip
        url = phone.base + VOICE_PATH
        async with http.post(url, data=params, headers={"X-Twilio-Signature": phone.sign(url, params)}) as r:
            assert r.status == 200
            stream = parse_connect_stream(await r.text())
        parameters = dict(stream.parameters)
        assert parameters["agent"] == "support" and parameters["to"] == sip_to
        assert stream.url == phone.stream_url(call_sid)  # the call's own URL
        ws = await phone.open_stream(http, call_sid)
        await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", parameters))
        await until(lambda: metric("kame_calls_active") >= 1, "the SIP call seated")
        await asyncio.sleep(0.5)  # a few frames: the greeting goes in as the call's first candidate
        await ws.send_str(tm.stop_msg("MZ1", 10**6, call_sid, "AC1"))
        await ws.close()
        await phone.settled()
        record = await phone.store.get(call_sid)
    assert record is not None and record.agent == "support" and record.to_number == sip_to
    assert record.oracle and record.oracle[0].text == "Acme support, go ahead."


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[agents.a]\ninstructions = "x"\ncolour = "red"\n', "agent 'a': key 'colour': unknown key"),
        ('[agents.a]\ngreeting = "hi"\n', "agent 'a': key 'instructions': every agent needs instructions"),
        (f'[agents.a]\ninstructions = "x"\nnumbers = ["{SALES}"]\n[agents.b]\ninstructions = "y"\n'
         f'numbers = ["{SALES}"]\n', f"agent 'b': key 'numbers': {SALES} is also claimed by agent 'a'"),
        ('[agents.a]\ninstructions = "x"\nnumbers = ["555-1234"]\n', "agent 'a': key 'numbers': a list of E.164"),
        ('[agents.a]\ninstructions = "x"\ntransfer_to = "bob"\n', "agent 'a': key 'transfer_to'"),
        # Full-width digits: \d took them; the file loaded, the agent never got a call, its transfers never dialled.
        ('[agents.a]\ninstructions = "x"\nnumbers = ["+1' + "\\uff15" * 3 + "\\uff10" * 3 + "\\uff12" * 4 + '"]\n',
         "agent 'a': key 'numbers': a list of E.164"),
        ('[agents.a]\ninstructions = "x"\ntransfer_to = "+4\u0664\u0662\u0660\u0667\u0669\u0664\u0666\u0660\u0660"\n',
         "agent 'a': key 'transfer_to'"),
        ('[agents.a]\ninstructions = "x"\nbusy = "dial"\n', "agent 'a': key 'busy': 'dial' needs transfer_to"),
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "http://crm.example.com/x"\n', "agent 'a': key 'tools.t.url'"),
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\nparameters = { type = "string" }\n',
         "agent 'a': key 'tools.t.parameters': a JSON Schema object"),
        ('[agents.a]\ninstructions = "x"\nforced_delay_ms = -5\n', "agent 'a': key 'forced_delay_ms'"),
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "end_call"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\n', "agent 'a': key 'tools.name': 'end_call' is reserved"),
        ("[agents.a\n", "not TOML"),
        # A typo in a tool's schema: refused here, not by the LLM server at the agent's first call.
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\n'
         'parameters = { type = "object", properties = { q = { type = "strin" } } }\n',
         "agent 'a': key 'tools.t.parameters': not a valid JSON Schema at properties/q/type"),
        # TOML values JSON cannot carry: the schema checks out, then every request offering the tool failed.
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\n'
         'parameters = { type = "object", properties = { d = { type = "string", default = 2024-05-01 } } }\n',
         "agent 'a': key 'tools.t.parameters': JSON values only (no TOML dates, nan or inf)"),
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\n'
         'parameters = { type = "object", properties = { n = { type = "number", maximum = nan } } }\n',
         "agent 'a': key 'tools.t.parameters': JSON values only (no TOML dates, nan or inf)"),
        ('[agents.a]\ninstructions = "x"\n' + '[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://crm.example.com/x"\n' * 2, "agent 'a': key 'tools.name': 't' names two tools"),
        # Transferring to a number this service answers rings the bot again, round and round.
        (f'[agents.a]\ninstructions = "x"\nnumbers = ["{SALES}"]\n[agents.b]\ninstructions = "y"\n'
         f'transfer_to = "{SALES}"\n', f"agent 'b': key 'transfer_to': {SALES} is answered by this service"),
        # The same SIP address claimed twice, in two forms (scheme, host case, a Twilio regional host).
        ('[agents.a]\ninstructions = "x"\nnumbers = ["sip:help@acme.sip.twilio.com"]\n[agents.b]\n'
         'instructions = "y"\nnumbers = ["sips:help@ACME.sip.us1.twilio.com"]\n',
         "agent 'b': key 'numbers': sip:help@acme.sip.twilio.com is also claimed by agent 'a'"),
        # A user holding an escaped '@' is no address routing could match.
        ('[agents.a]\ninstructions = "x"\nnumbers = ["sip:a%40b@acme.sip.twilio.com"]\n',
         "agent 'a': key 'numbers': a list of E.164 numbers"),
        # A SIP address with parameters says more than routing compares: refused, not silently cut.
        ('[agents.a]\ninstructions = "x"\nnumbers = ["sip:help@acme.sip.twilio.com;transport=tls"]\n',
         "agent 'a': key 'numbers': a list of E.164 numbers like \"+15550002222\" or SIP addresses"),
        # A transfer to our own SIP Domain, through its regional host, would ring the bot again.
        ('[agents.a]\ninstructions = "x"\nnumbers = ["sip:help@acme.sip.twilio.com"]\n[agents.b]\n'
         'instructions = "y"\ntransfer_to = "sip:help@acme.sip.ie1.twilio.com"\n',
         "agent 'b': key 'transfer_to': sip:help@acme.sip.ie1.twilio.com is answered by this service (agent 'a')"),
        # A transfer to one of our numbers through a Twilio SIP Domain comes back to us as that number's call.
        (f'[agents.a]\ninstructions = "x"\nnumbers = ["{SALES}"]\n[agents.b]\ninstructions = "y"\n'
         f'transfer_to = "sip:{SALES}@acme.sip.twilio.com"\n', "key 'transfer_to': sip:+15550002222@acme.sip.twilio"),
        # An unclosed IPv6 bracket: urlsplit's ValueError escaped (a traceback at start, a SIGHUP uncounted).
        ('[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\ndescription = "d"\n'
         'url = "https://[crm.internal/x"\n', "key 'tools.t.url': an https:// URL (http:// only on loopback), got "
         "one that does not parse"),
        # Nested thousands deep: a reload refused it, a start was a traceback of 3,000 lines (review, session 30).
        ('[agents.a]\ninstructions = "x"\ngreeting = ' + "[" * 5000 + "]" * 5000 + "\n", "nested too deep"),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_in_one_line_naming_file_agent_and_key(tmp_path: Path, text: str, says: str) -> None:
    path = write_agents(tmp_path, text)
    with pytest.raises(AgentsError) as refused:
        Agents.load(path)
    message = str(refused.value)
    assert message.startswith(f"agents file {path}: ") and says in message and "\n" not in message


def test_a_refused_tool_url_is_not_echoed_with_its_credentials(tmp_path: Path) -> None:
    """The refusal goes to the log (start-up, SIGHUP): a URL's user:password or ?key= must not."""
    path = write_agents(tmp_path, '[agents.a]\ninstructions = "x"\n[[agents.a.tools]]\nname = "t"\n'
                                  'description = "d"\nurl = "http://ops:hunter2@crm.example.com/x?key=sk-live-1"\n')
    with pytest.raises(AgentsError) as refused:
        Agents.load(path)
    message = str(refused.value)
    assert "key 'tools.t.url'" in message and "crm.example.com" in message
    assert "hunter2" not in message and "sk-live-1" not in message


def test_serve_refuses_a_bad_agents_file_in_one_line(tmp_path: Path) -> None:
    path = write_agents(tmp_path, '[agents.a]\ninstructions = "x"\nvoice = "deep"\n')
    proc = subprocess.run([sys.executable, "-m", "kame_phone.cli", "serve", "--insecure-dev", "--agents", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kame-phone serve: agents file {path}: agent 'a': key 'voice': unknown key " \
        "(known: busy, dtmf_transfer, forced_delay_ms, greeting, instructions, llm_model, numbers, tools, transfer_to)"


async def test_each_number_gets_its_agents_instructions_greeting_and_model(
    tiny_checkpoint: Path, question_wav: Path, llm_server: FakeLlm, tmp_path: Path
) -> None:
    directory = AgentDirectory.from_file(write_agents(tmp_path, AGENTS))
    config = BackendConfig(stt="pocketsphinx", llm_base_url=llm_server.base_url, llm_api_key="sk-test", llm_model="m")
    backend = BackendServices(config, directory)
    await backend.warm_up(2)
    sales_sid, other_sid = new_call_sid(), new_call_sid()
    async with running_phone(tiny_checkpoint, max_calls=2, backend=backend, agents=directory) as phone:
        reports = await asyncio.gather(*(
            simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, custom_sid=sid,
                          to_number=to, hold_after=3.0)
            for sid, to in ((sales_sid, SALES), (other_sid, "+15550001111"))
        ))  # fmt: skip
        await phone.settled()
        sales, other = await phone.store.get(sales_sid), await phone.store.get(other_sid)
    assert [r.outcome for r in reports] == ["completed", "completed"]
    assert sales is not None and other is not None
    assert (sales.agent, other.agent) == ("sales", "default")
    # The greeting is each call's first oracle candidate (recorded first; the front-end says it at once).
    assert sales.oracle[0].text == "Acme sales, how can I help?"
    assert other.oracle[0].text == "Thanks for calling Acme Dental."
    asked = {sid: [req for req, rid in zip(llm_server.requests, llm_server.request_ids, strict=True)
                   if rid and rid.startswith(sid)] for sid in (sales_sid, other_sid)}  # fmt: skip
    assert asked[sales_sid] and asked[other_sid], "the LLM was not asked for both calls"
    for sid, instructions, greeting, model in (
        (sales_sid, "You sell Acme widgets.", "Acme sales, how can I help?", "sales-model"),
        (other_sid, "You answer the phone for Acme Dental.", "Thanks for calling Acme Dental.", "m"),
    ):
        for req in asked[sid]:
            system, first = req["messages"][0], req["messages"][1]
            assert system["role"] == "system" and system["content"].startswith(instructions + "\n\n")
            assert system["content"].endswith(DEFAULT_SYSTEM_PROMPT)
            # The greeting opens the first bot turn (what the front-end says after it, before the caller's
            # words are final, continues that turn).
            assert first["role"] == "assistant" and first["content"].startswith(greeting)
            assert req["model"] == model
    assert metric("kame_calls_total", outcome="completed", agent="sales") >= 1


async def test_at_capacity_each_agent_answers_by_its_busy_policy(tiny_checkpoint: Path, tmp_path: Path) -> None:
    directory = AgentDirectory.from_file(write_agents(tmp_path, AGENTS))
    async with running_phone(tiny_checkpoint, max_calls=1, agents=directory) as phone, aiohttp.ClientSession() as http:
        await phone.answer(http)  # holds the one seat (a reservation) for a few seconds
        url = phone.base + VOICE_PATH
        busy_sales = metric("kame_calls_total", outcome="busy", agent="sales")
        answers = {}
        for to in (SALES, "+15550001111"):
            sid = new_call_sid()
            params = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": to}
            async with http.post(url, data=params, headers={"X-Twilio-Signature": phone.sign(url, params)}) as r:
                answers[to] = (sid, await r.text())
        await phone.store.flush()
        sales_sid, sales_twiml = answers[SALES]
        assert "<Dial><Number>+15550009999</Number></Dial>" in sales_twiml  # busy = "dial": to a person
        assert '<Reject reason="busy"' in answers["+15550001111"][1]  # the default: a busy signal, not answered
        record = await phone.store.get(sales_sid)
        assert record is not None and record.agent == "sales" and record.end_reason == "busy"
        assert metric("kame_calls_total", outcome="busy", agent="sales") == busy_sales + 1


async def test_sighup_reloads_the_agents_and_a_bad_reload_keeps_them(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = write_agents(tmp_path, AGENTS)
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, ADMIN_TOKEN="agents-admin")
    env.pop("TWILIO_AUTH_TOKEN", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kame_phone.cli", "serve", "--insecure-dev", "--port", str(port), "--metrics-port",
        str(metrics_port), "--checkpoint", str(tiny_checkpoint), "--stt", "none", "--llm", "none",
        "--no-engine-process", "--agents", str(path), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer agents-admin"}

    async def listed(http: aiohttp.ClientSession) -> dict[str, list[str]]:
        async with http.get(base + "/agents", headers=auth) as r:
            assert r.status == 200
            return {a["name"]: a["numbers"] for a in (await r.json())["agents"]}

    async def reloads(http: aiohttp.ClientSession, outcome: str) -> float:
        async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(f'kame_agents_reloads_total{{outcome="{outcome}"}}'):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                try:
                    async with http.get(base + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.2)
            async with http.get(base + "/agents") as r:
                assert r.status == 401  # the admin token is required
            assert await listed(http) == {"default": [], "sales": [SALES]}
            path.write_text(AGENTS + '\n[agents.support]\nnumbers = ["+15550003333"]\ninstructions = "Help."\n')
            proc.send_signal(signal.SIGHUP)
            for _ in range(50):
                if "support" in await listed(http):
                    break
                await asyncio.sleep(0.1)
            assert await listed(http) == {"default": [], "sales": [SALES], "support": ["+15550003333"]}
            assert await reloads(http, "ok") == 1
            path.write_text("[agents.broken\n")
            proc.send_signal(signal.SIGHUP)
            for _ in range(50):
                if await reloads(http, "refused") == 1:
                    break
                await asyncio.sleep(0.1)
            assert await reloads(http, "refused") == 1
            assert "support" in await listed(http)  # the agents in force stay
            assert proc.returncode is None  # a bad reload never stops the service
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


async def test_a_lost_engine_hands_the_caller_to_the_agents_fallback_not_dead_air(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The engine process dies mid-call: the stream ends, and Twilio's request to the <Connect action> URL
    (signed, checked like the webhook) gets the agent's fallback: a <Dial> to its transfer_to, or for an
    agent without one a short apology and a hang-up."""
    directory = AgentDirectory.from_file(write_agents(tmp_path, AGENTS))
    engine = await LocalEngine.load(EngineConfig(
        checkpoint=str(tiny_checkpoint), device="cpu", max_calls=2, warmup_ticks=2, engine_process=True,
        sampling=SamplingOverrides(greedy=True),
    ))  # fmt: skip
    await engine.start()
    token = "f" * 32
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token)
    handle = await ServiceHandle(ServerContext(config, MemoryCallStore(), engine, agents=directory)).start()
    dial = metric("kame_call_fallbacks_total", action="dial")
    apology = metric("kame_call_fallbacks_total", action="apology")
    t = np.arange(20 * 8000) / 8000  # long calls: the engine dies in the middle of them

    async def kill_engine_soon() -> None:
        await asyncio.sleep(2.0)
        engine.frame_loop._process.kill()  # type: ignore[union-attr]

    try:
        killer = asyncio.create_task(kill_engine_soon())
        reports = await asyncio.wait_for(asyncio.gather(*(
            simulate_call(handle.http_url.replace("http://", "ws://") + MEDIA_PATH,
                          (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), auth_token=token, public_url=None,
                          to_number=to, hold_after=0.5)
            for to in (SALES, "+15550001111")
        )), 20)  # fmt: skip
        await killer
        async with aiohttp.ClientSession() as http:  # an unsigned request to the action URL is refused
            url = handle.http_url + "/twilio/connect-action?agent=sales"
            async with http.post(url, data={"CallSid": "CA1"}) as r:
                assert r.status == 403
    finally:
        await handle.aclose()
        await engine.stop()
    sales, other = reports
    assert sales.server_hung_up and other.server_hung_up and sales.call_seconds < 10
    assert sales.fallback_twiml is not None and "<Dial><Number>+15550009999</Number></Dial>" in sales.fallback_twiml
    assert other.fallback_twiml is not None and "<Say>" in other.fallback_twiml and "<Hangup" in other.fallback_twiml
    assert metric("kame_call_fallbacks_total", action="dial") == dial + 1
    assert metric("kame_call_fallbacks_total", action="apology") == apology + 1


async def test_a_twilio_that_never_answers_fails_the_request_in_time() -> None:
    """The twilio package's async client keeps its timeout but hands aiohttp none: a hung Twilio held a
    transfer (and the call's actions with it) for as long as the socket lived. It fails in time now."""
    account = "AC" + "1" * 32
    async with serve_twilio_rest(account, account, "rest-secret") as twilio:
        twilio.update_delay_s = 30.0
        rest = TwilioRest(TwilioCredentials(account, account, "rest-secret", twilio.base_url), timeout_s=1.0)
        try:
            started = time.monotonic()
            with pytest.raises(TwilioRestError, match="did not answer in time"):
                await rest.complete("CA" + "2" * 32)
            assert time.monotonic() - started < 5.0
        finally:
            await rest.aclose()


@pytest.mark.parametrize("twilio_side", ["ok", "refused", "dropped", "slow"])
async def test_the_agents_dtmf_key_hands_the_caller_to_a_person_through_the_rest_api(
    tiny_checkpoint: Path, question_wav: Path, tmp_path: Path, twilio_side: str
) -> None:
    """The sales agent's key "0": the live call is updated through Twilio's REST API (the twilio package's
    client, against a local stand-in) with a <Dial> to transfer_to. Refused credentials: counted, logged,
    and the call goes on. A connection closed under the request (not retried by aiohttp for a POST): the
    same, and the caller's second press transfers the call. Twilio's answer slower than the caller's `stop`
    (they travel apart): the call is still recorded as transferred."""
    directory = AgentDirectory.from_file(write_agents(tmp_path, AGENTS))
    account = "AC" + "1" * 32
    credentials_ok = twilio_side != "refused"
    async with serve_twilio_rest(account, account, "rest-secret") as twilio:
        twilio.drop_updates = int(twilio_side == "dropped")
        twilio.update_delay_s = 6.0 if twilio_side == "slow" else 0.0  # past the caller's stop (~4.5 s)
        rest = TwilioRest(TwilioCredentials(account, account, "rest-secret" if credentials_ok else "wrong",
                                            twilio.base_url))  # fmt: skip
        before = {r: metric("kame_call_actions_total", action="transfer", trigger="dtmf", result=r)
                  for r in ("ok", "error")}  # fmt: skip
        presses = [("0", 1.0), ("0", 3.0)] if twilio_side == "dropped" else [("0", 1.0)]
        sid = new_call_sid()
        try:
            async with running_phone(tiny_checkpoint, agents=directory, twilio_rest=rest) as phone:
                report = await simulate_call(
                    phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base, custom_sid=sid,
                    to_number=SALES, dtmf=presses, hold_after=1.0,
                )  # fmt: skip
                await phone.settled()
                record = await phone.store.get(sid)
        finally:
            await rest.aclose()
    assert report.outcome == "completed", report.errors
    counted = {r: metric("kame_call_actions_total", action="transfer", trigger="dtmf", result=r) - before[r]
               for r in ("ok", "error")}  # fmt: skip
    assert counted == {"ok": int(credentials_ok), "error": int(twilio_side in ("refused", "dropped"))}
    assert record is not None and record.dtmf == ["0"] * len(presses)
    if credentials_ok:
        ((updated, form),) = twilio.updates
        assert updated == sid and "<Dial><Number>+15550009999</Number></Dial>" in form["Twiml"]
        assert record.end_reason == "transferred"
    else:
        assert not twilio.updates and twilio.refused == 1
        assert record.end_reason == "completed"


def test_get_agents_never_shows_a_sip_password(tmp_path: Path) -> None:
    """`transfer_to = "sip:user:password@pbx"` was shown as written by GET /agents (admin-only, but a PBX
    password all the same); the agent still dials it as written."""
    target = "sip:bob:s3cretPW@pbx.example.com;transport=tls"
    agents = Agents.load(write_agents(tmp_path, f'[agents.a]\ninstructions = "x"\ntransfer_to = "{target}"\n'))
    (shown,) = [a for a in agents.describe() if a["name"] == "a"]
    assert shown["transfer_to"] == "sip:bob:***@pbx.example.com;transport=tls"
    assert agents.get("a").transfer_to == target


def test_a_sip_password_never_reaches_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    claims = '[agents.b]\ninstructions = "x"\nnumbers = ["sip:desk@acme.sip.twilio.com"]\n'
    warned = Agents.load(write_agents(tmp_path, claims + '[agents.a]\ninstructions = "x"\n'
                                      'transfer_to = "sip:other:Hunter2pw@acme.sip.twilio.com"\n'))
    assert warned.get("a").transfer_to == "sip:other:Hunter2pw@acme.sip.twilio.com"
    assert "on a SIP Domain this service answers" in caplog.text and "Hunter2pw" not in caplog.text
    # A password does not hide a transfer that would ring the bot again (user[:password]@host is desk's).
    with pytest.raises(AgentsError) as looped:
        Agents.load(write_agents(tmp_path, claims + '[agents.a]\ninstructions = "x"\n'
                                 'transfer_to = "sip:desk:Hunter2pw@acme.sip.twilio.com"\n'))
    assert "would loop back" in str(looped.value) and "Hunter2pw" not in str(looped.value)

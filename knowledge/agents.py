"""Agents: what the bot is for, per called number. A TOML file (`--agents FILE`, KAME_AGENTS):

    [agents.default]                  # answers every number no other agent claims
    instructions = "You answer for Acme Dental ..."
    greeting = "Thanks for calling Acme Dental, how can I help?"

    [agents.sales]
    numbers = ["+15550002222", "sip:sales@acme.sip.twilio.com"]  # Twilio `To`: E.164, or SIP addresses
    instructions = "..."
    transfer_to = "+15550009999"      # E.164 or sip:
    busy = "reject"                   # reject | say | dial | enqueue:NAME
    llm_model = "gpt-4.1"

A bad file is refused whole, in one line naming the file, the agent and the key; a reload (SIGHUP) that
fails keeps the agents in force. Without a file there is one agent, `default`, with the built-in prompt.
The agent's instructions go before the built-in phone rules in the LLM's system message; its greeting
is the call's first oracle candidate (the front-end says it at once, in its own voice).

Pure configuration: the phone edge reads it to route and to answer at capacity, the back-end to prompt.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from jsonschema import Draft202012Validator, SchemaError
from prometheus_client import Counter

from engine.interface import is_forced_delay_ms
from engine.metrics import zero_series

log = logging.getLogger(__name__)

DEFAULT_AGENT = "default"
E164 = re.compile(r"\+[1-9][0-9]{6,14}")  # ASCII digits: \d takes any script's, which no carrier dials
# A SIP URI as Twilio's `To` carries it for a call through a SIP Domain or a BYOC trunk (the INVITE's
# Request-URI): scheme, user@host, then any port, parameters or headers (`;transport=tls`, `?X-Foo=1`).
# The user may carry parameters of its own (sip:+15550002222;npdi;rn=+15550009999@host: a carrier's number
# portability data); they are not part of the address routing compares.
_SIP_URI = re.compile(r"<?(sips?):([^@?>\s]+)@([^@;?>\s]+)(?:[;?][^\s>@]*)?>?", re.IGNORECASE)
# Twilio's regional and edge forms of a SIP Domain (acme.sip.us1.twilio.com, acme.sip.ashburn.twilio.com) are
# the same domain as acme.sip.twilio.com: a PBX may send to any of them.
_TWILIO_SIP_HOST = re.compile(r"([a-z0-9-]+)\.sip\.[a-z0-9-]+\.twilio\.com")
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
BUSY_POLICIES = ("reject", "say", "dial")  # or enqueue:NAME
_KEYS = {"numbers", "instructions", "greeting", "transfer_to", "dtmf_transfer", "busy", "llm_model", "tools",
         "forced_delay_ms"}
_TOOL_KEYS = {"name", "description", "url", "parameters"}
_MAX_TEXT = 20_000  # instructions; a prompt far larger is a mistake (and a cost on every request)

AGENT_RELOADS = zero_series(
    Counter("kame_agents_reloads_total", "Agents file reloads (SIGHUP) by outcome.", ["outcome"]),
    outcome=("ok", "refused"),
)


class AgentsError(ValueError):
    """The agents file cannot be used: the message names the file, the agent and the key."""


@dataclass(frozen=True)
class HttpTool:
    """An agent's own tool: the LLM calls it by name; its JSON arguments are POSTed to `url`."""

    name: str
    description: str
    url: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Agent:
    name: str
    instructions: str | None = None  # None: the built-in prompt alone
    greeting: str | None = None
    numbers: tuple[str, ...] = ()
    transfer_to: str | None = None
    dtmf_transfer: str | None = None
    busy: str = "reject"
    llm_model: str | None = None
    tools: tuple[HttpTool, ...] = ()
    forced_delay_ms: float | None = None  # None: the engine's --forced-delay-ms

    def system_prompt(self, builtin: str) -> str:
        """The agent's instructions, then the built-in phone-style rules."""
        return builtin if not self.instructions else f"{self.instructions.strip()}\n\n{builtin}"


@dataclass(frozen=True)
class Agents:
    by_name: dict[str, Agent]
    by_number: dict[str, str] = field(default_factory=dict)
    source: Path | None = None

    @classmethod
    def builtin(cls) -> Agents:
        return cls({DEFAULT_AGENT: Agent(DEFAULT_AGENT)})

    def for_call(self, to_number: str | None, requested: str | None = None) -> Agent:
        """The agent a call gets: one named on the webhook URL (`?agent=`, outbound calls), else the one
        claiming the called number or SIP address, else `default`. A SIP call to a number
        (sip:+15550002222@acme.sip.twilio.com) that no agent claims as an address goes to that number's agent:
        a PBX's trunk dials the number it means."""
        if requested and requested in self.by_name:
            return self.by_name[requested]
        name = self._claimant(to_number or "", any_host=True) or DEFAULT_AGENT
        return self.by_name.get(name) or self.by_name[DEFAULT_AGENT]

    def _claimant(self, target: str, *, any_host: bool) -> str | None:
        """The agent claiming `target` (a number, or a SIP URI by its address, else by the E.164 number that is
        its user: on any host for a call that reached us, only on a Twilio SIP Domain for a transfer, which
        a PBX elsewhere would answer itself)."""
        address = sip_address(target)
        if address is None:
            return self.by_number.get(target)
        if address in self.by_number:
            return self.by_number[address]
        user, host = _user_and_host(address)
        if E164.fullmatch(user) and (any_host or host.endswith(".sip.twilio.com")):
            return self.by_number.get(user)
        return None

    def get(self, name: str | None) -> Agent:
        return self.by_name.get(name or DEFAULT_AGENT) or self.by_name[DEFAULT_AGENT]

    def describe(self) -> list[dict[str, Any]]:
        """For `GET /agents`: names, numbers and policies; not the instructions (they may be long)."""
        return [
            {"name": a.name, "numbers": list(a.numbers), "greeting": a.greeting,
             "transfer_to": _without_password(a.transfer_to),
             "busy": a.busy, "llm_model": a.llm_model, "forced_delay_ms": a.forced_delay_ms,
             "tools": [t.name for t in a.tools]}
            for a in self.by_name.values()
        ]  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> Agents:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise AgentsError(f"agents file {path}: cannot read it ({e})") from None
        except tomllib.TOMLDecodeError as e:
            raise AgentsError(f"agents file {path}: not TOML ({e})") from None
        except RecursionError:  # arrays nested thousands deep: refused here, at start as on a reload
            raise AgentsError(f"agents file {path}: nested too deep") from None
        unknown = set(data) - {"agents"}
        if unknown or not isinstance(data.get("agents"), dict) or not data["agents"]:
            raise AgentsError(f"agents file {path}: wants [agents.NAME] tables only, got {sorted(data) or 'none'}")
        by_name: dict[str, Agent] = {}
        by_number: dict[str, str] = {}
        for name, table in data["agents"].items():
            agent = _agent(path, name, table)
            for number in agent.numbers:
                if number in by_number:
                    raise AgentsError(f"agents file {path}: agent {name!r}: key 'numbers': {number} is also "
                                      f"claimed by agent {by_number[number]!r}")  # fmt: skip
                by_number[number] = name
            by_name[name] = agent
        agents = cls(by_name, by_number, path)
        our_sip_hosts = {_user_and_host(key)[1] for key in by_number if key.startswith("sip:")}
        for name, agent in by_name.items():
            # A transfer (or a busy dial) to a number or SIP address this service answers rings the bot again:
            # the caller goes round, every leg billed.
            claimant = agent.transfer_to and agents._claimant(agent.transfer_to, any_host=False)
            if claimant:
                raise AgentsError(f"agents file {path}: agent {name!r}: key 'transfer_to': "
                                  f"{_without_password(agent.transfer_to)} is "
                                  f"answered by this service (agent {claimant!r}): a transfer "
                                  "there would loop back to the bot")  # fmt: skip
            target = sip_address(agent.transfer_to or "")
            if target is not None and _user_and_host(target)[1] in our_sip_hosts:
                # Not refused: a domain with SIP registration rings the phones registered there. Without it,
                # an address no agent claims comes back to this service's default agent.
                log.warning("agents file %s: agent %r: transfer_to %s is on a SIP Domain this service answers: "
                            "unless a phone is registered there, the transfer rings the bot again", path, name,
                            _without_password(agent.transfer_to))  # fmt: skip
        by_name.setdefault(DEFAULT_AGENT, Agent(DEFAULT_AGENT))  # numbers no agent claims
        return agents


def _agent(path: Path, name: str, table: Any) -> Agent:
    def bad(key: str, why: str) -> AgentsError:
        return AgentsError(f"agents file {path}: agent {name!r}: key {key!r}: {why}")

    if not _NAME.fullmatch(name):
        raise AgentsError(f"agents file {path}: agent {name!r}: name must be lowercase letters, digits, - or _")
    if not isinstance(table, dict):
        raise AgentsError(f"agents file {path}: agent {name!r}: must be a table")
    for key in sorted(set(table) - _KEYS):
        raise bad(key, f"unknown key (known: {', '.join(sorted(_KEYS))})")
    instructions = table.get("instructions")
    if not isinstance(instructions, str) or not instructions.strip():
        raise bad("instructions", "every agent needs instructions (a non-empty string)")
    if len(instructions) > _MAX_TEXT:
        raise bad("instructions", f"{len(instructions)} characters, at most {_MAX_TEXT}")
    greeting = _optional_text(table, "greeting", bad, limit=500)
    numbers = table.get("numbers", [])
    claims = [_claim(n) for n in numbers] if isinstance(numbers, list) else [None]
    if any(c is None for c in claims):
        raise bad("numbers", "a list of E.164 numbers like \"+15550002222\" or SIP addresses like "
                             "\"sip:support@acme.sip.twilio.com\"")  # fmt: skip
    numbers = claims
    transfer_to = _optional_text(table, "transfer_to", bad, limit=200)
    if transfer_to is not None and not (E164.fullmatch(transfer_to) or is_sip_uri(transfer_to)):
        raise bad("transfer_to", f"{transfer_to!r} is neither an E.164 number nor a sip: URI")
    dtmf = _optional_text(table, "dtmf_transfer", bad, limit=1)
    if dtmf is not None and (dtmf not in "0123456789*#" or transfer_to is None):
        raise bad("dtmf_transfer", "one key (0-9, * or #), and the agent needs transfer_to")
    busy = table.get("busy", "reject")
    if not isinstance(busy, str) or not (busy in BUSY_POLICIES or re.fullmatch(r"enqueue:[\w-]{1,64}", busy)):
        raise bad("busy", f"{busy!r}: one of reject, say, dial, enqueue:NAME")
    if busy == "dial" and transfer_to is None:
        raise bad("busy", "'dial' needs transfer_to")
    llm_model = _optional_text(table, "llm_model", bad, limit=200)
    delay = table.get("forced_delay_ms")
    if delay is not None and not is_forced_delay_ms(delay):
        raise bad("forced_delay_ms", "a number of milliseconds, 0 to 10000")
    tools = table.get("tools", [])
    if not isinstance(tools, list):
        raise bad("tools", "an array of [[agents.NAME.tools]] tables")
    http_tools = tuple(_tool(bad, t) for t in tools)
    names = [t.name for t in http_tools]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        # Two functions of one name: the LLM sees one, and which one ran was the dictionary's choice.
        raise bad("tools.name", f"{dup!r} names two tools")
    return Agent(
        name=name, instructions=instructions, greeting=greeting, numbers=tuple(numbers), transfer_to=transfer_to,
        dtmf_transfer=dtmf, busy=busy, llm_model=llm_model, tools=http_tools,
        forced_delay_ms=None if delay is None else float(delay),
    )  # fmt: skip


def _optional_text(table: dict[str, Any], key: str, bad: Any, *, limit: int) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise bad(key, f"a non-empty string of at most {limit} characters")
    return value.strip()


def _without_password(target: str | None) -> str | None:
    """A SIP target as shown (GET /agents): `sip:user:password@host` with its password masked."""
    if target is None or not is_sip_uri(target):
        return target
    scheme, _, rest = target.partition(":")
    user, _, host = rest.rpartition("@")
    return f"{scheme}:{user.split(':', 1)[0]}:***@{host}" if ":" in user else target


def is_sip_uri(value: str) -> bool:
    """A SIP URI to dial (`transfer_to`, `kame-phone dial`): its parameters (;transport=tls) are kept and sent."""
    # Lower-case scheme only: twiml.dial_twiml_verb tells a SIP target from a number by it.
    return re.fullmatch(r"sips?:[^\s@]+@[^\s@]+", value) is not None


def _claim(value: object) -> str | None:
    """An entry of `numbers` as `for_call` compares it: an E.164 number as it is, a plain SIP address (no
    parameters: routing ignores them) in `sip_address`'s form; None for anything else (an escaped '@' too)."""
    if not isinstance(value, str):
        return None
    if E164.fullmatch(value):
        return value
    plain = re.fullmatch(r"sips?:[^\s@;?<>]+@[^\s@;?<>]+", value, re.IGNORECASE)
    return sip_address(value) if plain else None


def sip_address(uri: str) -> str | None:
    """`sip:user@host` as routing compares a SIP URI: the scheme sip (sips too), the user as sent
    (percent-escapes decoded: users are case-sensitive), the host in lower case without its port, a Twilio
    SIP Domain's regional or edge host as the domain itself; parameters and headers dropped. None for
    anything else (a phone number, a client name)."""
    m = _SIP_URI.fullmatch(uri.strip())
    if m is None:
        return None
    # The user without its parameters or password (userinfo is user[:password], RFC 3261), escapes decoded after.
    user = unquote(m.group(2).split(";", 1)[0].split(":", 1)[0])
    host = re.sub(r":[0-9]+$", "", m.group(3).lower())
    if not user or "@" in user:  # an escaped '@' would make a user that names another domain's address
        return None
    host = _TWILIO_SIP_HOST.sub(r"\1.sip.twilio.com", host) if _TWILIO_SIP_HOST.fullmatch(host) else host
    return f"sip:{user}@{host}"


def _user_and_host(address: str) -> tuple[str, str]:
    """The two halves of a `sip_address`."""
    user, host = address.removeprefix("sip:").rsplit("@", 1)
    return user, host


def _tool(bad: Any, table: Any) -> HttpTool:
    if not isinstance(table, dict):
        raise bad("tools", "each tool is a table")
    for key in sorted(set(table) - _TOOL_KEYS):
        raise bad(f"tools.{key}", f"unknown key (known: {', '.join(sorted(_TOOL_KEYS))})")
    name = table.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
        raise bad("tools.name", "letters, digits, _ or -, at most 64 (OpenAI's rule for function names)")
    if name in ("transfer_call", "end_call", "unknown"):
        raise bad("tools.name", f"{name!r} is reserved (a built-in tool)")
    description = table.get("description")
    if not isinstance(description, str) or not description.strip():
        raise bad(f"tools.{name}.description", "a non-empty string")
    url = table.get("url")
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
    except ValueError:  # "https://[crm.internal/x": an unclosed IPv6 bracket
        raise bad(f"tools.{name}.url", "an https:// URL (http:// only on loopback), got one that does not parse") \
            from None
    loopback = parts is not None and parts.hostname in ("127.0.0.1", "localhost", "::1")
    if parts is None or not parts.netloc or not (parts.scheme == "https" or (parts.scheme == "http" and loopback)):
        # Not the URL itself: it may carry credentials (user:password@, ?key=), and this goes to the log.
        got = f"a {parts.scheme or 'scheme-less'} URL to {parts.hostname or 'no host'}" if parts else type(url).__name__
        raise bad(f"tools.{name}.url", f"an https:// URL (http:// only on loopback), got {got}")
    params = table.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(
        params.get("properties", {}), dict
    ):
        raise bad(f"tools.{name}.parameters", 'a JSON Schema object ({type = "object", properties = {...}})')
    try:
        # Checked here, not by the LLM server at the agent's first call (a typo such as type = "strin" is a 400
        # for every request of that agent).
        Draft202012Validator.check_schema(params)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "top level"
        raise bad(f"tools.{name}.parameters", f"not a valid JSON Schema at {where}: {e.message[:200]}") from None
    try:
        # TOML has values JSON has not (a bare date, nan, inf): the schema checks out, and then every request
        # offering the tool failed on our side, never reaching the server (so never dropped as refused).
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise bad(f"tools.{name}.parameters", f"JSON values only (no TOML dates, nan or inf): {e}") from None
    return HttpTool(name, description.strip(), url, params)


class AgentDirectory:
    """The agents in force, shared by the edge and the back-end of a process; SIGHUP swaps them whole.
    Calls keep the `Agent` they started with (immutable), so a reload never changes a live call."""

    def __init__(self, agents: Agents) -> None:
        self._agents = agents
        self._lock = threading.Lock()  # the back-end reads it from worker threads too

    @classmethod
    def from_file(cls, path: str | Path | None) -> AgentDirectory:
        return cls(Agents.load(path) if path else Agents.builtin())

    @property
    def agents(self) -> Agents:
        with self._lock:
            return self._agents

    def reload(self) -> bool:
        """Read the file again; a bad file is refused (logged, counted) and the old agents stay."""
        source = self.agents.source
        if source is None:
            log.info("SIGHUP: no agents file to reload (started without --agents)")
            return False
        try:
            fresh = Agents.load(source)
        except (AgentsError, ValueError, RecursionError) as e:  # (a file nested past the parser's depth)
            AGENT_RELOADS.labels(outcome="refused").inc()
            log.error("agents reload refused, the agents in force stay: %s", e)
            return False
        with self._lock:
            self._agents = fresh
        AGENT_RELOADS.labels(outcome="ok").inc()
        log.info("agents reloaded from %s: %s", source, ", ".join(sorted(fresh.by_name)))
        return True

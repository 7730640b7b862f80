"""`kame-phone twilio setup` (point a number at this service) and `kame-phone dial` (call a phone from it),
through Twilio's REST API (telephony/twilio_rest.py). Both read PUBLIC_URL and the Twilio credentials from
the environment (or `.env`); every failure is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import statistics
import sys
import time
from urllib.parse import quote, urlsplit

import aiohttp

from knowledge.agents import E164, Agents, AgentsError, is_sip_uri
from telephony.config import (
    ConfigError,
    check_public_url,
    hide_password,
    is_loopback,
    unfilled_message,
    unfilled_placeholders,
)
from telephony.server import CALL_STATUS_PATH, VOICE_PATH
from telephony.twilio_rest import TwilioRest, TwilioRestError


class CliError(Exception):
    """A one-line failure: printed after the command's name, exit 2 (set-up) or 1 (Twilio failed)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _public_url(args: argparse.Namespace) -> str:
    """PUBLIC_URL as `serve` takes it (a live number pointed at one `serve` refuses answered nothing), and one
    Twilio can reach: a loopback host only for a Twilio stand-in (TWILIO_API_BASE_URL, the tests')."""
    url = (args.public_url or "").strip().rstrip("/")  # stripped as serve strips it (a ConfigMap's newline)
    if not url:
        raise CliError("PUBLIC_URL is not set: the https:// URL Twilio reaches this service at (your tunnel's)")
    try:
        check_public_url("PUBLIC_URL", url)
    except ConfigError as e:
        raise CliError(str(e)) from None
    if is_loopback(urlsplit(url).hostname) and not os.environ.get("TWILIO_API_BASE_URL"):
        raise CliError(f"PUBLIC_URL {url!r} is this machine's loopback: Twilio cannot reach it (give your tunnel's "
                       "https:// URL)")
    return url


def _number(value: str, what: str) -> str:
    if not E164.fullmatch(value):
        raise CliError(f"{what} must be an E.164 number like +15551234567, got {value!r}")
    return value


def _sip_domain(value: str) -> str:
    # Twilio's rule for a SIP Domain's name; a typo is said here, not as "not a SIP Domain of account".
    if not re.fullmatch(r"[A-Za-z0-9-]+\.sip\.twilio\.com", value):
        raise CliError(f"--sip-domain must be a Twilio SIP Domain like acme.sip.twilio.com, got {value!r}")
    return value


def _rest(public_url: str) -> TwilioRest:
    # PUBLIC_URL as used: --public-url over the environment's (a .env still holding the example's was refused).
    if placeholders := unfilled_placeholders({**os.environ, "PUBLIC_URL": public_url}):
        raise CliError(unfilled_message(placeholders))
    rest = TwilioRest.from_env()
    if rest is None:
        raise CliError("no Twilio credentials: set TWILIO_ACCOUNT_SID with TWILIO_AUTH_TOKEN (or TWILIO_API_KEY and "
                       "TWILIO_API_SECRET), in the environment or in .env")  # fmt: skip
    return rest


async def twilio_setup(args: argparse.Namespace) -> None:
    number = _number(args.number, "--number") if args.number is not None else None
    domain = _sip_domain(args.sip_domain) if args.sip_domain is not None else None
    public = _public_url(args)
    voice_url, status_url = public + VOICE_PATH, public + CALL_STATUS_PATH
    rest = _rest(public)
    try:
        before = await rest.find_number(number) if number else await rest.find_sip_domain(domain or "")
        print(f"{before.name} ({before.sid}):")
        # Their URLs as printed: a webhook with basic auth carries its password (stdout ends up in CI logs).
        print(f"  voice URL:       {hide_password(before.voice_url) or '(none)'} [{before.voice_method or '-'}] -> "
              f"{voice_url} [POST]")  # fmt: skip
        print(f"  status callback: {hide_password(before.status_callback) or '(none)'} "
              f"[{before.status_callback_method or '-'}] -> {status_url} [POST]")  # fmt: skip
        if before.routed_elsewhere:
            # Changing the URL would change nothing a caller hears: said "done", it was a silent failure.
            raise CliError(f"{before.name}'s calls go to {before.routed_elsewhere}, and Twilio ignores its voice URL "
                           "while it is set: detach it (console: Phone Numbers > the number > Voice Configuration) "
                           "and run this again; nothing changed", code=1)  # fmt: skip
        theirs = before.status_callback or None
        if theirs is not None and urlsplit(theirs).path.endswith(CALL_STATUS_PATH):
            theirs = None  # ours (at an older URL: a quick tunnel's changes at each restart)
        if theirs and not args.replace_status_callback:
            # Another system (a CRM, a call log) reads this number's call statuses: taking them over silently
            # would break it. The service needs them to close calls that never streamed.
            message = (f"{before.name} sends its call statuses to {hide_password(theirs)}; this service needs them "
                       "(to close calls that never streamed). Pass --replace-status-callback to send them here "
                       "instead (that URL then gets none)")  # fmt: skip
            if not args.dry_run:
                raise CliError(message + "; nothing changed", code=1)
            print(f"note: {message}")
        if args.dry_run:
            print("--dry-run: nothing changed")
            return
        after = await rest.point(before, voice_url, status_url)
        print(f"done: calls to {before.name} now reach {after.voice_url}")
        if domain:
            print(f"agents answer its addresses by name: numbers = [\"sip:USER@{before.name}\"] in the agents file "
                  "(a call to sip:+NUMBER@... goes to that number's agent)")  # fmt: skip
    except TwilioRestError as e:
        raise CliError(str(e), code=1) from None
    finally:
        await rest.aclose()


TWILIO_STATUS_EVERY_S = 5.0  # how often `dial --wait` asks Twilio about a call the service has no record of
UNANSWERED = ("busy", "no-answer", "failed", "canceled")  # final Twilio statuses of a call never answered


async def dial(args: argparse.Namespace) -> None:
    # A SIP URI too: an extension on a PBX (through its trunk), a test softphone on a Twilio SIP Domain.
    to = args.to
    if not (E164.fullmatch(to) or is_sip_uri(to)):
        raise CliError(f"the number to call must be an E.164 number like +15551234567 or a sip: URI, got {to!r}")
    from_ = _number(args.from_number or "", "--from (one of your Twilio numbers)")
    public = _public_url(args)
    voice_url = public + VOICE_PATH
    if args.agent:
        _check_agent(args.agent, args.agents)
        voice_url += "?agent=" + quote(args.agent)  # signed by Twilio with the rest of the URL
    if args.wait and not args.admin_token:
        raise CliError("--wait reads the call's record from the service: set ADMIN_TOKEN")
    rest = _rest(public)
    try:
        try:
            call_sid = await rest.dial(to, from_, voice_url, public + CALL_STATUS_PATH)
        except TwilioRestError as e:
            raise CliError(str(e), code=1) from None
        print(call_sid, flush=True)
        if args.wait:
            await _follow(public, call_sid, args.admin_token, args.wait_timeout, rest)
    finally:
        await rest.aclose()


def _check_agent(name: str, agents_file: str | None) -> None:
    if not agents_file:
        return  # the service's own file decides; an unknown name gets its default agent
    try:
        agents = Agents.load(agents_file)
    except AgentsError as e:
        raise CliError(str(e)) from None
    if name not in agents.by_name:
        raise CliError(f"--agent {name!r} is not in {agents_file} (agents: {', '.join(sorted(agents.by_name))})")


async def _follow(public: str, call_sid: str, admin_token: str, timeout_s: float, rest: TwilioRest) -> None:
    """Poll the service's record of the call until it has ended; print its figures. A call never answered
    (busy, no answer) has no record: Twilio's own status says so, rather than the whole timeout."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {admin_token}"}
    record: dict | None = None
    asked_twilio = -math.inf
    ended_unrecorded = 0  # polls since Twilio said the call completed while the service still had no record of it
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() < deadline:
            if record is None and ended_unrecorded:
                ended_unrecorded += 1
                if ended_unrecorded > 3:  # its record's writes had seconds to land: it never reached the service
                    raise CliError(f"call {call_sid} was answered and has ended, but the service has no record of "
                                   "it: its webhook or stream never reached this service (see the Twilio console's "
                                   "call log)", code=1)  # fmt: skip
            elif record is None and time.monotonic() - asked_twilio >= TWILIO_STATUS_EVERY_S:
                asked_twilio = time.monotonic()
                with contextlib.suppress(TwilioRestError):  # Twilio unreachable for now: the record may still come
                    status = await rest.call_status(call_sid)
                    if status in UNANSWERED:
                        raise CliError(f"call {call_sid} was not answered: {status}", code=1)
                    ended_unrecorded = int(status == "completed")
            try:
                async with http.get(f"{public}/calls/{call_sid}") as r:
                    if r.status in (401, 403):
                        raise CliError(f"the service refused ADMIN_TOKEN (HTTP {r.status})", code=1)
                    record = await r.json() if r.status == 200 else record
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # the service may be restarting: keep asking until the deadline
            if record is not None and record.get("state") == "ended":
                break
            await asyncio.sleep(1.0)
        else:
            raise CliError(f"call {call_sid} had not ended after {timeout_s:g} s", code=1)
    assert record is not None
    print(_figures(record))
    if record.get("end_reason") not in CALL_ENDED_WELL:  # a smoke test's exit status says the service failed it
        raise CliError(f"call {call_sid} ended {record.get('end_reason')}", code=1)


# The ends of a call that went as it should (busy, engine_lost, no_start, ... are the service failing it).
CALL_ENDED_WELL = ("completed", "transferred", "ended_by_agent", "max_duration")


def _figures(record: dict) -> str:
    first = record.get("first_audio_s")
    turns = [float(x) for x in record.get("turn_latencies_s") or []]
    parts = [f"call {record.get('call_sid')}: {record.get('end_reason')}, agent {record.get('agent')}",
             "first audio " + (f"{first:.2f} s" if first is not None else "none")]  # fmt: skip
    if turns:
        parts.append(f"turn latency median {statistics.median(turns):.2f} s, max {max(turns):.2f} s "
                     f"over {len(turns)} turns")  # fmt: skip
    else:
        parts.append("no turns measured")
    return "; ".join(parts)


def run(coro_fn, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    try:
        asyncio.run(coro_fn(args))
    except CliError as e:
        print(f"kame-phone {args.command}{' ' + args.twilio_command if args.command == 'twilio' else ''}: {e}",
              file=sys.stderr)  # fmt: skip
        return e.code
    return 0

"""Calls to Twilio's REST API, through the `twilio` package's async client: hand a live call to a person
(`<Dial>` its agent's `transfer_to`), or hang it up.

Credentials: TWILIO_ACCOUNT_SID with TWILIO_AUTH_TOKEN, or TWILIO_API_KEY/TWILIO_API_SECRET (an API key
of that account). TWILIO_API_BASE_URL (Twilio's by default) points every request elsewhere: the tests run a
local stand-in. Without credentials there is no REST client: what needs one is not offered, and start-up
says so once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from twilio.base.exceptions import TwilioException
from twilio.http.async_http_client import AsyncTwilioHttpClient
from twilio.rest import Client
from twilio.twiml.voice_response import VoiceResponse

from .twiml import dial_twiml_verb

log = logging.getLogger(__name__)

# A transfer the caller waits for; Twilio answers in well under a second. Applied around each request here:
# the package's async client keeps a client-wide timeout but sends aiohttp none (no limit at all).
_TIMEOUT_S = 10.0


class TwilioRestError(RuntimeError):
    """A REST request failed (refused credentials, an unknown call, Twilio or the network down)."""


@dataclass(frozen=True)
class TwilioCredentials:
    account_sid: str
    username: str  # the account SID, or an API key SID
    password: str = field(repr=False)
    base_url: str | None = None  # TWILIO_API_BASE_URL: None for Twilio's own

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TwilioCredentials | None:
        env = os.environ if env is None else env
        # Stripped as serve's TWILIO_AUTH_TOKEN is (a secret made with `echo` ends in a newline): else the
        # webhooks worked and every transfer and hang-up was refused 401.
        account, key, secret, token = (env.get(name, "").strip() for name in (
            "TWILIO_ACCOUNT_SID", "TWILIO_API_KEY", "TWILIO_API_SECRET", "TWILIO_AUTH_TOKEN"))  # fmt: skip
        base_url = env.get("TWILIO_API_BASE_URL") or None
        if not account:
            return None
        if key and secret:
            return cls(account, key, secret, base_url)
        if token:
            return cls(account, account, token, base_url)
        return None


@dataclass(frozen=True)
class VoiceSettings:
    """Where Twilio sends the calls of one of the account's numbers or SIP Domains (what `twilio setup`
    changes). `name`: the number (E.164) or the domain (acme.sip.twilio.com)."""

    sid: str
    name: str
    voice_url: str | None
    voice_method: str | None
    status_callback: str | None
    status_callback_method: str | None
    # What takes the number's calls instead of its voice URL (Twilio ignores the URL while either is set): a
    # TwiML App ("TwiML App AP...") or an Elastic SIP Trunk ("SIP trunk TK..."); None: its voice URL does.
    routed_elsewhere: str | None = None

    @property
    def is_sip_domain(self) -> bool:
        return self.sid.startswith("SD")


def _number_settings(n: Any, name: str, sid: str = "") -> VoiceSettings:
    """An IncomingPhoneNumber resource's voice settings (`sid` where the answer lacks its own)."""
    app, trunk = getattr(n, "voice_application_sid", None), getattr(n, "trunk_sid", None)
    elsewhere = f"the TwiML App {app}" if app else f"the SIP trunk {trunk}" if trunk else None
    return VoiceSettings(n.sid or sid, name, n.voice_url, n.voice_method, n.status_callback, n.status_callback_method,
                         elsewhere)  # fmt: skip


def _domain_settings(d: Any, name: str, sid: str = "") -> VoiceSettings:
    """A SIP Domain resource's: its status callback has other field names."""
    return VoiceSettings(d.sid or sid, name, d.voice_url, d.voice_method, d.voice_status_callback_url,
                         d.voice_status_callback_method)  # fmt: skip


# What a request to Twilio can fail with. RestException is a TwilioException; the HTTP client's own errors
# (a keep-alive connection closed under a POST, which aiohttp does not retry; a bad API base URL) are not
# OSErrors, and escaped to the caller's action task, which then never let the call act again.
_FAILURES = (TwilioException, aiohttp.ClientError, OSError, TimeoutError, ValueError)


def _why(e: BaseException, doing: str) -> str:
    """One line for a failed REST request: refused credentials said as such, never the credentials."""
    if isinstance(e, TimeoutError):
        return f"Twilio REST request failed while {doing}: Twilio did not answer in time"
    status = getattr(e, "status", None)  # a RestException; a page that failed carries the response in its args
    status = status or next((a.status_code for a in e.args if hasattr(a, "status_code")), None)
    if status in (401, 403):
        return f"Twilio refused the credentials while {doing} (HTTP {status}): check TWILIO_ACCOUNT_SID and " \
            "TWILIO_AUTH_TOKEN (or TWILIO_API_KEY/TWILIO_API_SECRET)"
    message = getattr(e, "msg", None) or str(e)
    return f"Twilio REST request failed while {doing}: {' '.join(str(message).split())[:300]}"


class TwilioRest:
    """One client for the process (its HTTP session is shared by every call)."""

    def __init__(self, credentials: TwilioCredentials, timeout_s: float = _TIMEOUT_S) -> None:
        self.credentials = credentials
        self.timeout_s = timeout_s
        self._http = AsyncTwilioHttpClient(timeout=timeout_s)
        self._client = Client(credentials.username, credentials.password, credentials.account_sid,
                              http_client=self._http)  # fmt: skip
        if credentials.base_url:
            self._client.api.base_url = credentials.base_url.rstrip("/")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TwilioRest | None:
        credentials = TwilioCredentials.from_env(env)
        if credentials is None:
            log.info("no Twilio REST credentials (TWILIO_ACCOUNT_SID with TWILIO_AUTH_TOKEN or "
                     "TWILIO_API_KEY/TWILIO_API_SECRET): the agents' transfer_call and end_call tools are "
                     "not offered, and DTMF transfers are off")  # fmt: skip
            return None
        return cls(credentials)

    async def transfer(self, call_sid: str, target: str) -> None:
        """Replace the live call's TwiML with a `<Dial>` to `target` (E.164 or sip:): its stream ends."""
        response = VoiceResponse()
        response.append(dial_twiml_verb(target))
        await self._update(call_sid, twiml=response.to_xml())

    async def complete(self, call_sid: str) -> None:
        """Hang the call up."""
        await self._update(call_sid, status="completed")

    async def find_number(self, number: str) -> VoiceSettings:
        """The account's IncomingPhoneNumber for `number` (E.164), with its voice settings."""
        try:
            async with asyncio.timeout(self.timeout_s):
                found = await self._client.incoming_phone_numbers.list_async(phone_number=number, limit=2)
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"looking up {number}")) from e
        found = [n for n in found if n.phone_number == number]
        if not found:
            raise TwilioRestError(f"{number} is not a phone number of account {self.credentials.account_sid}")
        return _number_settings(found[0], number)

    async def find_sip_domain(self, domain: str) -> VoiceSettings:
        """The account's SIP Domain named `domain` (acme.sip.twilio.com): where a PBX's SIP trunk sends
        calls; Twilio asks its voice URL for TwiML as for a number's call."""
        try:
            async with asyncio.timeout(self.timeout_s):
                # No filter by name in the API; an account has a handful of domains (1000 is Twilio's page cap).
                found = await self._client.api.v2010.account.sip.domains.list_async(limit=1000)
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"looking up SIP Domain {domain}")) from e
        found = [d for d in found if (d.domain_name or "").lower() == domain.lower()]
        if not found:
            raise TwilioRestError(f"{domain} is not a SIP Domain of account {self.credentials.account_sid} "
                                  "(create it in the console: Voice > Manage > SIP domains)")  # fmt: skip
        return _domain_settings(found[0], found[0].domain_name or domain)

    async def point(self, target: VoiceSettings, voice_url: str, status_callback: str) -> VoiceSettings:
        """Send the number's or SIP Domain's calls to `voice_url` (POST), its call status events to
        `status_callback`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if target.is_sip_domain:
                    d = await self._client.api.v2010.account.sip.domains(target.sid).update_async(
                        voice_url=voice_url, voice_method="POST", voice_status_callback_url=status_callback,
                        voice_status_callback_method="POST",
                    )  # fmt: skip
                    return _domain_settings(d, target.name, target.sid)
                n = await self._client.incoming_phone_numbers(target.sid).update_async(
                    voice_url=voice_url, voice_method="POST", status_callback=status_callback,
                    status_callback_method="POST",
                )  # fmt: skip
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"updating {target.name}")) from e
        return _number_settings(n, target.name, target.sid)

    async def dial(self, to: str, from_: str, voice_url: str, status_callback: str) -> str:
        """Place an outbound call that Twilio connects to `voice_url` once answered; returns its CallSid."""
        try:
            async with asyncio.timeout(self.timeout_s):
                call = await self._client.calls.create_async(
                    to=to, from_=from_, url=voice_url, method="POST", status_callback=status_callback,
                    status_callback_method="POST",
                )  # fmt: skip
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"calling {to}")) from e
        return str(call.sid)

    async def call_status(self, call_sid: str) -> str:
        """The call's status as Twilio has it: queued, ringing, in-progress, completed, busy, no-answer, ..."""
        try:
            async with asyncio.timeout(self.timeout_s):
                call = await self._client.api.v2010.account.calls(call_sid).fetch_async()
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"looking up call {call_sid}")) from e
        return str(call.status)

    async def _update(self, call_sid: str, **changes: str) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._client.api.v2010.account.calls(call_sid).update_async(**changes)
        except _FAILURES as e:
            raise TwilioRestError(_why(e, f"updating call {call_sid}")) from e

    async def aclose(self) -> None:
        await self._http.close()

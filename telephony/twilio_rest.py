"""Calls to Twilio's REST API, through the `twilio` package's async client: hand a live call to a person
(`<Dial>` its agent's `transfer_to`), or hang it up.

Credentials: TWILIO_ACCOUNT_SID with TWILIO_AUTH_TOKEN, or TWILIO_API_KEY/TWILIO_API_SECRET (an API key
of that account). TWILIO_API_BASE_URL (Twilio's by default) points every request elsewhere: the tests run a
local stand-in. Without credentials there is no REST client: what needs one is not offered, and start-up
says so once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from twilio.base.exceptions import TwilioException
from twilio.http.async_http_client import AsyncTwilioHttpClient
from twilio.rest import Client
from twilio.twiml.voice_response import VoiceResponse

from .twiml import dial_twiml_verb

log = logging.getLogger(__name__)

_TIMEOUT_S = 10.0  # a transfer the caller waits for; Twilio answers in well under a second


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
        account = env.get("TWILIO_ACCOUNT_SID", "")
        base_url = env.get("TWILIO_API_BASE_URL") or None
        if not account:
            return None
        if env.get("TWILIO_API_KEY") and env.get("TWILIO_API_SECRET"):
            return cls(account, env["TWILIO_API_KEY"], env["TWILIO_API_SECRET"], base_url)
        if env.get("TWILIO_AUTH_TOKEN"):
            return cls(account, account, env["TWILIO_AUTH_TOKEN"], base_url)
        return None


class TwilioRest:
    """One client for the process (its HTTP session is shared by every call)."""

    def __init__(self, credentials: TwilioCredentials) -> None:
        self.credentials = credentials
        self._http = AsyncTwilioHttpClient(timeout=_TIMEOUT_S)
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

    async def _update(self, call_sid: str, **changes: str) -> None:
        try:
            await self._client.api.v2010.account.calls(call_sid).update_async(**changes)
        except (TwilioException, OSError, TimeoutError) as e:  # RestException is a TwilioException
            raise TwilioRestError(f"Twilio REST update of {call_sid} failed: {e}") from e

    async def aclose(self) -> None:
        await self._http.close()

"""A local stand-in for Twilio's REST API (the paid external API), with HTTP Basic auth checked against the
account's credentials: the Calls updates our service makes (recorded), the account's IncomingPhoneNumbers
and SIP Domains (`twilio setup`), and Calls created (`dial`): once "answered", the stand-in drives the call through the
service's real webhook and media stream with the simulated caller, as Twilio would."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from telephony.sim_caller import simulate_call
from telephony.sim_playout import CallReport

from .loopback_http import serve_on_loopback


@dataclass
class TwilioRestStandIn:
    account_sid: str
    username: str
    password: str
    base_url: str = ""
    updates: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (CallSid, form)
    updated_at: list[float] = field(default_factory=list)  # time.time() of each update
    refused: int = 0
    drop_updates: int = 0  # close this many call updates' connections unanswered (a keep-alive closed under us)
    update_delay_s: float = 0.0  # answer call updates this late
    numbers: dict[str, dict[str, str | None]] = field(default_factory=dict)  # PN sid -> the number's settings
    number_updates: list[dict[str, str]] = field(default_factory=list)
    sip_domains: dict[str, dict[str, str | None]] = field(default_factory=dict)  # SD sid -> the domain's settings
    sip_domain_updates: list[dict[str, str]] = field(default_factory=list)
    created: list[dict[str, str]] = field(default_factory=list)  # Calls.create forms
    # Dialed calls are answered with this audio by the simulated caller, its media socket at `media_ws_url`;
    # the webhook is signed with `auth_token` (the account's, which the service checks).
    answer_wav: Path | None = None
    media_ws_url: str = ""
    auth_token: str | None = None
    reports: list[asyncio.Task[CallReport]] = field(default_factory=list)
    # With no `answer_wav`, nobody answers dialed calls: their status, once Twilio has given up on them.
    unanswered_status: str = "no-answer"
    call_status: dict[str, str] = field(default_factory=dict)  # CallSid -> status, for calls created here
    status_fetches: int = 0

    def add_number(self, number: str, voice_url: str | None = None, voice_application_sid: str | None = None,
                   trunk_sid: str | None = None, status_callback: str | None = None) -> str:  # fmt: skip
        sid = "PN" + secrets.token_hex(16)
        self.numbers[sid] = {"sid": sid, "phone_number": number, "voice_url": voice_url, "voice_method": "POST",
                             "status_callback": status_callback, "status_callback_method": status_callback and "POST",
                             "voice_application_sid": voice_application_sid, "trunk_sid": trunk_sid}  # fmt: skip
        return sid

    def add_sip_domain(self, domain: str, voice_url: str | None = None) -> str:
        sid = "SD" + secrets.token_hex(16)
        self.sip_domains[sid] = {"sid": sid, "domain_name": domain, "voice_url": voice_url, "voice_method": "POST",
                                 "voice_status_callback_url": None, "voice_status_callback_method": None}  # fmt: skip
        return sid

    def _authorized(self, request: web.Request) -> bool:
        expected = "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        ok = request.headers.get("Authorization") == expected and request.match_info["account"] == self.account_sid
        self.refused += not ok
        return ok

    @staticmethod
    def _refused() -> web.Response:
        return web.json_response({"code": 20003, "message": "Authenticate", "status": 401}, status=401)

    async def update_call(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refused()
        sid = request.match_info["call"]
        form = {k: str(v) for k, v in (await request.post()).items()}
        if self.drop_updates > 0:
            self.drop_updates -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent
        if self.update_delay_s:
            await asyncio.sleep(self.update_delay_s)
        self.updates.append((sid, form))
        self.updated_at.append(time.time())
        status = form.get("Status", "in-progress")
        return web.json_response({"sid": sid, "account_sid": self.account_sid, "status": status})

    async def fetch_call(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refused()
        sid = request.match_info["call"]
        self.status_fetches += 1
        if sid not in self.call_status:
            return web.json_response({"code": 20404, "message": "not found", "status": 404}, status=404)
        return web.json_response({"sid": sid, "account_sid": self.account_sid, "status": self.call_status[sid]})

    async def list_numbers(self, request: web.Request) -> web.Response:
        wanted = request.query.get("PhoneNumber")
        found = [n for n in self.numbers.values() if wanted in (None, n["phone_number"])]
        return self._page(request, "incoming_phone_numbers", found)

    async def update_number(self, request: web.Request) -> web.Response:
        callbacks = {"StatusCallback": "status_callback", "StatusCallbackMethod": "status_callback_method"}
        return await self._update(request, self.numbers.get(request.match_info["number"]), self.number_updates,
                                  callbacks)

    async def list_sip_domains(self, request: web.Request) -> web.Response:
        return self._page(request, "domains", list(self.sip_domains.values()))

    async def update_sip_domain(self, request: web.Request) -> web.Response:
        callbacks = {"VoiceStatusCallbackUrl": "voice_status_callback_url",
                     "VoiceStatusCallbackMethod": "voice_status_callback_method"}
        domain = self.sip_domains.get(request.match_info["domain"])
        return await self._update(request, domain, self.sip_domain_updates, callbacks)

    def _page(self, request: web.Request, key: str, found: list[dict[str, str | None]]) -> web.Response:
        """One page of a list resource, as Twilio pages them (the client reads `key` and `next_page_uri`)."""
        if not self._authorized(request):
            return self._refused()
        return web.json_response({key: found, "next_page_uri": None, "page": 0, "page_size": 50, "start": 0,
                                  "end": len(found), "uri": request.path, "first_page_uri": request.path,
                                  "previous_page_uri": None})  # fmt: skip

    async def _update(self, request: web.Request, resource: dict[str, str | None] | None,
                      updates: list[dict[str, str]], callbacks: dict[str, str]) -> web.Response:
        """A number's or SIP Domain's voice settings changed by form fields (recorded in `updates`)."""
        if not self._authorized(request):
            return self._refused()
        if resource is None:
            return web.json_response({"code": 20404, "message": "not found", "status": 404}, status=404)
        form = {k: str(v) for k, v in (await request.post()).items()}
        updates.append(form)
        for key, field_name in {"VoiceUrl": "voice_url", "VoiceMethod": "voice_method", **callbacks}.items():
            if key in form:
                resource[field_name] = form[key]
        return web.json_response(resource)

    async def create_call(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refused()
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.created.append(form)
        sid = "CA" + secrets.token_hex(16)
        self.call_status[sid] = self.unanswered_status if self.answer_wav is None else "in-progress"
        if self.answer_wav is not None:  # the callee answers: Twilio requests the call's Url
            url = form["Url"]
            parts = urlsplit(url)
            self.reports.append(asyncio.create_task(simulate_call(
                self.media_ws_url, self.answer_wav, auth_token=self.auth_token,
                public_url=f"{parts.scheme}://{parts.netloc}", voice_url=url, custom_sid=sid,
                from_number=form["From"], to_number=form["To"], direction="outbound-api", hold_after=2.0,
            )))  # fmt: skip
        return web.json_response({"sid": sid, "account_sid": self.account_sid, "status": "queued",
                                  "to": form.get("To"), "from": form.get("From")}, status=201)  # fmt: skip


@contextlib.asynccontextmanager
async def serve_twilio_rest(account_sid: str, username: str, password: str) -> AsyncIterator[TwilioRestStandIn]:
    stand_in = TwilioRestStandIn(account_sid, username, password)
    app = web.Application()
    api = "/2010-04-01/Accounts/{account}"
    app.router.add_post(api + "/Calls/{call}.json", stand_in.update_call)
    app.router.add_get(api + "/Calls/{call}.json", stand_in.fetch_call)
    app.router.add_post(api + "/Calls.json", stand_in.create_call)
    app.router.add_get(api + "/IncomingPhoneNumbers.json", stand_in.list_numbers)
    app.router.add_post(api + "/IncomingPhoneNumbers/{number}.json", stand_in.update_number)
    app.router.add_get(api + "/SIP/Domains.json", stand_in.list_sip_domains)
    app.router.add_post(api + "/SIP/Domains/{domain}.json", stand_in.update_sip_domain)
    async with serve_on_loopback(app) as base_url:
        stand_in.base_url = base_url
        try:
            yield stand_in
        finally:
            for task in stand_in.reports:
                task.cancel()
            await asyncio.gather(*stand_in.reports, return_exceptions=True)

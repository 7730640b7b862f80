"""A local stand-in for Twilio's REST API (the paid external API): the Calls update our service makes,
recorded, with HTTP Basic auth checked against the account's credentials."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

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

    def _authorized(self, request: web.Request) -> bool:
        expected = "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        return request.headers.get("Authorization") == expected

    async def update_call(self, request: web.Request) -> web.Response:
        if not self._authorized(request) or request.match_info["account"] != self.account_sid:
            self.refused += 1
            return web.json_response({"code": 20003, "message": "Authenticate", "status": 401}, status=401)
        sid = request.match_info["call"]
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.updates.append((sid, form))
        self.updated_at.append(time.time())
        status = form.get("Status", "in-progress")
        return web.json_response({"sid": sid, "account_sid": self.account_sid, "status": status})


@contextlib.asynccontextmanager
async def serve_twilio_rest(account_sid: str, username: str, password: str) -> AsyncIterator[TwilioRestStandIn]:
    stand_in = TwilioRestStandIn(account_sid, username, password)
    app = web.Application()
    app.router.add_post("/2010-04-01/Accounts/{account}/Calls/{call}.json", stand_in.update_call)
    async with serve_on_loopback(app) as base_url:
        stand_in.base_url = base_url
        yield stand_in

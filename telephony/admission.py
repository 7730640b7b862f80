"""Which calls may open a media stream here: the per-call token the voice webhook hands out.

`/twilio/voice` reserves a slot and issues a random token bound to the CallSid (sent back to us by
Twilio as a `<Parameter>`). The stream's `start` must carry the same CallSid and token; the first use
consumes the reservation. A reconnect of the same live call (Twilio sometimes opens a second socket for
one call) presents the same pair and is accepted, replacing the first stream; the token is forgotten
when the call ends. Reservations that never see their stream expire, freeing the slot.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Grant:
    token: str
    issued_at: float
    claimed: bool = False


class Admission:
    def __init__(self, reservation_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.reservation_ttl_s = reservation_ttl_s
        self.clock = clock
        self._grants: dict[str, _Grant] = {}

    def _expire(self) -> None:
        now = self.clock()
        stale = [sid for sid, g in self._grants.items() if not g.claimed and now - g.issued_at > self.reservation_ttl_s]
        for sid in stale:
            del self._grants[sid]

    @property
    def reserved(self) -> int:
        """Slots promised to calls whose stream has not started yet."""
        self._expire()
        return sum(not g.claimed for g in self._grants.values())

    def issue(self, call_sid: str) -> str:
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None:  # Twilio retries a webhook with the same CallSid: same token
            grant = self._grants[call_sid] = _Grant(secrets.token_urlsafe(24), self.clock())
        return grant.token

    def claim(self, call_sid: str, token: str | None) -> bool:
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None or token is None or not hmac.compare_digest(grant.token, token):
            return False
        grant.claimed = True
        return True

    def release(self, call_sid: str) -> None:
        self._grants.pop(call_sid, None)

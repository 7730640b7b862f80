"""Which calls may open a media stream here: the per-call token the voice webhook hands out.

`/twilio/voice` reserves a slot and issues a random token bound to the CallSid (sent back to us by
Twilio as a `<Parameter>`). The stream's `start` must carry the same CallSid and token; the first use
consumes the reservation. A reconnect of the same live call (Twilio sometimes opens a second socket for
one call) presents the same pair and is accepted, replacing the first stream; the token is forgotten
when the call ends. Reservations that never see their stream expire, freeing the slot.

This is the in-process book keeping; `telephony.cluster` builds single- and multi-node admission on it.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


def new_token() -> str:
    return secrets.token_urlsafe(24)


def tokens_match(expected: str, given: str | None) -> bool:
    """Constant-time; bytes, so a non-ASCII token from a caller is a mismatch rather than a TypeError."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


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

    def token_for(self, call_sid: str) -> str | None:
        """The live grant's token for this call (reserved or streaming), if any."""
        self._expire()
        grant = self._grants.get(call_sid)
        return None if grant is None else grant.token

    def issue(self, call_sid: str, token: str | None = None) -> str:
        """Reserve for `call_sid` (with `token`, or a new one); a call that has a grant keeps its token."""
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None:  # Twilio retries a webhook with the same CallSid: same token
            grant = self._grants[call_sid] = _Grant(token or new_token(), self.clock())
        return grant.token

    def claim(self, call_sid: str, token: str | None) -> bool:
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None or not tokens_match(grant.token, token):
            return False
        grant.claimed = True
        return True

    def release(self, call_sid: str) -> None:
        self._grants.pop(call_sid, None)

"""Which calls may open a media stream here: the per-call token the voice webhook hands out.

`/twilio/voice` reserves a slot and issues a random token bound to the CallSid (sent back to us by
Twilio as a `<Parameter>`). The stream's `start` must carry the same CallSid and token, and the token is
single-use: a second socket presenting it (a replayed webhook's answer, say) is refused and never replaces
or hears the live call. Twilio's signatures carry no nonce, so a signed webhook can be replayed: a CallSid
whose stream started (or whose reservation was released, or expired) is remembered as used up and gets no
new token. A retried webhook before the stream starts gets the same token back. Reservations that never see
their stream expire within seconds, freeing the slot; a webhook replayed after that (a captured one) gets no
second seat and token, again every few seconds, for good.

This is the in-process book keeping; `telephony.cluster` builds single- and multi-node admission on it.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

REMEMBERED_CALLS = 100_000  # used-up CallSids kept in memory (~10 MB); a multi-node store keeps them in Redis


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


class CallSidUsed(Exception):
    """The voice webhook for a CallSid whose stream already started (a replay): no new token."""


class Admission:
    def __init__(self, reservation_ttl_s: float = 8.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.reservation_ttl_s = reservation_ttl_s
        self.clock = clock
        self._grants: dict[str, _Grant] = {}
        # CallSid -> whether its stream started (False: its reservation expired, or was released, unclaimed).
        self._used: collections.OrderedDict[str, bool] = collections.OrderedDict()

    def used(self, call_sid: str) -> bool:
        """True once the call's stream started here (live or ended), or its reservation was released or
        expired: it gets no new token."""
        self._expire()
        return call_sid in self._used

    def streamed(self, call_sid: str) -> bool:
        """True once the call's stream started (here, or elsewhere on a grant kept there); not for a
        reservation that expired or was released unclaimed (the call status callback ends that record)."""
        self._expire()
        return self._used.get(call_sid, False)

    def _use_up(self, call_sid: str, streamed: bool) -> None:
        self._used[call_sid] = streamed or self._used.get(call_sid, False)
        self._used.move_to_end(call_sid)
        if len(self._used) > REMEMBERED_CALLS:
            self._used.popitem(last=False)

    def _expire(self) -> None:
        now = self.clock()
        stale = [sid for sid, g in self._grants.items() if not g.claimed and now - g.issued_at > self.reservation_ttl_s]
        for sid in stale:
            del self._grants[sid]
            self._use_up(sid, streamed=False)  # its one chance: a webhook for it now is a replay

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

    def awaited(self, call_sid: str) -> bool:
        """Whether the call has a live grant whose stream has not started."""
        self._expire()
        grant = self._grants.get(call_sid)
        return grant is not None and not grant.claimed

    def issue(self, call_sid: str, token: str | None = None) -> str:
        """Reserve for `call_sid` (with `token`, or a new one); a call that has a grant keeps its token."""
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None:  # Twilio retries a webhook with the same CallSid: same token
            grant = self._grants[call_sid] = _Grant(token or new_token(), self.clock())
        return grant.token

    def claim(self, call_sid: str, token: str | None) -> bool:
        """True once per grant: the first stream with the call's token. A second socket gets False."""
        self._expire()
        grant = self._grants.get(call_sid)
        if grant is None or grant.claimed or not tokens_match(grant.token, token):
            return False
        grant.claimed = True
        self._use_up(call_sid, streamed=True)
        return True

    def mark_used(self, call_sid: str) -> None:
        """Remember `call_sid` as used up though it had no grant here (its stream started on a grant kept
        elsewhere): it gets no new token, and no second stream."""
        self._grants.pop(call_sid, None)
        self._use_up(call_sid, streamed=True)

    def release(self, call_sid: str) -> None:
        if (grant := self._grants.pop(call_sid, None)) is not None:
            self._use_up(call_sid, streamed=grant.claimed)

"""Per-call oracle cursor: which oracle token a call slot feeds on its next executed step.

KAME's rule, per slot instead of per batch: a new candidate starts with the boundary token, then its
tokens one per frame, then padding; the newest candidate always wins. Unlike the official code (which
anchors tokens to wall-clock steps and silently skips ones that arrive late), tokens that arrive while a
candidate streams continue it without gaps: the cursor waits on padding and resumes at the next unfed
token, which matches the contiguous layout the model saw in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OracleBuffer:
    start_token: int  # boundary token (text_card, i.e. 32000 at full size)
    pad_token: int = 3
    seq: list[int] = field(default_factory=list)  # boundary + tokens of the current candidate
    fed: int = 0  # how many entries of `seq` were fed already
    candidate_id: int = -1  # the back-end's id for the current candidate
    lag_from: float | None = None  # when the request behind this candidate was triggered (monotonic)
    queued_at: float | None = None  # when this candidate reached the slot (monotonic)

    def set_candidate(
        self, candidate_id: int, tokens: list[int], triggered_at: float | None = None, now: float | None = None
    ) -> None:
        """Install (or extend) a candidate. A new id restarts at the boundary; the same id continues."""
        new_seq = [self.start_token, *tokens]
        if candidate_id != self.candidate_id:
            self.candidate_id = candidate_id
            self.fed = 0
            self.lag_from = triggered_at
            self.queued_at = now
        # The same candidate re-tokenized as a whole: what was fed stays fed, the rest follows on.
        self.seq = new_seq

    def clear(self) -> None:
        self.seq = []
        self.fed = 0
        self.candidate_id = -1
        self.lag_from = None
        self.queued_at = None

    def next_token(self) -> int:
        """Token for the next executed step of this slot; advances the cursor."""
        if self.fed < len(self.seq):
            token = self.seq[self.fed]
            self.fed += 1
            return token
        return self.pad_token

    @property
    def streaming(self) -> bool:
        return self.fed < len(self.seq)

"""Per-call oracle cursor: which oracle token a call slot feeds on its next executed step.

KAME's rule, per slot instead of per batch: a new candidate starts with the boundary token, then its
tokens one per frame, then padding; the newest candidate always wins. Unlike the official code (which
anchors tokens to wall-clock steps and silently skips ones that arrive late), tokens that arrive while a
candidate streams continue it without gaps: the cursor waits on padding and resumes at the next unfed
token, which matches the contiguous layout the model saw in training.

A growing draft is re-tokenized as a whole, and only its *settled* tokens are fed: those no later text of
the same draft can change. SentencePiece splits on whitespace, so every word followed by whitespace is
settled; the unfinished last word ("... for cal") is held back until more text or the end of the stream
decides it ("calling" is one piece, "cal" two). Feeding it early would mix two tokenizations of one word.
docs/oracle.md has the whole rule and how it differs from the official code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

# The space right before the draft's last word. A plain space only: Python's \s also matches characters
# SentencePiece deletes or keeps inside a word (\x0b, \x1c-\x1f, \x85), and a "word" ended by one was fed,
# then re-tokenized with what followed (two tokenizations of one word). Other whitespace only holds a word
# back until the next space or the stream's end.
_LAST_SPACE = re.compile(r" (?=[^ ]*$)")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Characters the tokenizer maps to unknown (id 0) or deletes: U+FFFD (a broken character), control characters
# other than \t \n \r \f (SentencePiece reads those as a space), zero-width and bidi format marks, and private
# use. Deleted, as SentencePiece deletes most of them anyway: an unknown token in the oracle is a token the model
# never saw there. Per character, so a draft's prefix strips to a prefix of the whole (settling is unchanged).
_UNKNOWN = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff"
                      "\ue000-\uf8ff\ufffd\ufffe\uffff]")


def well_formed(text: str) -> str:
    """`text` as valid Unicode. JSON may carry UTF-16 surrogates, and an LLM stream can split a pair across
    two chunks ("\\ud83d", then "\\ude00"): joined, those are two lone surrogates, which SentencePiece (and
    any UTF-8 encoder) refuses. Pairs are joined into their character; a lone one becomes U+FFFD."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class DraftTokens:
    tokens: list[int]  # the whole draft, tokenized as a whole
    settled: int  # how many leading tokens no later text of this draft can change


def tokenize_draft(tokenizer: Tokenizer, text: str, complete: bool) -> DraftTokens:
    """Tokenize a draft; all of it is settled once `complete` (its stream ended), else all but its last word."""
    text = well_formed(text)  # from any back-end or engine-link peer: one call's bad text must not raise here
    text = _UNKNOWN.sub("", text)
    tokens = tokenizer.encode(text) if text else []
    if complete:
        return DraftTokens(tokens, len(tokens))
    # Text up to (and with) the last whitespace: its words are finished. If the draft ends in whitespace,
    # that is all of it.
    space = _LAST_SPACE.search(text)
    head = text[: space.end()] if space else ""
    head_tokens = tokenizer.encode(head) if head.strip() else []
    # The common prefix, not len(head_tokens): a tokenizer that merged across words must never get a token
    # fed that the whole draft does not also have.
    settled = 0
    for a, b in zip(head_tokens, tokens, strict=False):
        if a != b:
            break
        settled += 1
    return DraftTokens(tokens, settled)


@dataclass
class OracleBuffer:
    start_token: int  # boundary token (text_card, i.e. 32000 at full size)
    pad_token: int = 3
    seq: list[int] = field(default_factory=list)  # boundary + tokens of the current candidate
    feedable: int = 0  # entries of `seq` that may be fed: the boundary and the settled tokens
    fed: int = 0  # how many entries of `seq` were fed already
    candidate_id: int = -1  # the back-end's id for the current candidate
    lag_from: float | None = None  # when the request behind this candidate was triggered (monotonic)
    queued_at: float | None = None  # when this candidate reached the slot (monotonic)

    def set_candidate(
        self,
        candidate_id: int,
        draft: DraftTokens,
        triggered_at: float | None = None,
        now: float | None = None,
    ) -> None:
        """Install (or extend) a candidate. A new id restarts at the boundary; the same id continues."""
        if candidate_id != self.candidate_id:
            self.candidate_id = candidate_id
            self.fed = 0
            self.lag_from = triggered_at
            self.queued_at = now
        # The same candidate re-tokenized as a whole: what was fed stays fed (settled tokens never change),
        # the rest follows on. The boundary goes at once, even before any token is settled.
        self.seq = [self.start_token, *draft.tokens]
        self.feedable = 1 + draft.settled

    def clear(self) -> None:
        self.seq = []
        self.feedable = 0
        self.fed = 0
        self.candidate_id = -1
        self.lag_from = None
        self.queued_at = None

    def next_token(self) -> int:
        """Token for the next executed step of this slot; advances the cursor."""
        if self.fed < self.feedable:
            token = self.seq[self.fed]
            self.fed += 1
            return token
        return self.pad_token

"""Per-call conversation state for the LLM back-end: what the caller said and what the bot said.

The caller side comes from the STT (finals and one pending partial); the bot side is rebuilt from the
SentencePiece pieces the front-end model emits, one per 80 ms frame ('▁' starts a word, '' is padding).
`messages()` renders it as OpenAI chat messages: caller = user, bot = assistant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

WORD_START = "\u2581"  # SentencePiece's '▁'

DEFAULT_SYSTEM_PROMPT = (
    "You are the thinking half of a voice assistant on a phone call. A fast speech model is already "
    "talking to the caller and uses your text as a script for what to say next. Write the assistant's "
    "next spoken reply to the caller.\n"
    "Rules:\n"
    "- At most 30 words, in plain spoken English: no lists, symbols, emoji or markdown. Say numbers, "
    "times and prices the way a person would say them aloud.\n"
    "- The caller's words come from speech recognition while they are still talking: they may be "
    "unfinished or misheard. Work out what the caller is most likely asking and answer that.\n"
    "- The assistant's earlier lines were spoken by the fast model and may contain mistakes. If "
    "something it said was wrong, correct it briefly and naturally.\n"
    "- Reply with the words to speak and nothing else."
)


@dataclass(slots=True)
class Turn:
    role: Literal["user", "assistant"]
    text: str  # raw text; whitespace is normalised when rendered


@dataclass(slots=True)
class ToolExchange:
    """Function calls the LLM made and their results, kept together: the API wants an assistant message
    with `tool_calls` followed at once by one `tool` message per call."""

    calls: list[dict[str, Any]]  # OpenAI's assistant `tool_calls` entries
    results: list[tuple[str, str]]  # (tool_call_id, content)
    role: Literal["tool"] = "tool"
    # Made while the caller was still talking: their final, when it comes, goes before it (the words that
    # asked for the call come first, and the request after its result ends with that result).
    mid_utterance: bool = False
    # Its calls rendered, counted once (results are filled in later; calls are not).
    _calls_chars: int = field(default=-1, compare=False, repr=False)

    def size(self) -> int:
        """Characters as a request charges it: its calls rendered (counted once) and its results' text."""
        if self._calls_chars < 0:
            self._calls_chars = len(str(self.calls or ""))
        return self._calls_chars + sum(len(str(content or "")) for _, content in self.results)

    def group(self) -> list[dict[str, Any]]:
        """As chat messages: the assistant's `tool_calls`, then one `tool` message per result."""
        group: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": self.calls}]
        return group + [{"role": "tool", "tool_call_id": cid, "content": content} for cid, content in self.results]


# The transcript sent with each request, newest first, up to this many characters (~4k tokens; the system
# prompt and the caller's unfinished words come on top). Every request carries the whole history, several a
# second while the caller talks: without a bound a long call's requests grow without end, and past a small
# self-hosted model's context every one fails and the call runs front-end only for the rest of its life.
MAX_HISTORY_CHARS = 16_000
# A tool exchange rendered is over this many characters (its `tool_calls` entry's keys alone are), so no request
# could send more than max_history_chars // this of them (and the newest). Requests consider only that many of
# the newest that fit the budget, and pruning keeps no more: an LLM calling tools on every request kept them all.
MIN_EXCHANGE_CHARS = 64
# No one turn takes more than this share of it: a caller who talks on with no reply (a recorded message, a
# dictation) or a bot that talks on alone grows one turn without end, and sent whole it would either be the
# whole prompt or crowd every earlier turn out. Its newest words are kept (a quarter is ~700 words, minutes
# of speech: no real turn is cut).
TURN_SHARE = 4
MIN_CLIPPED_CHARS = 40  # a turn clipped to fewer than this says nothing: the history stops there instead
# Kept in memory: what a request could still send, several times over. Every turn of a long call was kept and
# re-rendered on every request (thousands after hours: 12 ms a request on the event loop at 4 h), and one turn
# growing piece by piece was copied whole at each piece. Older turns are dropped every PRUNE_EVERY new ones, and
# a turn's text past what a request sends of it is dropped from its front.
KEEP_HISTORY_FACTOR = 3
PRUNE_EVERY = 64


def _clean(text: str) -> str:
    return " ".join(text.split())


def _tail(text: str, limit: int) -> str:
    """The newest `limit` characters of a turn, from a word's start, marked as cut."""
    if len(text) <= limit:
        return text
    cut = text[len(text) - limit:]
    space = cut.find(" ")
    return "… " + (cut[space + 1:] if 0 <= space < len(cut) - 1 else cut)


def _letters(text: str) -> str:
    """Only what identifies the words: lower-case letters and digits (the front-end's pieces may differ
    from the greeting's text in case, spacing and punctuation)."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def _said_part(text: str, letters: int) -> str:
    """`text` up to its `letters`-th letter or digit (what of a greeting the front-end said)."""
    if letters <= 0:
        return ""
    seen = 0
    for i, ch in enumerate(text):
        seen += ch.isalnum()
        if seen == letters:
            return text[: i + 1]
    return text


def word_count(text: str) -> int:
    return len(text.split())


@dataclass
class Conversation:
    """One call's transcript. Not thread-safe: the back-end touches it from its event loop only."""

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    turns: list[Turn | ToolExchange] = field(default_factory=list)
    max_history_chars: int = MAX_HISTORY_CHARS
    partial: str = ""  # the caller's current unfinished utterance
    committed_words: int = 0  # words in the caller's finals
    prune: bool = True  # drop what no request can send any more (False: keep everything, for comparison)
    # The assistant turn whose last word may still continue with a piece that has no '▁'.
    _bot_word_turn: Turn | None = field(default=None, init=False, repr=False)
    # While the front-end speaks the greeting (until the caller first speaks), its pieces are the greeting
    # again: the greeting turn stands for them.
    _greeting_spoken: bool = field(default=False, init=False, repr=False)
    # The greeting's letters and digits the front-end has not said yet (None: no greeting, or the bot has
    # moved on): a caller talking over the greeting does not stop the front-end saying the rest of it, and
    # the greeting turn already holds those words.
    _greeting_left: str | None = field(default=None, init=False, repr=False)
    _greeting_turn: Turn | None = field(default=None, init=False, repr=False)
    _since_prune: int = field(default=0, init=False, repr=False)  # turns added since the last prune

    def greet(self, greeting: str) -> None:
        """The agent's greeting as the first assistant turn (cut to what was said if the bot moves on from it
        before the end: a caller who talked over it)."""
        self._greeting_turn = Turn("assistant", _clean(greeting))
        self.turns.insert(0, self._greeting_turn)
        self._greeting_spoken = True
        self._greeting_left = _letters(greeting)

    # --- caller ------------------------------------------------------------------------------------
    def caller_partial(self, text: str) -> None:
        self.partial = _clean(text)
        if self.partial:
            self._greeting_spoken = False

    def caller_final(self, text: str) -> None:
        """Close the caller's utterance. An empty final only drops the partial."""
        text = _clean(text)
        self.partial = ""
        # The calls made during this utterance: its words go before the first of them, whatever the bot said
        # since (full duplex: it talks on while the caller does); an utterance that came to nothing leaves them
        # where they are. Either way the utterance is over for them. They all follow the caller's last final.
        at = len(self.turns)
        for i in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[i]
            if isinstance(turn, ToolExchange):
                if turn.mid_utterance:
                    turn.mid_utterance, at = False, i
            elif turn.role == "user":
                break
        if not text:
            return
        self._greeting_spoken = False
        self.committed_words += word_count(text)
        last = self.turns[at - 1] if at else None
        if last is not None and last.role == "user":
            self._grow(last, " " + text)  # type: ignore[arg-type]
        else:
            self.turns.insert(at, Turn("user", text))
            self._added()

    @property
    def pending_words(self) -> int:
        return word_count(self.partial)

    # --- bot ---------------------------------------------------------------------------------------
    def bot_piece(self, piece: str) -> None:
        """Add one SentencePiece piece the bot emitted. '' (padding) and '<...>' controls are ignored."""
        if not piece or (piece.startswith("<") and piece.endswith(">")):
            return
        starts_word = piece.startswith(WORD_START)
        text = piece.replace(WORD_START, " ")
        if self._greeting_left is not None:
            said = _letters(text)
            if self._greeting_left.startswith(said):  # more of the greeting (or its punctuation)
                self._greeting_left = self._greeting_left[len(said):]
                return
            if not self._greeting_left:
                # All of it said: the bot's own words from here, the caller silent or not ("are you there?").
                self._greeting_left, self._greeting_spoken = None, False
            elif not self._greeting_spoken:
                # The bot moved on before the end (the caller talked over it). Saying it word for word (its first
                # word at least), the history holds what was said, not the rest the caller never heard; said in
                # its own words, the greeting as written stands for them.
                turn = self._greeting_turn
                if turn is not None and turn.text:
                    said = len(_letters(turn.text)) - len(self._greeting_left)
                    if said >= len(_letters(turn.text.split()[0])):
                        turn.text = _said_part(turn.text, said)
                self._greeting_left = None  # its own words from here
        if self._greeting_spoken:
            return
        if not starts_word and self._bot_word_turn is not None:
            # Continuation of a word: it belongs to the turn holding that word, even if a caller final
            # landed in between ("hel" | caller final | "lo" stays "hello").
            self._grow(self._bot_word_turn, text)
            return
        last = self.turns[-1] if self.turns else None
        if last is not None and last.role == "assistant":
            self._grow(last, text)  # type: ignore[arg-type]
        else:
            last = Turn("assistant", text)
            self.turns.append(last)
            self._added()
        self._bot_word_turn = last

    @property
    def bot_text(self) -> str:
        return " ".join(_clean(t.text) for t in self.turns if t.role == "assistant")

    def tool_exchange(self, exchange: ToolExchange) -> None:
        """The LLM's function calls with their results, as the newest entry (after what was said so far)."""
        exchange.mid_utterance = bool(self.partial)
        self.turns.append(exchange)
        self._added()

    # --- memory ------------------------------------------------------------------------------------
    def _per_turn(self) -> int:
        return max(1, self.max_history_chars // TURN_SHARE)

    def _grow(self, turn: Turn, text: str) -> None:
        """`text` onto `turn`; past four times what a request sends of one turn, its front is dropped (at
        most a quarter of the budget of it is ever sent, its newest words)."""
        turn.text += text
        if self.prune and len(turn.text) > 4 * self._per_turn():
            # Cut as sent (whitespace collapsed), so that what is kept is at least twice what a request sends
            # of it: cut raw, a turn of many spaces kept less than that, and its request started mid-word.
            trailing = " " if turn.text[-1].isspace() else ""  # the next piece may continue this word, or not
            turn.text = _clean(turn.text)[-2 * self._per_turn():] + trailing

    def _added(self) -> None:
        if not self.prune:
            return
        self._since_prune += 1
        if self._since_prune >= PRUNE_EVERY:
            self._since_prune = 0
            self._prune()

    def _prune(self) -> None:
        """Drop the turns older than KEEP_HISTORY_FACTOR times what a request sends of the words (each turn
        counted as `messages` would send of it), but the newest tool exchange, which every request sends whole.
        Exchanges are not counted: `messages` leaves out an older one that does not fit and goes on to older
        words, so only the words' share bounds how far back a request reaches. Of the exchanges, those no
        request can send go (`_sendable_exchanges`, with room to spare), but one made mid-utterance. An LLM
        calling tools on every request kept them all (32 KB each, 70 MB and 36 ms of every request's rendering
        after 13 minutes, in the review)."""
        keep = KEEP_HISTORY_FACTOR * self.max_history_chars
        newest_exchange = next((t for t in reversed(self.turns) if isinstance(t, ToolExchange)), None)
        # Twice what a request considers: an exchange's result is filled in after it was added (a tool still
        # running), and one that grows past the budget leaves the requests' window to an older one, kept here.
        # A mid-utterance exchange stays whatever its size: the caller's final is placed by it.
        sendable = self._sendable_exchanges(2 * (self.max_history_chars // MIN_EXCHANGE_CHARS))
        self.turns = [t for t in self.turns if not isinstance(t, ToolExchange) or t.mid_utterance
                      or id(t) in sendable]  # fmt: skip
        total, cut = 0, 0
        for i in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[i]
            if isinstance(turn, ToolExchange):
                continue
            total += len(_tail(_clean(turn.text), self._per_turn()))  # as `messages` charges it
            if total > keep:
                cut = i
                break
        if cut:
            older = self.turns[:cut]
            kept = [newest_exchange] if any(t is newest_exchange for t in older) else []  # (identity, not ==)
            self.turns = kept + self.turns[cut:]

    def _sendable_exchanges(self, room: int) -> set[int]:
        """The exchanges (by id) a request may send: the newest, whatever its size, and of the others no bigger
        than the budget the newest `room`. Requests consider max_history_chars // MIN_EXCHANGE_CHARS of them (no
        request could hold more), and pruning keeps more, so pruned and unpruned conversations send the same."""
        out: set[int] = set()
        for turn in reversed(self.turns):
            if not isinstance(turn, ToolExchange):
                continue
            if not out:  # the newest
                out.add(id(turn))
            elif room > 0 and turn.size() <= self.max_history_chars:
                out.add(id(turn))
                room -= 1
        return out

    # --- rendering ---------------------------------------------------------------------------------
    def messages(self) -> list[dict[str, Any]]:
        """System prompt + the transcript as chat turns; the pending partial is the last user text. Only the
        newest turns that fit `max_history_chars` are sent, no turn longer than a TURN_SHARE of it (its newest
        words kept), a tool exchange whole or not at all (the newest always, even behind newer words: the LLM
        must see the result it asked for; its size is bounded by the tools' own caps, and it is charged at most
        half the budget, so the words before it still go)."""
        groups: list[list[dict[str, Any]]] = []
        sizes: list[int] = []  # an exchange's size, its calls counted once
        sendable = self._sendable_exchanges(self.max_history_chars // MIN_EXCHANGE_CHARS)
        for turn in self.turns:
            if isinstance(turn, ToolExchange):
                if id(turn) in sendable:
                    groups.append(turn.group())
                    sizes.append(turn.size())
                continue
            text = _clean(turn.text)
            if text:
                groups.append([{"role": turn.role, "content": text}])
                sizes.append(len(text))
        budget, per_turn = self.max_history_chars, max(1, self.max_history_chars // TURN_SHARE)
        exchanges = [i for i, group in enumerate(groups) if group[0].get("tool_calls") is not None]
        newest_exchange = exchanges[-1] if exchanges else -1
        chosen: list[list[dict[str, Any]]] = []
        full = False  # the budget is spent (or what is left would clip a turn to nothing)
        for i in range(len(groups) - 1, -1, -1):
            group = groups[i]
            if i == newest_exchange:
                # Sent whole whatever its size, even behind the caller's next words and with the budget spent by
                # newer turns: without its result the LLM would call the tool again. Charged at most half the
                # budget: four answers at the tools' cap spent it all, and the words that asked for them (the
                # caller's question) were left out of the request about their results.
                chosen.append(group)
                budget -= min(sizes[i], self.max_history_chars // 2)
                continue
            if full or budget <= 0:
                if i > newest_exchange:
                    continue  # on to the newest exchange, still to be sent
                break
            if group[0].get("tool_calls") is not None:
                if sizes[i] <= budget:
                    chosen.append(group)
                    budget -= sizes[i]
                continue  # an older exchange that does not fit is left out; older words may still fit
            limit = min(per_turn, budget)
            if len(group[0]["content"]) > limit and limit < MIN_CLIPPED_CHARS and chosen:
                full = True
                continue
            content = _tail(group[0]["content"], limit)
            chosen.append([{"role": group[0]["role"], "content": content}])
            budget -= len(content)
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}]
        for group in reversed(chosen):
            out += group
        if self.partial:
            if out[-1]["role"] == "user":
                out[-1] = {"role": "user", "content": out[-1]["content"] + " " + self.partial}
            else:
                out.append({"role": "user", "content": self.partial})
        return out

"""A long call's conversation keeps what its requests can still send, not everything ever said: every turn of
a 4-hour call was kept and re-rendered on each request (12 ms a request on the event loop in the review), and
one turn growing piece by piece was copied whole at each piece."""

from __future__ import annotations

from knowledge.conversation import KEEP_HISTORY_FACTOR, TURN_SHARE, Conversation, ToolExchange


def _exchange(n: int, size: int = 50) -> ToolExchange:
    call = {"id": f"c{n}", "type": "function", "function": {"name": "order_status", "arguments": "{}"}}
    return ToolExchange(calls=[call], results=[(f"c{n}", "r" * size)])


def _talk(conv: Conversation, shadow: list, turns: int) -> None:
    """Caller and bot alternate (a tool exchange now and then); `shadow` keeps every turn, unpruned."""
    for n in range(turns):
        if n % 2 == 0:
            conv.caller_final(f"question number {n} about the order")
        else:
            for word in f"answer number {n} with a few more words".split():
                conv.bot_piece("▁" + word)
        if n % 17 == 0:
            conv.tool_exchange(_exchange(n))
        shadow[:] = _merged(shadow, conv)


def _merged(shadow: list, conv: Conversation) -> list:
    """The full history: what `shadow` had, then whatever `conv` holds that it lacks (by identity)."""
    known = {id(t) for t in shadow}
    return shadow + [t for t in conv.turns if id(t) not in known]


def test_a_long_call_keeps_a_bounded_history_and_sends_what_it_sent_before() -> None:
    conv, shadow = Conversation(system_prompt="S", max_history_chars=2_000), []
    _talk(conv, shadow, 3_000)
    assert len(shadow) > 3_000
    # Bounded: about KEEP_HISTORY_FACTOR budgets of turns of ~40 characters, plus a prune's worth.
    assert len(conv.turns) < KEEP_HISTORY_FACTOR * 2_000 // 30 + 64 + 1
    # Every request sends exactly what the whole history would have sent.
    whole = Conversation(system_prompt="S", max_history_chars=2_000, turns=list(shadow))
    assert conv.messages() == whole.messages()


def test_the_newest_tool_exchange_stays_however_old() -> None:
    """Every request sends the newest exchange whole (the LLM must see the result it asked for), even behind a
    caller's many words since: pruning keeps it."""
    conv = Conversation(system_prompt="S", max_history_chars=1_000)
    exchange = _exchange(1, size=300)
    conv.caller_final("where is my order")
    conv.tool_exchange(exchange)
    for n in range(2_000):
        if n % 2:
            conv.caller_final(f"still talking {n}")
        else:
            conv.bot_piece(f"▁reply{n}")
    assert any(t is exchange for t in conv.turns)
    sent = conv.messages()
    assert any(m.get("tool_calls") == exchange.calls for m in sent)
    assert len(conv.turns) < 500


def test_a_monologue_turn_is_kept_to_what_a_request_sends_of_it() -> None:
    """A bot talking on alone for an hour grows one turn: kept to a bounded tail, its newest words sent."""
    conv = Conversation(system_prompt="S", max_history_chars=16_000)
    per_turn = 16_000 // TURN_SHARE
    for n in range(60_000):
        conv.bot_piece(f"▁w{n}")
    (turn,) = conv.turns
    assert len(turn.text) <= 4 * per_turn
    sent = conv.messages()[-1]["content"]
    assert sent.endswith("w59999") and len(sent) <= per_turn + 2

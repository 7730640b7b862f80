"""A long call's conversation keeps what its requests can still send, not everything ever said: every turn of
a 4-hour call was kept and re-rendered on each request (12 ms a request on the event loop in the review), and
one turn growing piece by piece was copied whole at each piece. Each test runs the same call on a pruned
conversation and on one that keeps everything (`prune=False`), and asks for the same requests."""

from __future__ import annotations

import random
from collections.abc import Callable

from knowledge.conversation import KEEP_HISTORY_FACTOR, TURN_SHARE, Conversation, ToolExchange

Step = Callable[[Conversation], None]


def _exchange(n: int, results: int = 1, size: int = 50) -> ToolExchange:
    calls = [{"id": f"c{n}-{i}", "type": "function", "function": {"name": "order_status", "arguments": "{}"}}
             for i in range(results)]  # fmt: skip
    return ToolExchange(calls=calls, results=[(c["id"], "r" * size) for c in calls])


def _same_requests(steps: list[Step], budget: int = 16_000, every: int = 1) -> Conversation:
    """Runs `steps` on both; the requests must match after every `every` steps. Returns the pruned one."""
    pruned, whole = Conversation(system_prompt="S", max_history_chars=budget), \
        Conversation(system_prompt="S", max_history_chars=budget, prune=False)  # fmt: skip
    for n, step in enumerate(steps):
        step(pruned)
        step(whole)
        if n % every == 0 or n == len(steps) - 1:
            assert pruned.messages() == whole.messages(), f"step {n}"
    return pruned


def _caller(text: str) -> Step:
    return lambda c: c.caller_final(text)


def _bot(text: str) -> Step:
    return lambda c: [c.bot_piece("▁" + w) for w in text.split()]  # type: ignore[func-returns-value]


def _tools(n: int, results: int = 1, size: int = 50) -> Step:
    return lambda c: c.tool_exchange(_exchange(n, results, size))


def test_a_long_call_keeps_a_bounded_history_and_sends_what_it_sent_before() -> None:
    steps: list[Step] = []
    for n in range(3_000):
        steps.append(_caller(f"question number {n} about the order") if n % 2 == 0
                     else _bot(f"answer number {n} with a few more words"))  # fmt: skip
        if n % 17 == 0:
            steps.append(_tools(n))
    pruned = _same_requests(steps, budget=2_000, every=7)
    # Bounded: about KEEP_HISTORY_FACTOR budgets of turns of ~40 characters, plus a prune's worth.
    assert len(pruned.turns) < KEEP_HISTORY_FACTOR * 2_000 // 30 * 2 + 64


def test_big_tool_answers_do_not_cut_the_words_a_request_still_sends() -> None:
    """An older exchange too big for what is left of the budget is left out, and the request goes on to older
    words: pruning that charged exchanges dropped words the request still sent (the review: 7 messages
    against 67)."""
    steps: list[Step] = []
    for n in range(30):
        steps += [_caller(f"small talk {n}"), _bot(f"sure thing {n}"), _tools(n)]
    steps.append(_caller("where are my four orders"))
    for n in range(4):
        steps += [_tools(100 + n, results=4, size=4_000), _bot(f"order {n} is on its way")]
    steps += [_caller(f"and the next one {n}") for n in range(200)]
    _same_requests(steps)


def test_random_calls_send_the_same_requests() -> None:
    rng = random.Random(7)
    for seed in range(6):
        rng.seed(seed)
        steps: list[Step] = []
        for n in range(1_200):
            roll = rng.random()
            if roll < 0.4:
                steps.append(_caller(" ".join(rng.choice(["yes", "no", "order", "the", "price"])
                                              for _ in range(rng.randint(0, 12)))))  # fmt: skip
            elif roll < 0.85:
                said = " ".join(rng.choice(["sure", "let", "me", "check"]) for _ in range(rng.randint(1, 9)))
                steps.append(_bot(said))
            elif roll < 0.9:
                steps.append(lambda c: c.caller_partial("and also"))
            elif roll < 0.93:
                steps.append(lambda c: c.bot_piece("thing"))  # a word continued, maybe across a caller final
            else:
                steps.append(_tools(n, results=rng.randint(1, 4), size=rng.choice([20, 800, 3_000])))
        _same_requests(steps, budget=rng.choice([1_000, 4_000, 16_000]), every=11)


def test_the_newest_tool_exchange_stays_however_old() -> None:
    """Every request sends the newest exchange whole (the LLM must see the result it asked for), even behind a
    caller's many words since: pruning keeps it."""
    steps: list[Step] = [_caller("where is my order"), _tools(1, size=300)]
    steps += [_caller(f"still talking {n}") if n % 2 else _bot(f"reply {n}") for n in range(2_000)]
    pruned = _same_requests(steps, budget=1_000, every=50)
    assert any(isinstance(t, ToolExchange) for t in pruned.turns) and len(pruned.turns) < 500


def test_a_monologue_turn_is_kept_to_what_a_request_sends_of_it() -> None:
    """A bot talking on alone for an hour grows one turn: kept to a bounded tail, its newest words sent; a
    turn of many spaces as well (cut raw, it kept less than a request sends)."""
    words = [_bot(f"w{n}") for n in range(60_000)]
    spaces = [lambda c: c.bot_piece("▁")] * 3 + [lambda c: c.bot_piece("a")]
    for steps, budget, every in ((words, 16_000, 997), (spaces * 2_000, 400, 1)):
        pruned = _same_requests(steps, budget=budget, every=every)
        (turn,) = pruned.turns
        assert len(turn.text) <= 4 * (budget // TURN_SHARE)


def test_turns_cut_to_a_few_words_are_charged_as_sent() -> None:
    """A turn whose newest words follow a long run with no space is sent as those words alone ("… ok"):
    charged at a quarter of the budget, it pushed turns that requests still send out of memory."""
    steps = [step for n in range(200) for step in (_caller("x" * 5000 + f" ok{n}"), _bot(f"fine {n}"))]
    _same_requests(steps, every=13)


def test_an_llm_calling_tools_on_every_request_keeps_a_bounded_history() -> None:
    """A hostile or broken LLM answering every request with tool calls (the caller saying "yes" now and then):
    words stay few, so no exchange was ever pruned: 70 MB held and 36 ms of rendering a request after 13
    minutes, in the review. Those too big to send and those past what a request can hold go."""
    steps: list[Step] = []
    for n in range(1_500):
        steps.append(_caller("yes") if n % 3 == 0 else _tools(n, results=4, size=(8_000 if n % 2 else 30)))
    pruned = _same_requests(steps, budget=4_000, every=13)
    exchanges = [t for t in pruned.turns if isinstance(t, ToolExchange)]
    assert len(exchanges) <= 2 * (4_000 // 64) + 64 + 1  # twice what a request holds, a prune's worth, the newest
    assert sum(t.size() for t in exchanges) < 4 * 4_000 * 64  # not every 32 KB answer since the call began
    # Small answers first, then many that each nearly fill the budget: a request sends one of the big ones and
    # then older small ones, as far back as it considers; pruned or not, the same.
    steps = [_caller("hi")] + [_tools(n, size=10) for n in range(100)]
    steps += [_tools(1_000 + n, size=3_500) for n in range(150)] + [_caller("and now")]
    _same_requests(steps, budget=4_000, every=7)


def test_a_mid_utterance_exchange_too_big_to_send_still_places_the_callers_final() -> None:
    """The caller's final goes before the first exchange made during the utterance: pruning dropped that one (too
    big to send) and the pruned conversation put the words after the next one (review of session 30's change).
    A prune lands anywhere in the sequence, so every padding is run."""
    for pad in range(140):
        steps: list[Step] = [step for i in range(pad // 2) for step in (_caller(f"q{i}"), _bot(f"a{i}"))]
        steps += [_tools(0, size=30)] if pad % 2 else []
        steps += [_caller("hello"), _bot("sure"), lambda c: c.caller_partial("where is my"),
                  _tools(1, size=8_000), _bot("checking"), _tools(2), _caller("where is my order")]  # fmt: skip
        _same_requests(steps, budget=4_000, every=1)


def test_an_exchange_whose_result_comes_after_a_prune_leaves_the_same_requests() -> None:
    """A tool's exchange goes in with a placeholder result, filled in when the tool answers: one that grew past
    the budget after a prune left its place in the requests' window to an older exchange pruning had dropped."""
    for pad in range(64):
        both = [Conversation(system_prompt="S", max_history_chars=400),
                Conversation(system_prompt="S", max_history_chars=400, prune=False)]  # fmt: skip
        running = []
        for c in both:
            for i in range(pad):
                c.caller_final(f"q{i}")
                c.bot_piece(f"▁a{i}")
            c.caller_final("hi")
            c.tool_exchange(_exchange(0, size=5))
            running.append(_exchange(1, size=9))  # "pending"
            c.tool_exchange(running[-1])
            for n in range(5):
                c.tool_exchange(_exchange(10 + n, size=255))
            c.caller_final("ok")
            c.tool_exchange(_exchange(99, size=5))
        assert both[0].messages() == both[1].messages(), pad
        for exchange in running:
            exchange.results = [(exchange.results[0][0], "R" * 500)]  # its tool answers, past the budget
        assert both[0].messages() == both[1].messages(), pad

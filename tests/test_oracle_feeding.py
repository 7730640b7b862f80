"""The oracle feeding rule: a growing draft never garbles words in the oracle stream.

Each update re-tokenizes the whole draft, and a draft cut mid-word tokenizes differently once the word is
finished ("for cal" -> "▁c al", "for calling" -> "▁call ing"). Only settled tokens are fed: the drafts here
are cut at every character, and what was fed must always be a token prefix of the final text's own
tokenization (so it decodes to a prefix of the text), and all of it once the stream ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece

from engine.batch import KameBatch
from engine.frame_loop import FrameLoop
from engine.oracle_buffer import OracleBuffer, tokenize_draft
from engine.sampling import SamplingConfig
from engine.tiny_checkpoint import train_tiny_tokenizer

SENTENCES = [
    "Thanks for calling. How can I help you today?",
    "Hello, your order shipped yesterday and it arrives on Monday.",
    "Sure thing",  # the whole answer is two words: the second waits for the end of the stream
]
START, PAD = 256, 3


@pytest.fixture(scope="module")
def sp() -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_proto=train_tiny_tokenizer())


def _assert_clean(sp, fed: list[int], final: str) -> None:
    want = sp.encode(final)
    assert 0 not in want, "the test text must be in the tiny tokenizer's vocabulary (0 is unknown)"
    assert fed == want[: len(fed)], f"fed {sp.id_to_piece(fed)} is not a prefix of {sp.id_to_piece(want)}"
    assert final.startswith(sp.decode(fed))


def _feed_growing_draft(sp, text: str, ticks_per_char: int) -> list[int]:
    """Drafts cut at every character, `ticks_per_char` cursor steps after each; returns the tokens fed."""
    buf = OracleBuffer(START, PAD)
    fed: list[int] = []

    def step() -> None:
        token = buf.next_token()
        if token == START:
            assert not fed, "one boundary per candidate"
        elif token != PAD:
            fed.append(token)
            _assert_clean(sp, fed, text)

    for i in range(1, len(text) + 1):
        buf.set_candidate(1, tokenize_draft(sp, text[:i], complete=False))
        for _ in range(ticks_per_char):
            step()
    buf.set_candidate(1, tokenize_draft(sp, text, complete=True))
    for _ in range(len(sp.encode(text)) + 2):
        step()
    return fed


@pytest.mark.parametrize("text", SENTENCES)
@pytest.mark.parametrize("ticks_per_char", [0, 1, 3])  # an LLM faster than the frames, as fast, slower
def test_drafts_cut_at_every_character_feed_only_settled_tokens(sp, text: str, ticks_per_char: int) -> None:
    fed = _feed_growing_draft(sp, text, ticks_per_char)
    assert fed == sp.encode(text)  # every token once, the whole text's own tokenization: no word split


@pytest.mark.parametrize("sep", [" ", "\x0b", "\x1c", "\x1f", "\x85", "\t", "\n"])
def test_whitespace_the_tokenizer_does_not_split_on_never_settles_a_word(tiny_checkpoint: Path, sep: str) -> None:
    """Python's \\s matches characters SentencePiece deletes or keeps inside a word: the word before one was
    fed as finished, then the grown draft tokenized it another way (a piece skipped; found by fuzzing drafts
    cut at every character). What is fed is the final text's own tokenization, whatever the separator."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_checkpoint / "tokenizer.model"))
    final = f"sZlca!dfri{sep}tybiBan"
    buf = OracleBuffer(START, PAD)
    fed: list[int] = []
    for i in range(1, len(final) + 1):
        buf.set_candidate(1, tokenize_draft(sp, final[:i], complete=False))
        fed += [buf.next_token() for _ in range(16)]  # the frames outpace the LLM: all that is settled goes
    buf.set_candidate(1, tokenize_draft(sp, final, complete=True))
    fed += [buf.next_token() for _ in range(len(final) + 2)]
    # \x85 is unknown to SentencePiece (it would be token 0): deleted before tokenizing, like the others it drops.
    assert [t for t in fed if t != PAD] == [START, *sp.encode(final.replace("\x85", ""))]


def test_settled_tokens_stop_before_the_unfinished_word(sp) -> None:
    draft = tokenize_draft(sp, "Thanks for cal", complete=False)
    assert draft.tokens == sp.encode("Thanks for cal")
    assert draft.tokens[: draft.settled] == sp.encode("Thanks for")
    # Whitespace at the end finishes the word before it.
    assert tokenize_draft(sp, "Thanks for ", complete=False).settled == len(sp.encode("Thanks for"))
    assert tokenize_draft(sp, "Thanks", complete=False).settled == 0
    assert tokenize_draft(sp, "Thanks", complete=True).settled == len(sp.encode("Thanks"))
    assert tokenize_draft(sp, "", complete=True) == tokenize_draft(sp, "", complete=False)


def test_ours_is_cleaner_than_tokenizing_each_chunk(sp) -> None:
    """The official server tokenizes each streamed chunk on its own: words split at chunk edges."""
    chunks = ["Thanks for cal", "ling. How can I he", "lp you?"]
    official = [t for chunk in chunks for t in sp.encode(chunk.strip())]
    text = "".join(chunks)
    assert official != sp.encode(text)  # "▁c al ▁ling": the word is split
    buf = OracleBuffer(START, PAD)
    drafts = ["".join(chunks[: i + 1]) for i in range(len(chunks))]
    fed = []
    for i, draft in enumerate(drafts):
        buf.set_candidate(1, tokenize_draft(sp, draft, complete=i == len(drafts) - 1))
        fed += [t for t in (buf.next_token() for _ in range(40)) if t not in (START, PAD)]
    assert fed == sp.encode(text)


def test_frame_loop_never_feeds_two_tokenizations_of_one_word(tiny_bundle) -> None:
    """Through the real loop and model: the cursor catches up with a draft that ends mid-word."""
    loop = FrameLoop(KameBatch(tiny_bundle.lm, tiny_bundle.mimi, 2, SamplingConfig(use_sampling=False)),
                     tiny_bundle.tokenizer)
    sp = tiny_bundle.tokenizer
    start, pad = tiny_bundle.lm.oracle_start_token_id, tiny_bundle.lm.text_padding_token_id
    row = loop.join("A", None)
    text = "Thanks for calling. How can I help?"
    fed: list[int] = []
    for i in range(1, len(text) + 1):
        loop.set_oracle(row, "A", 1, text[:i], complete=False)
        for _, out in loop.tick():
            if out.oracle_token not in (start, pad):
                fed.append(out.oracle_token)
                _assert_clean(sp, fed, text)
    assert fed == sp.encode("Thanks for calling. How can I")  # "help?" waits for the end of the stream
    loop.set_oracle(row, "A", 1, text, complete=True)
    for _ in range(len(sp.encode(text)) - len(fed) + 2):
        fed += [out.oracle_token for _, out in loop.tick() if out.oracle_token not in (start, pad)]
    assert fed == sp.encode(text)


def test_characters_the_tokenizer_does_not_know_never_reach_the_oracle(sp) -> None:
    """U+FFFD (a broken character from the LLM), NUL, NEL, ZWJ and private use: SentencePiece maps each to the
    unknown token 0, which reached the oracle as a token the model never saw there. They are deleted; \t and
    \n stay (read as spaces), and words settle as before."""
    text = "Sure\ufffd, \x00about\x85 your\u200d\ue000 card.\nThanks"
    clean = "Sure, about your card.\nThanks"
    assert 0 in sp.encode("a\x00b") and 0 in sp.encode("a\x85b")  # the tokenizer's unknowns, as said
    whole = tokenize_draft(sp, text, complete=True)
    assert 0 not in whole.tokens and whole.tokens == sp.encode(clean)
    for i in range(1, len(text) + 1):  # growing drafts settle only tokens of the whole, clean text
        draft = tokenize_draft(sp, text[:i], complete=False)
        assert 0 not in draft.tokens and draft.tokens[: draft.settled] == whole.tokens[: draft.settled]

"""Streamed text equals the full decode exactly — spaces, multi-byte UTF-8 split across tokens,
invalid byte sequences — and stop strings cut the text where a user expects."""
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.detokenizer import Delta, IncrementalDetokenizer, StopStrings, decode, decode_delta

from .conftest import DEFAULT_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    if not os.path.exists(DEFAULT_MODEL):
        pytest.skip("default model not built")
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def stream(tokenizer, ids, chunk=1):
    det = IncrementalDetokenizer(tokenizer)
    deltas = []
    for i in range(0, len(ids), chunk):
        delta = det.add(ids[i:i + chunk], final=i + chunk >= len(ids))
        if delta is not None:
            deltas.append(delta)
    return deltas


@pytest.mark.parametrize("text", [
    "The assert statement is a convenient way to insert debugging assertions.",
    "  leading and  double  spaces\n\ttabs\n\n",
    "héllo wörld — naïve café ∑ 你好，世界 🎉🚀 done",
    "def f(x):\n    return x ** 2  # comment",
])
def test_streamed_text_equals_the_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for chunk in (1, 2, 5):
        deltas = stream(tokenizer, ids, chunk)
        assert "".join(d.text for d in deltas) == decode(tokenizer, ids) == text
        assert all("\ufffd" not in d.text for d in deltas), "no half characters on the wire"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_token_sequence_streams_exactly(tokenizer, data):
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    deltas = stream(tokenizer, ids)
    assert "".join(d.text for d in deltas) == decode(tokenizer, ids)
    # each delta's (context, new) decodes to exactly its text: what the ensemble's postprocessing does
    for d in deltas:
        assert decode_delta(tokenizer, d.context_ids, d.new_ids) == d.text
    assert [t for d in deltas for t in d.new_ids] == ids


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("a b", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert "".join(d.text for d in stream(tokenizer, ids)) == "a b"


@pytest.mark.parametrize("pieces, stops, expected", [
    (["Hello", " wor", "ld. ", "Bye"], ["world"], "Hello "),
    (["abc", "de"], ["cd", "b"], "a"),
    (["no stop here"], ["zzz"], "no stop here"),
    (["x" * 5, "STO", "P", "y"], ["STOP"], "xxxxx"),
])
def test_stop_strings_cut_before_the_earliest_match(pieces, stops, expected):
    s = StopStrings(stops)
    out = "".join(s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert out == expected


def test_include_stop_str_in_output_keeps_the_earliest_stop_string():
    s = StopStrings(["world", "wo"], include=True)
    out = "".join(s.feed(p) for p in ["Hello", " wor", "ld. ", "Bye"])
    assert out == "Hello wo" and s.stopped


def test_stop_strings_hold_back_only_a_possible_prefix():
    s = StopStrings(["STOP"])
    assert s.feed("abcdef") == "abc"          # 'def' could begin 'STOP'? held: 3 chars
    assert s.feed("gh") == "de"
    assert s.feed("", final=True) == "fgh"
    assert not s.stopped


def test_random_streams_with_stop_strings_equal_the_truncated_full_text():
    rng = random.Random(0)
    alphabet = "ab cSTOP"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = StopStrings(["STOP", "cc"])
        out = "".join(s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
        ends = [i for i in (text.find("STOP"), text.find("cc")) if i >= 0]
        assert out == (text[:min(ends)] if ends else text)


def byte_token_ids(tokenizer) -> list[int]:
    """The one-byte tokens of a byte-level BPE vocabulary, indexed by byte value (GPT-2's
    printable mapping of the 256 bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    ids = tokenizer.convert_tokens_to_ids([chars[b] for b in range(256)])
    assert len(set(ids)) == 256 and tokenizer.unk_token_id not in ids
    return ids


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_bytes_never_hold_more_than_one_incomplete_character(tokenizer, data):
    """A model may emit byte tokens that never form UTF-8: the stream goes on with U+FFFD (as the
    full decode shows them), holding only the tokens of the one character still incomplete (and the
    special tokens after them, which the decode skips: bytes on both sides still join)."""
    byte_ids = byte_token_ids(tokenizer)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_ids), st.integers(0, len(tokenizer) - 1)),
                             min_size=1, max_size=60))
    det = IncrementalDetokenizer(tokenizer)
    deltas = []
    for i, token in enumerate(ids):
        delta = det.add([token], final=i == len(ids) - 1)
        if delta is not None:
            deltas.append(delta)
        held = [t for t in det.token_ids[det.read_offset:] if t not in det.special_ids]
        assert len(held) <= 3, "held more than one character's bytes"
    assert "".join(d.text for d in deltas) == decode(tokenizer, ids)
    for d in deltas:
        assert decode_delta(tokenizer, d.context_ids, d.new_ids) == d.text
    assert [t for d in deltas for t in d.new_ids] == ids


def test_invalid_bytes_stream_as_replacement_characters(tokenizer):
    """The silent stream: 98 continuation bytes, never valid UTF-8, used to come out as one delta
    at the end; now each is released as U+FFFD one token later. A 3-byte character split over
    three tokens is held until it completes."""
    byte_ids = byte_token_ids(tokenizer)
    ids = [byte_ids[0x80 + i % 64] for i in range(98)]
    det = IncrementalDetokenizer(tokenizer)
    texts = [(det.add([t]) or Delta("", [], [])).text for t in ids]
    assert texts[0] == "" and texts[1:] == ["\ufffd"] * 97
    assert det.add([], final=True).text == "\ufffd" and decode(tokenizer, ids) == "\ufffd" * 98
    det = IncrementalDetokenizer(tokenizer)
    texts = [det.add([byte_ids[b]]) for b in "你".encode()]
    assert texts[:2] == [None, None] and texts[2].text == "你"

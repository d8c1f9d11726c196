"""Streamed text equals the full decode exactly — spaces, multi-byte UTF-8 split across tokens,
invalid byte sequences — and stop strings cut the text where a user expects."""
import bisect
import itertools
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.detokenizer import (Delta, DecodeOptions, IncrementalDetokenizer, StopStrings, decode, decode_delta,
                                  token_text)

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


def test_a_run_of_skipped_tokens_streams_at_once_and_stays_out_of_the_window(tokenizer):
    """EOS after EOS (ignore_eos): each comes out at once, as an empty delta covering it, and the
    decode window does not grow with the run (it was decoded again every step); a character split
    around such tokens still joins, and the text is the full decode."""
    eos = tokenizer.eos_token_id
    euro = tokenizer("€", add_special_tokens=False)["input_ids"]
    assert len(euro) == 3                       # a token per byte, in the shipped byte-level tokenizer
    ids = tokenizer("a b", add_special_tokens=False)["input_ids"] + [eos] * 2000 + euro[:1] + [eos] * 3 + euro[1:]
    det = IncrementalDetokenizer(tokenizer)
    texts, widest = [], 0
    for i, token in enumerate(ids):
        delta = det.add([token], final=i == len(ids) - 1)
        widest = max(widest, len(det.token_ids))
        if token == eos and det.read_offset == len(det.token_ids):
            assert delta is not None and delta.text == "" and delta.new_ids == [eos]
        texts.append("" if delta is None else delta.text)
    assert "".join(texts) == decode(tokenizer, ids) == "a b€"
    assert widest < 20


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


def test_include_stop_str_in_output_holds_nothing_back_as_vllm_streams_it():
    """Text before a stop string that is kept anyway goes out at once; the search still looks
    back into what was sent, for a stop string split across pieces."""
    s = StopStrings(["STOP"], include=True)
    assert [s.feed(p) for p in ["abcST", "O", "Pxyz"]] == ["abcST", "O", "P"] and s.matched == "STOP"


def test_stop_strings_hold_back_only_a_possible_prefix():
    s = StopStrings(["STOP"])
    assert s.feed("abcdef") == "abc"          # 'def' could begin 'STOP'? held: 3 chars
    assert s.feed("gh") == "de"
    assert s.feed("", final=True) == "fgh"
    assert not s.stopped


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("alphabet", ["ab cST", "ab"])
@pytest.mark.parametrize("unmatched", [0, 1000])
def test_random_streams_with_stop_strings_equal_the_truncated_full_text(include, alphabet, unmatched):
    """Any set of stop strings (overlapping, nested, of mixed lengths; also among thousands that
    never occur, where the search looks up end positions rather than scanning for each string)
    cuts at the first to complete as the pieces stream, and among those completing in one piece
    the earliest-starting, then shortest. Pieces fed before min_tokens (search=False) are passed;
    a stop string must end after them."""
    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        stops += ["".join(rng.choice("XYZ") for _ in range(rng.randint(1, 5))) for _ in range(unmatched)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        unsearched = rng.randint(0, len(pieces) - 1)        # the first pieces, before min_tokens
        s = StopStrings(stops, include=include)
        out = "".join(s.feed(p, final=i == len(pieces) - 1, search=i >= unsearched) for i, p in enumerate(pieces))
        free = len("".join(pieces[:unsearched]))            # a match must end after these characters
        piece_ends = list(itertools.accumulate(map(len, pieces)))
        found = [(bisect.bisect_left(piece_ends, i + len(stop)), i, len(stop), stop)
                 for stop in stops[:len(stops) - unmatched]
                 for i in [text.find(stop, max(free - len(stop) + 1, 0))] if i >= 0]
        _, start, length, matched = min(found) if found else (None, len(text), 0, None)
        assert out == text[:start + length if include else start] and s.matched == matched, (pieces, unsearched)


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
        held = [t for t in det.token_ids[det.read_offset:] if t not in det.skipped_ids]
        assert len(held) <= 3, "held more than one character's bytes"
    assert "".join(d.text for d in deltas) == decode(tokenizer, ids)
    for d in deltas:
        assert decode_delta(tokenizer, d.context_ids, d.new_ids) == d.text
    assert [t for d in deltas for t in d.new_ids] == ids


KEEP_SPECIAL = DecodeOptions(skip_special_tokens=False)


def test_special_tokens_are_text_when_not_skipped(tokenizer):
    """vLLM's skip_special_tokens = false: the special tokens a model generates are in the text,
    each released as it comes (it decodes to text: nothing to hold), and the deltas add up to
    transformers' decode(skip_special_tokens=False); by default they are left out, as before."""
    words = tokenizer(" one two", add_special_tokens=False)["input_ids"]
    ids = [tokenizer.bos_token_id, words[0], tokenizer.pad_token_id, *words[1:], tokenizer.eos_token_id]
    full = tokenizer.decode(ids, skip_special_tokens=False)
    assert full == "<s> one<pad> two</s>"
    for chunk in (1, 2):
        det = IncrementalDetokenizer(tokenizer, tokenizer("Say")["input_ids"], KEEP_SPECIAL)
        deltas = [det.add(ids[i:i + chunk], final=i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
        assert None not in deltas and "".join(d.text for d in deltas) == full
        assert all(decode_delta(tokenizer, d.context_ids, d.new_ids, KEEP_SPECIAL) == d.text for d in deltas)
    assert "".join(d.text for d in stream(tokenizer, ids)) == decode(tokenizer, ids) == " one two"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_without_skipping_any_token_sequence_streams_exactly(tokenizer, data):
    """Special tokens among bytes that never become a character: they split the bytes (the full
    decode does too), and only the one character still incomplete is held."""
    specials = st.sampled_from(tokenizer.all_special_ids)
    ids = data.draw(st.lists(st.one_of(specials, st.sampled_from(byte_token_ids(tokenizer)),
                                       st.integers(0, len(tokenizer) - 1)), min_size=1, max_size=40))
    det = IncrementalDetokenizer(tokenizer, options=KEEP_SPECIAL)
    deltas = []
    for i, token in enumerate(ids):
        deltas.append(det.add([token], final=i == len(ids) - 1))
        assert len(det.token_ids) - det.read_offset <= 3, "held more than one character's bytes"
    deltas = [d for d in deltas if d is not None]
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids, skip_special_tokens=False)
    assert all(decode_delta(tokenizer, d.context_ids, d.new_ids, KEEP_SPECIAL) == d.text for d in deltas)
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


def sentencepiece_tokenizer():
    """A Llama-2 / Mistral-style tokenizer (SentencePiece as a fast tokenizer): words carry a
    leading "▁", the decoder strips one leading space at the start of a decode, and a character
    missing from the vocabulary is spelled with byte tokens (byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁What": 3, "▁is": 4, "▁machine": 5, "▁learning?": 6, "▁Machine": 7,
             "▁learning": 8, "▁": 9, "é": 10}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_output_reads_as_it_follows_the_prompt():
    """Decoded alone, a SentencePiece output loses its first word's space ("Machine learning"); the
    detokenizer decodes it after the prompt's last tokens, as vLLM's does: " Machine learning"."""
    tokenizer = sentencepiece_tokenizer()
    prompt, output = [1, 3, 4, 5, 6], [7, 8, 2]
    assert decode(tokenizer, output) == "Machine learning"
    for chunk in (1, 2):
        det = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [det.add(output[i:i + chunk], final=i + chunk >= len(output)) for i in range(0, len(output), chunk)]
        assert "".join(d.text for d in deltas if d) == " Machine learning"
        for d in filter(None, deltas):       # what the ensemble's postprocessing decodes
            assert decode_delta(tokenizer, d.context_ids, d.new_ids) == d.text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["Machine", "learning", " ", "é", "ü", "你", "好", "€", "🎉", "\n"]),
                max_size=12).map("".join), st.sampled_from([1, 2]))
def test_characters_spelled_in_byte_tokens_stream_whole(text, chunk):
    """Byte fallback decodes an incomplete character to one U+FFFD per byte, the same as its bytes
    apart: "你" as <0xE4> <0xBD> <0xA0> came out as "�" and then nothing. Now every
    character streams as it completes, and nothing more than its bytes is held."""
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tokenizer, [1, 3, 4])
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(det.add(ids[i:i + chunk], final=i + chunk >= len(ids)))
        if chunk == 1:       # the engine's pace; a chunk ending inside a character holds the run's whole
            assert len(det.token_ids) - det.read_offset <= 3, "held more than one character's bytes"
    streamed = "".join(d.text for d in deltas if d)
    assert streamed == decode_delta(tokenizer, [1, 3, 4], ids) == (" " + text if text else "")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_after_any_prompt_a_byte_level_output_streams_as_its_own_decode(tokenizer, data):
    """Byte-level BPE decodes the same after a prompt as alone, except where the prompt ends inside a
    character: then the prompt gives no context, so its bytes never join the output's."""
    vocab = len(tokenizer)
    prompt = data.draw(st.lists(st.one_of(st.sampled_from(byte_token_ids(tokenizer)), st.integers(0, vocab - 1)),
                                min_size=1, max_size=12))
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_token_ids(tokenizer)), st.integers(0, vocab - 1)),
                             min_size=1, max_size=30))
    det = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [det.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(d.text for d in deltas if d) == decode(tokenizer, ids)
    assert [t for d in deltas if d for t in d.new_ids] == ids


def test_stop_strings_are_searched_only_where_asked():
    """search=False (before min_tokens) lets text through; the held tail still lets a stop string
    that ends in the first searched text match, as vLLM's look-back does."""
    s = StopStrings(["STOP"])
    assert s.feed("a STOP b", search=False) + s.feed(" c", final=True, search=False) == "a STOP b c"
    assert not s.stopped
    s = StopStrings(["STOP"])
    out = s.feed("x ST", search=False) + s.feed("OP y")
    assert out == "x " and s.stopped


def test_a_stop_token_ends_the_text_without_its_own_and_releases_what_was_held(tokenizer):
    """vLLM's rule: the text of the stop token that ended the output is left out (unless
    include_stop_str_in_output), and the text held back for a stop string still comes out."""
    from inflight import SamplingParams
    from inflight.serving.job import Sample
    ids = tokenizer("one\n two", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1
    for include in (False, True):
        sample = Sample("r", SamplingParams(), IncrementalDetokenizer(tokenizer), StopStrings(["\n\n"]), include)
        for token in ids:
            sample.add(token, None, None)
        sample.add(newline[0], None, "stop")         # a stop_token_ids token
        piece = sample.take()
        assert piece.text == "one\n two" + ("\n" if include else "") and sample.finish_reason == "stop"
        assert piece.new_ids == ids + (newline if include else []) and piece.num_tokens == len(ids) + 1


def test_without_skipping_the_ending_stop_token_is_still_left_out_as_vllm_leaves_it(tokenizer):
    """skip_special_tokens = false: the EOS that ends the output decodes to text, but, as in vLLM's
    detokenizer, it is not part of the output unless include_stop_str_in_output; stop strings
    match the text of special tokens."""
    from inflight import SamplingParams
    from inflight.serving.job import Sample
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = tokenizer(" one two", add_special_tokens=False)["input_ids"]
    params = SamplingParams(skip_special_tokens=False)
    for include in (False, True):
        sample = Sample("r", params, IncrementalDetokenizer(tokenizer, options=KEEP_SPECIAL), None, include, eos)
        for token in (ids[0], pad, *ids[1:]):
            sample.add(token, None, None)
        sample.add(eos, None, "stop")
        piece = sample.take()
        assert piece.text == " one<pad> two" + ("</s>" if include else "")
        assert sample.text_ids == piece.new_ids == [ids[0], pad, *ids[1:], *([eos] if include else [])]
    sample = Sample("r", params, IncrementalDetokenizer(tokenizer, options=KEEP_SPECIAL), StopStrings(["<pad>"]))
    assert not sample.add(ids[0], None, None) and sample.add(pad, None, None), "the engine must abort it"
    assert sample.take().text == " one" and sample.stop_reason == "<pad>"


def test_stop_reason_is_the_stop_string_or_token_and_none_for_eos_and_length(tokenizer):
    """vLLM's stop_reason: the matched stop string; a stop token's id, also the EOS when ignore_eos
    made it a plain stop token; None for an end on EOS and for a length limit."""
    from inflight import SamplingParams
    from inflight.serving.job import Sample
    eos = tokenizer.eos_token_id
    ids = tokenizer("one two", add_special_tokens=False)["input_ids"]

    def reason(params: SamplingParams, last: int, finish: str, stop: list[str] = ()) -> str | int | None:
        sample = Sample("r", params, IncrementalDetokenizer(tokenizer), StopStrings(stop) if stop else None,
                        eos_token_id=eos)
        for token in ids[:-1]:
            sample.add(token, None, None)
        sample.add(last, None, finish)
        assert sample.finish_reason == ("stop" if stop else finish)
        return sample.stop_reason

    assert reason(SamplingParams(), eos, "stop") is None
    assert reason(SamplingParams(ignore_eos=True, stop_token_ids=(eos,)), eos, "stop") == eos
    assert reason(SamplingParams(stop_token_ids=(ids[-1],)), ids[-1], "stop") == ids[-1]
    assert reason(SamplingParams(), ids[-1], "length") is None
    assert reason(SamplingParams(stop=("two", "wo")), ids[-1], None, stop=["two", "wo"]) == "two"


def test_a_stop_string_must_end_in_text_searched():
    """Text before min_tokens is not searched, also not by a shorter stop string in the tail held
    for a longer one (vLLM's look-back reaches len(stop) - 1 characters before the new text)."""
    s = StopStrings(["a", "xyzzy"])
    assert s.feed("a", search=False) + s.feed("b", search=False) + s.feed("c") + s.feed("d", final=True) == "abcd"
    assert not s.stopped
    s = StopStrings(["a", "xyzzy"])
    assert s.feed("ab", search=False) + s.feed("ca") == "abc" and s.stopped


def test_the_whole_output_decodes_after_the_prompt_tail_too():
    """The non-streamed token ids (the ensemble's postprocessing decodes them without the prompt)
    come with the same prompt tail the stream's first delta has."""
    tokenizer = sentencepiece_tokenizer()
    det = IncrementalDetokenizer(tokenizer, [1, 3, 4, 5, 6])
    assert det.prompt_tail == [4, 5, 6] or det.prompt_tail == [3, 4, 5, 6]
    assert decode_delta(tokenizer, det.prompt_tail, [7, 8, 2]) == " Machine learning"


def test_a_tokens_own_text_keeps_its_sentencepiece_space(tokenizer):
    """vLLM's decoded_token: a SentencePiece (Metaspace) piece decoded alone loses the space its
    `▁` stands for, which log-probability tokens (and OpenAI's `bytes`) must keep; byte-level
    tokenizers decode a token alone as it is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581Machine": 1, "ing": 2, "\u2581": 3}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert spiece.decode([1]) == "Machine"
    assert [token_text(spiece, t) for t in (1, 2, 3)] == [" Machine", "ing", " "]
    assert all(token_text(tokenizer, t) == tokenizer.decode([t]) for t in range(len(tokenizer)))

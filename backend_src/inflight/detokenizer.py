"""Incremental detokenization whose deltas add up exactly to the full decode, and stop strings.

Decoding token by token loses the spaces that some tokenizers attach to the next piece and breaks
multi-byte UTF-8 characters split across tokens. Here each delta is the difference between two
decodes that start at the same token (`prefix_offset`, a little before the new tokens), and text
is released only once it no longer ends in an incomplete character (U+FFFD). The final add releases
whatever is left at the end, so ''.join(deltas) == decode(all tokens) — except where a tokenizer's
decode of earlier tokens changes with later ones: SentencePiece byte fallback turns a whole run of
byte tokens into U+FFFD once one of them is invalid, text a stream has already sent (vLLM's
incremental decode cannot take it back either).

Bytes that never become a character (a model can emit any byte tokens) must not hold the stream:
while the text ends in U+FFFD, everything up to the last cut that no later token can change is
released (invalid bytes as U+FFFD, as the full decode gives them), and only the tokens of the one
character still incomplete are held: at most 3 with byte-level BPE, where a character is at most
4 bytes and every token carries at least one (special tokens, which the decode skips, are held
too: bytes on both sides of one still join). With vLLM's skip_special_tokens = false (DecodeOptions)
special tokens decode to their text, and are released like any other token.

SentencePiece byte fallback (Llama-2, Mistral: a character missing from the vocabulary is spelled
with `<0xNN>` tokens) decodes an incomplete character to one U+FFFD per byte, the same text as its
bytes decoded apart, so the decode alone cannot tell a character still being spelled from bytes
that never join: there a cut is also refused where the next byte continues an incomplete one.
"""
from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
MAX_LOOKBACK = 8             # tokens searched back for a cut (a character spans at most 4)
TOKEN_CONTEXT = 4            # sampled tokens before a byte piece that vLLM decodes it after


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """vLLM's SamplingParams fields of the same names: how a request's output reads as text."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


DEFAULT_DECODE = DecodeOptions()


def decode(tokenizer, token_ids: Sequence[int], options: DecodeOptions = DEFAULT_DECODE) -> str:
    """The one decode that both the full and the incremental paths use."""
    # spaces_between_special_tokens = false: transformers 4's Python (slow) tokenizers then join a
    # special token to its neighbours without a space. Fast tokenizers, and transformers 5's Python
    # ones, never add that space and ignore the flag, much as vLLM's fast incremental detokenizer
    # ignores it. Passed only when false, so that a decode which refuses keywords it does not know
    # (mistral-common's) keeps working with the defaults.
    spaces = {} if options.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return tokenizer.decode(list(token_ids), skip_special_tokens=options.skip_special_tokens,
                            clean_up_tokenization_spaces=False, **spaces)


SPIECE_SPACE = "\u2581"        # SentencePiece's (Metaspace's) mark of a leading space


def token_text(tokenizer, token: int) -> str:
    """A token decoded alone (vLLM's `decoded_token`), with the leading spaces of its SentencePiece
    piece that decode strips from a text's first token restored, as vLLM restores them."""
    text = tokenizer.decode([token])
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        missing = (len(piece) - len(piece.lstrip(SPIECE_SPACE))) - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            return " " * missing + text
    return text


def completed_token_text(tokenizer, token: int, context: Sequence[int]) -> str:
    """vLLM 0.32's decoded_token for a token that alone decodes to an unfinished character (U+FFFD
    at its end: a byte-fallback piece): decoded after up to TOKEN_CONTEXT sampled tokens before it, the
    text it completes, those of the pieces before it that were unfinished too included; "" while
    the character is still unfinished (vLLM's _correct_decoded_token)."""
    for n in range(1, min(len(context), TOKEN_CONTEXT) + 1):
        window = list(context[-n:])
        full = tokenizer.decode(window + [token])
        if full.endswith(REPLACEMENT):
            continue
        clean = len(window)
        while clean and tokenizer.decode([window[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = tokenizer.decode(window[:clean]) if clean else ""
        return full[len(os.path.commonprefix([prefix, full])):]
    return ""


def decode_delta(tokenizer, context_ids: Sequence[int], new_ids: Sequence[int],
                 options: DecodeOptions = DEFAULT_DECODE) -> str:
    """The text that new_ids add after context_ids: what a delta's (context, new tokens) decode to."""
    before = decode(tokenizer, context_ids, options)
    return decode(tokenizer, list(context_ids) + list(new_ids), options)[len(before):]


@dataclass(slots=True)
class Delta:
    text: str
    context_ids: list[int]     # the tokens decoded before the new ones (the decode window's start)
    new_ids: list[int]         # the tokens this text covers


PROMPT_CONTEXT = 4           # prompt tokens the first output token is decoded after


@functools.lru_cache(maxsize=8)
def fallback_bytes(tokenizer) -> dict[int, int]:
    """{token id: byte} for a byte-fallback tokenizer's `<0xNN>` tokens; empty for any other (byte-
    level BPE decodes an incomplete character to one U+FFFD, which the decode check already reads)."""
    pieces = {b: f"<0x{b:02X}>" for b in range(256)}
    ids = {b: tokenizer.convert_tokens_to_ids(piece) for b, piece in pieces.items()}
    by_byte = {b: i for b, i in ids.items() if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == pieces[b]}
    spelled = [by_byte.get(b) for b in "é".encode()]
    if None in spelled or tokenizer.decode(spelled) != "é":    # not bytes to this decoder
        return {}
    return {i: b for b, i in by_byte.items()}


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), options: DecodeOptions = DEFAULT_DECODE):
        """prompt_ids: the output is decoded as it reads after the prompt's last tokens, as vLLM's
        detokenizer does — SentencePiece tokenizers (Llama-2, Mistral) drop a leading space at the
        start of a decode, so decoded alone an output would lose its first word's space. A prompt
        that ends inside a character gives no context (its bytes would join the output's), nor does
        one with ids the tokenizer cannot decode (the engine refuses those; this runs first)."""
        self.tokenizer = tokenizer
        self.options = options
        # the tokens the decode skips: they decode to nothing
        self.skipped_ids = frozenset(tokenizer.all_special_ids if options.skip_special_tokens else ())
        self.byte_values = fallback_bytes(tokenizer)
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if not all(0 <= t < len(tokenizer) for t in context) or self._decode(context).endswith(REPLACEMENT):
            context = []
        self.prompt_tail = context      # what a decode of the whole output starts after
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0          # first token of the decode window
        self.read_offset = len(context)     # tokens before this are already released (or the prompt's)

    def add(self, token_ids: Sequence[int], final: bool = False) -> Delta | None:
        """Add new tokens; the text they complete, or None while a character is incomplete.
        With final=True (the request ended) everything not yet released comes out."""
        if (not final and token_ids and self.read_offset == len(self.token_ids)
                and self.skipped_ids.issuperset(token_ids)):
            # nothing pending, and tokens the decode skips add no text whatever follows: released
            # now and kept out of the window, where a run of them (EOS after EOS under ignore_eos)
            # was decoded again every step, ever longer
            return Delta("", self.token_ids[self.prefix_offset:self.read_offset], list(token_ids))
        self.token_ids.extend(token_ids)
        return self._step(final)

    def _step(self, final: bool) -> Delta | None:
        ids = self.token_ids
        context = ids[self.prefix_offset:self.read_offset]
        new = ids[self.read_offset:]
        if not new:
            return None
        text = decode_delta(self.tokenizer, context, new, self.options)
        if not final and (not text or text.endswith(REPLACEMENT)):
            cut = self._settled_prefix(context, new)
            if cut is None:
                return None
            new, text = new[:cut[0]], cut[1]
        self.prefix_offset, self.read_offset = self.read_offset, self.read_offset + len(new)
        return Delta(text, context, new)

    def _settled_prefix(self, context: list[int], new: list[int]) -> tuple[int, str] | None:
        """(n, text of the first n new tokens) for the largest n whose end no later token can
        change: the new tokens decode to the first n's text followed by what the rest decode to on
        their own (so no character or invalid sequence spans the cut); None if there is none."""
        before = self._decode(context)
        full = self._decode(context + new)
        for n in range(len(new) - 1, max(0, len(new) - MAX_LOOKBACK - 1), -1):
            if self.skipped_ids.issuperset(new[n:]):
                continue            # only skipped tokens after the cut: a later byte may still join
            if self._splits_a_character(context + new[:n], new[n:]):
                continue
            part = self._decode(context + new[:n])
            if full == part + self._decode(new[n:]):
                return n, part[len(before):]
        return None

    def _splits_a_character(self, before: list[int], after: list[int]) -> bool:
        """Byte fallback only: the cut falls between an incomplete character's bytes and a
        continuation byte (at most 3 bytes are held: a character has at most 4)."""
        if not self.byte_values:
            return False
        following = next((t for t in after if t not in self.skipped_ids), None)
        if self.byte_values.get(following, 0) & 0xC0 != 0x80:
            return False
        run = []                 # the last bytes before the cut: an incomplete character is at most 3
        for token in reversed(before):
            if token in self.skipped_ids:
                continue
            if token not in self.byte_values or len(run) == 3:
                break
            run.append(self.byte_values[token])
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.decode(bytes(reversed(run)))
        return bool(utf8.getstate()[0])          # bytes still waiting for their character

    def _decode(self, token_ids: Sequence[int]) -> str:
        return decode(self.tokenizer, token_ids, self.options)


class StopStrings:
    """Cuts streamed text before the earliest stop string (after it with include=True, vLLM's
    include_stop_str_in_output). The search looks back len(longest) - 1 characters, where a stop
    string may begin. Without include those characters are held back until the request ends,
    since they may be cut; with include nothing is (as vLLM streams it), and the look-back reads
    text already sent. Text fed with search=False (before min_tokens, as vLLM checks stop strings
    only after it) passes: a stop string may begin in it but must end in text fed with
    search=True, as vLLM's look-back allows."""

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop = tuple(stop)
        self.include = include
        # by length, so that a feed can look up each new end position once per length rather than
        # scan for every string: 200,000 stop strings cost ~70 ms a token scanned one by one
        self.by_length: dict[int, set[str]] = {}
        for s in self.stop:
            self.by_length.setdefault(len(s), set()).add(s)
        self.look_back = max(self.by_length, default=1) - 1
        self.sent_tail = ""         # include only: the look-back's part of the text already sent
        self.pending = ""           # text not sent yet
        self.unsearched = 0         # leading characters of sent_tail + pending fed with search=False
        self.matched: str | None = None     # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str, final: bool = False, search: bool = True) -> str:
        if self.stopped:
            return ""
        sent = len(self.sent_tail)
        window = self.sent_tail + self.pending + text
        hit = self._earliest(window, max(self.unsearched, len(window) - len(text))) if search else None
        if hit:
            start, length, self.matched = hit
            end = start + length if self.include else start
            assert end >= sent, "a stop string ends in text searched before"
            self.sent_tail = self.pending = ""
            return window[sent:end]
        cut = len(window) if final or self.include else max(len(window) - self.look_back, sent)
        kept = max(cut - self.look_back, 0) if self.include else cut     # where the next window begins
        self.sent_tail, self.pending = window[kept:cut], window[cut:]
        self.unsearched = max((self.unsearched if search else len(window)) - kept, 0)
        return window[sent:cut]

    def _earliest(self, window: str, searched: int) -> tuple[int, int, str] | None:
        """The earliest-starting (then shortest) stop string that ends past window[:searched]: text
        searched before held none, and one ending in text fed with search=False does not count.
        Whichever is cheaper: a lookup per new end position and length, or a scan per string (long
        pieces against stop strings of many lengths)."""
        if (len(window) - searched) * len(self.by_length) > len(self.stop):
            found = ((window.find(s, max(searched - len(s) + 1, 0)), s) for s in self.stop)
            return min(((start, len(s), s) for start, s in found if start >= 0), default=None)
        best = None
        for end in range(searched + 1, len(window) + 1):
            if best and end - self.look_back > best[0]:
                break                   # every later match starts after the best one
            for length, strings in self.by_length.items():
                start = end - length
                if start >= 0 and window[start:end] in strings and (best is None or (start, length) < best[:2]):
                    best = (start, length, window[start:end])
        return best

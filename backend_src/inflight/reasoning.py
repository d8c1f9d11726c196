"""Reasoning models (vLLM's `reasoning_parser`): a model that thinks between two markers before it
answers, as DeepSeek-R1 and its Llama and Qwen distills do in <think> ... </think>. With a reasoning
parser set, a request's structured outputs constrain the answer alone, as vLLM's engine does: the
grammar waits while the model reasons and starts after the end marker (from the first token where
the prompt ended the reasoning already; at qwen3's <tool_call>, which ends it too, with that token).
And a request's thinking_token_budget (vLLM's) bounds the reasoning: once it has written that many
tokens after the start marker, the end marker is the only token it may take. Each output's reasoning
tokens are counted (ReasoningTokens: the usage's completion_tokens_details.reasoning_tokens at the
OpenAI server). Splitting the text into reasoning and content is the OpenAI server's
(client/inflight_client/openai_server/reasoning.py). mistral (Magistral's [THINK] ... [/THINK],
special tokens) reads as vLLM 0.32's parser engine for it does (Markers.content_first)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Markers:
    start: str
    end: str
    tool_start: str | None = None       # a tool call's opening: inside the reasoning it ends it (and is content)
    turn_starts: tuple[str, ...] = ()   # a marker before the last of these belongs to another turn of the chat
    repeats_dropped: bool = False       # a start marker inside the reasoning, an end one in the content: none
    # vLLM's mistral: the markers are special tokens, kept in the text (the tokenizer's other special
    # tokens, but for `kept`, are dropped from it; neither is a reasoning token); a reply's reading starts
    # in the content whatever the prompt holds, and a start marker opens the reasoning wherever the model
    # writes it; a tokenizer without the start marker has no reasoning (all content, constrained from the
    # first token), one without tool_start is refused (vLLM's parser reads the calls too)
    content_first: bool = False
    kept: tuple[str, ...] = ()


# vLLM's parser name -> its markers. deepseek_r1: R1's templates open <think> in the prompt (the model may
# write it too). qwen3 (vLLM 0.32's): Qwen3 writes <think> itself in thinking mode (its template closes
# the reasoning in the prompt without it); a <tool_call> in the reasoning ends it, the prompt's markers
# count from the current turn on (its template keeps the reasoning of the turn's earlier replies), and a
# <think> inside the reasoning or a </think> after it is none (the OpenAI server's split drops them).
# mistral (vLLM 0.32's, with a Hugging Face tokenizer): Magistral's [THINK] ... [/THINK], special tokens;
# [TOOL_CALLS] ends the reasoning as <tool_call> does, and the prompt's markers count from anywhere
MARKERS = {"deepseek_r1": Markers("<think>", "</think>"),
           "qwen3": Markers("<think>", "</think>", "<tool_call>", ("<|im_start|>", "<|im_end|>"), True),
           "mistral": Markers("[THINK]", "[/THINK]", "[TOOL_CALLS]", (), True, True, ("[ARGS]",))}


@dataclass(frozen=True, slots=True)
class Reasoning:
    parser: str
    start_id: int | None                        # None: the tokenizer has no markers, no reply reasons (mistral)
    end_id: int | None
    tool_start_id: int | None = None            # where the tokenizer has the parser's tool_start
    turn_ids: frozenset[int] = frozenset()      # the turn_starts the tokenizer has
    dropped_texts: tuple[str, ...] = ()         # content_first: the tokenizer's other special tokens
    uncounted_ids: frozenset[int] = frozenset()  # content_first: those and the kept ones (vLLM's count skips them)

    @property
    def markers(self) -> Markers:
        return MARKERS[self.parser]

    @classmethod
    def load(cls, parser: str, tokenizer) -> "Reasoning":
        """The markers' token ids in the checkpoint's tokenizer; ValueError naming the setting where
        it has none or lacks the start or end marker (vLLM refuses such a parser too), or for a
        content_first parser the tool_start (its start marker may be missing: no reasoning)."""
        assert parser in MARKERS
        if tokenizer is None:
            raise ValueError(f"'reasoning_parser' {parser!r} needs the model's tokenizer, and this checkpoint has none")
        vocab, markers = tokenizer.get_vocab(), MARKERS[parser]
        thinks = markers.start in vocab or not markers.content_first
        needed = ((markers.start, markers.end) if thinks else ()) + ((markers.tool_start,) if markers.content_first
                                                                      else ())
        missing = [marker for marker in needed if marker not in vocab]
        if missing:
            raise ValueError(f"'reasoning_parser' {parser!r}: the tokenizer has no {missing[0]!r} token (its "
                             "markers must be tokens of their own)")
        if not thinks:
            log.warning("reasoning_parser %r: the tokenizer has no %r token, so no reply reasons (all content, "
                        "constrained from the first token), as vLLM's parser reads it", parser, markers.start)
            return cls(parser, None, None)
        own = {markers.start, markers.end, markers.tool_start, *markers.kept}
        dropped = [(i, text) for i, text in zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)
                   if markers.content_first and text not in own]
        kept = [vocab[text] for text in markers.kept if text in vocab]
        return cls(parser, vocab[markers.start], vocab[markers.end], vocab.get(markers.tool_start),
                   frozenset(vocab[t] for t in markers.turn_starts if t in vocab),
                   tuple(text for _, text in dropped), frozenset([*kept, *(i for i, _ in dropped)]))

    def ends(self, token: int) -> bool:
        """Whether the token ends the reasoning: the end marker, or a tool call's opening."""
        return token == self.end_id or token == self.tool_start_id

    def open_after(self, token_ids: Sequence[int]) -> bool:
        """Whether the model is still reasoning after these tokens: unless the last marker among them
        (in the current turn) ends it; no marker at all counts as reasoning, as vLLM's
        is_reasoning_end says (a tokenizer without markers: never)."""
        if self.start_id is None:
            return False
        last = self._last_marker(token_ids)
        return last < 0 or token_ids[last] == self.start_id

    def reply_opens(self, prompt: Sequence[int], ended: bool = False) -> bool:
        """Whether a reply's reading (its split, its reasoning-token count) starts in the reasoning:
        where the prompt left it open, unless the request gives the reasoning as ended (its
        reasoning_ended), and never for a content_first parser (vLLM's mistral reads the reply alone)."""
        return not ended and not self.markers.content_first and self.open_after(prompt)

    def budget_left(self, prompt: Sequence[int], budget: int) -> int | None:
        """The reasoning tokens a request of this budget may still write: where the prompt's last
        marker is the start, the tokens after it count already; elsewhere the count begins when the
        model writes the start marker (None until then), as vLLM counts."""
        last = self._last_marker(prompt)
        return budget - (len(prompt) - 1 - last) if last >= 0 and prompt[last] == self.start_id else None

    def _last_marker(self, token_ids: Sequence[int]) -> int:
        """The index of the last start or end marker among the tokens, after the last turn start;
        -1 if none."""
        for i in range(len(token_ids) - 1, -1, -1):
            token = token_ids[i]
            if token == self.start_id or self.ends(token):
                return i
            if token in self.turn_ids:
                return -1
        return -1

    def budget_after(self, left: int | None, token: int, budget: int) -> int | None:
        """What is left of the budget after a sampled token (None: not reasoning)."""
        if token == self.start_id:
            return budget
        if self.ends(token) or left is None:
            return None
        return left - 1


@dataclass(slots=True)
class ReasoningTokens:
    """One output's reasoning tokens so far: those it writes while reasoning, the markers not counted
    (vLLM's count). A start marker opens the reasoning, an end marker closes it."""
    markers: Reasoning
    open: bool            # reasoning now: the prompt left it open (Reasoning.reply_opens), or a start since
    count: int = 0

    def add(self, token: int) -> None:
        if token == self.markers.start_id or self.markers.ends(token):
            self.open = token == self.markers.start_id
        elif self.open and token not in self.markers.uncounted_ids:
            self.count += 1

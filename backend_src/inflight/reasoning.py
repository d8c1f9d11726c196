"""Reasoning models (vLLM's `reasoning_parser`): a model that thinks between two markers before it
answers, as DeepSeek-R1 and its Llama and Qwen distills do in <think> ... </think>. With a reasoning
parser set, a request's structured outputs constrain the answer alone, as vLLM's engine does: the
grammar waits while the model reasons and starts after the end marker (from the first token where
the prompt ended the reasoning already). And a request's thinking_token_budget (vLLM's) bounds the
reasoning: once it has written that many tokens after the start marker, the end marker is the only
token it may take. Each output's reasoning tokens are counted (ReasoningTokens: the usage's
completion_tokens_details.reasoning_tokens at the OpenAI server). Splitting the text into reasoning
and content is the OpenAI server's (client/inflight_client/openai_server/reasoning.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's parser name -> its start and end markers. qwen3: Qwen3 writes <think> itself in thinking mode
# and its template closes the reasoning in the prompt without it, both read as deepseek_r1's are
MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}


@dataclass(frozen=True, slots=True)
class Reasoning:
    parser: str
    start_id: int
    end_id: int

    @property
    def markers(self) -> tuple[str, str]:
        return MARKERS[self.parser]

    @classmethod
    def load(cls, parser: str, tokenizer) -> "Reasoning":
        """The markers' token ids in the checkpoint's tokenizer; ValueError naming the setting where
        it has none or lacks one (vLLM refuses such a parser too)."""
        assert parser in MARKERS
        if tokenizer is None:
            raise ValueError(f"'reasoning_parser' {parser!r} needs the model's tokenizer, and this checkpoint has none")
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in MARKERS[parser] if marker not in vocab]
        if missing:
            raise ValueError(f"'reasoning_parser' {parser!r}: the tokenizer has no {missing[0]!r} token (its "
                             "markers must be tokens of their own)")
        return cls(parser, *(vocab[marker] for marker in MARKERS[parser]))

    def open_after(self, token_ids: Sequence[int]) -> bool:
        """Whether the model is still reasoning after these tokens: unless the last marker among them
        is the end (no marker at all counts as reasoning, as vLLM's is_reasoning_end says)."""
        last = self._last_marker(token_ids)
        return last < 0 or token_ids[last] == self.start_id

    def budget_left(self, prompt: Sequence[int], budget: int) -> int | None:
        """The reasoning tokens a request of this budget may still write: where the prompt's last
        marker is the start, the tokens after it count already; elsewhere the count begins when the
        model writes the start marker (None until then), as vLLM counts."""
        last = self._last_marker(prompt)
        return budget - (len(prompt) - 1 - last) if last >= 0 and prompt[last] == self.start_id else None

    def _last_marker(self, token_ids: Sequence[int]) -> int:
        """The index of the last start or end marker among the tokens; -1 if none."""
        for i in range(len(token_ids) - 1, -1, -1):
            if token_ids[i] in (self.start_id, self.end_id):
                return i
        return -1

    def budget_after(self, left: int | None, token: int, budget: int) -> int | None:
        """What is left of the budget after a sampled token (None: not reasoning)."""
        if token == self.start_id:
            return budget
        if token == self.end_id or left is None:
            return None
        return left - 1


@dataclass(slots=True)
class ReasoningTokens:
    """One output's reasoning tokens so far: those it writes while reasoning, the markers not counted
    (vLLM's count). A start marker opens the reasoning, an end marker closes it."""
    markers: Reasoning
    open: bool            # reasoning now: the prompt left it open (Reasoning.open_after), or a start since
    count: int = 0

    def add(self, token: int) -> None:
        if token in (self.markers.start_id, self.markers.end_id):
            self.open = token == self.markers.start_id
        elif self.open:
            self.count += 1

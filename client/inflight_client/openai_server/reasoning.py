"""--reasoning-parser (vLLM's): a chat reply of a reasoning model split into its reasoning and its
content, as it arrives. deepseek_r1 (DeepSeek-R1 and its Llama and Qwen distills, QwQ): the text up
to </think> is reasoning (a leading <think> dropped: these templates open it in the prompt), the
rest is content; a reply that never writes </think> is all reasoning, and where the prompt's last
marker is </think> (the reasoning was ended in the prompt) all of it is content. qwen3 reads the
same, and as vLLM 0.32's: a <tool_call> also ends the reasoning (it begins the content, where the
tool parser reads it), the prompt's markers count from its last turn on, and a <think> inside the
reasoning or a </think> in the content is dropped. The engine's own reasoning_parser (backend_src/inflight/reasoning.py) keeps a
constraint for the content."""
from __future__ import annotations

from inflight.reasoning import MARKERS, Reasoning

from .tool_parsers import held_prefix

PARSERS = tuple(MARKERS)


def markers(parser: str, tokenizer) -> Reasoning:
    """The parser's markers in the tokenizer; SystemExit naming the flag where it lacks one."""
    try:
        return Reasoning.load(parser, tokenizer)
    except ValueError as exc:
        raise SystemExit(f"inflight-openai: --reasoning-parser: {exc}") from None


class ReasoningText:
    """One choice's text as it arrives: `feed` returns the (reasoning, content) the new text
    completes, `close` what is held at the end; `split` reads a whole reply."""

    def __init__(self, markers: Reasoning, reasoning: bool):
        spec = markers.markers
        self.start = spec.start
        # what ends the reasoning: the end marker (dropped), and qwen3's tool call opening (the content's start)
        self.ends = (spec.end,) if spec.tool_start is None else (spec.end, spec.tool_start)
        self.drops_repeats = spec.repeats_dropped       # qwen3 (vLLM's): a <think> inside, a </think> after: none
        # what is held back while reasoning: what could begin an end (or a start that is dropped)
        self.held_markers = (*self.ends, self.start) if self.drops_repeats else self.ends
        self.reasoning = reasoning        # still reasoning: no end read yet
        self.text = ""                    # what arrived and is held (while reasoning: all of it)
        self.position = 0                 # while reasoning: what has been read
        self.opened = False               # a leading start marker was looked for

    def feed(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", self._content(text)
        self.text += text
        if not self.opened:
            stripped = self.text.lstrip()
            if self.start.startswith(stripped):
                return "", ""             # what could still be the start marker
            if stripped.startswith(self.start):
                self.position = len(self.text) - len(stripped) + len(self.start)
            self.opened = True
        found = [(at, marker) for marker in self.ends if (at := self.text.find(marker, self.position)) >= 0]
        if not found:
            held = max(held_prefix(self.text[self.position:], marker) for marker in self.held_markers)
            reasoning, self.position = self.text[self.position:len(self.text) - held], len(self.text) - held
            return self._reasoning(reasoning), ""
        at, marker = min(found)
        after = at + len(marker) if marker == self.ends[0] else at       # a tool call stays in the content
        reasoning, content = self.text[self.position:at], self.text[after:]
        self.reasoning, self.text, self.position = False, "", 0
        return self._reasoning(reasoning), self._content(content)

    def _reasoning(self, text: str) -> str:
        return text.replace(self.start, "") if self.drops_repeats else text

    def _content(self, text: str) -> str:
        """Content as it comes; qwen3's without </think> (held while one could be starting)."""
        if not self.drops_repeats:
            return text
        text = (self.text + text).replace(self.ends[0], "")
        end = len(text) - held_prefix(text, self.ends[0])
        self.text = text[end:]
        return text[:end]

    def close(self) -> tuple[str, str]:
        """The reasoning and the content held at the end (what could have begun a marker)."""
        rest, self.text, self.position = self.text[self.position:], "", 0
        return (self._reasoning(rest), "") if self.reasoning else ("", rest)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply's reasoning (None where the prompt had ended it) and content."""
        reasoned = self.reasoning
        reasoning, content = self.feed(text)
        more, rest = self.close()
        return (reasoning + more if reasoned else None), content + rest

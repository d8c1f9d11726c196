"""--reasoning-parser (vLLM's): a chat reply of a reasoning model split into its reasoning and its
content, as it arrives. deepseek_r1 (DeepSeek-R1 and its Llama and Qwen distills, QwQ): the text up
to </think> is reasoning (a leading <think> dropped: these templates open it in the prompt), the
rest is content; a reply that never writes </think> is all reasoning, and where the prompt's last
marker is </think> (the reasoning was ended in the prompt) all of it is content. The engine's own
reasoning_parser (backend_src/inflight/reasoning.py) keeps a constraint for the content."""
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
    completes, `close` what is held at the end."""

    def __init__(self, markers: Reasoning, reasoning: bool):
        self.start, self.end = markers.markers
        self.reasoning = reasoning        # still reasoning: the end marker not read yet
        self.text = ""                    # while reasoning: what arrived
        self.position = 0                 # what has been read
        self.opened = False               # a leading start marker was looked for

    def feed(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", text
        self.text += text
        if not self.opened:
            stripped = self.text.lstrip()
            if self.start.startswith(stripped):
                return "", ""             # what could still be the start marker
            if stripped.startswith(self.start):
                self.position = len(self.text) - len(stripped) + len(self.start)
            self.opened = True
        end = self.text.find(self.end, self.position)
        if end < 0:
            held = held_prefix(self.text[self.position:], self.end)
            reasoning, self.position = self.text[self.position:len(self.text) - held], len(self.text) - held
            return reasoning, ""
        reasoning, content = self.text[self.position:end], self.text[end + len(self.end):]
        self.reasoning, self.text = False, ""
        return reasoning, content

    def close(self) -> str:
        """The reasoning held at the end (what could have begun a marker)."""
        if not self.reasoning:
            return ""
        rest, self.position = self.text[self.position:], len(self.text)
        return rest

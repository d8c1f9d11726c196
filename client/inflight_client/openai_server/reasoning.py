"""--reasoning-parser (vLLM's): a chat reply of a reasoning model split into its reasoning and its
content, as it arrives. deepseek_r1 (DeepSeek-R1 and its Llama and Qwen distills, QwQ): the text up
to </think> is reasoning (a leading <think> dropped: these templates open it in the prompt), the
rest is content; a reply that never writes </think> is all reasoning, and where the prompt's last
marker is </think> (the reasoning was ended in the prompt) all of it is content. qwen3 reads the
same, and as vLLM 0.32's: a <tool_call> also ends the reasoning (it begins the content, where the
tool parser reads it), the prompt's markers count from its last turn on, and a <think> inside the
reasoning or a </think> in the content is dropped. mistral (Magistral's [THINK] ... [/THINK]) reads
as vLLM 0.32's: ContentFirstText. The engine's own reasoning_parser (backend_src/inflight/reasoning.py)
keeps a constraint for the content."""
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


def reader(markers: Reasoning, prompt_ids: list[int]) -> "ReasoningText | ContentFirstText":
    """A choice's reader for a reply to this prompt."""
    if markers.markers.content_first:
        return ContentFirstText(markers)
    return ReasoningText(markers, markers.reply_opens(prompt_ids))


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


class ContentFirstText:
    """vLLM 0.32's mistral reading of one choice's text as it arrives (its parser engine's): content
    until a start marker, reasoning until an end marker or a tool call's opening (which stays in the
    content, where the tool parser reads it), and so on; a start marker inside the reasoning and an
    end marker in the content are dropped, as are the tokenizer's other special tokens (the text
    keeps them, for the markers) and the reasoning's trailing whitespace. Where the tokenizer has no
    markers the text is all content, as written. `feed`, `close` and `split` as ReasoningText's."""

    def __init__(self, markers: Reasoning):
        spec = markers.markers
        self.thinks = markers.start_id is not None
        self.start, self.end, self.tool_start = spec.start, spec.end, spec.tool_start
        self.terminals = (spec.start, spec.end, spec.tool_start, *markers.dropped_texts)
        self.reasoning = False            # in the reasoning now
        self.text = ""                    # what arrived and could still begin a terminal
        self.spaces = ""                  # the reasoning's trailing whitespace: sent if more reasoning follows

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinks:
            return "", text
        self.text += text
        reasoning, content = [], []
        while found := [(at, -len(t), t) for t in self.terminals if (at := self.text.find(t)) >= 0]:
            at, _, terminal = min(found)      # the first, and the longest there
            (reasoning if self.reasoning else content).append(self.text[:at])
            self.text = self.text[at + len(terminal):]
            if terminal == self.tool_start:
                content.append(terminal)
                self.reasoning = False
            elif terminal in (self.start, self.end):
                self.reasoning = terminal == self.start
        held = max(held_prefix(self.text, terminal) for terminal in self.terminals)
        (reasoning if self.reasoning else content).append(self.text[:len(self.text) - held])
        self.text = self.text[len(self.text) - held:]
        return self._reasoning("".join(reasoning)), "".join(content)

    def _reasoning(self, text: str) -> str:
        """The reasoning to send: its trailing whitespace held until more reasoning follows."""
        text = self.spaces + text
        sent = text.rstrip()
        self.spaces = text[len(sent):]
        return sent

    def close(self) -> tuple[str, str]:
        """What is held at the end: the text that could have begun a terminal; the whitespace is dropped."""
        rest, self.text = self.text, ""
        return (self._reasoning(rest), "") if self.reasoning else ("", rest)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply's reasoning (None where it has none, as vLLM's) and content."""
        reasoning, content = self.feed(text)
        more, rest = self.close()
        return (reasoning + more) or None, content + rest

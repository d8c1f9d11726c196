"""What the response thread keeps per request: a Job per Triton request, and a Sample per output
(`n` of them; each is an engine request of its own, with its own detokenizer and stop strings).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..config import SamplingParams
from ..detokenizer import IncrementalDetokenizer, StopStrings
from ..logprobs import TokenLogprobs
from ..reasoning import ReasoningTokens
from .protocol import GenerateRequest


class ResponseSink(Protocol):
    """Where a request's responses go (a Triton response sender, in production). outputs None
    with final: no response, only the end of the stream; {}: a response without outputs."""

    def send(self, outputs: dict[str, np.ndarray] | None, final: bool, error: str | None = None) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(slots=True)
class Piece:
    """What one response carries for one output: everything since the previous response (a
    stream), or everything (one response)."""
    text: str
    num_tokens: int
    logprobs: list[TokenLogprobs]
    new_ids: list[int]
    context_ids: list[int]
    num_reasoning_tokens: int = 0           # of num_tokens, those written while reasoning


@dataclass(eq=False)
class Sample:
    request_id: str
    params: SamplingParams                  # as the engine runs it (its own seed; log-probs if needed)
    detokenizer: IncrementalDetokenizer
    stops: StopStrings | None
    include_stop_text: bool = False         # vLLM's include_stop_str_in_output: also a stop token's text
    eos_token_id: int | None = None         # the tokenizer's: an end on it has no stop_reason
    output_ids: list[int] = field(default_factory=list)
    stop_token_hidden: bool = False         # the output ended on a stop token left out of its text and ids
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None    # vLLM's: the stop string, or the stop token (not EOS), that ended it
    ready: bool = False                     # got tokens (or its end) since the last response
    first_token_time: float | None = None   # when its first token was delivered (the metrics' TTFT)
    last_token_time: float | None = None    # when its latest token was delivered (the metrics' token gaps)
    reasoning: ReasoningTokens | None = None  # its reasoning tokens, counted where asked (a reasoning_parser)
    num_cached_tokens: int = 0              # prompt tokens its first admission found in the prefix cache
    _text: list[str] = field(default_factory=list)          # not sent yet
    _logprobs: list[TokenLogprobs] = field(default_factory=list)
    _num_tokens: int = 0
    _new_ids: list[int] = field(default_factory=list)       # tokens of the text not sent yet
    _context_ids: list[int] = field(default_factory=list)   # and the tokens decoded before them
    _reasoning_sent: int = 0                                  # reasoning tokens the responses so far covered

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprobs: TokenLogprobs | None, finish: str | None) -> bool:
        """One generated token (finish: the engine's reason when it was the last). True when a
        stop string ended the sample here, so the engine must abort it."""
        self.output_ids.append(token)
        self._num_tokens += 1
        if logprobs is not None:
            self._logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token].logprob
        # the engine's "stop" is a stop token (EOS or stop_token_ids) sampled last: its text is not
        # part of the output unless asked for, as in vLLM (also with skip_special_tokens = false);
        # a special token the decode skips (EOS, by default) has no text to leave out and stays
        # among the token ids
        self.stop_token_hidden = (finish == "stop" and not self.include_stop_text
                                  and token not in self.detokenizer.skipped_ids)
        if self.reasoning is not None and not self.stop_token_hidden:
            self.reasoning.add(token)
        final = finish is not None
        delta = self.detokenizer.add([] if self.stop_token_hidden else [token], final=final)
        # None: the text ends inside a character (wait for more), or at the end nothing was left
        text = delta.text if delta is not None else ""
        if self.stops is not None and (delta is not None or final):   # the end releases what it held
            # searched from min_tokens on, as vLLM does
            text = self.stops.feed(text, final=final, search=len(self.output_ids) > self.params.min_tokens)
        self._text.append(text)
        if delta is not None:
            if not self._new_ids:
                self._context_ids = delta.context_ids
            self._new_ids = self._new_ids + delta.new_ids
        # a stream gets one response per engine step, as the vLLM backend sends, even while a
        # character is incomplete (empty text): a client timing responses sees the engine's pace
        self.ready = True
        if self.stops is not None and self.stops.stopped:
            self.finish_reason, self.stop_reason = "stop", self.stops.matched
            return finish is None
        self.finish_reason = finish
        if finish == "stop" and (token != self.eos_token_id or self.params.ignore_eos):
            self.stop_reason = token            # one of stop_token_ids, or a model's other EOS (vLLM's rule)
        return False

    @property
    def pending_tokens(self) -> int:
        """Tokens since the last response."""
        return self._num_tokens

    @property
    def text_ids(self) -> list[int]:
        """The output tokens its text covers."""
        return self.output_ids[:-1] if self.stop_token_hidden else self.output_ids

    def take(self) -> Piece:
        reasoned = 0 if self.reasoning is None else self.reasoning.count - self._reasoning_sent
        self._reasoning_sent += reasoned
        piece = Piece("".join(self._text), self._num_tokens, self._logprobs, self._new_ids, self._context_ids,
                      reasoned)
        self._text, self._logprobs, self._num_tokens, self._new_ids, self._context_ids = [], [], 0, [], []
        self.ready = False
        return piece


@dataclass(eq=False)
class Job:
    job_id: str
    request: GenerateRequest
    sink: ResponseSink
    prompt_ids: list[int]
    arrival: float
    samples: list[Sample]
    enqueued: float = 0.0                   # when it went to the engine thread, after its grammar (max_queue_wait_s)
    done: bool = False                      # its final response went out
    grammar: object = None                  # structured outputs: compiled before the engine thread takes it
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)   # from the second prompt token on
    num_responses: int = 0
    last_response: float = 0.0              # when its latest response or heartbeat went out (monotonic)
    embedding: list[float] | None = None    # an embedding request's, from the step that ran its prompt's end

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    @property
    def first_token_time(self) -> float | None:
        """When the first token of any of its outputs was delivered."""
        return min((s.first_token_time for s in self.samples if s.first_token_time is not None), default=None)

    @property
    def output_ids(self) -> list[int]:
        """The longest output (what the latency metrics count)."""
        return max((sample.output_ids for sample in self.samples), key=len)

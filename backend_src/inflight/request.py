"""One request's lifecycle state, and what the engine hands back for it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .logprobs import TokenLogprobs


class Status(enum.IntEnum):
    WAITING = 0     # queued, or preempted and waiting to be recomputed
    RUNNING = 1     # holds a row of the batch table (a seat) and KV blocks
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Request:
    """While RUNNING, the request's token ids and progress live in its row of the BatchTable
    (vectorised per-step bookkeeping); otherwise `token_ids` holds prompt + output so far."""
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int                     # 0 high, 1 normal, 2 low
    arrival_seq: int                  # global arrival order: FIFO within a priority class
    arrival_time: float
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    row: int = -1
    finish_reason: str | None = None
    error: str | None = None          # set when the engine failed the request (finish_reason "error")
    num_preemptions: int = 0
    cache_key: bytes = b""            # separates prefix-cache entries of models and cache salts
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of full blocks
    first_scheduled_time: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # per output token, if params.logprobs
    # if params.prompt_logprobs: per prompt token from the second on (the first has no context)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    matcher: object | None = None     # structured outputs: the grammar matcher (structured.py)
    reasoning: bool = False           # the matcher waits: the model reasons until its end marker (reasoning.py)
    thinking_left: int | None = None  # thinking_token_budget: reasoning tokens left (None: not reasoning)
    lora_id: int = -1                 # the adapter's id in the runner's LoRA weights; -1: base model
    group: list[Request] | None = None    # the outputs of one n > 1 request, this one among them
    pooling: object | None = None     # an embedding request's PoolingParams (pooling.py); None: it generates
    embedding: list[float] | None = None      # a pooling request's result, once its prompt has run

    @property
    def started(self) -> bool:
        """Admitted once, or one of its group was: an n > 1 request has begun as a whole."""
        members = self.group or (self,)
        return any(r.first_scheduled_time is not None for r in members)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]              # generated ids only
    finish_reason: str | None         # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None   # per token: {token id: Logprob}, sampled token first
    num_preemptions: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None    # per prompt token, None first (vLLM)
    embedding: list[float] | None = None      # a pooling request's (then token_ids is empty)


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced: one new token per advancing request, and the finished ones.

    Kept as parallel lists (not one object per request) so a step at hundreds of running requests
    costs no per-request allocation in the engine.
    """
    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None    # per advancing request; None when nobody asked
    finished: dict[str, str]          # request id -> finish reason, for every request that ended
    errors: dict[str, str] = field(default_factory=dict)   # request id -> message, reason "error"
    # request id -> the prompt log-probabilities this step computed (a prompt's chunks, in order)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> the prompt tokens found in the prefix cache, for each request first admitted this step
    cached: dict[str, int] = field(default_factory=dict)
    # request id -> the embedding of each pooling request whose prompt this step finished (it ends too)
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def __iter__(self):
        """(request_id, token_id, logprob | None, finish_reason | None) per advancing request."""
        logprobs = self.logprobs or [None] * len(self.token_ids)
        for request_id, token_id, logprob in zip(self.request_ids, self.token_ids, logprobs):
            yield request_id, token_id, logprob, self.finished.get(request_id)

    def __len__(self) -> int:
        return len(self.request_ids)

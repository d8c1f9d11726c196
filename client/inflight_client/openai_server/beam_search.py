"""vLLM's `use_beam_search`, run where vLLM 0.32's server runs it: here, over `llm` requests of one
token. Each step asks `llm` for the next token of every live beam at once (max_tokens 1, greedy,
the top 2 x width log-probabilities; `llm`'s prefix cache and batching serve the beams together),
extends each beam by each of those candidates, sets aside a candidate that is EOS as an ended beam
(unless ignore_eos), and keeps the `width` (= n) likeliest others. After max_tokens steps, the ended
and live beams are ranked by vLLM's score (the cumulative log-probability over the length, prompt
included, to the power length_penalty) and the best `width` are the choices: one LLMResponse, which
the routes turn into a reply as they do `llm`'s (a chat stream: every choice at once, at the end).

Log-probabilities are the model's own (before temperature, as vLLM's), so the search is the same at
any temperature; the other sampling fields (top_p, top_k, min_p, seed) do not apply to it and are
ignored, as vLLM ignores them. Fields that would shape the tokens, which vLLM's search drops
silently, are refused by name (IDLE)."""
from __future__ import annotations

import asyncio
import functools
import heapq
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from inflight.config import MAX_LOGPROBS
from inflight.reasoning import ReasoningTokens

from .context import Context
from .errors import APIError
from .schemas import CompletionRequest, SamplingFields
from .structured import request_constraints
from .triton import LLMResponse, Prompt

MAX_WIDTH = MAX_LOGPROBS // 2       # each step asks `llm` for 2 x width log-probabilities
# the request's sampling keys each step passes on: the adapter, the queue's order, the prefix cache's salt
STEP_KEYS = ("lora_name", "lora_path", "priority", "cache_salt")
# fields that shape the tokens, which the search does not read: refused unless at a value that changes nothing
IDLE = {"stop": (None, []), "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
        "logit_bias": (None, {}), "min_tokens": (None, 0), "frequency_penalty": (None, 0),
        "presence_penalty": (None, 0), "repetition_penalty": (None, 1), "prompt_logprobs": (None,),
        "thinking_token_budget": (-1,)}


@dataclass(slots=True)
class Beam:
    tokens: list[int]           # generated (an ending EOS kept only with include_stop_str_in_output)
    logprob: float              # cumulative, an ending EOS's included
    steps: list[dict]           # each token's step: `llm`'s map {token id: {logprob, rank, decoded_token}}
    ended: bool = False         # on EOS: finish_reason "stop"


def generator(body: SamplingFields, ctx: Context) -> Callable[[Prompt, dict], AsyncIterator[LLMResponse]]:
    """What a beam-search request's prompts go to in place of ctx.triton.generate, with the
    sampling the route built for them (max_tokens fitted to the context, n, lora_name, ...)."""
    _check(body)
    return functools.partial(search, ctx, body.length_penalty)


def _check(body: SamplingFields) -> None:
    if body.n > MAX_WIDTH:
        raise APIError(400, f"'n' is the beam width with 'use_beam_search', at most {MAX_WIDTH} (each step asks "
                       f"for 2 x n log-probabilities, at most {MAX_LOGPROBS}); got {body.n}", "n")
    if isinstance(body, CompletionRequest):
        if body.stream:         # vLLM's rule
            raise APIError(400, "'use_beam_search': a completion with beam search cannot be streamed (as in vLLM)",
                           "use_beam_search")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "'echo' with 'logprobs' is not served with beam search, which scores no prompt "
                           "(as in vLLM)", "echo")
    for name, neutral in IDLE.items():
        if getattr(body, name) not in neutral:
            raise APIError(400, f"'{name}' is not served with 'use_beam_search' (the search reads only n, max_tokens, "
                           "ignore_eos, length_penalty, include_stop_str_in_output and skip_special_tokens)", name)
    constraints = request_constraints(body)
    forced_call = getattr(body, "tool_choice", None) not in (None, "none", "auto")
    if constraints or forced_call:
        name = constraints[0].source if constraints else "tool_choice"
        raise APIError(400, f"'{name}': output constraints are not served with 'use_beam_search' (a chat's tools "
                       "are, with tool_choice \"auto\": calls are read from the text)", name)


async def search(ctx: Context, length_penalty: float, prompt: Prompt, sampling: dict
                 ) -> AsyncIterator[LLMResponse]:
    """The search for one prompt, as one response with its `n` choices, best first."""
    width, shown = sampling.get("n", 1), sampling.get("logprobs")
    eos = ctx.tokenizer.eos_token_id
    stops = not sampling.get("ignore_eos", False)
    keep_eos = sampling.get("include_stop_str_in_output", False)
    step = {"max_tokens": 1, "temperature": 0, "logprobs": max(2 * width, shown or 0),
            **{key: sampling[key] for key in STEP_KEYS if key in sampling}}
    if sampling["max_tokens"] < 1:         # `llm` checks it on other requests; the steps here each ask for 1
        raise APIError(400, f"'max_tokens' must be an integer >= 1, got {sampling['max_tokens']}", "max_tokens")
    live, ended = [Beam([], 0.0, [])], []
    for _ in range(sampling["max_tokens"]):
        candidates = []         # (cumulative log-probability, beam, token, its step)
        for beam, top in zip(live, await _next_tokens(ctx, prompt.ids, live, step)):
            for token, entry in top.items():
                if entry["rank"] > 2 * width:       # beyond what vLLM asks for: shown only
                    continue
                candidate = (beam.logprob + entry["logprob"], beam, int(token), top)
                if int(token) == eos and stops:
                    ended.append(_grown(*candidate, ended=True, kept=keep_eos))
                else:
                    candidates.append(candidate)
        live = [_grown(*c) for c in heapq.nlargest(width, candidates, key=lambda c: c[0])]
        if not live:
            break

    def score(beam: Beam) -> float:
        # vLLM's: the length counts the prompt, less a final EOS
        length = len(prompt.ids) + len(beam.tokens)
        last = beam.tokens[-1] if beam.tokens else prompt.ids[-1]
        return beam.logprob / max(length - (last == eos), 1) ** length_penalty

    best = sorted(ended + live, key=score, reverse=True)[:width]
    assert len(best) == width, "every step keeps `width` beams: a vocabulary has more than 2 x width tokens"
    skip = sampling.get("skip_special_tokens", True)
    texts = [ctx.tokenizer.decode(beam.tokens[:-1] if beam.ended and keep_eos else beam.tokens,
                                  skip_special_tokens=skip) for beam in best]
    yield LLMResponse(texts, ["stop" if beam.ended else "length" for beam in best],
                      [eos if beam.ended else None for beam in best], [len(beam.tokens) for beam in best],
                      [_positions(beam, shown) if shown is not None else None for beam in best], len(prompt.ids),
                      num_reasoning_tokens=_reasoning_tokens(ctx, prompt.ids, sampling, best))


def _grown(logprob: float, beam: Beam, token: int, top: dict, ended: bool = False, kept: bool = True) -> Beam:
    if not kept:
        return Beam(beam.tokens, logprob, beam.steps, ended)
    return Beam(beam.tokens + [token], logprob, beam.steps + [top], ended)


async def _next_tokens(ctx: Context, prompt_ids: list[int], beams: list[Beam], step: dict) -> list[dict]:
    """Each beam's next-token map, its requests run at once; the first error cancels the others
    (as does cancelling this: a client gone) and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_next_token(ctx, Prompt(prompt_ids + beam.tokens, None, "use_beam_search"),
                                                   step)) for beam in beams]
    except* APIError as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def _next_token(ctx: Context, prompt: Prompt, step: dict) -> dict:
    positions = []
    async for response in ctx.triton.generate(prompt, step):
        positions += response.logprobs[0] or []
    return positions[0]


def _reasoning_tokens(ctx: Context, prompt_ids: list[int], sampling: dict, beams: list[Beam]) -> list[int] | None:
    """Each beam's tokens written while reasoning, as `llm` counts them (with --reasoning-parser)."""
    if ctx.reasoning is None:
        return None
    counts, opens = [], ctx.reasoning.reply_opens(prompt_ids, sampling.get("reasoning_ended", False))
    for beam in beams:
        counter = ReasoningTokens(ctx.reasoning, opens)
        for token in beam.tokens:
            counter.add(token)
        counts.append(counter.count)
    return counts


def _positions(beam: Beam, shown: int) -> list[dict]:
    """The beam's tokens as `llm`'s logprobs give sampled ones: each its step's map with that token
    first, then the step's top `shown`."""
    return [{str(token): top[str(token)],
             **{key: entry for key, entry in top.items() if entry["rank"] <= shown and key != str(token)}}
            for token, top in zip(beam.tokens, beam.steps)]

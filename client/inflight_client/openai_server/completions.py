"""POST /v1/completions: one `llm` request per prompt (a string, a token array, or a list of
either); choice i * n + j is prompt i's output j. `echo` prepends the prompt here, so a stream
can echo too (`llm` never repeats a prompt in a stream, as the vLLM backend); with `logprobs` the
prompt's tokens come first in them (what lm-evaluation-harness's loglikelihood reads), scored by
`llm` (prompt_logprobs). Every prompt is tokenized here, to fit max_tokens to the context and for
vLLM's `return_token_ids` (each choice's prompt_token_ids, and token_ids: the sampled tokens of
its log-probability positions, which `llm` then returns with N = 0 if the request gave none).
`max_tokens` 0 with `echo` answers the prompt alone, streamed or not."""
from __future__ import annotations

import functools
import time

from starlette.responses import JSONResponse

from . import beam_search, generation
from .context import Context
from .errors import APIError
from .logprobs import completion_logprobs, echoed_positions, sampled_ids
from .sampling import completion_sampling
from .schemas import CompletionRequest
from .sse import event, sse_response
from .structured import blame, request_constraints, single
from .triton import Prompt


async def create_completion(body: CompletionRequest, ctx: Context, request_id: str, large: bool):
    adapter = ctx.models.check(body.model)
    generate = beam_search.generator(body, ctx) if body.use_beam_search else ctx.triton.generate
    constraint = single(request_constraints(body), ctx.disable_any_whitespace)
    sampling = completion_sampling(body, ctx.completion_max_tokens, constraint, adapter, ctx.sampling_defaults)
    sent, echoes = await ctx.offload(large, _prompts, body, ctx)
    prompts = [prompt.ids for prompt in sent]
    echoed = None               # with echo and logprobs: (prompt i, its prompt_logprobs) -> positions
    if body.echo and body.logprobs is not None:
        echoed = functools.partial(_echoed, ctx.tokenizer, prompts)
    calls = [generate(prompt, ctx.fit(sampling, prompt.ids, "prompt")) for prompt in sent]
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or ctx.models.name}
    def as_sent(error: APIError) -> APIError:
        return blame(error, constraint)
    try:
        if body.stream:
            responses = await generation.stream(calls)
            return sse_response(_chunks(head, body, responses, prompts, echoes, echoed, ctx.prompt_tokens_details),
                                as_sent)
        outputs, usage = await generation.gather(calls, body.n)
    except APIError as exc:
        raise as_sent(exc) from None
    choices = [_choice(index, out, body, prompts[index // body.n], echoes[index // body.n], echoed)
               for index, out in enumerate(outputs)]
    return JSONResponse({**head, "choices": choices, "usage": usage.body(cached=ctx.prompt_tokens_details)})


def _prompts(body: CompletionRequest, ctx: Context) -> tuple[list[Prompt], list[str]]:
    """The prompts as `llm` gets them, and what each echoes."""
    given = body.prompts()
    ids = ctx.prompts_ids(given, "prompt", body.add_special_tokens, body.truncate_prompt_tokens, body.truncation_side)
    # echoed as cut; with return_token_ids the prompt comes back as prompt_token_ids, not as text (vLLM's rule)
    cut = body.truncate_prompt_tokens is not None
    echoes = [ctx.prompt_text(i if cut else g) if body.echo and not body.return_token_ids else ""
              for g, i in zip(given, ids)]
    return [_as_sent(body, g, i) for g, i in zip(given, ids)], echoes


def _as_sent(body: CompletionRequest, given: str | list[int], ids: list[int]) -> Prompt:
    """Token ids (which fit() counts), and for a model that takes text only the text, where the
    request left it as that model would tokenize it."""
    if not isinstance(given, str):
        return Prompt(ids, None, "prompt")
    if body.truncate_prompt_tokens is not None:
        return Prompt(ids, None, "truncate_prompt_tokens")
    if body.add_special_tokens is False:
        return Prompt(ids, None, "add_special_tokens")
    return Prompt(ids, given)


def _echoed(tokenizer, prompts: list[list[int]], i: int, prompt_logprobs: list) -> list[dict]:
    return echoed_positions(prompts[i], prompt_logprobs, tokenizer.decode([prompts[i][0]]))


def _choice(index: int, out: generation.Output, body: CompletionRequest, prompt: str | list[int], echo: str,
            echoed) -> dict:
    """max_tokens 0 (with echo): the prompt alone, as vLLM answers it (`llm` still generated one
    token, which usage counts)."""
    generated = body.max_tokens != 0
    positions = out.logprobs if generated else []
    logprobs = None
    if body.logprobs is not None:
        if echoed is not None:
            logprobs = completion_logprobs(body.shown(echoed(index // body.n, out.prompt_logprobs) + positions),
                                           body.logprobs)
        else:
            logprobs = completion_logprobs(body.shown(positions), body.logprobs)
    choice = {"index": index, "text": echo + "".join(out.text) if generated else echo, "logprobs": logprobs,
              "finish_reason": out.finish_reason if generated else "length",
              "stop_reason": out.stop_reason if generated else None}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = out.prompt_logprobs
    if body.return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = prompt, sampled_ids(positions)
    return choice


async def _chunks(head: dict, body: CompletionRequest, responses, prompts: list, echoes: list[str], echoed,
                  cached_tokens: bool):
    """A choice's first chunk carries the echo (and prompt_token_ids); with max_tokens 0 it is the
    choice's only chunk."""
    n = body.n
    generating = body.max_tokens != 0
    include_usage, continuous = body.stream_usage()
    usage = generation.Usage()
    offsets = [0] * (len(echoes) * n)          # each choice's tokens' text so far, for text_offset
    counts = [0] * (len(echoes) * n)           # each choice's tokens so far
    seen, begun, ended = set(), set(), set()    # prompts with a response, choices with a chunk, with their end
    scored = {}     # prompt index -> its prompt_logprobs, which come in its first response only
    try:
        async for prompt_index, response in responses:
            usage.add(response, prompt_index not in seen)
            seen.add(prompt_index)
            if response.prompt_logprobs is not None:
                scored.setdefault(prompt_index, response.prompt_logprobs)
            for j, generated in enumerate(response.texts):
                index = prompt_index * n + j
                if index in ended:      # `llm` repeats an ended output's finish_reason; a client gets it once
                    continue
                first = index not in begun
                counts[index] += response.num_output_tokens[j]
                reason, positions = response.finish_reasons[j], response.logprobs[j]
                if not generating:
                    if not first:
                        continue
                    generated, reason, positions = "", "length", []
                text = echoes[prompt_index] + generated if first else generated
                if not (response.num_output_tokens[j] or text or reason or positions):
                    continue        # nothing new for this output in this step
                begun.add(index)
                logprobs = None
                if body.logprobs is not None:
                    # text_offset counts the tokens' texts, as in the whole reply (and vLLM's stream)
                    # (n > 1: a choice's first chunk can come in a later response than its prompt's first)
                    prompt_positions = echoed(prompt_index, scored[prompt_index]) if first and echoed else []
                    logprobs = completion_logprobs(body.shown(prompt_positions + positions), body.logprobs,
                                                   offsets[index])
                    offsets[index] += sum(map(len, logprobs["tokens"]))
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
                if reason is not None:          # vLLM's stop_reason, in the chunk that ends the choice
                    choice["stop_reason"] = response.stop_reasons[j] if generating else None
                if body.return_token_ids:
                    choice["prompt_token_ids"] = prompts[prompt_index] if first else None
                    choice["token_ids"] = sampled_ids(positions)
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = generation.usage_body(response.num_input_tokens, counts[index])
                if reason is not None:
                    ended.add(index)
                yield event(chunk)
    finally:
        await responses.aclose()
    if include_usage:
        yield event({**head, "choices": [], "usage": usage.body(cached=cached_tokens)})

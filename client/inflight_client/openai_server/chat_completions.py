"""POST /v1/chat/completions: the messages rendered with the chat template into prompt token ids,
one `llm` request with `n` outputs. A stream sends each choice's role first, then content deltas,
then its finish_reason (and usage last, with stream_options.include_usage)."""
from __future__ import annotations

import time
import uuid

from starlette.responses import JSONResponse

from . import generation
from .context import Context
from .logprobs import chat_logprobs
from .sampling import chat_sampling
from .schemas import ChatCompletionRequest
from .sse import event, sse_response


async def create_chat_completion(body: ChatCompletionRequest, ctx: Context):
    lora_name = ctx.models.check(body.model)
    prompt_ids = ctx.chat.prompt_ids(body.messages)
    calls = [ctx.triton.generate(prompt_ids, chat_sampling(body, ctx.default_max_tokens, lora_name), body.stream)]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model}
    top_n = body.top_logprobs or 0
    if body.stream:
        responses = await generation.stream(calls)
        return sse_response(_chunks({**head, "object": "chat.completion.chunk"}, body, responses, top_n))
    outputs, usage = await generation.gather(calls, body.n)
    choices = [{"index": index, "message": {"role": "assistant", "content": "".join(out.text)},
                "logprobs": chat_logprobs(out.logprobs, top_n) if body.logprobs else None,
                "finish_reason": out.finish_reason} for index, out in enumerate(outputs)]
    return JSONResponse({**head, "choices": choices, "usage": usage.body()})


def _choice(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


async def _chunks(head: dict, body: ChatCompletionRequest, responses, top_n: int):
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    usage = generation.Usage()
    first = True
    try:
        async for _, response in responses:
            if first:
                for index in range(body.n):
                    yield event({**head, "choices": [_choice(index, {"role": "assistant", "content": ""})]})
            usage.add(response, first)
            first = False
            for index, text in enumerate(response.texts):
                reason, positions = response.finish_reasons[index], response.logprobs[index]
                if not text and reason is None and not positions:
                    continue
                logprobs = chat_logprobs(positions, top_n) if body.logprobs and positions is not None else None
                yield event({**head, "choices": [_choice(index, {"content": text}, logprobs, reason)]})
    finally:
        await responses.aclose()
    if include_usage:
        yield event({**head, "choices": [], "usage": usage.body()})

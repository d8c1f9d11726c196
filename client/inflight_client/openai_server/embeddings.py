"""POST /v1/embeddings: one `llm` request per input, each the vLLM backend's `embedding_request`
(what Triton's OpenAI frontend sends it), which `llm` answers where its engine runs as an
embedding model (runner "pooling"; otherwise its refusal is the answer). Inputs (or vLLM's chat
form: conversations rendered with the chat template) are tokenized here (add_special_tokens,
truncate_prompt_tokens, the context length checked) and sent as token ids; the vectors come
back as lists of floats, or with encoding_format "base64" as their little-endian float32 bytes,
which the `openai` SDK asks for and decodes by default."""
from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from starlette.responses import JSONResponse

from .chat_template import message_text
from .context import Context
from .errors import APIError
from .schemas import EmbeddingRequest, PoolingFields, PoolingInputs


async def create_embedding(body: EmbeddingRequest, ctx: Context, request_id: str, large: bool):
    prompts = await ctx.offload(large, pooling_prompts, body, ctx)
    pooling = {} if body.dimensions is None else {"dimensions": [body.dimensions]}
    vectors = await embed(body, ctx, prompts, pooling)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
            for i, vector in enumerate(vectors)]
    return JSONResponse({"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or ctx.models.name, "data": data, "usage": usage(prompts)})


def usage(prompts: list[list[int]]) -> dict:
    """vLLM's usage of a pooling request: every prompt's tokens, no completion."""
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


async def embed(body: PoolingFields, ctx: Context, prompts: list[list[int]], pooling: dict) -> list[list[float]]:
    """Each prompt's vector (an embedding, or a classifier's scores) from `llm`, all asked at once
    (one refused: the others are cancelled); with the LoRA adapter `model` names."""
    adapter = ctx.models.check(body.model)
    if body.use_activation is not None:
        pooling = {**pooling, "use_activation": body.use_activation}
    try:
        async with asyncio.TaskGroup() as group:
            calls = [group.create_task(ctx.triton.embed(ids, pooling, body.priority, body.cache_salt, adapter))
                     for ids in prompts]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [call.result() for call in calls]


def pooling_prompts(body: PoolingInputs, ctx: Context) -> list[list[int]]:
    """The inputs (or conversations) of an embedding or classification request as token ids."""
    field = "input" if body.messages is None else "messages"
    prompts = ctx.prompts_ids(_texts(body, ctx), field, body.special_tokens(), body.truncate_prompt_tokens,
                              body.truncation_side, POOLING_SIDE)
    check_fits(prompts, ctx, field)
    return prompts


def _texts(body: PoolingInputs, ctx: Context) -> list[str | list[int]]:
    """The inputs, or each conversation rendered with the chat template (text that cannot fit is
    refused before the template renders it, unless the prompt is to be cut)."""
    if body.messages is None:
        return body.inputs()
    texts = []
    for conversation in body.conversations():
        if body.truncate_prompt_tokens is None:
            ctx.check_size("".join(message_text(m, i) for i, m in enumerate(conversation)), "messages")
        texts.append(ctx.chat.render(conversation, None, body))
    return texts


POOLING_SIDE = "right"      # vLLM's pooling models truncate a prompt on the right: its first tokens stay


def check_fits(prompts: list[list[int]], ctx: Context, field: str) -> None:
    """A prompt the context cannot hold is refused in vLLM's words."""
    limit = ctx.models.max_model_len
    for ids in prompts:
        if len(ids) >= limit:       # `llm` runs an embedding as a step of one token after its prompt
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of "
                           "the input.", field, "context_length_exceeded")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")

"""vLLM's POST /tokenize and /detokenize (at the server's root): a prompt, or chat messages rendered
as /v1/chat/completions renders them, as the token ids `llm` will see, with their count and the
context length; and token ids back to text. Clients use them to count tokens and fit prompts."""
from __future__ import annotations

from starlette.responses import JSONResponse

from .context import Context
from .errors import APIError
from .schemas import DetokenizeRequest, TokenizeRequest


def tokenize(body: TokenizeRequest, ctx: Context) -> JSONResponse:
    ctx.models.check(body.model)
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = ctx.tokenize(ctx.chat.render(body.messages, tools, body), bool(body.add_special_tokens))
    else:
        ids = ctx.tokenize(body.prompt, body.add_special_tokens is not False)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.models.max_model_len, "tokens": ids,
                         "token_strs": strs})


def detokenize(body: DetokenizeRequest, ctx: Context) -> JSONResponse:
    ctx.models.check(body.model)
    vocab = len(ctx.tokenizer)
    outside = [(i, t) for i, t in enumerate(body.tokens) if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"'tokens': token id {outside[0][1]} at position {outside[0][0]} is outside the "
                       f"vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})

"""POST /score and /rerank (and vLLM's other paths to them): vLLM's scoring API. On an embedding
model (its "bi-encoder" scoring) each query and each document is embedded once, by the same
`llm` requests as /v1/embeddings, and a pair's score is the cosine similarity of the two
vectors; on a classifier each pair is scored whole (cross-encoder scoring, classify.py). Pairs
go 1:1, 1:N (one query against every document) or N:N (by position); rerank orders the
documents by score and keeps the best `top_n`."""
from __future__ import annotations

import time

import numpy as np
from starlette.responses import JSONResponse

from .classify import Side, cross_encoder_scores, first_text
from .context import Context
from .embeddings import POOLING_SIDE, check_fits, embed, usage
from .errors import APIError
from .schemas import RerankRequest, ScoreRequest, ScoringFields


async def create_score(body: ScoreRequest, ctx: Context, request_id: str, large: bool):
    scores, prompts = await _scores(body, ctx, large, *body.sides())
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    return JSONResponse({"id": f"score-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or ctx.models.name, "data": data, "usage": usage(prompts)})


async def create_rerank(body: RerankRequest, ctx: Context, request_id: str, large: bool):
    query, documents = body.sides()
    scores, prompts = await _scores(body, ctx, large, query, documents)
    _, texts = documents
    results = sorted(({"index": i, "document": {"text": text, "multi_modal": None}, "relevance_score": score}
                      for i, (text, score) in enumerate(zip(texts, scores))),
                     key=lambda result: result["relevance_score"], reverse=True)
    tokens = sum(map(len, prompts))
    return JSONResponse({"id": f"score-{request_id}", "model": body.model or ctx.models.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "results": results[:body.top_n or None]})


async def _scores(body: ScoringFields, ctx: Context, large: bool, first: Side,
                  second: Side) -> tuple[list[float], list[list[int]]]:
    """Each pair's score, and the token ids the model read (every text's, or on a classifier
    every pair's)."""
    (first_name, queries), (second_name, documents) = first, second
    for name, texts in (first, second):
        if not texts:
            raise APIError(400, f"'{name}' must hold at least one text", name)
    if len(queries) > 1 and len(queries) != len(documents):
        raise APIError(400, f"Input lengths must be either 1:1, 1:N or N:N (got {len(queries)} '{first_name}' and "
                       f"{len(documents)} '{second_name}')", second_name)
    for limit, field in ((body.max_tokens_per_query, "max_tokens_per_query"),
                         (body.max_tokens_per_doc, "max_tokens_per_doc")):
        if limit >= ctx.models.max_model_len:
            raise APIError(400, f"'{field}' ({limit}) must be less than max_model_len ({ctx.models.max_model_len})",
                           field)
    if ctx.classifier is not None:
        return await cross_encoder_scores(body, ctx, large, first, second)
    prompts = await ctx.offload(large, _prompts, body, ctx, first, second)
    vectors = np.asarray(await embed(body, ctx, prompts, {}), dtype=np.float64)
    firsts, seconds = vectors[:len(queries)], vectors[len(queries):]
    firsts = np.broadcast_to(firsts, seconds.shape)
    norms = np.maximum(np.linalg.norm(firsts, axis=1), EPS) * np.maximum(np.linalg.norm(seconds, axis=1), EPS)
    return (np.einsum("ij,ij->i", firsts, seconds) / norms).tolist(), prompts


EPS = 1e-8      # torch's cosine_similarity, which vLLM scores with: a zero vector scores 0


def _prompts(body: ScoringFields, ctx: Context, first: Side, second: Side) -> list[list[int]]:
    """Every query's then every document's token ids: each side's texts first cut to their
    max_tokens_per_* (the text's own tokens, not counting the special ones the tokenizer adds),
    then as truncate_prompt_tokens asks, and the context length checked."""
    prompts = []
    for (name, texts), limit in ((first, body.max_tokens_per_query), (second, body.max_tokens_per_doc)):
        cut = [first_text(ctx, text, limit) for text in texts]
        ids = ctx.prompts_ids(cut, name, True, body.truncate_prompt_tokens, body.truncation_side, POOLING_SIDE)
        check_fits(ids, ctx, name)
        prompts += ids
    return prompts

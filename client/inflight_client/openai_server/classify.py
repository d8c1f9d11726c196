"""POST /classify, and /score and /rerank on a classifier: vLLM's APIs for a
*ForSequenceClassification checkpoint (or a reranker converted into one by --hf-overrides, as
`llm` converts it: inflight.score_head). /classify sends each input to `llm` as an
`embedding_request` of task "classify" and names the likeliest class by config.json's id2label.
Scoring a pair on a classifier is vLLM's cross-encoder scoring: the query and the document read
as one prompt (rendered with the server's --chat-template where it has one, with the roles
"query" and "document"; else the tokenizer's pair encoding, or for a converted reranker the two
texts one after the other), and the pair's score is the one output of a one-label classifier."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
from starlette.responses import JSONResponse

from inflight.pooling import is_classifier
from inflight.score_head import apply_overrides

from .context import Context
from .embeddings import check_fits, embed, pooling_prompts, usage
from .errors import APIError
from .schemas import ClassificationRequest, ScoringFields

CLASSIFY = {"task": "classify"}          # the pooling_params of an embedding_request that classifies


@dataclass(slots=True, frozen=True)
class Classifier:
    labels: dict[int, str]      # config.json's id2label (as transformers reads it: LABEL_i where it names none)
    use_sep_token: bool         # a pair is the tokenizer's pair encoding (else the two texts one after the other)


def read_classifier(directory: str, hf_overrides: dict | None) -> Classifier | None:
    """The checkpoint's config.json with vLLM's hf_overrides over it, as `llm` reads it; None for a
    model that is no classifier, or a directory without config.json."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(directory)
    apply_overrides(config, hf_overrides)
    if not is_classifier(config):
        return None
    return Classifier({int(i): label for i, label in config.id2label.items()}, getattr(config, "use_sep_token", True))


async def create_classify(body: ClassificationRequest, ctx: Context, request_id: str, large: bool):
    prompts = await ctx.offload(large, pooling_prompts, body, ctx)
    outputs = await embed(body, ctx, prompts, CLASSIFY)
    labels = ctx.classifier.labels if ctx.classifier is not None else {}
    data = [{"index": i, "label": labels.get(int(np.argmax(probs))), "probs": probs, "num_classes": len(probs)}
            for i, probs in enumerate(outputs)]
    return JSONResponse({"id": f"classify-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or ctx.models.name, "data": data, "usage": usage(prompts)})


Side = tuple[str, list[str]]        # a side's field name, and its texts


async def cross_encoder_scores(body: ScoringFields, ctx: Context, large: bool, first: Side,
                               second: Side) -> tuple[list[float], list[list[int]]]:
    """Each (query, document) pair's score from the classifier, and each pair's token ids."""
    if len(ctx.classifier.labels) != 1:
        raise APIError(400, f"scoring pairs needs a classifier of one label (a cross-encoder); this model has "
                       f"{len(ctx.classifier.labels)}: use /classify", first[0])
    prompts = await ctx.offload(large, _pair_prompts, body, ctx, first, second)
    outputs = await embed(body, ctx, prompts, CLASSIFY)
    return [output[0] for output in outputs], prompts


def _pair_prompts(body: ScoringFields, ctx: Context, first: Side, second: Side) -> list[list[int]]:
    (first_name, queries), (second_name, documents) = first, second
    queries = [first_text(ctx, query, body.max_tokens_per_query) for query in queries]
    documents = [first_text(ctx, document, body.max_tokens_per_doc) for document in documents]
    if body.truncate_prompt_tokens is None:         # text that cannot fit is refused before it is tokenized
        for name, texts in ((first_name, queries), (second_name, documents)):
            for text in texts:
                ctx.check_size(text, name)
    if len(queries) == 1:
        queries = queries * len(documents)
    prompts = [_pair_ids(body, ctx, query, document) for query, document in zip(queries, documents)]
    check_fits(prompts, ctx, second_name)
    return prompts


def _pair_ids(body: ScoringFields, ctx: Context, query: str, document: str) -> list[int]:
    """The pair's token ids as vLLM's cross-encoder gets them: the prompt (the score template's,
    the tokenizer's pair encoding, or the two texts), truncated by the tokenizer where
    truncate_prompt_tokens asks with no side (for a pair its longest-first rule), its ids sliced
    where a side is given; a pair's document limit is kept by truncating the second text only."""
    keep = None if body.truncate_prompt_tokens is None else ctx.truncation_length(body.truncate_prompt_tokens)
    kwargs = {}
    if keep is not None and body.truncation_side is None:
        kwargs = {"truncation": True, "max_length": keep}
    if ctx.chat.template is not None:
        ids = ctx.tokenizer(ctx.chat.render_pair(query, document, body.template_variables()), **kwargs)["input_ids"]
    elif ctx.classifier.use_sep_token:
        if body.max_tokens_per_doc:
            limit = len(ctx.tokenize(query, add_special_tokens=False)) + body.max_tokens_per_doc + \
                ctx.tokenizer.num_special_tokens_to_add(pair=True)
            kwargs = {"truncation": "only_second", "max_length": min(limit, kwargs.get("max_length", limit))}
        ids = ctx.tokenizer(text=query, text_pair=document, **kwargs)["input_ids"]
    else:
        ids = ctx.tokenizer(query + document, **kwargs)["input_ids"]
    if keep is not None and body.truncation_side is not None:
        ids = ctx.truncate(ids, keep, body.truncation_side)      # the ids cut from that side
    return ids


def first_text(ctx: Context, text: str, limit: int) -> str:
    """The text cut to its first `limit` tokens (0: as it is), at the character where the next
    token starts, as vLLM cuts a side's texts for max_tokens_per_query/doc; cut again while the
    shorter text tokenizes longer (a merge the cut undid)."""
    if not limit:
        return text
    while text:
        encoding = ctx.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if len(encoding["input_ids"]) <= limit:
            break
        end = min(offsets[limit - 1][1], offsets[limit][0])
        text = text[:min(end, len(text) - 1)]
    return text

"""A *ForCausalLM reranker served as a classifier, as vLLM converts one (its `hf_overrides`
`classifier_from_token`, with which it serves Qwen3-Reranker and mxbai-rerank-v2): the
architecture is named a *ForSequenceClassification, and the score head is made at load from the
LM head's rows for the given tokens: "from_2_way_softmax" (two tokens, "no" then "yes") one
label whose logit is yes's minus no's, so its sigmoid is the softmax of the two tokens' logits;
"no_post_processing" one label per token, its logit. Such a reranker reads a query and a document
as one text, without the tokenizer's pair separator (vLLM's use_sep_token false)."""
from __future__ import annotations

METHODS = ("from_2_way_softmax", "no_post_processing")


def apply_overrides(hf_config, overrides: dict | None) -> None:
    """vLLM's hf_overrides (each key set on config.json's values), then what vLLM derives from a
    conversion they ask for: the method (Qwen3's is_original_qwen3_reranker means
    from_2_way_softmax), the number of labels, and no pair separator."""
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        if tokens is None or len(tokens) != 2:
            raise ValueError("is_original_qwen3_reranker needs classifier_from_token, its two tokens (\"no\", \"yes\")")
        hf_config.method = "from_2_way_softmax"
    method = getattr(hf_config, "method", None)
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"'method' {method!r}: a reranker's score head is made by one of {METHODS}")
    if not tokens or (method == "from_2_way_softmax" and len(tokens) != 2):
        raise ValueError(f"'method' {method!r} needs classifier_from_token: "
                         f"{'two tokens' if method == 'from_2_way_softmax' else 'its tokens'}, got {tokens!r}")
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    hf_config.use_sep_token = getattr(hf_config, "use_sep_token", False)


def head_rows(hf_config, tokenizer) -> tuple[int, ...] | None:
    """The ids of the tokens whose LM head rows make the score head (None: the checkpoint has a
    score head of its own)."""
    if getattr(hf_config, "method", None) is None:
        return None
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the checkpoint's tokenizer, to find its tokens")
    ids = tuple(tokenizer.convert_tokens_to_ids(token) for token in hf_config.classifier_from_token)
    unknown = [t for t, i in zip(hf_config.classifier_from_token, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token: {unknown} are not tokens of the tokenizer")
    return ids


def with_score_head(weights, rows: tuple[int, ...], hf_config):
    """The checkpoint's (name, tensor) pairs with a score head made of the LM head's rows (the
    embedding's where the config ties them) in place of the LM head, as the config's method makes it."""
    two_way = hf_config.method == "from_2_way_softmax"
    source = "model.embed_tokens.weight" if getattr(hf_config, "tie_word_embeddings", False) else "lm_head.weight"
    for name, tensor in weights:
        if name == source:
            picked = tensor[list(rows)].float()
            yield "score.weight", picked[1:] - picked[:1] if two_way else picked
        if name != "lm_head.weight":
            yield name, tensor

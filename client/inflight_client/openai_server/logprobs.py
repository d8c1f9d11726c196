"""`llm`'s logprobs JSON (per token {token id: {logprob, rank, decoded_token}}, the sampled token
first) in the OpenAI API's two shapes. -inf becomes -9999.0, as OpenAI and vLLM send it (also in
vLLM's `prompt_logprobs`, passed on as `llm` wrote them otherwise)."""
from __future__ import annotations

import itertools
import json


def _value(entry: dict) -> float:
    return max(entry["logprob"], -9999.0)


def _constant(name: str) -> float:
    return -9999.0 if name == "-Infinity" else float(name)


def prompt_logprobs_json(text: str) -> list[dict | None] | None:
    """`llm`'s prompt_logprobs JSON, -inf (json's -Infinity) read as -9999.0, as vLLM's
    clamp_prompt_logprobs writes it: the response passes them on as they are, and -inf is not JSON."""
    return json.loads(text, parse_constant=_constant)


def echoed_positions(prompt_ids: list[int], prompt_logprobs: list[dict | None], first_text: str) -> list[dict]:
    """`llm`'s prompt_logprobs (null for the first token, which has no context) as positions for
    completion_logprobs: the first one the token alone, without a log-probability."""
    return [{str(prompt_ids[0]): {"logprob": None, "rank": None, "decoded_token": first_text}}, *prompt_logprobs[1:]]


def sampled_ids(positions: list[dict] | None) -> list[int]:
    """The sampled token of each position (the first of its map): vLLM's `return_token_ids`."""
    return [int(next(iter(position))) for position in positions or ()]


def as_token_ids(positions: list[dict]) -> list[dict]:
    """vLLM's `return_tokens_as_token_ids`: every token shown as "token_id:<id>" instead of its
    text (a token's text alone need not map back to that token). The text stays under "text":
    a chat's sampled token has the bytes of its text, as in vLLM."""
    return [{token: {**entry, "decoded_token": f"token_id:{token}", "text": entry["decoded_token"]}
             for token, entry in position.items()} for position in positions]


def completion_logprobs(positions: list[dict], top_n: int, text_offset: int = 0) -> dict:
    """/v1/completions: tokens, token_logprobs, top_logprobs (the sampled token and the top N,
    by text: at most the first N + 1 entries of a position, vLLM's rule, also for an echoed
    prompt scored with a larger `prompt_logprobs`; null for an echoed prompt's first token, as
    vLLM), text_offset (from `text_offset`, the length of the earlier tokens' texts, counted as
    vLLM counts them)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for position in positions:
        sampled = next(iter(position.values()))
        out["tokens"].append(sampled["decoded_token"])
        if sampled["logprob"] is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_value(sampled))
            kept = itertools.islice(position.values(), top_n + 1)
            out["top_logprobs"].append({entry["decoded_token"]: _value(entry) for entry in kept})
        out["text_offset"].append(text_offset)
        text_offset += len(sampled["decoded_token"])
    return out


def _token(entry: dict, sampled: bool = False) -> dict:
    """A chat token: the sampled one's bytes are its text's even where `token` is "token_id:<id>"
    (vLLM's step_decoded; a client rebuilds the reply from them), the top N's those of `token`."""
    text = entry["decoded_token"]
    raw = entry.get("text", text) if sampled else text
    return {"token": text, "logprob": _value(entry), "bytes": list(raw.encode("utf-8", errors="replace"))}


def chat_logprobs(positions: list[dict], top_n: int) -> dict:
    """/v1/chat/completions: per token the sampled token and the `top_n` most likely. By
    log-probability, not rank: the sampled token's rank counts the tokens tied with it (vLLM's
    rule), so at a tie for first it is 2 while it is one of the most likely."""
    content = []
    for position in positions:
        sampled = next(iter(position.values()))
        top = sorted(position.values(), key=lambda entry: -entry["logprob"])[:top_n]    # stable: ties keep order
        content.append({**_token(sampled, sampled=True), "top_logprobs": [_token(entry) for entry in top]})
    return {"content": content}

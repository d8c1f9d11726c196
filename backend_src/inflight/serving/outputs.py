"""A response's output tensors, built as Triton's vLLM backend builds them (src/utils/request.py
there): one element per output (`n`); in a stream, `text_output`, `num_output_tokens` and
`logprobs` cover what is new since the previous response, `cumulative_logprob` the whole output
so far; `finish_reason` is "None" until an output ends. The `logprobs` JSON is per token a map
token id -> {"logprob", "rank", "decoded_token"} (sampled token first), or `null` when the
request's sampling parameters did not ask for log-probabilities. `prompt_logprobs` (inflight's;
the vLLM backend has no such output) is vLLM's list in the same JSON: `null` for the first prompt
token, then per prompt token that token first and the top N; in the first response only (`null`
in later ones and when `sampling_parameters` has no "prompt_logprobs"). `stop_reason` (inflight's
too) is per output the JSON of vLLM's stop_reason: the stop string or stop token id that ended
it, `null` for EOS or a length limit; only from the response where an output ends (`null` for
those still running), so that a stream's other responses carry nothing more per token.
`num_reasoning_tokens` (inflight's too, where the engine has a reasoning_parser) is, like
num_output_tokens, per output the tokens of this response that the model wrote while reasoning;
`num_cached_tokens` (inflight's) the prompt tokens the request found in the prefix cache when it was
first admitted (the first output's, where n > 1), in every response as num_input_tokens is.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from ..detokenizer import TOKEN_CONTEXT
from .job import Job, Piece, Sample


def _strings(values: list[str]) -> np.ndarray:
    return np.array([value.encode("utf-8") for value in values], dtype=object)


def logprobs_json(positions: list, decoded_token: Callable[[int, list[int]], str], before: list[int] = ()) -> str:
    """decoded_token(token, context): vLLM's text of a token at a position, given the sampled tokens
    before it (`before`, then each earlier position's own: the first of its entries)."""
    context, listed = list(before), []
    for position in positions:
        if position is None:
            listed.append(None)
            continue
        listed.append({str(token): {"logprob": entry.logprob, "rank": entry.rank,
                                    "decoded_token": decoded_token(token, context)}
                       for token, entry in position.items()})
        context.append(next(iter(position)))
    return json.dumps(listed)


def _tokens_before(piece: Piece, sample: Sample) -> list[int]:
    """The sampled tokens a byte piece of this response may be decoded after: the last
    TOKEN_CONTEXT before the piece's positions, which are its sample's latest tokens (sliced, not
    copied: a long output's every response would copy all of it)."""
    end = len(sample.output_ids) - len(piece.logprobs)
    return sample.output_ids[max(end - TOKEN_CONTEXT, 0):end]


def response_outputs(job: Job, pieces: list[Piece], decoded_token: Callable[[int, list[int]], str],
                     prompt_text: str | None = None) -> dict[str, np.ndarray]:
    """pieces: one per sample, in order; prompt_text: prepended to every text (the non-streaming
    default, exclude_input_in_output = false)."""
    request = job.request
    texts = [piece.text if prompt_text is None else prompt_text + piece.text for piece in pieces]
    outputs = {"text_output": _strings(texts)}
    if request.return_finish_reason:
        outputs["finish_reason"] = _strings([str(sample.finish_reason) for sample in job.samples])
    if request.return_stop_reason and any(sample.finished for sample in job.samples):
        outputs["stop_reason"] = _strings([json.dumps(sample.stop_reason) for sample in job.samples])
    if request.return_cumulative_logprob:
        outputs["cumulative_logprob"] = np.array([sample.cumulative_logprob for sample in job.samples], dtype=np.float32)
    if request.return_logprobs:
        asked = request.params.logprobs is not None
        outputs["logprobs"] = _strings([logprobs_json(piece.logprobs, decoded_token, _tokens_before(piece, sample))
                                        if asked else "null" for piece, sample in zip(pieces, job.samples)])
    if request.return_prompt_logprobs:
        first = job.num_responses == 0 and request.params.prompt_logprobs is not None
        outputs["prompt_logprobs"] = _strings([logprobs_json([None, *job.prompt_logprobs], decoded_token) if first
                                               else "null"])
    if request.return_num_input_tokens:
        outputs["num_input_tokens"] = np.array([len(job.prompt_ids)], dtype=np.uint32)
    if request.return_num_output_tokens:
        outputs["num_output_tokens"] = np.array([piece.num_tokens for piece in pieces], dtype=np.uint32)
    if request.return_num_cached_tokens:      # inflight's own: the prompt's, as vLLM's num_cached_tokens
        outputs["num_cached_tokens"] = np.array([job.samples[0].num_cached_tokens], dtype=np.uint32)
    if job.samples[0].reasoning is not None:    # inflight's own: asked for, and the engine has a reasoning_parser
        outputs["num_reasoning_tokens"] = np.array([piece.num_reasoning_tokens for piece in pieces], dtype=np.uint32)
    if request.return_token_ids:      # inflight's own (n = 1): what the ensemble's postprocessing decodes
        if request.stream:
            ids, context = pieces[0].new_ids, pieces[0].context_ids
        else:
            sample = job.samples[0]
            ids, context = ((sample.text_ids, sample.detokenizer.prompt_tail) if prompt_text is None
                            else (job.prompt_ids + sample.text_ids, []))
        outputs["token_ids"] = np.asarray(ids, dtype=np.int32)
        outputs["context_ids"] = np.asarray(context, dtype=np.int32)
    return outputs


def embedding_outputs(job: Job) -> dict[str, np.ndarray]:
    """An embedding request's one response, as the vLLM backend builds it: the vector's JSON in
    text_output, and where asked the prompt's tokens and 0 generated."""
    outputs = {"text_output": _strings([json.dumps(job.embedding)])}
    if job.request.return_num_input_tokens:
        outputs["num_input_tokens"] = np.array([len(job.prompt_ids)], dtype=np.uint32)
    if job.request.return_num_output_tokens:
        outputs["num_output_tokens"] = np.array([0], dtype=np.uint32)
    return outputs

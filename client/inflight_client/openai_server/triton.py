"""The server's one gRPC channel to Triton, and the `llm` tensor contract (the vLLM backend's):
the request's inputs, and each response read into an LLMResponse. Every request is a
bidirectional stream of its own on the shared channel, so it can be cancelled on its own."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from ..streams import grpc_inputs, grpc_responses
from .errors import from_grpc, from_triton


@dataclass(slots=True)
class LLMResponse:
    """One `llm` response; one list element per output (`n`)."""
    texts: list[str]                      # new text (a stream) or all of it
    finish_reasons: list[str | None]      # None while an output runs
    num_output_tokens: list[int]          # tokens covered by this response
    logprobs: list[list[dict] | None]     # per token {token id: {logprob, rank, decoded_token}}
    num_input_tokens: int
    final: bool


def _strings(array: np.ndarray) -> list[str]:
    return [value.decode("utf-8") for value in array.reshape(-1)]


def parse_response(outputs: dict[str, np.ndarray], final: bool) -> LLMResponse:
    texts = _strings(outputs["text_output"])
    reasons = [None if r == "None" else r for r in _strings(outputs["finish_reason"])]
    logprobs = [json.loads(s) for s in _strings(outputs["logprobs"])] if "logprobs" in outputs else [None] * len(texts)
    return LLMResponse(texts, reasons, outputs["num_output_tokens"].reshape(-1).tolist(), logprobs,
                       int(outputs["num_input_tokens"].reshape(-1)[0]), final)


class TritonLLM:
    def __init__(self, url: str, model: str = "llm"):
        self.url = url
        self.model = model
        self.client = None

    async def start(self) -> None:
        """Open the channel (inside the event loop that will use it)."""
        import tritonclient.grpc.aio as grpcclient
        self.client = grpcclient.InferenceServerClient(self.url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready(client_timeout=2) and \
                await self.client.is_model_ready(self.model, client_timeout=2)
        except Exception:      # unreachable, or an error status: not ready either way
            return False

    @staticmethod
    def inputs(prompt: str | list[int], sampling: dict, stream: bool):
        """The tensors Triton's OpenAI frontend sends the vLLM backend (plus `input_ids` for
        token prompts, inflight's): the prompt is never repeated (echo is this server's job)."""
        return grpc_inputs(prompt, stream, sampling, exclude_input_in_output=True, return_finish_reason=True,
                           return_num_input_tokens=True, return_num_output_tokens=True,
                           return_logprobs="logprobs" in sampling)

    async def generate(self, prompt: str | list[int], sampling: dict, stream: bool) -> AsyncIterator[LLMResponse]:
        """The request's responses; raises APIError for an error response or a failed call.
        Closing the iterator early cancels the request."""
        responses = grpc_responses(self.client, self.model, self.inputs(prompt, sampling, stream))
        try:
            async for outputs, final, error in responses:
                if error is not None:
                    raise from_triton(error)
                if outputs:                  # an empty final response ends a cancelled request
                    yield parse_response(outputs, final)
        except grpc.RpcError as exc:
            raise from_grpc(exc, self.url) from None
        finally:
            await responses.aclose()


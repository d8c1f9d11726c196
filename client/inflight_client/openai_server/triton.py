"""The server's connection pool to Triton and the `llm` tensor contract (the vLLM backend's): each
request is one POST to Triton's `/v2/models/<model>/generate_stream`, whose server-sent events
are `llm`'s responses, read into LLMResponses. Leaving early closes the request's connection,
which Triton takes as the request's cancellation at its next response (the engine aborts it and
frees its blocks). Triton notices a closed connection only when it writes a response, so the
server asks inflight's `llm` for `queue_heartbeat`: an event without outputs after about each
second without one, so that a request whose client left while it waited in the queue (or while a
large stream_interval held its tokens back) is cancelled then, not run on for nobody (the vLLM
backend has no such input: there it runs to its first token).

HTTP rather than Triton's gRPC stream: per streamed token, receiving a response through
tritonclient's grpc.aio stack costs this process ~0.24 ms of CPU, reading the same response as an
event with aiohttp ~0.08 ms (`make bench-openai`; README, "The OpenAI server: overhead"): CPU that
a small host takes from the engine, and that caps what one server process can forward."""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from inflight.config import parse_priority

from .errors import APIError, from_triton
from .logprobs import prompt_logprobs_json


# sampling_parameters keys of inflight's `llm` that vLLM's SamplingParams, and so the vLLM backend, lacks
INFLIGHT_SAMPLING = ("priority", "cache_salt")
# and those that are vLLM's engine's own (not SamplingParams): left out for the vLLM backend, whose engine
# decides from the prompt
ENGINE_HINTS = ("reasoning_ended",)


@dataclass(slots=True)
class Prompt:
    """A request's prompt as `llm` gets it: token ids, or for a model that takes text only (the
    vLLM backend) the same prompt as text, which it tokenizes with its special tokens."""
    ids: list[int]
    text: str | None = None     # None where only the ids say it: a token prompt, a cut one
    only_ids: str = "prompt"    # the request field that made it ids only, named in that model's refusal


@dataclass(slots=True)
class LLMResponse:
    """One `llm` response; one list element per output (`n`)."""
    texts: list[str]                      # new text (a stream) or all of it
    finish_reasons: list[str | None]      # None while an output runs
    stop_reasons: list[str | int | None]  # vLLM's: the stop string or token that ended an output
    num_output_tokens: list[int]          # tokens covered by this response
    logprobs: list[list[dict] | None]     # per token {token id: {logprob, rank, decoded_token}}
    num_input_tokens: int
    prompt_logprobs: list[dict | None] | None = None    # the first response's, when asked: null first
    num_reasoning_tokens: list[int] | None = None       # of num_output_tokens, reasoning (llm's reasoning_parser)
    num_cached_tokens: int | None = None                # of num_input_tokens, found in the prefix cache


def _elements(value) -> list:
    """An output as a list: Triton writes a one-element tensor as its value, a longer one as a list."""
    return value if isinstance(value, list) else [value]


def parse_event(event: dict) -> LLMResponse:
    texts = _elements(event["text_output"])
    reasons = [None if r == "None" else r for r in _elements(event["finish_reason"])]
    logprobs = [json.loads(s) for s in _elements(event["logprobs"])] if "logprobs" in event else [None] * len(texts)
    stops = [json.loads(s) for s in _elements(event["stop_reason"])] if "stop_reason" in event else [None] * len(texts)
    prompt_logprobs = prompt_logprobs_json(event["prompt_logprobs"]) if "prompt_logprobs" in event else None
    reasoning = _elements(event["num_reasoning_tokens"]) if "num_reasoning_tokens" in event else None
    cached = int(event["num_cached_tokens"]) if "num_cached_tokens" in event else None
    return LLMResponse(texts, reasons, stops, _elements(event["num_output_tokens"]), logprobs,
                       int(event["num_input_tokens"]), prompt_logprobs, reasoning, cached)


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON of each `data:` event (however long: a whole output's logprobs can exceed
    aiohttp's line limit)."""
    pending = bytearray()
    async for data in response.content.iter_any():
        start = max(len(pending) - 1, 0)          # a blank line can straddle two reads
        pending += data
        if pending.find(b"\n\n", start) < 0:     # a long event, still arriving
            continue
        *events, rest = pending.split(b"\n\n")
        pending = bytearray(rest)
        for raw in events:
            if raw.startswith(b"data:"):
                yield json.loads(raw[5:])


class OutputSlots:
    """At most `total` outputs in flight to Triton, taken by priority (as the engine seats them),
    then in arrival order; a request of n outputs (`llm` fans them out, and its queue counts each)
    takes n at once, so that no request waits here holding part of what it needs. A completion of
    thousands of prompts then runs them in turn instead of overflowing the engine's queue by itself
    (a 429 no retry could pass) or opening a connection each (a 503 at the open-files limit), and a
    high-priority request that arrives behind it still reaches the engine next. Health checks do not
    wait here."""

    def __init__(self, total: int):
        self.total = total
        self.free = total
        self._waiting: list[tuple[int, int, int, asyncio.Future]] = []    # heap: (class, arrival, n, future)
        self._arrivals = itertools.count()

    async def take(self, n: int, priority: int = 1) -> int:
        """n slots for a request of `llm`'s priority class (parse_priority: 0 high, 1 normal, 2 low)."""
        n = min(n, self.total)
        if not self._waiting and self.free >= n:
            self.free -= n
            return n
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), n, granted))
        self._grant()                 # first in line now, and it fits
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.give(n)          # granted in the moment it was cancelled
            else:
                granted.cancel()      # left in the heap: _grant drops it when it comes first
                self._grant()         # the next ones may fit now
            raise
        return n

    def give(self, n: int) -> None:
        self.free += n
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            _, _, n, granted = self._waiting[0]
            if granted.cancelled():     # its waiter left: nothing to grant it
                heapq.heappop(self._waiting)
                continue
            if n > self.free:
                return
            heapq.heappop(self._waiting)
            self.free -= n
            granted.set_result(None)


# how long a connection to Triton is kept for the next request: long enough for a busy server,
# short enough that an idle one never holds a stopping tritonserver long
KEEPALIVE_S = 2.0


class TritonLLM:
    def __init__(self, url: str, model: str = "llm", max_outputs: int = 1024):
        self.url = url                    # Triton's HTTP address, host:port
        self.model = model
        self.slots = OutputSlots(max_outputs)
        self.session: aiohttp.ClientSession | None = None
        self.probes: aiohttp.ClientSession | None = None
        self.inputs: set[str] | None = None         # the model's input names (inflight's `llm` has more)

    async def start(self) -> None:
        """Open the pools (inside the event loop that will use them): a connection per request in
        flight (OutputSlots bounds them), kept alive for the next a short while only, since a
        stopping tritonserver waits for every open connection (its exit timeout, then exit 1); and
        one that closes each connection, for the health probes: a stopping tritonserver still
        answers ready on a connection it had, and refuses new ones."""
        self.session = aiohttp.ClientSession(f"http://{self.url}",
                                             connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                             timeout=aiohttp.ClientTimeout(total=None, connect=10))
        self.probes = aiohttp.ClientSession(f"http://{self.url}", connector=aiohttp.TCPConnector(force_close=True),
                                            timeout=aiohttp.ClientTimeout(total=2))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            await self.probes.close()

    async def ready(self) -> bool:
        try:
            for path in ("/v2/health/ready", f"/v2/models/{self.model}/ready"):
                async with self.probes.get(path) as response:
                    if response.status != 200:
                        return False
            return True
        except (aiohttp.ClientError, TimeoutError):      # unreachable: not ready either way
            return False

    async def _check_inputs(self) -> None:
        """Read the model's input names once from its metadata: inflight's `llm` also takes
        input_ids, return_prompt_logprobs, return_stop_reason, queue_heartbeat,
        return_num_reasoning_tokens and return_num_cached_tokens, which the vLLM backend would refuse."""
        async with self.session.get(f"/v2/models/{self.model}") as response:
            if response.status == 200:
                self.inputs = {tensor["name"] for tensor in (await response.json()).get("inputs", [])}

    def _takes(self, name: str) -> bool:
        return self.inputs is None or name in self.inputs      # unknown: inflight's `llm`

    def payload(self, prompt: Prompt, sampling: dict) -> dict:
        """The inputs Triton's OpenAI frontend sends the vLLM backend, with inflight's where the
        model takes them: the prompt as `input_ids` (else as `text_input`, where the request left
        its text whole), `return_prompt_logprobs` when asked, `return_stop_reason`, `queue_heartbeat`,
        `return_num_reasoning_tokens` (answered where `llm` has a reasoning_parser) and
        `return_num_cached_tokens`. A model without an input the request needs is a 400 naming its
        field; the prompt is never repeated (echo is this server's job). `llm` streams whether or
        not the client does (gather joins the pieces; prompt_logprobs come in the first response):
        Triton's HTTP frontend learns that a request's connection closed only when it writes a
        response, so without one per step a request whose client left, or that this server gave
        up, ran to its end."""
        if not self._takes("input_ids"):
            sampling = {name: value for name, value in sampling.items() if name not in ENGINE_HINTS}
        payload = {"stream": True, "sampling_parameters": json.dumps(sampling), "exclude_input_in_output": True,
                   "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
                   "return_logprobs": "logprobs" in sampling}
        if self._takes("input_ids"):
            payload["input_ids"] = prompt.ids
        else:
            self._check_text_only(prompt, sampling)
            payload["text_input"] = prompt.text
        if "prompt_logprobs" in sampling:
            if not self._takes("return_prompt_logprobs"):
                raise APIError(400, f"'prompt_logprobs': Triton's model '{self.model}' returns no prompt "
                               "log-probabilities (no `return_prompt_logprobs` input, as the vLLM backend; echo "
                               "with logprobs asks for them too)", "prompt_logprobs")
            payload["return_prompt_logprobs"] = True
        for name in ("return_stop_reason", "queue_heartbeat", "return_num_reasoning_tokens",
                     "return_num_cached_tokens"):
            if self.inputs and name in self.inputs:
                payload[name] = True
        return payload

    def _check_text_only(self, prompt: Prompt, sampling: dict) -> None:
        """A model that takes its prompt as text only has the vLLM backend's tensors, so vLLM's
        SamplingParams: refuse by name what it cannot serve."""
        if prompt.text is None:
            raise APIError(400, f"'{prompt.only_ids}': Triton's model '{self.model}' takes a prompt as text only "
                           "(`text_input`, as the vLLM backend does), and this request's prompt is token ids (a "
                           "token prompt, truncate_prompt_tokens, add_special_tokens false, or beam search's "
                           "growing prompts)", prompt.only_ids)
        for name in INFLIGHT_SAMPLING:
            if name in sampling:
                raise APIError(400, f"'{name}': Triton's model '{self.model}' has the vLLM backend's tensors, whose "
                               f"sampling_parameters (vLLM's SamplingParams) take no '{name}'", name)
        if sampling.get("n", 1) > 1:        # its stream (this server streams from it) sends a child per response
            raise APIError(400, f"'n': Triton's model '{self.model}' has the vLLM backend's tensors, whose stream of "
                           "n > 1 outputs sends one output a response and mixes their text; send n requests", "n")

    async def generate(self, prompt: Prompt, sampling: dict) -> AsyncIterator[LLMResponse]:
        """The request's responses; raises APIError for an error response or a failed call.
        Closing the iterator early cancels the request."""
        # closed with this iterator, at once: closing the request's connection is what cancels it
        async with contextlib.aclosing(self._request(sampling.get("n", 1), sampling.get("priority", "normal"),
                                                     lambda: self.payload(prompt, sampling))) as events:
            async for event in events:
                yield parse_event(event)

    async def embed(self, prompt_ids: list[int], pooling: dict, priority: str | int | None,
                    cache_salt: str | None = None, adapter: dict | None = None) -> list[float]:
        """One prompt's embedding: the vLLM backend's `embedding_request` (what Triton's OpenAI
        frontend sends), answered where `llm`'s engine runs as an embedding model; with
        inflight's inputs, and its adapter keys (models.py), where asked."""
        def payload() -> dict:
            request = {"input": prompt_ids, "pooling_params": pooling}
            if adapter:
                if not self._takes("queue_heartbeat"):
                    raise APIError(400, f"'model' {adapter['lora_name']!r} is a LoRA adapter: Triton's model "
                                   f"'{self.model}' has the vLLM backend's tensors, whose embedding_request runs the "
                                   "base model", "model")
                request.update(adapter)
            inputs = {"embedding_request": json.dumps(request), "stream": True}
            if self.inputs and "queue_heartbeat" in self.inputs:   # inflight's: Triton sees a client leave the queue
                inputs["queue_heartbeat"] = True
            for name, value in (("priority", priority), ("cache_salt", cache_salt)):
                if value is None:
                    continue
                if not self._takes(name):
                    raise APIError(400, f"'{name}': Triton's model '{self.model}' has the vLLM backend's tensors, "
                                   f"which take no {name}", name)
                inputs[name] = str(value)
            return inputs
        vector = None
        async with contextlib.aclosing(self._request(1, priority or "normal", payload)) as events:
            async for event in events:          # read to the stream's end: its connection goes back to the pool
                vector = json.loads(_elements(event["text_output"])[0])
        if vector is None:
            raise APIError(500, f"Triton's model '{self.model}' ended an embedding request without its vector")
        return vector

    async def _request(self, outputs: int, priority: str | int, payload) -> AsyncIterator[dict]:
        """One request's response events with outputs (payload() builds its inputs once the
        model's are known); raises APIError for an error response or a failed call. Closing the
        iterator early cancels the request."""
        taken = await self.slots.take(outputs, parse_priority(priority))
        try:
            if self.inputs is None:
                await self._check_inputs()
            async with self.session.post(f"/v2/models/{self.model}/generate_stream", json=payload()) as response:
                try:
                    if response.status != 200 and response.content_type != "text/event-stream":
                        body = await response.text()
                        raise from_triton(json.loads(body).get("error", body) if body.startswith("{") else body)
                    async for event in _events(response):
                        if "error" in event:
                            raise from_triton(event["error"])
                        if "text_output" in event:      # not a heartbeat
                            yield event
                except APIError as exc:
                    if exc.status == 503:       # Triton stopping (or failed): the connection goes, not back to the pool
                        response.close()
                    raise
        except aiohttp.ClientConnectionError as exc:
            raise APIError(503, f"Triton at {self.url} is not reachable: {exc}") from None
        except aiohttp.ClientError as exc:
            raise APIError(503, f"Triton at {self.url} failed the request: {exc}") from None
        finally:
            self.slots.give(taken)

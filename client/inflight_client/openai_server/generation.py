"""One OpenAI request as `llm` requests (one per prompt; `n` outputs each, fanned out by `llm`),
gathered into whole outputs or streamed as they come."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .errors import APIError
from .triton import LLMResponse


@dataclass(slots=True)
class Output:
    """One choice, put together from its responses."""
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None                 # vLLM's: the stop string or token that ended it
    prompt_logprobs: list[dict | None] | None = None     # its prompt's, when asked


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None     # llm's count, where it has a reasoning_parser
    cached_tokens: int | None = None        # of prompt_tokens, found in llm's prefix cache (where it says)

    def add(self, response: LLMResponse, first: bool) -> None:
        if first:                   # every response repeats them
            self.prompt_tokens += response.num_input_tokens
            if response.num_cached_tokens is not None:
                self.cached_tokens = (self.cached_tokens or 0) + response.num_cached_tokens
        self.completion_tokens += sum(response.num_output_tokens)
        if response.num_reasoning_tokens is not None:
            self.reasoning_tokens = (self.reasoning_tokens or 0) + sum(response.num_reasoning_tokens)

    def body(self, reasoning: bool = False, cached: bool = False) -> dict:
        """reasoning: with the reasoning tokens (a chat reply of a server with --reasoning-parser);
        cached: with the cached prompt tokens (--enable-prompt-tokens-details)."""
        return usage_body(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens if reasoning else None,
                          self.cached_tokens if cached else None)


def usage_body(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
               cached_tokens: int | None = None) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:            # vLLM's and OpenAI's fields
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


async def _collect(call: AsyncIterator[LLMResponse]) -> list[LLMResponse]:
    return [response async for response in call]


async def gather(calls: list[AsyncIterator[LLMResponse]], n: int) -> tuple[list[Output], Usage]:
    """Run the calls to the end: outputs in choice order (prompt i, output j -> i * n + j). The
    first error cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_collect(call)) for call in calls]
    except* APIError as errors:
        raise errors.exceptions[0] from None
    outputs = [Output() for _ in range(len(calls) * n)]
    usage = Usage()
    for i, task in enumerate(tasks):
        for k, response in enumerate(task.result()):
            usage.add(response, first=k == 0)
            for j in range(n):
                out = outputs[i * n + j]
                if k == 0:
                    out.prompt_logprobs = response.prompt_logprobs
                out.text.append(response.texts[j])
                if response.logprobs[j] is not None:
                    out.logprobs = (out.logprobs or []) + response.logprobs[j]
                if response.finish_reasons[j] is not None:
                    out.finish_reason, out.stop_reason = response.finish_reasons[j], response.stop_reasons[j]
    return outputs, usage


async def stream(calls: list[AsyncIterator[LLMResponse]]) -> AsyncIterator[tuple[int, LLMResponse]]:
    """Wait for every call's first response (so that an error, such as a full queue or a bad
    parameter, becomes the HTTP status), then return an iterator of (prompt index, response) as
    they arrive. Closing it (or cancelling its consumer) cancels every call still running."""
    if len(calls) == 1:         # the common case, without tasks and a queue
        call = calls[0]
        first = await anext(call, None)
        if first is None:
            raise APIError(503, "Triton ended the request without a response")
        return _chain(first, call)
    # bounded: a client that stops reading stops the calls (and Triton) as one call's stream does,
    # instead of this server holding every prompt's whole output
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(calls))

    async def pump(index: int, call: AsyncIterator[LLMResponse]) -> None:
        try:
            async for response in call:
                await queue.put((index, response))
            await queue.put((index, None))
        except Exception as exc:        # an APIError, or a bug: raised where the responses are read
            await queue.put((index, exc))
        finally:        # cancelled while waiting to put: close the call now, which cancels its request
            await call.aclose()

    tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    buffered, started = [], set()
    try:
        while len(started) < len(calls):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            started.add(index)
            buffered.append((index, item))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return _merged(buffered, queue, tasks, len(calls))


async def _chain(first: LLMResponse, call: AsyncIterator[LLMResponse]) -> AsyncIterator[tuple[int, LLMResponse]]:
    try:
        yield 0, first
        async for response in call:
            yield 0, response
    finally:
        await call.aclose()


async def _merged(buffered: list, queue: asyncio.Queue, tasks: list, num_calls: int):
    try:
        running = num_calls
        for index, item in buffered:
            if item is None:
                running -= 1
            else:
                yield index, item
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()

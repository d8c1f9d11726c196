"""Server-sent events as the OpenAI API streams them: one `data: {json}` per chunk, an error as
`data: {"error": ...}`, and `data: [DONE]` at the end (the Responses API's own events and error
event, without [DONE], through the same path: responses.py)."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from .errors import APIError

log = logging.getLogger("inflight.openai")
DONE = b"data: [DONE]\n\n"


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(error: APIError) -> bytes:
    return event(error.body())


async def with_errors(chunks: AsyncIterator[bytes], as_sent: Callable[[APIError], APIError],
                      error: Callable[[APIError], bytes] = error_event, done: bytes | None = DONE
                      ) -> AsyncIterator[bytes]:
    """A failure after the first chunk (the status is already sent) ends the stream with an
    error event (written by `error`), then `done` (None: nothing)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield error(as_sent(exc))
    except Exception as exc:      # a bug: the client still gets an error and the end, not a cut stream
        log.exception("inflight-openai: unexpected error in a stream")
        yield error(APIError(500, f"internal error: {type(exc).__name__}"))
    finally:
        await chunks.aclose()
    if done is not None:
        yield done


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse_response(chunks: AsyncIterator[bytes], as_sent: Callable[[APIError], APIError]) -> StreamingResponse:
    """`as_sent` names an error's fields as the request did, as before the first chunk."""
    return event_stream(with_errors(chunks, as_sent))

"""Server-sent events as the OpenAI API streams them: one `data: {json}` per chunk, an error as
`data: {"error": ...}`, and `data: [DONE]` at the end."""
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


async def _with_errors(chunks: AsyncIterator[bytes], as_sent: Callable[[APIError], APIError]) -> AsyncIterator[bytes]:
    """A failure after the first chunk (the status is already sent) ends the stream with an
    error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield event(as_sent(exc).body())
    except Exception as exc:      # a bug: the client still gets an error and the end, not a cut stream
        log.exception("inflight-openai: unexpected error in a stream")
        yield event(APIError(500, f"internal error: {type(exc).__name__}").body())
    finally:
        await chunks.aclose()
    yield DONE


def sse_response(chunks: AsyncIterator[bytes], as_sent: Callable[[APIError], APIError]) -> StreamingResponse:
    """`as_sent` names an error's fields as the request did, as before the first chunk."""
    return StreamingResponse(_with_errors(chunks, as_sent), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

"""Server-sent events as the OpenAI API streams them: one `data: {json}` per chunk, an error as
`data: {"error": ...}`, and `data: [DONE]` at the end."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from .errors import APIError

log = logging.getLogger("inflight.openai")
DONE = b"data: [DONE]\n\n"


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _with_errors(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure after the first chunk (the status is already sent) ends the stream with an
    error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield event(exc.body())
    except Exception as exc:      # a bug: the client still gets an error and the end, not a cut stream
        log.exception("inflight-openai: unexpected error in a stream")
        yield event(APIError(500, f"internal error: {type(exc).__name__}").body())
    finally:
        await chunks.aclose()
    yield DONE


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(_with_errors(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

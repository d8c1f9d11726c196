"""A cap on request bodies, as Triton's own OpenAI frontend has (64 MiB, answered with 413): a
body is read whole and parsed on the event loop, about 4 ms a MB during which every stream of
the server waits, so an unbounded one could stall them all for seconds. The Content-Length is
checked before anything is read; a chunked body is counted as it comes."""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .errors import APIError

MAX_BODY_BYTES = 64 * 2**20


class BodyTooLarge(APIError):
    """Answered by the app's APIError handler where a route reads the body."""
    def __init__(self):
        super().__init__(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")


class LimitBody:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            error = BodyTooLarge()
            return await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise BodyTooLarge
            return message

        await self.app(scope, counted, send)

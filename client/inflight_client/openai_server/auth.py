"""API keys, as vLLM's server takes them (`--api-key`, or an environment variable): every route
but the probes (/health, /ping, /version) and /metrics needs `Authorization: Bearer <key>`, else a
401 in OpenAI's error shape, the one the `openai` SDK raises as AuthenticationError. Probes and
metrics stay open, as vLLM leaves them, so that a load balancer, Kubernetes or a Prometheus scraper
needs no key; vLLM also leaves /tokenize open, guarded here.
A pure ASGI middleware: the streamed responses pass through untouched."""
from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .errors import APIError

API_KEY_ENV = "INFLIGHT_API_KEY"
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class RequireAPIKey:
    def __init__(self, app, keys: tuple[str, ...]):
        assert keys, "no key to require"
        self.app = app
        self.digests = [_digest(key) for key in keys]

    def allowed(self, headers: Headers) -> bool:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(key.strip())
        # every digest compared, in constant time: no timing tells a key's prefix
        return sum(secrets.compare_digest(given, digest) for digest in self.digests) > 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] in OPEN_PATHS \
                or self.allowed(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

"""The floor of an OpenAI streaming server on this stack, for `make bench-openai BENCH_ARGS="--floor"`:
the least any server that turns Triton's generate_stream events into OpenAI completion chunks does
per token on the OpenAI server's own stack (ASGI on uvicorn with uvloop and httptools, aiohttp to
Triton), with nothing else: no FastAPI, no validation, no sampling options, no tokenizer, no
disconnect watch. What the OpenAI server spends above this is its own; what this spends is the
stack's.

python perf/openai_floor.py TRITON_HTTP_URL PORT   (POST /v1/completions with a token-array prompt,
streamed; GET /health)
"""
from __future__ import annotations

import json
import sys
import time

import aiohttp
import uvicorn


def chunk(body: dict) -> dict:
    return {"type": "http.response.body", "body": b"data: " + json.dumps(body).encode() + b"\n\n",
            "more_body": True}


class Floor:
    def __init__(self, triton_url: str):
        self.triton_url = triton_url
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        else:
            await self.complete(receive, send)

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(f"http://{self.triton_url}",
                                                     timeout=aiohttp.ClientTimeout(total=None))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def complete(self, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        sampling = {"max_tokens": request["max_tokens"], "ignore_eos": True, "temperature": 0}
        payload = {"input_ids": request["prompt"], "stream": True, "exclude_input_in_output": True,
                   "sampling_parameters": json.dumps(sampling), "return_finish_reason": True,
                   "return_num_input_tokens": True, "return_num_output_tokens": True}
        head = {"id": "cmpl-floor", "object": "text_completion", "created": int(time.time()),
                "model": request["model"]}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        generated = 0
        async with self.session.post("/v2/models/llm/generate_stream", json=payload) as response:
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                generated += event["num_output_tokens"]
                reason = None if event["finish_reason"] == "None" else event["finish_reason"]
                await send(chunk({**head, "choices": [{"index": 0, "text": event["text_output"], "logprobs": None,
                                                       "finish_reason": reason}]}))
        prompt = len(request["prompt"])
        await send(chunk({**head, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                                                           "total_tokens": prompt + generated}}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        sys.exit(__doc__)
    uvicorn.run(Floor(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
                loop="uvloop", http="httptools", access_log=False)

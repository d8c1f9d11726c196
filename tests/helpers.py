"""Client-side helpers for tests that talk to a real server."""
import asyncio
import time

from inflight_client.streams import Completion, grpc_stream


def run_streams(server, requests: list[dict]) -> list[Completion]:
    """Run gRPC streams concurrently; each request is grpc_stream's keyword arguments
    (model, inputs, parameters, cancel_after)."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        async with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return await asyncio.gather(*(grpc_stream(client, **r) for r in requests))

    return asyncio.run(main())


def wait_for_metric(server, name: str, expected: float, timeout_s: float = 10.0, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = server.metric(name, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)

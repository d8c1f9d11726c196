"""Client-side helpers for tests that talk to a real server."""
import asyncio
import re
import time
import urllib.request

from inflight_client.streams import Completion, grpc_stream


def run_streams(server, requests: list[dict]) -> list[Completion]:
    """Run gRPC streams concurrently; each request is grpc_stream's keyword arguments
    (model, inputs, parameters, cancel_after)."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        async with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return await asyncio.gather(*(grpc_stream(client, **r) for r in requests))

    return asyncio.run(main())


def metrics(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return response.read().decode()


def metric(server, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include `labels`."""
    total = 0.0
    for line in metrics(server).splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def wait_for_metric(server, name: str, expected: float, timeout_s: float = 10.0, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(server, name, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)

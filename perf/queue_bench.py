"""A deep queue must not slow the requests that run (`make bench-queue`): the tokens/s of a few
long streams through tritonserver with nothing queued, and with many more requests waiting behind
them (the engine's queue full of streams that asked for `queue_heartbeat`, as the OpenAI server's
do), the two alternated over rounds against one server; medians over rounds and their ratio,
and tritonserver's CPU. The waiting requests cost the server their heartbeats and cancellation
checks, each a round trip between the model's process and tritonserver, on the same cores as the
engine: checking 1,000 of them every poll took the running streams to 0.27-0.78x their speed.

    python perf/queue_bench.py [--queued 1000] [--running 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), REPO]

import aiohttp  # noqa: E402

from inflight.serving.launch import ServerProcess, make_repository  # noqa: E402
from perf.bench_stats import median_of_rounds, median_ratio, rotated  # noqa: E402
from perf.quiet import tree_cpu_seconds, wait_quiet  # noqa: E402
from perf.serve_bench import build_serve_model  # noqa: E402

PROMPT = list(range(5, 21))
WINDOW_S = 2.0          # measured while every running stream still runs (they are long enough)


async def stream(http, url: str, max_tokens: int, tokens: list[int], heartbeat: bool) -> None:
    body = {"input_ids": PROMPT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "return_num_output_tokens": True, "queue_heartbeat": heartbeat}
    async with http.post(f"{url}/v2/models/llm/generate_stream", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data:"):
                tokens[0] += json.loads(line[5:]).get("num_output_tokens", 0)


async def run(server: ServerProcess, running: int, queued: int, max_tokens: int) -> tuple[float, float]:
    """The running streams' tokens/s and tritonserver's cores over WINDOW_S, with `queued` more waiting."""
    url, pid = f"http://{server.http_url}", server.process.pid
    counted, uncounted = [0], [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(stream(http, url, max_tokens, counted, False)) for _ in range(running)]
        await asyncio.sleep(0.5)                      # they hold every seat
        tasks += [asyncio.create_task(stream(http, url, 8, uncounted, True)) for _ in range(queued)]
        await asyncio.sleep(1.0)                      # the waiting ones have arrived
        start, tokens, cpu = time.monotonic(), counted[0], tree_cpu_seconds(pid)
        await asyncio.sleep(WINDOW_S)
        elapsed = time.monotonic() - start
        rate, cores = (counted[0] - tokens) / elapsed, (tree_cpu_seconds(pid) - cpu) / elapsed
        assert not any(task.done() for task in tasks[:running]), "a running stream ended inside the window"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    deadline = time.monotonic() + 120                 # every request gone before the next run
    while (server.metric("inflight_requests_running") or server.metric("inflight_requests_waiting")) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    quiet = await asyncio.to_thread(wait_quiet, [pid], 0.1, 0.5, 60)
    print(f"  (the server went quiet {quiet:.1f} s after the requests were gone)", flush=True)
    return rate, cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = build_serve_model()
    engine = {"max_num_seqs": args.running, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
              "max_queue_size": args.queued + args.running}
    max_tokens = 1000          # the model's context: ~4 s a stream at 4 streams on 2 cores, past the window
    with tempfile.TemporaryDirectory(prefix="queue-bench-") as tmp:
        repo = make_repository(os.path.join(tmp, "repo"), model, engine, models=("llm",))
        with ServerProcess(repo, log_path=os.path.join(tmp, "tritonserver.log")) as server:
            asyncio.run(run(server, args.running, 0, max_tokens))          # warm-up
            results = {0: [], args.queued: []}
            for index in range(args.rounds):
                for queued in rotated([0, args.queued], index):
                    rate, cores = asyncio.run(run(server, args.running, queued, max_tokens))
                    results[queued].append(rate)
                    print(f"round {index}: {args.running} running, {queued:5d} queued: {rate:7.1f} tokens/s, "
                          f"tritonserver {cores:.2f} cores", flush=True)
    alone, behind = results[0], results[args.queued]
    print(f"median tokens/s of {args.running} running streams: {median_of_rounds(alone):.1f} alone, "
          f"{median_of_rounds(behind):.1f} with {args.queued} queued: {median_ratio(behind, alone):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

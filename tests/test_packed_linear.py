"""Linear layers with prepacked oneDNN weights: the same results as F.linear (bit for bit in
bfloat16 without a bias), and the CPU engine runs every projection and the LM head through them."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inflight import EngineConfig, LLMEngine
from inflight.packed_linear import PackedLinear, pack_linears


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


def test_the_cpu_engine_runs_its_linears_packed(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=16))
    model = engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)


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

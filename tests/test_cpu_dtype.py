"""dtype auto on CPU (bf16 where the CPU has AMX-BF16 or AVX-512-BF16, else fp32) and how close bf16
greedy decoding stays to transformers' own bf16 greedy decoding."""
import logging
import os

import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.cpu_features import cpu_auto_dtype, cpu_flags

from .conftest import DEFAULT_MODEL
from .test_exactness import hf_greedy, text_workload

FIRST_TOKENS = 16


@pytest.mark.parametrize("flags, expected", [
    ({"avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"amx_tile", "amx_bf16", "avx512f"}, torch.bfloat16),
    ({"avx2", "avx512f"}, torch.float32),
    (set(), torch.float32),
])
def test_auto_picks_bf16_only_with_bf16_instructions_and_logs_why(flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="inflight"):
        assert cpu_auto_dtype(flags) == expected
    assert f"dtype auto on CPU -> {str(expected)[6:]}" in caplog.text


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_the_engine_uses_the_cpu_choice(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=16, max_model_len=256))
    assert engine.runner.dtype == cpu_auto_dtype()


@pytest.mark.skipif(not os.path.exists(DEFAULT_MODEL), reason="default model not built")
def test_bf16_greedy_follows_transformers_bf16_for_most_requests(record_property):
    """The exactness workload (64 requests, prompts of real text) in bf16 on both sides: the first
    16 tokens agree for >= 90% of requests (rounding differs between batched and single-request
    matmuls, so later divergence is normal; the float64 suites stay exact)."""
    from transformers import AutoTokenizer
    prompts, lengths = text_workload(AutoTokenizer.from_pretrained(DEFAULT_MODEL), seed=7)
    lengths = [min(n, FIRST_TOKENS) for n in lengths]
    expected = hf_greedy(DEFAULT_MODEL, prompts, lengths, torch.bfloat16)
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="bfloat16", max_num_seqs=64,
                                                                   max_num_batched_tokens=256, num_kv_blocks=2048))
    got = [o.token_ids for o in engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])]
    agree = sum(g == e for g, e in zip(got, expected)) / len(prompts)
    record_property("bf16_first16_agreement", agree)
    print(f"\nbf16: first {FIRST_TOKENS} greedy tokens equal transformers' bf16 for {agree:.1%} of {len(prompts)} requests")
    assert agree >= 0.9, f"only {agree:.1%} of requests agree over the first {FIRST_TOKENS} tokens"

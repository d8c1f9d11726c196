"""Greedy token ids from the engine equal transformers' `generate`, request by request, for every
architecture, under token budgets that force chunking and a KV pool that forces preemption.

Engine and oracle both run in float64: batch-shape-dependent rounding cannot flip an argmax there,
so the check stays exact (no "mostly equal").
"""
import os
import random

import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams, testing

from .conftest import ARCH_CONFIGS, DEFAULT_MODEL

NUM_REQUESTS = 64
# budget 8 chunks nearly every prompt; 64 mixes chunks with decodes; 2048 takes whole prompts
BUDGETS = (8, 64, 2048)
PREEMPT_POOL_BLOCKS = 30        # (300 + 64) / 16 = 23 blocks fit one request; 64 requests contend


def make_workload(vocab_size: int, seed: int, prompt_pool: list[int] | None = None):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(NUM_REQUESTS):
        n = rng.randint(1, 300)
        if prompt_pool:
            start = rng.randrange(len(prompt_pool) - n)
            prompts.append(prompt_pool[start:start + n])
        else:
            prompts.append([rng.randrange(3, vocab_size) for _ in range(n)])
        lengths.append(rng.randint(1, 64))
    return prompts, lengths


def text_workload(tokenizer, seed: int):
    """make_workload's prompts cut from real text: the first pydoc topics, tokenized."""
    import pydoc_data.topics
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:20])
    pool = tokenizer(text, add_special_tokens=False)["input_ids"]
    return make_workload(vocab_size=len(tokenizer), seed=seed, prompt_pool=pool)


def hf_greedy(model_dir: str, prompts, lengths, dtype: torch.dtype = torch.float64) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return [testing.hf_greedy(model, prompt, n) for prompt, n in zip(prompts, lengths)]


def engine_greedy(model_dir: str, prompts, lengths, **config) -> tuple[list[list[int]], dict]:
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**{"dtype": "float64", "max_num_seqs": 64, **config}))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    engine.check_invariants()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    for out, n in zip(outs, lengths):
        assert out.finish_reason == ("length" if len(out.token_ids) == n else "stop")
    return [o.token_ids for o in outs], stats


def check_all_modes(model_dir: str, prompts, lengths):
    expected = hf_greedy(model_dir, prompts, lengths)
    for budget in BUDGETS:
        got, _ = engine_greedy(model_dir, prompts, lengths, max_num_batched_tokens=budget, num_kv_blocks=4096)
        mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        assert not mismatches, f"budget {budget}: requests {mismatches} differ from transformers"
    got, stats = engine_greedy(model_dir, prompts, lengths, max_num_batched_tokens=64,
                               num_kv_blocks=PREEMPT_POOL_BLOCKS, max_model_len=PREEMPT_POOL_BLOCKS * 16)
    assert stats["preemptions"] > 0, "the small pool should have forced preemptions"
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"under preemption: requests {mismatches} differ from transformers"


@pytest.mark.parametrize("name", list(ARCH_CONFIGS))
def test_greedy_matches_transformers(arch_checkpoints, name):
    model_dir = arch_checkpoints[name]
    prompts, lengths = make_workload(vocab_size=512, seed=list(ARCH_CONFIGS).index(name))
    check_all_modes(model_dir, prompts, lengths)


@pytest.mark.skipif(not os.path.exists(DEFAULT_MODEL), reason="default model not built")
def test_default_model_matches_transformers():
    from transformers import AutoTokenizer
    prompts, lengths = text_workload(AutoTokenizer.from_pretrained(DEFAULT_MODEL), seed=7)
    check_all_modes(DEFAULT_MODEL, prompts, lengths)


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_request_level_policies_give_the_same_tokens(tiny_checkpoint, policy):
    prompts, lengths = make_workload(vocab_size=512, seed=3)
    prompts, lengths = prompts[:24], lengths[:24]
    expected, _ = engine_greedy(tiny_checkpoint, prompts, lengths, num_kv_blocks=4096)
    got, stats = engine_greedy(tiny_checkpoint, prompts, lengths, num_kv_blocks=4096, policy=policy,
                               max_num_seqs=8)
    assert got == expected
    assert stats["padding_tokens"] > 0


def _greedy_with_backend(model_dir, backend, prompts, lengths):
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(attention_backend=backend, num_kv_blocks=64,
                                                               max_num_batched_tokens=32, dtype="float32"))
    assert engine.runner.backend.name == backend
    return [o.token_ids for o in engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0)
                                                           for n in lengths])]


@pytest.mark.parametrize("model", ["random", "default"])
def test_triton_kernels_give_the_same_tokens_as_the_torch_backend(tiny_checkpoint, model):
    """The whole engine through the Triton-language kernels (interpreted on CPU): mixed steps with
    chunked prefills (budget 32) and decodes."""
    if model == "default" and not os.path.exists(DEFAULT_MODEL):
        pytest.skip("default model not built")
    model_dir = tiny_checkpoint if model == "random" else DEFAULT_MODEL
    prompts = [[5 + i for i in range(n)] for n in (1, 45, 20)]
    lengths = [6, 4, 5]
    assert _greedy_with_backend(model_dir, "triton", prompts, lengths) == \
        _greedy_with_backend(model_dir, "torch", prompts, lengths)

"""Shared fixtures. Sets TRITON_INTERPRET before anything imports triton, so the Triton-language
kernels run (slowly, exactly) on machines without a GPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# two cores: one torch thread per test process leaves the other for the server under test
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 2) // 2)))

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# INFLIGHT_TEST_MODEL runs the suite against another local checkpoint (with a tokenizer)
DEFAULT_MODEL = os.environ.get("INFLIGHT_TEST_MODEL") or os.path.join(REPO, "model_repository", "llm", "1", "inflight-tiny")

# small random configs covering every supported architecture and its switches
ARCH_CONFIGS = {
    "llama-mha-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa2-tied-llama3rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                                 rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 128})),
    "llama-gqa4-headdim24": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24)),
    "mistral-gqa4-tied": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                          sliding_window=None)),
    "qwen2-bias-gqa2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: q/k norms, and a head_dim apart from hidden_size / heads (as Qwen3-0.6B's 128 of 1024 / 16)
    "qwen3-qknorm-gqa2-headdim24": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                                  tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def arch_checkpoints(tmp_path_factory):
    """name -> directory of a random HF checkpoint, built once per session."""
    from inflight.testing import make_random_checkpoint
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_random_checkpoint(str(root / name), arch, seed=i, **overrides)
            for i, (name, (arch, overrides)) in enumerate(ARCH_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_checkpoint(arch_checkpoints):
    return arch_checkpoints["llama-gqa2-tied-llama3rope"]

# the test server runs the engine in float64, so token ids can be compared with transformers exactly
TEST_ENGINE = {"dtype": "float64", "max_num_seqs": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 2048,
               "cpu_threads": 1}   # the test process computes too: two cores, no oversubscription


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real tritonserver with this model repository (default model, TEST_ENGINE settings)."""
    from inflight.serving.launch import ServerProcess, make_repository
    if not os.path.exists(DEFAULT_MODEL):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL}; run `make model`")
    repo = make_repository(str(tmp_path_factory.mktemp("repository")), DEFAULT_MODEL, TEST_ENGINE)
    with ServerProcess(repo) as s:
        yield s


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def reference_engine():
    """The in-process engine with the server's settings."""
    from inflight import EngineConfig, LLMEngine
    return LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**TEST_ENGINE))

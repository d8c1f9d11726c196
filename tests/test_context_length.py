"""The context length the OpenAI server reports (/v1/models, /tokenize) is the engine's own for every
architecture switch that bounds it: a sliding window, and Qwen2's and Qwen3's use_sliding_window."""
import json
import os

import pytest

from inflight import EngineConfig, LLMEngine
from inflight.context_length import checkpoint_max_len
from inflight.testing import make_random_checkpoint

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64, max_position_embeddings=256)
CASES = {
    "llama": ("llama", {}, 256),
    "mistral, window 64": ("mistral", dict(sliding_window=64), 64),
    "mistral, no window": ("mistral", dict(sliding_window=None), 256),
    "qwen2, window 64 switched on": ("qwen2", dict(sliding_window=64, use_sliding_window=True, max_window_layers=0),
                                     64),
    "qwen2, window 64 switched off": ("qwen2", dict(use_sliding_window=False), 256),
    "qwen3, window 64 switched on": ("qwen3", dict(sliding_window=64, use_sliding_window=True, max_window_layers=0,
                                                   head_dim=8), 64),
    "qwen3, window 64 switched off": ("qwen3", dict(use_sliding_window=False, head_dim=8), 256),
    "llama, a stray window in config.json": ("llama", {}, 256),       # Llama attends in full (transformers, vLLM)
    "qwen2, window 64 on, no layer past max_window_layers": (
        "qwen2", dict(sliding_window=64, use_sliding_window=True, max_window_layers=1), 256),
    # rope scaling extends the context as vLLM 0.32 derives it: YaRN's max_position_embeddings
    # already is the extended length (Qwen2.5's documented yarn block: vLLM serves 32768, not 131072)
    "qwen2, yarn x4 of 128": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 128}), 256),
    "llama, linear x4": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), 1024),
    "llama, llama3 rope (already extended)": ("llama", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), 256),
}


def with_window_in_config_json(directory: str, window: int) -> None:
    """Released Qwen2 configs keep a sliding_window with the switch off (transformers saves null);
    some Llama configs carry one too."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "sliding_window": window}, f)


@pytest.mark.parametrize("name", CASES)
def test_the_server_reports_the_engines_context_length(tmp_path, name):
    arch, overrides, expected = CASES[name]
    directory = make_random_checkpoint(str(tmp_path / "ckpt"), arch, **SMALL, **overrides)
    if overrides.get("use_sliding_window") is False or "stray window" in name:
        with_window_in_config_json(directory, 64)
    engine = LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=64))
    assert engine.max_model_len == expected
    assert checkpoint_max_len(directory) == expected


def test_a_config_without_max_position_embeddings_gets_the_engines_default(tmp_path):
    """transformers' config class fills the key in for the engine; the server reads it the same way."""
    directory = make_random_checkpoint(str(tmp_path / "ckpt"), "llama", **SMALL)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["max_position_embeddings"]
    with open(path, "w") as f:
        json.dump(config, f)
    engine = LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=128))
    assert checkpoint_max_len(directory) == engine.max_model_len == 2048     # LlamaConfig's default


def test_without_a_config_the_server_reports_none(tmp_path):
    assert checkpoint_max_len(str(tmp_path)) is None


def test_the_older_rope_scaling_key_counts_too():
    """config.json files written before transformers 5 name it rope_scaling, some with "type"."""
    from types import SimpleNamespace

    from inflight.context_length import context_length
    config = SimpleNamespace(max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4.0})
    assert context_length(config) == 16384


def test_a_yarn_checkpoint_takes_the_stretched_length_when_asked_and_refuses_past_it(tmp_path):
    """YaRN's default is max_position_embeddings (vLLM 0.32); its frequencies are stretched to
    original_max_position_embeddings x factor (transformers), so a max_model_len up to that is
    served, and one past it is refused by name."""
    yarn = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    directory = make_random_checkpoint(str(tmp_path / "ckpt"), "qwen2", **SMALL, **yarn)
    engine = LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=512))
    assert engine.max_model_len == 512
    with pytest.raises(ValueError, match=r"'max_model_len' 513 exceeds what the model supports \(512\)"):
        LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=513))

"""The context length the OpenAI server reports (/v1/models, /tokenize) is the engine's own for every
architecture switch that bounds it: a sliding window, and Qwen2's use_sliding_window."""
import json
import os

import pytest

from inflight import EngineConfig, LLMEngine
from inflight.testing import make_random_checkpoint
from inflight_client.openai_server.cli import checkpoint_max_len

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64, max_position_embeddings=256)
CASES = {
    "llama": ("llama", {}, 256),
    "mistral, window 64": ("mistral", dict(sliding_window=64), 64),
    "mistral, no window": ("mistral", dict(sliding_window=None), 256),
    "qwen2, window 64 switched on": ("qwen2", dict(sliding_window=64, use_sliding_window=True), 64),
    "qwen2, window 64 switched off": ("qwen2", dict(use_sliding_window=False), 256),
}


def with_window_in_config_json(directory: str, window: int) -> None:
    """Released Qwen2 configs keep a sliding_window with the switch off (transformers saves null)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "sliding_window": window}, f)


@pytest.mark.parametrize("name", CASES)
def test_the_server_reports_the_engines_context_length(tmp_path, name):
    arch, overrides, expected = CASES[name]
    directory = make_random_checkpoint(str(tmp_path / "ckpt"), arch, **SMALL, **overrides)
    if overrides.get("use_sliding_window") is False:
        with_window_in_config_json(directory, 64)
    engine = LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=64))
    assert engine.max_model_len == expected
    assert checkpoint_max_len(directory) == expected


def test_without_a_config_the_server_reports_none(tmp_path):
    assert checkpoint_max_len(str(tmp_path)) is None

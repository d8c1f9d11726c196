"""The context length a Llama-family checkpoint supports, from its config alone (no torch): the
engine bounds max_model_len by it, and the OpenAI server reports it without loading the engine."""
from __future__ import annotations


def context_length(config) -> int:
    """max_position_embeddings, within the sliding window where the checkpoint's attention has one
    (attention here is full attention: exact only while no sequence passes the window). A Qwen2
    config's sliding_window counts only with use_sliding_window. `config` is a transformers config
    or any object with config.json's keys as attributes."""
    window = getattr(config, "sliding_window", None)
    architecture = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if architecture == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
        window = None
    return min(config.max_position_embeddings, window or config.max_position_embeddings)

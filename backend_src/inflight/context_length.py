"""The context length a Llama-family checkpoint supports, from its config alone (no weights): the
engine bounds max_model_len by it, and the OpenAI server reports it without loading the engine."""
from __future__ import annotations

import os

# rope types whose max_position_embeddings already is the extended length (vLLM 0.32's list, which
# counts YaRN's: its factor is not applied again)
_EXTENDED_ALREADY = ("llama3", "longrope", "su", "yarn")


# config.json's model_type -> its architecture, for a config that names none (transformers picks the
# class by model_type the same way)
ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


CLASSIFIER = "ForSequenceClassification"     # the suffix of a decoder with a classification head


def causal_architecture(named: str) -> str:
    """The decoder an architecture is built on: a *ForSequenceClassification's *ForCausalLM."""
    return named.removesuffix(CLASSIFIER) + "ForCausalLM" if named.endswith(CLASSIFIER) else named


def architecture(config) -> str:
    """The architecture a config names, or where it names none its model_type's: a Mistral config
    without `architectures` was served as a Llama, its sliding window ignored (wrong tokens, no
    message). ValueError where neither says (vLLM refuses such a config too)."""
    named = getattr(config, "architectures", None)
    if named:
        return named[0]
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURE_BY_MODEL_TYPE:
        raise ValueError(f"'architectures' is missing and 'model_type' is {model_type!r}: config.json names no "
                         f"architecture this engine serves (model_type one of {', '.join(ARCHITECTURE_BY_MODEL_TYPE)})")
    return ARCHITECTURE_BY_MODEL_TYPE[model_type]


def rope_scaling(config) -> tuple[str, dict]:
    """(rope type, its parameters) of a config: transformers 5's rope_parameters, or the older
    rope_scaling (whose type some files name "type"); ("default", {}) without either."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default")), rope


def context_length(config) -> int:
    """The default max_model_len: max_position_embeddings, times a rope scaling factor where the
    rope type does not already count it (linear does; llama3 and YaRN do not), as vLLM 0.32 derives
    it; within the sliding window where the checkpoint's attention has one (attention here is full
    attention: exact only while no sequence passes the window): a Mistral's, and a Qwen2's or Qwen3's only with
    use_sliding_window and layers at or past max_window_layers, transformers' rule for which layers
    slide; a Llama's sliding_window key is ignored, as there. `config` is a transformers config or
    any object with config.json's keys as attributes (rope_parameters, or the older rope_scaling)."""
    positions = config.max_position_embeddings
    kind, rope = rope_scaling(config)
    if rope.get("factor") and kind not in _EXTENDED_ALREADY:
        positions = int(positions * rope["factor"])
    return _within_window(config, positions)


def longest_context(config) -> int:
    """The longest max_model_len the engine accepts: context_length, or where longer a YaRN rope's
    original_max_position_embeddings x factor, the length transformers stretches its frequencies
    to (Qwen2.5's documented yarn block keeps max_position_embeddings 32768 and stretches 4x: vLLM
    0.32 serves 32768 by default and more only under VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    kind, rope = rope_scaling(config)
    stretched = 0
    if kind == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        stretched = _within_window(config, int(rope["original_max_position_embeddings"] * rope["factor"]))
    return max(context_length(config), stretched)


def _within_window(config, positions: int) -> int:
    window = getattr(config, "sliding_window", None)
    try:
        named = causal_architecture(architecture(config))
    except ValueError:          # the engine refuses it; a length alone reads it as a Llama
        named = "LlamaForCausalLM"
    if named in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding = getattr(config, "use_sliding_window", False) and \
            getattr(config, "max_window_layers", 0) < config.num_hidden_layers
        window = window if sliding else None
    elif named != "MistralForCausalLM":      # Llama attends in full, whatever config.json holds
        window = None
    return min(positions, window or positions)


def checkpoint_max_len(directory: str) -> int | None:
    """The context length the engine gives a checkpoint, from its config.json read as the engine
    reads it (transformers' config class, so a file without max_position_embeddings gets the
    class's default, as in the engine); None without a config.json transformers can read."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception:       # whatever transformers raises for a config it cannot read: the engine refuses it too
        return None
    return context_length(config)

"""Random models for tests and benchmarks: HF checkpoints built with transformers itself and saved
as safetensors (exactly what a user's checkpoint directory looks like), and engines whose random
weights are initialised where they run (no file at all: `make gpu-check`'s Llama-3-8B shape). And
the reference the engine's greedy outputs are checked against: transformers' `generate`."""
from __future__ import annotations

import os

import torch

_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_random_checkpoint(path: str, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                           **overrides) -> str:
    """Save a randomly initialised `arch` model ('llama' | 'mistral' | 'qwen2' | 'qwen3') to `path`."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in _CONFIGS[arch])
    values = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.1)
    values.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**values))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def make_classifier_checkpoint(base_dir: str, path: str, num_labels: int, seed: int = 0, **config) -> str:
    """Save `base_dir`'s decoder as a *ForSequenceClassification of `num_labels` (transformers
    itself draws the score head), with base_dir's tokenizer files; `config`: config.json keys to
    set (id2label, problem_type, ...)."""
    import shutil

    from transformers import AutoConfig, AutoModelForSequenceClassification

    hf_config = AutoConfig.from_pretrained(base_dir, num_labels=num_labels)
    for key, value in config.items():
        setattr(hf_config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base_dir, config=hf_config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5 / model.config.hidden_size ** 0.5)     # logits of about 1
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(base_dir):
        if name.startswith(("tokenizer", "special_tokens")) or name == "chat_template.jinja":
            shutil.copy(os.path.join(base_dir, name), path)
    return path


def random_engine(hf_config, config=None):
    """An LLMEngine over `hf_config`'s architecture with the modules' random initialisation, built
    directly on the engine's device. No token is an end of sequence (random weights)."""
    from .config import EngineConfig
    from .engine import LLMEngine
    from .runner import ModelRunner

    config = config or EngineConfig()
    return LLMEngine(ModelRunner(None, hf_config, config), config, eos_token_ids=(), model_key=b"random-weights")
def make_random_adapter(base_dir: str, path: str, seed: int = 0, scale: float = 0.2, **lora_config) -> str:
    """Save a PEFT LoRA adapter for the checkpoint in `base_dir`, made by `peft` itself with
    LoraConfig(**lora_config), its A and B weights drawn N(0, scale^2) (large enough to change
    the model's greedy tokens, unlike PEFT's default B = 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(**lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(path)
    return path


class _OpenAIPenalties:
    """OpenAI's frequency/presence penalties as a transformers logits processor (transformers has
    none): logit -= f x the token's count in the output + p x (count > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, settings: dict | None = None) -> list[int]:
    """transformers' greedy output for a prompt, with the engine's repetition_penalty,
    frequency_penalty, presence_penalty, logit_bias and allowed_token_ids from `settings` (its own
    repetition_penalty and sequence_bias, which run before the processor above, as in the engine,
    and prefix_allowed_tokens_fn)."""
    from transformers import LogitsProcessorList
    settings = settings or {}
    device = next(model.parameters()).device
    penalties = _OpenAIPenalties(len(prompt), settings.get("frequency_penalty", 0.0),
                                 settings.get("presence_penalty", 0.0))
    bias = {(token,): value for token, value in settings.get("logit_bias", {}).items()} or None
    allowed = settings.get("allowed_token_ids")
    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, min_new_tokens=0,
                         do_sample=False, repetition_penalty=settings.get("repetition_penalty", 1.0),
                         logits_processor=LogitsProcessorList([penalties]), sequence_bias=bias,
                         prefix_allowed_tokens_fn=None if allowed is None else lambda batch, ids: list(allowed),
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()

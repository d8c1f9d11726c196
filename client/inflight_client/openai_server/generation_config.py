"""The checkpoint's sampling defaults, as vLLM's server reads them (`--generation-config auto`,
its default): every sampling key generation_config.json sets (transformers 5's own defaults are
all unset, so to_diff_dict keeps even a neutral top_k 50; vLLM's try_get_generation_config and
ModelConfig.get_diff_sampling_param) becomes one of the
defaults of requests that leave those fields out; `max_new_tokens` is a chat's default
`max_tokens` (a completion's stays 16, as in vLLM, whose CompletionRequest defaults it).
`--generation-config vllm` ignores the file: requests get the neutral defaults."""
from __future__ import annotations

import logging

log = logging.getLogger("inflight.openai")

# vLLM 0.32's available_params, in its order
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens")


def diff_sampling_params(config: dict) -> dict:
    """vLLM's get_diff_sampling_param: the sampling keys a generation config sets (null is unset),
    `max_new_tokens` named `max_tokens`."""
    params = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in params:
        params["max_tokens"] = params.pop("max_new_tokens")
    return params


def read_generation_config(directory: str) -> dict:
    """vLLM's try_get_generation_config(...).to_diff_dict(): generation_config.json, else what
    transformers derives from config.json, else nothing."""
    from transformers import AutoConfig, GenerationConfig
    try:
        return GenerationConfig.from_pretrained(directory).to_diff_dict()
    except OSError:         # no generation_config.json
        try:
            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory)).to_diff_dict()
        except (OSError, ValueError):       # no config.json (a tokenizer directory), or one transformers cannot read
            return {}


def sampling_defaults(directory: str, source: str = "auto") -> dict:
    """The defaults for requests (vLLM's SamplingParams names), logged at start as vLLM logs them."""
    if source == "vllm":
        return {}
    params = diff_sampling_params(read_generation_config(directory))
    if params:
        log.warning("inflight-openai: default sampling parameters have been overridden by the model's "
                    "generation_config.json: %s (for requests that leave them out; a chat's max_tokens is "
                    "max_new_tokens). If this is not intended, start with --generation-config vllm", params)
    return params

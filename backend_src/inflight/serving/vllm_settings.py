"""model.json as the Triton vLLM backend writes it: every key at the top level is an argument of
vLLM's engine (`AsyncEngineArgs(**model_json)`), where inflight's own keys sit under "engine".

A top-level key is read here when it means the same thing to both: the engine arguments
EngineConfig has under vLLM's name, the vLLM backend's switch for its `vllm:` metrics
(`disable_log_stats`), arguments that change nothing for one engine on one device (accepted and
logged), and the parallel sizes, which must be 1. Any other key is refused by the caller, naming
it: an argument whose effect inflight cannot give is an error, never a silent default.
"""
from __future__ import annotations

import logging

from .startup import StartupError

log = logging.getLogger("inflight")

# vLLM engine arguments EngineConfig has with the same name and meaning
ENGINE_ARGS = ("block_size", "dtype", "enable_chunked_prefill", "enable_lora", "enable_prefix_caching",
               "enforce_eager", "gpu_memory_utilization", "max_cpu_loras", "max_lora_rank", "max_loras",
               "max_model_len", "max_num_batched_tokens", "max_num_seqs", "reasoning_parser", "runner", "seed",
               "hf_overrides")
BOOLEAN_ARGS = ("enable_chunked_prefill", "enable_lora", "enable_prefix_caching", "enforce_eager",
                "disable_log_stats")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}        # vLLM's --dtype names
# vLLM engine arguments that change nothing here, and why
WITHOUT_EFFECT = {
    "disable_log_requests": "inflight does not log requests",
    "enable_log_requests": "inflight does not log requests",
    "trust_remote_code": "inflight runs its own model code for the architectures it supports, never a checkpoint's",
    "distributed_executor_backend": "one engine runs in its Triton instance's process",
}
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")
# vLLM's convert "auto" or "embed": what a pooling runner makes of the *ForCausalLM checkpoints served
# here (LAST pooling: pooling.py); "embed" with runner "auto" (or none) asks for the pooling runner
CONVERTS = ("auto", "embed")
KEYS = (*ENGINE_ARGS, "disable_log_stats", "convert", *WITHOUT_EFFECT, *PARALLEL_SIZES)


def read_top_level(raw: dict, path: str) -> tuple[dict, bool]:
    """The EngineConfig values among model.json's top-level keys, and whether the `vllm:` metrics
    stay on (False where `disable_log_stats` is true, as the vLLM backend reads it)."""
    values = {}
    for key in ENGINE_ARGS + ("disable_log_stats",):
        if key in raw:
            values[key] = _boolean(raw[key]) if key in BOOLEAN_ARGS else raw[key]
    if isinstance(values.get("dtype"), str):
        values["dtype"] = DTYPE_ALIASES.get(values["dtype"], values["dtype"])
    if "convert" in raw and raw["convert"] not in CONVERTS:
        raise StartupError(f"{path}: 'convert' is {raw['convert']!r}: inflight serves a checkpoint as it is "
                           f"(runner 'generate') or as an embedding model (runner 'pooling'); one of {CONVERTS}")
    if raw.get("convert") == "embed":
        if values.get("runner", "auto") not in ("auto", "pooling"):
            raise StartupError(f"{path}: 'convert' 'embed' makes an embedding model, which runner "
                               f"{values['runner']!r} does not serve: give runner 'pooling' or 'auto'")
        values["runner"] = "pooling"
    for key in PARALLEL_SIZES:
        if key in raw and (isinstance(raw[key], bool) or raw[key] not in (1, "1")):
            raise StartupError(f"{path}: '{key}' is {raw[key]!r}: inflight runs each engine on one device; to serve "
                               "more, run several instances (config.pbtxt's instance_group: a count, or KIND_GPU for "
                               "one per GPU)")
    if "max_cpu_loras" in raw:
        log.info("inflight: %s: 'max_cpu_loras' bounds the adapters loaded at runtime (allow_runtime_lora_updating); "
                 "those of multi_lora.json all stay in host memory", path)
    for key, why in WITHOUT_EFFECT.items():
        if key in raw:
            log.info("inflight: %s: '%s' has no effect here (%s)", path, key, why)
    disable_stats = values.pop("disable_log_stats", False)
    if not isinstance(disable_stats, bool):
        raise StartupError(f"{path}: 'disable_log_stats' must be true or false, got {disable_stats!r}")
    return values, not disable_stats


def _boolean(value):
    """true/false, or the strings the vLLM backend's tutorials write ("true", "True", "false")."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value

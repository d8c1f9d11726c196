"""inflight: an iteration-level (continuous-batching) LLM engine for Triton's Python backend."""
from .config import EngineConfig, SamplingParams

# the engine imports torch: loaded on first use, so that the tokenizing ensemble steps, which
# import inflight.serving, stay without it
_LAZY = {"LLMEngine": "engine", "QueueFullError": "engine", "RequestOutput": "request", "StepOutput": "request",
         "Logprob": "logprobs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineConfig", "LLMEngine", "Logprob", "QueueFullError", "RequestOutput", "SamplingParams", "StepOutput"]

"""Model definitions for the engine's runner."""
from .llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelSpec, rope_tables

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelSpec", "rope_tables"]

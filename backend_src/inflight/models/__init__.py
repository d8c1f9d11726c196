"""Model definitions for the engine's runner."""
from .llama import (SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, LlamaForCausalLM, LlamaForSequenceClassification,
                    ModelSpec, rope_tables)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "LlamaForCausalLM", "LlamaForSequenceClassification",
           "ModelSpec", "rope_tables"]

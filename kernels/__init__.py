"""Triton-language kernels for the paged KV cache (importable as `inflight.kernels`).

unified_attention: causal paged attention for a whole engine step (decodes, prefill chunks and
  prefills in one launch, split-KV flash-decoding for long decode steps).
write_kv: store a step's new K/V rows at their cache slots.
Both follow the argument conventions of the torch reference in `inflight.attention`.
"""
from .unified_attention import unified_attention
from .write_kv import write_kv

__all__ = ["unified_attention", "write_kv"]

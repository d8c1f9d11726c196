"""Triton kernel that stores a step's new K/V rows into the paged cache.

Same contract as the torch reference `inflight.attention.write_kv`:
  key, value        [num_tokens, num_kv_heads, head_dim]
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping      [num_tokens], slot = block * block_size + offset, -1 = skip this token
One program copies one token's rows (all KV heads, K and V) as a single 2-D tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import require_contiguous


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64 so block * block stride cannot wrap on caches larger than 2^31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token / sequence that does not store this step
        return
    # block_size is a runtime scalar (one division per program), so cache block sizes share a kernel
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V rows at its cache slot; slot -1 means skip. Any strides are accepted
    but slot_mapping's, which must be contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not fit "
                         f"rows [{num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not match {num_tokens} tokens")
    require_contiguous(slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
    )

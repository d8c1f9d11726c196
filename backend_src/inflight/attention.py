"""Attention over the paged KV cache: the torch reference backend and the backend choice.

Cache layout (shared with the Triton kernels in `inflight.kernels`):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A step's tokens are packed by sequence: q/out [num_tokens, num_q_heads, head_dim];
cu_seqlens_q [num_seqs + 1]; seq_lens [num_seqs] = tokens already cached + this step's tokens;
block_table [num_seqs, max_blocks_per_seq]. The queries of sequence i are its last
(cu_seqlens_q[i+1] - cu_seqlens_q[i]) positions, so one call serves decodes, prefill chunks and
full prefills alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """A step's packed layout, shared by every layer."""
    slot_mapping: torch.Tensor      # [num_real_tokens] int64 cache slot of each token
    cu_seqlens_q: torch.Tensor      # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_table: torch.Tensor       # [num_seqs, max_blocks] int32
    num_real_tokens: int            # tokens after these are padding (static/dynamic policies)
    max_seq_len: int                # known on the host, so kernels need not read seq_lens back


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """write_kv(key, value, k_cache, v_cache, slot_mapping) and
    attention(q, k_cache, v_cache, out, meta, scale)."""
    name: str
    write_kv: Callable
    attention: Callable


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """'triton' (the Triton-language kernels; default on CUDA) or 'torch' (the reference; default
    on CPU, and for float64, which the kernels do not cover). With TRITON_INTERPRET=1 the triton
    backend also runs on CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if name == "triton" and dtype == torch.float64:
        raise ValueError("'attention_backend' 'triton' supports float16, bfloat16 and float32, not float64; "
                         "use 'torch'")
    if name == "torch":
        def attention(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float):
            return paged_attention(q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, scale)
        return AttentionBackend("torch", write_kv, attention)
    from .kernels import unified_attention, write_kv as triton_write_kv

    def triton_attention(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float):
        return unified_attention(q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_table,
                                 scale, max_seq_len=meta.max_seq_len)
    return AttentionBackend("triton", triton_write_kv, triton_attention)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V row at its slot (block * block_size + offset); slot -1 means skip."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence, contiguous: [length, num_kv_heads, head_dim]."""
    return cache.index_select(0, block_ids).flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of every packed query against its sequence's cached keys (torch reference).

    Decode rows (one query token) are batched into one padded call; other sequences run one by one.
    """
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        _decode_attention(q, k_cache, v_cache, out, starts, lens, block_table, decode, scale)
    decode_set = set(decode)
    for i, seq_len in enumerate(lens):
        if i in decode_set:
            continue
        start, end = starts[i], starts[i + 1]
        num_blocks = -(-seq_len // block_size)
        k = gather_kv(k_cache, block_table[i, :num_blocks], seq_len)
        v = gather_kv(v_cache, block_table[i, :num_blocks], seq_len)
        out[start:end] = _attend(q[start:end], k, v, scale, causal_offset=seq_len - (end - start))
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """q [n, H, D] against k/v [L, KVH, D]; query j sits at position causal_offset + j."""
    n, heads, dim = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    # fold each KV head's query heads into the query rows (row = token * group + head in group):
    # one plain SDPA per KV head, with no copies of K/V for the group (several times faster on CPU)
    folded = q.view(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
    mask = None
    if n > 1:
        q_pos = torch.arange(causal_offset, causal_offset + n, device=q.device).repeat_interleave(group)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(folded, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale)
    return o[0].view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)


def _decode_attention(q, k_cache, v_cache, out, starts, lens, block_table, rows, scale) -> None:
    """All one-token queries in one padded SDPA call, a KV head's query heads folded into rows:
    [B, KVH, group, D] against [B, KVH, max_len, D]."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    device = q.device
    rows_t = torch.tensor(rows, device=device)
    token_idx = torch.tensor([starts[i] for i in rows], device=device)
    row_lens = torch.tensor([lens[i] for i in rows], device=device)
    max_len = int(row_lens.max())
    max_blocks = -(-max_len // block_size)
    batch = len(rows)
    blocks = block_table[rows_t, :max_blocks].reshape(-1)
    k = k_cache.index_select(0, blocks).view(batch, max_blocks * block_size, kv_heads, dim)[:, :max_len]
    v = v_cache.index_select(0, blocks).view(batch, max_blocks * block_size, kv_heads, dim)[:, :max_len]
    mask = torch.arange(max_len, device=device)[None, :] < row_lens[:, None]
    heads = q.shape[1]
    folded = q[token_idx].view(batch, kv_heads, heads // kv_heads, dim)
    o = F.scaled_dot_product_attention(folded, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale)
    out[token_idx] = o.reshape(batch, heads, dim)

"""Attention over the paged KV cache: the torch reference backend and the backend choice.

Cache layout (shared with the Triton kernels in `inflight.kernels`):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A step's tokens are packed by sequence: q/out [num_tokens, num_q_heads, head_dim];
cu_seqlens_q [num_seqs + 1]; seq_lens [num_seqs] = tokens already cached + this step's tokens;
block_table [num_seqs, max_blocks_per_seq]. The queries of sequence i are its last
(cu_seqlens_q[i+1] - cu_seqlens_q[i]) positions, so one call serves decodes, prefill chunks and
full prefills alike.

On CPU, `compiled_paged_attention` (backend "cpu", the default for float32 and bfloat16) runs
every query through the compiled kernels of cpu_kernels.cpp, which read K/V in place through the
block table: one-token queries through the decode kernel, prefill chunks through the prefill
kernel a tile of query tokens at a time (causal; 3-4x faster than gathering the context for
SDPA with AVX-512; on a CPU without it the chunks take gather + SDPA, which is faster there). Two
torch implementations over the same layout: `paged_attention`, the reference the tests compare against, and `grouped_paged_attention`, the CPU fallback (backend "torch": float64, or no
compiler). The reference pads every decoding sequence to the longest and copies the whole batch's K/V into one
tensor per layer; the fallback sorts the decoding sequences by length once per step, cuts them into
groups whose K/V fit in about 2 MiB, and per group reads exactly its sequences' blocks into a
buffer that stays in the CPU's cache, then runs one SDPA over it (a KV head's query heads folded
into rows). Prefill chunks keep SDPA over their gathered context.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_kernels


@dataclass(slots=True)
class AttentionMetadata:
    """A step's packed layout, shared by every layer."""
    slot_mapping: torch.Tensor      # [num_real_tokens] int64 cache slot of each token
    cu_seqlens_q: torch.Tensor      # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_table: torch.Tensor       # [num_seqs, max_blocks] int32
    num_real_tokens: int            # tokens after these are padding (static/dynamic policies)
    max_seq_len: int                # known on the host, so kernels need not read seq_lens back
    cpu_plan: "CpuAttentionPlan | None" = None   # built by the first layer of a step, reused by the rest


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """write_kv(key, value, k_cache, v_cache, slot_mapping) and
    attention(q, k_cache, v_cache, out, meta, scale); where the backend has it,
    rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping) -> q:
    the rotations and write_kv in one pass over the fused projection's output, which the model then
    takes instead of write_kv (the CPU backend's K/V reach the cache only that way: its write_kv
    is the torch one)."""
    name: str
    write_kv: Callable
    attention: Callable
    rotary_write_kv: Callable | None = None


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """'triton' (the Triton-language kernels; default on CUDA), 'cpu' (the compiled CPU kernel for
    decodes, `compiled_paged_attention`; default on CPU in float32 and bfloat16 where it builds) or
    'torch' (grouped_paged_attention; the CPU fallback, and float64, which no kernel covers). With
    TRITON_INTERPRET=1 the triton backend also runs on CPU."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if dtype != torch.float64 else "torch"
        else:
            # cpu_kernels.load() logs why when the kernels cannot be had
            name = "cpu" if dtype in cpu_kernels.DTYPES and cpu_kernels.load() is not None else "torch"
    if name == "triton" and dtype == torch.float64:
        raise ValueError("'attention_backend' 'triton' supports float16, bfloat16 and float32, not float64; "
                         "use 'torch'")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # else the first step fails ("0 active drivers") and takes the serving loop down with it
        raise ValueError(f"'attention_backend' 'triton' needs a CUDA device (this engine runs on {device.type}); "
                         "use 'auto', 'cpu' or 'torch'")
    if name == "cpu":
        return _compiled_backend(device, dtype)
    if name == "torch":
        return AttentionBackend("torch", write_kv, grouped_paged_attention)
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] against k/v [L, KVH, D]; query j sits at position causal_offset + j. `mask`
    (causal_mask's) may be passed in when it was built before."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # fold each KV head's query heads into the query rows (row = token * group + head in group):
    # one plain SDPA per KV head, with no copies of K/V for the group (several times faster on CPU)
    folded = q.view(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
    if mask is None and n > 1:
        mask = causal_mask(n, group, k.shape[0], causal_offset, q.device)
    o = F.scaled_dot_product_attention(folded, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale)
    return o[0].view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)


def causal_mask(n: int, group: int, length: int, causal_offset: int, device, dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """[n * group, length]: row token * group + g sees keys up to causal_offset + token; boolean, or
    additive in `dtype` (0 / -inf: what SDPA would convert a boolean mask to on every call)."""
    q_pos = torch.arange(causal_offset, causal_offset + n, device=device).repeat_interleave(group)
    allowed = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


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


GROUP_KV_BYTES = 2 * 2**20      # K+V of one decode group: small enough to stay in a core's cache


@dataclass(slots=True)
class DecodeGroup:
    token_idx: torch.Tensor     # [n] the group's query rows
    blocks: torch.Tensor        # [n * num_blocks] their blocks, row by row
    mask: torch.Tensor          # [n, 1, 1, num_blocks * block_size] 0 for each sequence's keys, -inf after
    num_blocks: int


@dataclass(slots=True)
class CpuAttentionPlan:
    """A step's attention work, worked out on the host once and used by every layer."""
    groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int]]        # (sequence, first query row, end row) of the others
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)   # by prefill, from the first layer


def plan_cpu_attention(meta: AttentionMetadata, k_cache: torch.Tensor, group_decodes: bool = True) -> CpuAttentionPlan:
    """The prefill chunks, and the decodes cut into groups for the torch path (group_decodes)."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    device = k_cache.device          # the torch backend also runs on CUDA when asked for
    starts = meta.cu_seqlens_q.cpu().numpy()
    lens = meta.seq_lens.cpu().numpy().astype(np.int64)
    one_token = np.diff(starts) == 1
    decode = np.flatnonzero(one_token) if group_decodes else np.zeros(0, dtype=np.int64)
    order = decode[np.argsort(lens[decode], kind="stable")]
    group_tokens = max(block_size, GROUP_KV_BYTES // (2 * kv_heads * dim * k_cache.element_size()))
    groups, i = [], 0
    positions = torch.arange(-(-int(lens.max()) // block_size) * block_size if len(lens) else 0)
    while i < len(order):
        # sorted by length, so the group's last sequence is its longest: little padding
        j = i + max(1, int(np.searchsorted(np.cumsum(lens[order[i:]]), group_tokens, side="right")))
        rows = order[i:j]
        num_blocks = -(-int(lens[rows[-1]]) // block_size)
        rows_t = torch.from_numpy(rows).to(device)
        # additive, in the cache's dtype: SDPA would convert a boolean mask in every layer
        outside = positions[:num_blocks * block_size][None, :] >= torch.from_numpy(lens[rows])[:, None]
        mask = torch.zeros(outside.shape, dtype=k_cache.dtype).masked_fill_(outside, float("-inf"))
        groups.append(DecodeGroup(torch.from_numpy(starts[rows].astype(np.int64)).to(device),
                                  meta.block_table[rows_t, :num_blocks].reshape(-1), mask[:, None, None, :].to(device),
                                  num_blocks))
        i = j
    prefills = [(int(s), int(starts[s]), int(starts[s + 1])) for s in np.flatnonzero(~one_token)]
    return CpuAttentionPlan(groups, prefills)


def grouped_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The CPU backend: same result as `paged_attention`, organised for the CPU's caches."""
    if meta.cpu_plan is None:
        meta.cpu_plan = plan_cpu_attention(meta, k_cache)
    block_size, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    for g in meta.cpu_plan.groups:
        n, length = len(g.token_idx), g.num_blocks * block_size
        k = k_cache.index_select(0, g.blocks).view(n, length, kv_heads, dim).transpose(1, 2)
        v = v_cache.index_select(0, g.blocks).view(n, length, kv_heads, dim).transpose(1, 2)
        folded = q.index_select(0, g.token_idx).view(n, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(folded, k, v, attn_mask=g.mask, scale=scale)
        out.index_copy_(0, g.token_idx, o.reshape(n, heads, dim))
    _prefill_attention(q, k_cache, v_cache, out, meta, scale)
    return out


def _compiled_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if device.type != "cpu" or dtype not in cpu_kernels.DTYPES:
        raise ValueError(f"'attention_backend' 'cpu' runs float32 and bfloat16 on the CPU, not {dtype} on {device}; "
                         "use 'torch'")
    kernels = cpu_kernels.load()
    if kernels is None:
        raise ValueError("'attention_backend' 'cpu' needs the compiled CPU kernels, which could not be built here "
                         "(the log says why); use 'torch' or 'auto'")

    # both look the kernels' methods up on each call, so the benchmarks' timers can wrap them
    def attention(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float):
        return compiled_paged_attention(kernels, q, k_cache, v_cache, out, meta, scale)

    # the rotations and the K/V write were two compiled calls a layer and the views between them (at
    # decode 24 and 35 µs a call, most of it the wrappers')
    def rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping):
        return kernels.rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping)
    return AttentionBackend("cpu", write_kv, attention, rotary_write_kv)


def compiled_paged_attention(kernels: "cpu_kernels.CpuKernels", q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                             scale: float) -> torch.Tensor:
    """The CPU backend with the compiled kernels (cpu_kernels.cpp): every query reads its K/V in
    place through the block table; decodes one token each, prefill chunks a tile of tokens each."""
    kv_heads, dim = k_cache.shape[2:]
    if not kernels.supports(q.dtype, q.shape[1], kv_heads, dim):
        return grouped_paged_attention(q, k_cache, v_cache, out, meta, scale)
    args = (q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, scale)
    kernels.paged_decode_attention(*args)
    if meta.num_real_tokens > len(meta.seq_lens):       # some sequence has several query tokens
        if kernels.tiled_prefill:
            kernels.paged_prefill_attention(*args)
        else:
            if meta.cpu_plan is None:
                meta.cpu_plan = plan_cpu_attention(meta, k_cache, group_decodes=False)
            _prefill_attention(q, k_cache, v_cache, out, meta, scale)
    return out


def _prefill_attention(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float) -> None:
    """SDPA per prefill chunk over its gathered context, a KV head's query heads folded into rows
    (with enable_gqa, or without a mask, torch's CPU SDPA leaves its flash kernel for the slow
    math path)."""
    block_size = k_cache.shape[1]
    block_table, lens = meta.block_table, meta.seq_lens
    masks = meta.cpu_plan.prefill_masks
    for i, (seq, start, end) in enumerate(meta.cpu_plan.prefills):
        seq_len = int(lens[seq])
        blocks = block_table[seq, :-(-seq_len // block_size)]
        k, v = gather_kv(k_cache, blocks, seq_len), gather_kv(v_cache, blocks, seq_len)
        if i not in masks and end - start > 1:
            masks[i] = causal_mask(end - start, q.shape[1] // k.shape[1], seq_len, seq_len - (end - start), q.device,
                                   q.dtype)
        out[start:end] = _attend(q[start:end], k, v, scale, seq_len - (end - start), masks.get(i))

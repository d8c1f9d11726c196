"""Unified paged attention: one launch for a whole engine step (decodes, prefill chunks, prefills).

Same contract as the torch reference `inflight.attention.paged_attention`:
  q, out            [num_tokens, num_q_heads, head_dim], packed by sequence
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  cu_seqlens_q      [num_seqs + 1] int32; sequence i owns q rows cu_seqlens_q[i] : cu_seqlens_q[i+1]
  seq_lens          [num_seqs] int32 = tokens already cached + this step's tokens
  block_table       [num_seqs, max_blocks_per_seq] int32
The queries of sequence i are its LAST n_i positions, so query j may see keys 0 .. seq_len - n_i + j.

Grid: (query tiles, KV heads, KV splits). A query tile is block_q consecutive query tokens of one
sequence times the group of query heads that read the same KV head (rows = token-major, head-minor),
so every K/V tile loaded from the cache serves the whole group through one `tl.dot`. Each program
runs a flash-attention online softmax (fp32 running max / sum / accumulator, base-2 exponentials)
over its key range. With num_splits > 1 (flash-decoding, see launch_config.py) each program covers
one slice of the key range and writes partial results that split_kv_reduce.py merges.

Query tiles are found without a host sync: sequence i's tiles are numbered from
cu_seqlens_q[i] // block_q + i, which leaves at least cdiv(n_i, block_q) tile ids per sequence, so
num_tokens // block_q + num_seqs programs along axis 0 always suffice (spare ones exit at once).

Compile-time constants are only what shapes the key loop (tile sizes, head size, cache block size,
dtype). The query-group layout, the split count and the per-step integers are runtime arguments
kept out of Triton's integer specialisation, so a model compiles one kernel per step kind (decode /
mixed), not one per group size, batch size, block-table width or split count
(`python -m inflight.kernels.aot` lists every compilation).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch_config import choose_config, require_contiguous
from .split_kv_reduce import reduce_splits

LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile_id, num_seqs, block_q):
    """The sequence whose query tiles include `tile_id` (binary search over first tile ids)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // block_q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Step-dependent integers: not specialised (== 1, % 16), or each new value could recompile.
_PER_STEP_INTS = ["num_seqs", "num_splits", "group", "group_pad", "block_q", "stride_btr",
                  "stride_pot", "stride_poh", "stride_pos", "stride_pod", "stride_pmt", "stride_pmh", "stride_pms"]


@triton.jit(do_not_specialize=_PER_STEP_INTS)
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_out_ptr, part_m_ptr, part_l_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, num_splits, group, group_pad, block_q, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btr, stride_btc,
    stride_pot, stride_poh, stride_pos, stride_pod,
    stride_pmt, stride_pmh, stride_pms,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, tile_id, num_seqs, block_q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_tok = (tile_id - (q_start // block_q + seq)) * block_q
    if first_tok >= q_len:        # spare tile id of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len     # keys cached before this step's first query

    # Tile rows (BLOCK_M = block_q * group_pad): token-major, query-head-minor (rows of one token
    # share a causal horizon).
    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // group_pad                  # query index within the sequence
    head = kv_head * group + rows % group_pad
    row_ok = (tok < q_len) & (rows % group_pad < group)
    q_pos = context + tok                                # absolute position: sees keys <= q_pos
    token = (q_start + tok).to(tl.int64)                 # packed row in q / out
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # This tile's keys stop at its last real query's horizon; the split takes a slice of them.
    kv_end = context + tl.minimum(first_tok + block_q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    acc, m_i, l_i = _attend_key_range(
        q, k_cache_ptr, v_cache_ptr, block_table_ptr + seq * stride_btr, stride_btc,
        kv_head, q_pos, kv_end, tile_lo, tile_hi, qk_scale, dims, dim_ok,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        BLOCK_M, BLOCK_SIZE, HEAD_PAD, TILE_N, DOT_PRECISION)

    # Rows that saw no key (only possible inside a split) have l == 0: emit 0 instead of NaN.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if num_splits == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        ml_offs = token * stride_pmt + head * stride_pmh + split * stride_pms
        tl.store(part_m_ptr + ml_offs, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml_offs, l_i, mask=row_ok)
        o_offs = (token[:, None] * stride_pot + head[:, None] * stride_poh + split * stride_pos
                  + dims[None, :] * stride_pod)
        tl.store(part_out_ptr + o_offs, o, mask=store_mask)


@triton.jit
def _attend_key_range(
    q, k_cache_ptr, v_cache_ptr, block_row_ptr, stride_btc,
    kv_head, q_pos, kv_end, tile_lo, tile_hi, qk_scale, dims, dim_ok,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the q tile over key tiles [tile_lo, tile_hi): un-normalised acc, max, sum."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    for t in range(tile_lo, tile_hi):
        keys = t * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < kv_end
        # Each key finds its own cache block, so TILE_N need not match the block size.
        # int64 before the multiply: block id * block stride can pass 2^31 on large caches.
        block = tl.load(block_row_ptr + (keys // BLOCK_SIZE) * stride_btc, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        k = tl.load(k_head_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks + dims[:, None] * stride_kd,
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)          # [HEAD_PAD, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_head_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)          # [TILE_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      scale: float, *, max_seq_len: int | None = None, num_splits: int | None = None,
                      tile_n: int | None = None, block_q: int | None = None) -> torch.Tensor:
    """Causal paged attention for every packed query of a step; writes and returns `out`.

    max_seq_len: the longest seq_len, if the caller knows it; only read by the split-KV heuristic
      (decode-only steps on CUDA), which otherwise syncs once to compute it.
    num_splits / tile_n / block_q: override the launch heuristics (tests, benchmarks).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    _check_shapes(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, num_seqs)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = choose_config(num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=q.dtype, device=q.device,
                        seq_lens=seq_lens, max_seq_len=max_seq_len,
                        num_splits=num_splits, tile_n=tile_n, block_q=block_q)

    if cfg.num_splits == 1:   # the kernel writes `out` directly; partial pointers are never read
        part_out = part_m = part_l = _no_partials(q.device)
        part_out_strides, part_ml_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        part_out = torch.empty(num_tokens, num_q_heads, cfg.num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_q_heads, cfg.num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_out_strides, part_ml_strides = part_out.stride(), part_m.stride()

    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, cfg.num_splits)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_m, part_l,
        cu_seqlens_q, seq_lens, block_table,
        num_seqs, cfg.num_splits, num_q_heads // num_kv_heads, cfg.group_pad, cfg.block_q, scale * LOG2_E,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        *part_out_strides, *part_ml_strides,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=cfg.block_m,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=cfg.tile_n,
        # fp32 caches get exact fp32 products (tensor-core TF32 would cost ~1e-3 accuracy).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        reduce_splits(part_out, part_m, part_l, out)
    return out


@functools.lru_cache(maxsize=None)
def _no_partials(device: torch.device) -> torch.Tensor:
    """Stand-in for the split buffers when nothing is split: the same pointer type (fp32) as a
    split launch, so both launches share one compiled kernel."""
    return torch.empty(1, dtype=torch.float32, device=device)


def _check_shapes(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, num_seqs) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unified_attention supports float16, bfloat16 and float32, got {q.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if num_q_heads % k_cache.shape[2]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} != q {tuple(q.shape)}")
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} / block_table {tuple(block_table.shape)} "
                         f"do not fit {num_seqs} sequences")
    require_contiguous(cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)

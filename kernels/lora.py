"""Multi-LoRA shrink / expand kernels in the SGMV style (Punica, S-LoRA): one launch serves every
adapter of a step.

The step's tokens that run with an adapter are listed grouped by adapter: `tokens` [m] holds token
rows, segment s is tokens[seg_starts[s] : seg_starts[s+1]] and uses adapter slot seg_slots[s].
Weights are stacked per slot, rank zero-padded:
  shrink  h[t, :] = x[t, :] @ A[slot]       x [n, K], A [slots, K, N], h [n, N]
  expand  y[t, :] += h[t, :] @ B[slot]      h [n, K], B [slots, K, N], y [n, N]
(one kernel, `_lora_kernel`; expand accumulates into y)
for every listed token t (inflight.lora folds each adapter's scale into its B); rows of h and y
not listed are neither read nor written. Any strides are accepted, so `y` may be a column slice
of a fused projection's output.

Grid: (tiles, column blocks). A tile is BLOCK_M consecutive listed tokens of one segment; tile ids
are numbered per segment from seg_starts[s] // BLOCK_M + s (the same scheme as unified_attention's
query tiles), so m // BLOCK_M + num_segments programs along axis 0 always suffice and spare ones exit
at once: no host sync, whatever the segment lengths. Each program loads its tokens' rows through
the index (the gather), multiplies by its segment's slot with `tl.dot` (fp32 accumulation), and
stores through the index (the scatter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch_config import require_contiguous
from .unified_attention import _find_seq

DTYPES = (torch.float16, torch.bfloat16, torch.float32)     # what the kernels take

SMALL_TILE_M = 16         # decode-heavy steps: tl.dot's smallest M
LARGE_TILE_M = 64         # steps whose segments hold prefill chunks
LARGE_SEGMENT = 64        # a segment this long makes the step use LARGE_TILE_M
MAX_TILE_N = 64
MAX_TILE_K = 64


@dataclass(frozen=True)
class LoraKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def _pow2(n: int, low: int, high: int) -> int:
    return min(max(triton.next_power_of_2(n), low), high)


def choose_config(kind: str, max_segment: int, n: int, k: int, dtype: torch.dtype) -> LoraKernelConfig:
    """Launch shape for `kind` 'shrink' or 'expand' of an [.., k] x [k, n] product.

    Shrink has a long K (the hidden size) and a short N (the rank x modules): K is walked in
    blocks, N mostly fits one block. Expand has K = the rank, in one block up to 64, and a long N
    spread over programs. fp32 takes exact ("ieee") dots, which need more registers: smaller K tiles.
    Like the attention kernels' shapes, these are sensible defaults checked by compiling for
    sm_80/sm_90, not tuned on a GPU.
    """
    block_m = LARGE_TILE_M if max_segment >= LARGE_SEGMENT else SMALL_TILE_M
    # 16-bit 64-row tiles spill registers on sm_80 with 4 warps; fp32 ones spill with 8 (ptxas -v)
    num_warps = 8 if block_m == LARGE_TILE_M and dtype != torch.float32 else 4
    if kind == "shrink":
        return LoraKernelConfig(block_m, _pow2(n, 16, MAX_TILE_N), 32 if dtype == torch.float32 else MAX_TILE_K,
                                num_warps)
    if kind == "expand":
        return LoraKernelConfig(block_m, 32 if dtype == torch.float32 else MAX_TILE_N, _pow2(k, 16, MAX_TILE_K),
                                num_warps)
    raise ValueError(f"kind must be 'shrink' or 'expand', got {kind!r}")


@triton.jit
def _segment_tile(seg_starts_ptr, seg_slots_ptr, num_segments, BLOCK_M: tl.constexpr):
    """This program's (first listed row, end of its segment, adapter slot)."""
    tile = tl.program_id(0)
    seg = _find_seq(seg_starts_ptr, tile, num_segments, BLOCK_M)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + (tile - (start // BLOCK_M + seg)) * BLOCK_M
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    return row0, end, slot


@triton.jit
def _lora_kernel(
    x_ptr, w_ptr, out_ptr, tokens_ptr, seg_starts_ptr, seg_slots_ptr,
    num_segments, K, N,
    stride_xt, stride_xk, stride_ws, stride_wk, stride_wn, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """out[t] (+)= x[t] @ w[slot of t] for one tile of one segment: shrink stores, expand adds."""
    row0, end, slot = _segment_tile(seg_starts_ptr, seg_slots_ptr, num_segments, BLOCK_M)
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(tokens_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + slot * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_segments(tokens: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    if tokens.dtype != torch.int32 or seg_starts.dtype != torch.int32 or seg_slots.dtype != torch.int32:
        raise ValueError("tokens, seg_starts and seg_slots must be int32")
    if seg_starts.shape != (seg_slots.shape[0] + 1,):
        raise ValueError(f"seg_starts {tuple(seg_starts.shape)} does not fit {seg_slots.shape[0]} segments")
    require_contiguous(tokens=tokens, seg_starts=seg_starts, seg_slots=seg_slots)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_segment: int) -> torch.Tensor:
    """h[t] = x[t] @ a[slot of t] for every listed token t; returns h.
    x [n, K], a [slots, K, N], h [n, N]; max_segment (the longest segment, known on the host)
    only picks the tile size."""
    return _launch("shrink", x, a, h, tokens, seg_starts, seg_slots, max_segment)


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_segment: int) -> torch.Tensor:
    """y[t] += h[t] @ b[slot] for every listed token t, in place; returns y.
    h [n, K], b [slots, K, N], y [n, N]."""
    return _launch("expand", h, b, y, tokens, seg_starts, seg_slots, max_segment)


def _launch(kind: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor,
            seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_segment: int) -> torch.Tensor:
    _check_segments(tokens, seg_starts, seg_slots)
    if w.dim() != 3 or x.shape[1] != w.shape[1] or out.shape != (x.shape[0], w.shape[2]):
        raise ValueError(f"{kind}: x {tuple(x.shape)}, weights {tuple(w.shape)} and output {tuple(out.shape)} "
                         "do not fit")
    m, num_segments = tokens.shape[0], seg_slots.shape[0]
    if m == 0:
        return out
    K, N = w.shape[1], w.shape[2]
    cfg = choose_config(kind, max_segment, N, K, out.dtype)
    grid = (m // cfg.block_m + num_segments, triton.cdiv(N, cfg.block_n))
    _lora_kernel[grid](
        x, w, out, tokens, seg_starts, seg_slots, num_segments, K, N,
        *x.stride(), *w.stride(), *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32", ACCUMULATE=kind == "expand",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out

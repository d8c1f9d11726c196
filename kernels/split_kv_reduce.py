"""Merges the per-split partial results of split-KV (flash-decoding) attention.

Each split s of a (token, head) row left: its normalised output o_s = acc_s / l_s, its running max
m_s (log2 domain, -inf when the split saw no visible key) and its softmax denominator l_s.
The exact result is sum_s w_s * o_s / sum_s w_s with w_s = l_s * 2^(m_s - max_s m_s).

The split count is a runtime argument (one program loads all splits of its row, padded to
MAX_SPLITS), so every split count the heuristic picks runs the same compiled kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import MAX_SPLITS


@triton.jit(do_not_specialize=["num_splits", "stride_pot", "stride_poh", "stride_pmt", "stride_pmh"])
def _reduce_splits_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, num_splits,
    stride_pot, stride_poh, stride_pos, stride_pod,
    stride_pmt, stride_pmh, stride_pms,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    split_ok = splits < num_splits

    ml_offs = token * stride_pmt + head * stride_pmh + splits * stride_pms
    m = tl.load(part_m_ptr + ml_offs, mask=split_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + ml_offs, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # no split saw a key: avoid -inf - -inf
    w = tl.exp2(m - m_max) * l                             # empty splits: 2^-inf * 0 = 0

    o_offs = (token * stride_pot + head * stride_poh
              + splits[:, None] * stride_pos + dims[None, :] * stride_pod)
    o = tl.load(part_out_ptr + o_offs, mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    result = tl.sum(o * w[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def reduce_splits(part_out: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor,
                  out: torch.Tensor) -> None:
    """part_out [T, H, S, D] fp32, part_m / part_l [T, H, S] fp32 -> out [T, H, D]; S <= MAX_SPLITS."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    assert num_splits <= MAX_SPLITS, f"{num_splits} splits > MAX_SPLITS ({MAX_SPLITS})"
    _reduce_splits_kernel[(num_tokens, num_heads)](
        part_out, part_m, part_l, out, num_splits,
        *part_out.stride(), *part_m.stride(), *out.stride(),
        SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        num_warps=8,     # a 64 x 256 fp32 tile needed all 255 registers of 4 warps (ptxas, sm_80/sm_90)
    )

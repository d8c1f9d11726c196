"""How `unified_attention` tiles a step and when it splits the KV range (flash-decoding).

Tiling (see unified_attention.py):
  * One program owns BLOCK_Q query tokens of one sequence x all GROUP query heads that share one KV
    head, so its tile has BLOCK_M = BLOCK_Q * GROUP_PAD rows and the QK^T / PV products are real
    matrix products for `tl.dot` even for a single decode token. BLOCK_M is at least 16 (the
    smallest `tl.dot` operand).
  * Keys are walked TILE_N at a time; each key position looks its cache block up in the block
    table, so TILE_N and the cache block size are independent.
  * Decode-only steps use BLOCK_M = 16 (one token's head group, padded), 4 warps and 3 pipeline
    stages (they are bandwidth-bound: keep many K/V loads in flight); steps with prefill chunks use
    BLOCK_M = 64 and 8 warps (4 warps spill registers on sm_80 at head_dim 128), and BLOCK_M = 32
    for heads wider than 128 (a 64 x 256 tile spilled on sm_80 and sm_90). fp32 and wide heads
    get smaller key tiles. These were checked for register spills and shared-memory use by
    compiling with ptxas for sm_80 and sm_90 (`python -m inflight.kernels.aot`), not by timing on
    a GPU.

Split-KV heuristic (decode-only steps): a decode step launches num_seqs * num_kv_heads programs.
When that is less than the number of SMs, most of the GPU would idle while those few programs walk
long contexts, so the key range is cut into `num_splits` pieces, each its own program, and a small
reduction kernel merges the partial softmax results. Splits are chosen to give about two programs
per SM, but never fewer than MIN_KEYS_PER_SPLIT keys per split, and at most MAX_SPLITS. Prefill-
bearing steps are never split automatically: their query tiles already give enough parallelism.
Such a split decode step walks its keys in LONG_SPLIT_TILE_N tiles when each split has that many
keys (LONG_SPLIT_KEYS) and the head size is a power of two.

Tuned on an H200 (perf/kernel_tune.py, 2026-12-04, GPU time of Llama-3-8B heads in bf16): one
sequence's 512 / 2,048 / 8,192 keys ran fastest in 8 / 32 / 32 splits of 64 / 64 / 128-key tiles
(7.0 / 8.4 / 13.1 us; the earlier 256-key floor chose 2 / 8 / 32 splits: 13.3 / 13.1 / 15.9 us);
16 sequences' 2,048 / 8,192 keys in 2-3 splits of 128-key tiles (45.2 / 135.2 us against 50.0 /
157.7 with 64-key tiles); 64 sequences (512 programs, no split) fastest as they were.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

MIN_TILE_M = 16           # tl.dot needs M, N, K >= 16
PREFILL_TILE_M = 64       # query rows per program when the step carries prefill chunks
WIDE_HEAD_TILE_M = 32     # the same for head_dim > 128
TILE_N = 64               # keys per inner-loop iteration
# fp32 caches use exact ("ieee") dots, which run on CUDA cores and need far more registers than
# tensor-core dots: smaller tiles and more warps keep them from spilling (checked with ptxas on
# sm_80 and sm_90: 32-key tiles spilled at head_dim 128 and 256, 16-key tiles do not).
FP32_TILE_N = 16
WIDE_HEAD_TILE_N = 32     # head_dim > 128: halve the key tile so K/V stages fit shared memory
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 64
LONG_SPLIT_KEYS = 128
LONG_SPLIT_TILE_N = 128


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int        # query tokens per program
    group_pad: int      # query heads per KV head, padded to a power of two
    tile_n: int         # keys per inner-loop iteration
    num_splits: int     # programs per (query tile, KV head) along the key range; 1 = no split
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_pad


def require_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels read their 1-D index tensors (slot mapping, sequence lengths, LoRA segments)
    with a stride of 1: a strided view would give wrong slots or lengths, silently."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads it with a stride of 1)")


def choose_config(*, num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device, seq_lens: torch.Tensor,
                  max_seq_len: int | None, num_splits: int | None = None, tile_n: int | None = None,
                  block_q: int | None = None) -> AttentionConfig:
    """Pick the launch shape; explicit num_splits / tile_n / block_q override the heuristics."""
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    decode_only = num_tokens == num_seqs        # every sequence has at least one query token
    fp32 = dtype == torch.float32
    if block_q is None:
        target_m = (MIN_TILE_M if decode_only or fp32 else
                    WIDE_HEAD_TILE_M if head_dim > 128 else PREFILL_TILE_M)
        block_q = max(1, target_m // group_pad)
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    block_q = max(block_q, triton.cdiv(MIN_TILE_M, group_pad))   # keep BLOCK_M >= 16
    if num_splits is None:
        num_splits = _auto_splits(decode_only, num_seqs * num_kv_heads, device, seq_lens, max_seq_len)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if tile_n is None:
        tile_n = FP32_TILE_N if fp32 else WIDE_HEAD_TILE_N if head_dim > 128 else TILE_N
        # not for padded heads (80, 96 -> 128): their 128-key tiles spill 8 B a thread on sm_90
        if tile_n == TILE_N and num_splits > 1 and head_dim & (head_dim - 1) == 0 \
                and _longest(seq_lens, max_seq_len) // num_splits >= LONG_SPLIT_KEYS:
            tile_n = LONG_SPLIT_TILE_N
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    num_warps = 8 if fp32 or not decode_only or block_q * group_pad >= 64 else 4
    # 128-key tiles: two stages keep K and V within sm_80's shared memory (3 x 64 KB would not)
    num_stages = 3 if decode_only and not fp32 and tile_n <= TILE_N else 2
    return AttentionConfig(block_q, group_pad, tile_n, num_splits, num_warps, num_stages)


def _auto_splits(decode_only: bool, programs: int, device: torch.device, seq_lens: torch.Tensor,
                 max_seq_len: int | None) -> int:
    if not decode_only or device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= num_sms:
        return 1                               # the GPU is already full without splitting
    splits = min(triton.cdiv(2 * num_sms, programs), _longest(seq_lens, max_seq_len) // MIN_KEYS_PER_SPLIT,
                 MAX_SPLITS)
    return max(splits, 1)


def _longest(seq_lens: torch.Tensor, max_seq_len: int | None) -> int:
    """The longest sequence: max_seq_len, or read from the device (a host sync: callers that know
    it should pass it)."""
    return int(seq_lens.max()) if max_seq_len is None else max_seq_len


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count

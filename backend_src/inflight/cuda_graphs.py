"""Decode steps replayed from CUDA graphs, as vLLM does unless `enforce_eager`.

Why: on an H200 a decode step of a Llama-3-8B-shaped model launched ~1,200 kernels (32 layers of
matmuls, norms, rotary, KV writes, attention) at 7-11 us of host time each; the step took 19.5 ms
of wall time for 7.1 ms of GPU work at 32 sequences (make gpu-check, 2026-12-04). A graph captured
once per batch size replays all of them in one call.

A step qualifies when every scheduled sequence feeds exactly one token (a pure decode step) and
they fit the largest captured size. Its tokens go into static input buffers, padded up to the next
captured size: padding rows are one-token sequences of length 1 whose KV write is skipped (slot
-1); their logits are computed and dropped. The attention's split count is fixed per size at
capture (from max_model_len); the kernel reads each sequence's length at run time, so any length
up to max_model_len replays correctly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from .attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_CAPTURED_BATCH = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (at most 512): a step pads to the next."""
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]
    return sorted(set(sizes))


class DecodeGraphs:
    """Static input buffers and one replayable forward per batch size.

    capture=False replays by running the same forward eagerly on the same buffers: the CPU tests
    check the buffer handling this way, while make gpu-check runs the captured graphs."""

    def __init__(self, runner, sizes: list[int], capture: bool = True):
        self.runner = runner
        self.sizes = sizes
        largest, device = sizes[-1], runner.device
        max_blocks = -(-runner.max_model_len // runner.block_size)
        self.host = _Buffers(largest, max_blocks, torch.device("cpu"), pin=capture)
        self.static = _Buffers(largest, max_blocks, device, pin=False)
        self.static.cu_seqlens_q.copy_(torch.arange(largest + 1, dtype=torch.int32))   # one token each
        self.static.seq_lens.fill_(1)
        self.static.slot_mapping.fill_(-1)
        # one output for every size: a graph's own output would stay allocated beside the others'
        # (1.05 GB for the 32 sizes up to 256 at a 128k vocabulary, measured on an H200)
        self.logits = torch.empty(largest, runner.spec.vocab_size, dtype=runner.dtype, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        if capture:
            self._capture_all()
        else:
            for size in sizes:
                self.replays[size] = self._eager(size)

    def _forward(self, size: int) -> torch.Tensor:
        runner, s = self.runner, self.static
        meta = AttentionMetadata(s.slot_mapping[:size], s.cu_seqlens_q[:size + 1], s.seq_lens[:size],
                                 s.block_table[:size], size, runner.max_model_len)
        return runner.model.compute_logits(runner.forward(s.input_ids[:size], s.positions[:size], meta))

    def _eager(self, size: int):
        def replay():
            self.logits[:size].copy_(self._forward(size))
        return replay

    @torch.no_grad()
    def _capture_all(self) -> None:
        with torch.cuda.device(self.runner.device):   # Triton launches and captures on the current device
            pool = torch.cuda.graph_pool_handle()
            # on the current stream: a side stream's freed blocks would stay cached for it alone
            for size in self.sizes:                   # compiles the kernels, sets up cuBLAS per shape
                self._forward(size)
            for size in reversed(self.sizes):         # largest first: the smaller reuse its pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[:size].copy_(self._forward(size))
                self.replays[size] = graph.replay
            torch.cuda.synchronize()
        log.info("inflight: decode steps of up to %d sequences replay CUDA graphs (%d sizes)",
                 self.sizes[-1], len(self.sizes))

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, or None (too many: run eagerly)."""
        i = int(np.searchsorted(self.sizes, num_seqs))
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, step) -> bool:
        """One token per sequence (no prompt chunk, no padding), and few enough sequences."""
        n = len(step.seq_lens)
        return len(step.input_ids) == step.num_real_tokens == n and self.size_for(n) is not None

    def run(self, step) -> torch.Tensor:
        """Logits of the sampling rows of a packed step that fits (inflight.runner.PackedStep)."""
        assert self.fits(step), "not a decode step that fits the captured sizes"
        n = len(step.seq_lens)
        size = self.size_for(n)
        h, s = self.host, self.static
        width = step.block_table.shape[1]
        h.input_ids[:n] = torch.from_numpy(step.input_ids)
        h.input_ids[n:size] = 0
        h.positions[:n] = torch.from_numpy(step.positions)
        h.positions[n:size] = 0
        h.slot_mapping[:n] = torch.from_numpy(step.slot_mapping)
        h.slot_mapping[n:size] = -1                   # padding rows write no KV
        h.seq_lens[:n] = torch.from_numpy(step.seq_lens)
        h.seq_lens[n:size] = 1
        h.block_table[:n, :width] = torch.from_numpy(step.block_table)
        h.block_table[n:size, :1] = 0                 # padding rows read block 0's first key
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(s, name)[:size].copy_(getattr(h, name)[:size], non_blocking=True)
        s.block_table[:size, :width].copy_(h.block_table[:size, :width], non_blocking=True)
        self.replays[size]()
        if len(step.logits_index) == n:          # every row samples (a decode step): rows in order
            return self.logits[:n]
        return self.logits[self.runner.to_device(step.logits_index)]


class _Buffers:
    """A decode step's inputs for up to `rows` sequences (pinned on the host side: the copies to
    the device stay asynchronous)."""
    __slots__ = ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q", "block_table")

    def __init__(self, rows: int, max_blocks: int, device: torch.device, pin: bool):
        def zeros(*shape, dtype):
            t = torch.zeros(*shape, dtype=dtype, device=device)
            return t.pin_memory() if pin else t
        self.input_ids = zeros(rows, dtype=torch.int64)
        self.positions = zeros(rows, dtype=torch.int64)
        self.slot_mapping = zeros(rows, dtype=torch.int64)
        self.seq_lens = zeros(rows, dtype=torch.int32)
        self.cu_seqlens_q = zeros(rows + 1, dtype=torch.int32)
        self.block_table = zeros(rows, max_blocks, dtype=torch.int32)

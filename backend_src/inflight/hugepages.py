"""The CPU KV cache on transparent huge pages.

A bf16 KV block of the bench model is 4 KiB, one page: a decode step reads each sequence's blocks
from scattered pages, so every block costs TLB misses (two where a block straddles pages), and
inside a VM each miss walks two page tables. On 2 MiB pages the TLB covers the cache. Linux gives
them to a region asked for with madvise(MADV_HUGEPAGE) when transparent_hugepage is "madvise"
(the usual default) or "always"; elsewhere the tensor is the same, on small pages.
"""
from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger("inflight")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, starting on a 2 MiB boundary and advised onto huge
    pages before its memory is first touched (the zeroing faults it in)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)    # untouched: no page is in memory yet
    offset = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)    # the view keeps `raw` alive
    _advise(tensor.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return tensor.zero_()


def _advise(address: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        # a kernel without transparent huge pages: the cache stays on small pages
        log.info("inflight: madvise(MADV_HUGEPAGE) for the KV cache failed (errno %d); small pages",
                 ctypes.get_errno())

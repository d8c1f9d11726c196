"""A CPU engine's step activations kept mapped between steps (glibc's malloc).

A bf16 prefill step of 2,048 tokens through the bench model makes tensors of 1-12 MB in every layer
(qkv, the attention output, gate_up, ...) and frees them by the end of the step. glibc's malloc
serves blocks over its mmap threshold with fresh mappings and hands the top of its heap back to the
kernel past its trim threshold; both thresholds move with what was last freed, and a step's mix of
sizes keeps some of its tensors on either side, so every step faulted a share of its activations'
pages in again, each zeroed by the kernel: 170,000-210,000 minor page faults and 0.4 s of system
time in an 11 s offline round of the bench model on the AMX Xeon. Fixed thresholds (blocks up to
32 MiB from the heap, the heap kept up to 1 GiB) leave 11,000-41,000 faults and 0.06-0.14 s. Both
settings are needed: a trim threshold alone pins the mmap threshold at its 128 KiB start, which
made 1.8 million faults. Blocks over 32 MiB (a larger model's activations) stay mappings.

mallopt is process-wide: the engine sets it once, on CPU, where it runs in a process of its own
(Triton's Python backend stub) or in the caller's; on a C library other than glibc nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("inflight")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20       # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_activations_mapped() -> bool:
    """Fix glibc malloc's mmap and trim thresholds (see the module doc); False where it is not glibc
    or mallopt refused."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.info("inflight: mallopt refused the heap thresholds; activations may be faulted in every step")
    return done

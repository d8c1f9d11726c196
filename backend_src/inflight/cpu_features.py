"""What `dtype="auto"` means on a CPU: bfloat16 where the CPU multiplies bf16 natively (AMX-BF16 or
AVX-512-BF16, read from /proc/cpuinfo's flags), float32 elsewhere. Without those instructions
oneDNN emulates bf16 matmuls by converting to float32, so bf16 would only lose precision."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("inflight")

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU listed; empty where there is no /proc/cpuinfo."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_auto_dtype(flags: set[str] | None = None) -> torch.dtype:
    flags = cpu_flags() if flags is None else flags
    found = [f for f in BF16_FLAGS if f in flags]
    dtype = torch.bfloat16 if found else torch.float32
    log.info("inflight: dtype auto on CPU -> %s (%s)", str(dtype).removeprefix("torch."),
             f"{' and '.join(found)} in the CPU flags" if found else "no amx_bf16 or avx512_bf16 in the CPU flags")
    return dtype

"""CPU linear layers whose weights are prepacked once, at load, in oneDNN's blocked layout.

F.linear on a CPU tensor hands the weight to the BLAS in its plain [out, in] layout on every call:
in bfloat16 oneDNN reorders it into its blocked layout each time, and in float32 the call goes to
MKL's sgemm. Prepacking (torch.ops.mkldnn._reorder_linear_weight, as torch.compile's CPU backend
does for frozen linear weights) moves that work to load time. Measured on this project's 2-core
Zen 4 machine: bfloat16 10-75% faster, the most at decode-sized batches (a [64, 512] x [512, 8192]
LM head 2.19 -> 1.44 ms), and bit-identical (with a bias, the bias is added before the one
rounding instead of after a first one); float32 takes oneDNN's kernels instead of MKL's, 1.4-9x
faster, its sums in another order (relative differences ~1e-6). Where the ops are missing, or a
probe's packed result differs from the plain one beyond that, the layers stay as they are.

On a CPU with AMX-BF16, a bf16 layer called with at most 32 rows (a decode step of up to 32
sequences) runs on the tiles through cpu_kernels' linear_small_rows, over the same packed weight:
oneDNN spends ~15 µs more a call at these sizes (on the bench model's linears it took 1.3-2.5x the
tiles' time). Each layer takes the tiles only if probes give oneDNN's results bit for bit.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

log = logging.getLogger("inflight")

DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """nn.Linear's forward over the prepacked weight (the plain weight is not kept); small_rows,
    where set, the compiled kernels that take calls of up to their max_linear_rows on the AMX tiles."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self.small_rows: cpu_kernels.CpuKernels | None = None
        self.packed_ptr = 0         # the packed weight's data, for small_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # anything but the layer's own bf16 rows goes to oneDNN, which raises for what it cannot take
        # (the tiles would read past the weight for a wider x)
        if (self.small_rows is not None and x.dim() == 2 and x.shape[0] <= self.small_rows.max_linear_rows
                and x.shape[1] == self.in_features and x.dtype == torch.bfloat16 and x.is_cpu and x.stride(1) == 1):
            y = self.small_rows.linear_small_rows(x, self.packed_ptr, self.bias, self.out_features)
            if y is not None:
                return y
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def take_small_rows(self) -> bool:
        """Use the tiles for calls of up to the kernels' max_linear_rows if, on probes of one and two
        row tiles, they give oneDNN's results bit for bit (they sum in the same order; the probes also
        guard against a packed layout other than the one the kernel reads). The kernel itself refuses
        where the CPU has no AMX-BF16 or the shapes are not whole 32s."""
        kernels = cpu_kernels.for_tensor(self.packed) if self.packed.dtype == torch.bfloat16 else None
        if kernels is None or not hasattr(torch.ops.mkldnn, "data_ptr"):
            return False
        packed_ptr = torch.ops.mkldnn.data_ptr(self.packed)
        g = torch.Generator().manual_seed(self.out_features)
        for rows in (1, 17, kernels.max_linear_rows):
            x = torch.randn(rows, self.in_features, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                tiles = kernels.linear_small_rows(x, packed_ptr, self.bias, self.out_features)
                if tiles is None:
                    return False
                onednn = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if not torch.equal(tiles, onednn):
                return False
        self.small_rows, self.packed_ptr = kernels, packed_ptr
        return True


def shape_bucket(rows: int) -> int:
    """rows rounded up to one of 8 sizes per power of two (at most 12.5% more; every size up to 16).

    oneDNN builds (JIT-compiles) a matmul for each new number of rows it is given, and keeps the
    last 1,024 it built, ~0.7 MB each: a step whose token count it has not seen pays that on every
    linear shape of the model (a [500, 512] x [512, 3072] bf16 linear: 4-5 ms the first time, 1 ms
    after, on 2 cores of a Xeon with AMX). Serving meets every count from 1 to
    max_num_batched_tokens: with exact shapes a float32 engine's cache filled (~700 MB of built
    matmuls, memray) and kept rebuilding what it had evicted. So the runner pads a CPU step's
    tokens and the LM head's rows to these sizes, about 70 up to 2,048, and LoRA runs its long
    runs' matmuls on windows of them (the offline bench model's bf16 run 8.1 -> 7.4 s; its float32
    run on a Zen 5 4-7% faster, RSS 1,550 -> 1,232 MB)."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a CPU float32 / bfloat16 model with a PackedLinear, in place;
    returns how many were replaced (0 where the ops are not available or the probe fails)."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in DTYPES]
    if not linears or not _packing_works(linears[0][2]):
        return 0
    count, tiled = len(linears), []
    linears.reverse()
    while linears:
        # off the list first: each plain weight is freed as its packed copy replaces it, so the
        # load never holds the model twice (a 1B model peaked at 4.4 GB instead of 2.6)
        parent, name, child = linears.pop()
        packed = PackedLinear(child)
        setattr(parent, name, packed)
        if packed.take_small_rows():
            tiled.append(packed)
    if tiled:
        log.info("inflight: %d of %d bf16 linears take calls of up to %d rows on the AMX tiles", len(tiled),
                 count, tiled[0].small_rows.max_linear_rows)
    return count


def _packing_works(linear: nn.Linear) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        log.info("inflight: this torch has no oneDNN linear packing; CPU matmuls use the plain weights")
        return False
    if linear.weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN's bf16 packing needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2 CPU has neither
        log.info("inflight: this CPU has no oneDNN bfloat16 path; CPU matmuls use the plain weights")
        return False
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    try:
        with torch.no_grad():
            packed, plain = PackedLinear(linear)(x).float(), F.linear(x, linear.weight, linear.bias).float()
    except RuntimeError as exc:
        log.warning("inflight: packing the linear weights failed (%s); CPU matmuls use the plain weights", exc)
        return False
    tolerance = 1e-4 if linear.weight.dtype == torch.float32 else 1e-2
    if not torch.allclose(packed, plain, rtol=tolerance, atol=tolerance * float(plain.abs().max())):
        log.warning("inflight: packed linear weights gave other results than the plain ones; not packing")
        return False
    return True

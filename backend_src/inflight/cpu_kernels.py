"""The compiled CPU kernels (cpu_kernels.cpp): built at first use with the system C++ compiler,
cached outside the source tree, loaded with ctypes.

The library is built for this CPU (-march=native) and keyed by a hash of the source, the compiler,
its flags and the CPU's feature flags, in $INFLIGHT_CACHE_DIR, else $XDG_CACHE_HOME/inflight, else
~/.cache/inflight (a temporary directory where none of those is writable). Building takes a few
seconds (2.5 s on this project's 2-core machine). Without a compiler, or when the build or the load fails, `load()` logs one line saying why
and returns None, and the engine keeps the torch path. INFLIGHT_CPU_KERNELS=0 turns them off.

The kernels take raw pointers and element strides; torch's OpenMP runtime (libgomp, which the
library links by the same soname) runs their parallel loops with torch.get_num_threads() threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

from .cpu_features import cpu_flags

log = logging.getLogger("inflight")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_loaded: dict[str, "CpuKernels | None"] = {}
_NOT_LOADED = object()


class CpuKernels:
    """The loaded library; the callers check shapes and dtypes (`supports`) first."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        max_dim, max_group, max_linear_rows = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        lib.inflight_kernel_limits(ctypes.byref(max_dim), ctypes.byref(max_group), ctypes.byref(max_linear_rows))
        self.max_dim, self.max_group, self.max_linear_rows = max_dim.value, max_group.value, max_linear_rows.value
        # the prefill kernel's tiles are sized for AVX-512's 32 registers: with AVX2 alone a 512-token
        # prefill took 2-3x gather + SDPA's time (make bench-cpu-attention), so prefill chunks take that
        self.tiled_prefill = "avx512f" in cpu_flags()
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        attention = [p, p, p, p, p, p, p, p, p, p, p, i64, i32, i32, i32, i32, i32, f32, i32]
        signatures = {"paged_decode_attention": attention, "paged_prefill_attention": attention,
                      "rms_norm": [p, i64, p, i64, p, p, i64, i64, i32, f32, i32],
                      "rotary": [p, i64, i64, p, p, i64, p, i64, i32, i32, i32],
                      "rotary_write_kv": [p, i64, p, p, i64, p, i64, i32, i32, i32, p, p, p, p, i64, i32, i32],
                      "silu_and_mul": [p, i64, p, i64, i64, i32, i32],
                      "lora_add": [p, i64, p, i64, p, i64, i64, p, i64, p, i32, i32, i32, i32, p, i32]}
        self.fns = {}
        for op, argtypes in signatures.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{op}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self.fns[op, dtype] = fn
        self.argmax_f32 = lib.argmax_rows_f32
        self.argmax_f32.argtypes, self.argmax_f32.restype = [p, i64, p, i64, i64, i32], None
        lib.inflight_amx_tiles.argtypes, lib.inflight_amx_tiles.restype = [i32], i32
        self.amx_tiles = bool(lib.inflight_amx_tiles(-1))
        lib.linear_small_rows_bf16.argtypes = [p, i64, p, p, p, i64, i32, i32, i32, i32]
        lib.linear_small_rows_bf16.restype = i32

    def use_amx(self, on: bool) -> bool:
        """Whether bf16 attention takes the AMX tiles from now on (on a CPU with AMX-BF16, for head
        dims of whole 32s and block sizes of whole 16s: decodes with groups of up to 16, and the
        prefill kernel); False elsewhere. For the benchmark, which times the vector code beside
        them."""
        self.amx_tiles = bool(self.lib.inflight_amx_tiles(int(on)))
        return self.amx_tiles

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (dtype in DTYPES and head_dim <= self.max_dim and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= self.max_group)

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               out: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                               block_table: torch.Tensor, scale: float) -> None:
        """out[t] for every sequence with one query token t and a key at least (the others are left as they are)."""
        self._attention("paged_decode_attention", q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, scale)

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                out: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                block_table: torch.Tensor, scale: float) -> None:
        """out for every sequence with several query tokens, token i of n at position
        seq_len - n + i (the one-token sequences are left as they are)."""
        self._attention("paged_prefill_attention", q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, scale)

    def _attention(self, op: str, q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, scale) -> None:
        dtype = q.dtype
        assert k_cache.dtype == v_cache.dtype == out.dtype == dtype and q.device.type == out.device.type == "cpu"
        assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == out.stride(-1) == 1
        assert cu_seqlens_q.dtype == seq_lens.dtype == block_table.dtype == torch.int32
        assert cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous() and block_table.stride(-1) == 1
        num_seqs = len(seq_lens)
        if num_seqs == 0:
            return
        _, block_size, num_kv_heads, dim = k_cache.shape
        # the shapes the kernels' fixed per-call arrays are sized for (a larger group or head dim
        # would write past them); the metadata's values are the scheduler's invariants
        assert self.supports(dtype, q.shape[1], num_kv_heads, dim) and v_cache.shape == k_cache.shape
        assert q.shape[2] == dim and out.shape == q.shape and len(cu_seqlens_q) == num_seqs + 1
        assert block_table.shape[0] >= num_seqs
        self.fns[op, dtype](
            q.data_ptr(), _strides(q, 2), k_cache.data_ptr(), _strides(k_cache, 3), v_cache.data_ptr(),
            _strides(v_cache, 3), out.data_ptr(), _strides(out, 2), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), num_seqs, q.shape[1], num_kv_heads, dim, block_size,
            scale, torch.get_num_threads())

    # ---- the layer's small ops: x a CPU tensor of one of DTYPES, the last dim contiguous ----------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x); with a residual, residual += x first (in place, rounded to the dtype) and
        the norm is of that sum."""
        if x.dim() != 2:
            rows = x.reshape(-1, x.shape[-1])
            skip = None if residual is None else residual.view(rows.shape)
            return self.rms_norm(rows, weight, eps, skip).view(x.shape)
        # the model's rows are 2-d: no reshape or view, which took a third of a decode step's call
        # (40 rows: 19 -> 14 µs)
        assert x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[1:]
        assert residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(1) == 1)
        out = x.new_empty(x.shape)
        self.fns["rms_norm", x.dtype](x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                      0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
                                      out.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, dim] (any row/head strides), cos/sin [tokens, 1 or absent, dim]."""
        tokens, heads, dim = x.shape
        assert dim % 2 == 0 and dim > 0, "rotary embeddings turn pairs of values: an even head dim"
        # each row's table read at its row stride, not reshaped (in every layer: reshapes cost more here)
        assert cos.shape == sin.shape and cos.numel() == tokens * dim and cos.shape[0] == tokens
        assert x.stride(-1) == 1 and cos.dtype == sin.dtype == x.dtype and cos.stride() == sin.stride()
        assert cos.stride(-1) == 1
        out = x.new_empty((tokens, heads, dim))
        self.fns["rotary", x.dtype](x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                    cos.stride(0), out.data_ptr(), tokens, heads, dim, torch.get_num_threads())
        return out

    def rotary_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """An attention layer's step up to the attention, one call: qkv [tokens, (num_heads + 2 x
        num_kv_heads) x dim] (the fused projection's output, rows at any stride) -> the query heads
        rotated [tokens, num_heads, dim]; the key heads rotated and the value heads written into the
        caches at each token's slot (tokens past len(slot_mapping), or at slot -1, write none).
        cos/sin as for rotary."""
        tokens, dim = qkv.shape[0], k_cache.shape[-1]
        assert dim % 2 == 0 and dim > 0, "rotary embeddings turn pairs of values: an even head dim"
        assert qkv.stride(-1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * dim
        assert cos.shape == sin.shape and cos.numel() == tokens * dim and cos.shape[0] == tokens
        assert cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == qkv.dtype and cos.stride() == sin.stride()
        assert cos.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and len(slot_mapping) <= tokens
        assert k_cache.dim() == 4 and k_cache.shape[2] == num_kv_heads and v_cache.shape == k_cache.shape
        q = qkv.new_empty((tokens, num_heads, dim))
        self.fns["rotary_write_kv", qkv.dtype](
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), q.data_ptr(), tokens,
            num_heads, num_kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), _strides(k_cache, 3),
            slot_mapping.data_ptr(), len(slot_mapping), k_cache.shape[1], torch.get_num_threads())
        return q

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [tokens, 2 * inner] (gate first)."""
        assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
        out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
        self.fns["silu_and_mul", gate_up.dtype](gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                                                out.shape[0], out.shape[1], torch.get_num_threads())
        return out

    def lora_adder(self, a: torch.Tensor, b: torch.Tensor, rank: int, module_cols: np.ndarray, column: int):
        """lora_add with one projection group's weights bound: add(x, y, segments, count) does y[t,
        column:] += (x[t] a[s]) b[s] for the tokens t in [start, end) of each of `count` segments
        (s, start, end; int32 at address `segments`), in place. a [slots, in, modules x rank], b
        [slots, modules x rank, cols], module m's rank rows of b feeding only columns
        module_cols[m] (a (begin, end) pair; b is zero elsewhere); rank % 16 == 0; x A is kept in
        float32 and y rounded once. The weights' checks and arguments are done here once (a decode
        step calls it four times a layer, and those were ~7 us of each call's ~10): the slots stay
        where they are, loading copies into them."""
        assert a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype
        assert rank % 16 == 0 and a.shape[2] % rank == 0
        assert module_cols.dtype == np.int32 and module_cols.flags.c_contiguous
        assert len(module_cols) == a.shape[2] // rank
        fn = self.fns["lora_add", a.dtype]
        weights = (a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), b.stride(1))
        shape = (a.shape[1], len(module_cols), rank, module_cols.ctypes.data)
        offset = column * a.element_size()

        def add(x: torch.Tensor, y: torch.Tensor, segments: int, count: int) -> None:
            assert x.dtype == y.dtype == a.dtype and x.stride(-1) == 1 and y.stride(-1) == 1
            fn(x.data_ptr(), x.stride(0), *weights, y.data_ptr() + offset, y.stride(0), segments, count, *shape,
               torch.get_num_threads())

        add.module_cols = module_cols        # the kernel reads it through its address
        return add

    def linear_small_rows(self, x: torch.Tensor, weight_ptr: int, bias: torch.Tensor | None,
                          out_features: int) -> torch.Tensor | None:
        """x W^T (+ bias) for bf16 x [rows <= max_linear_rows, in_features] on the AMX tiles, W at
        weight_ptr in oneDNN's prepacked layout (torch.ops.mkldnn.data_ptr of what
        _reorder_linear_weight returned); None where the CPU or the shapes do not allow it."""
        assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        y = x.new_empty((x.shape[0], out_features))
        done = self.lib.linear_small_rows_bf16(x.data_ptr(), x.stride(0), weight_ptr,
                                               None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
                                               x.shape[0], out_features, x.shape[1], torch.get_num_threads())
        return y if done else None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a float32 [rows, cols] CPU tensor (the first maximum; NaN wins)."""
        assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[1] > 0
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.argmax_f32(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        return out


def for_tensor(x: torch.Tensor) -> CpuKernels | None:
    """The kernels where they apply to x (a CPU tensor of one of DTYPES, outside autograd), else None."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or (x.requires_grad and torch.is_grad_enabled()):
        return None
    kernels = _loaded.get("kernels", _NOT_LOADED)
    return load() if kernels is _NOT_LOADED else kernels


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [rows, vocab] logits; the compiled one for float32 on the CPU
    (64 x 8192 on two threads: torch's 0.30 ms, the compiled one 0.09 ms)."""
    kernels = for_tensor(logits) if logits.dtype == torch.float32 and logits.dim() == 2 else None
    if kernels is None or logits.stride(-1) != 1 or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return kernels.argmax(logits)


_stride_arrays: dict[tuple[int, ...], ctypes.Array] = {}


def _strides(t: torch.Tensor, n: int) -> ctypes.Array:
    """t's first n strides as a C array; a step's layers pass the same few stride tuples, so the
    arrays are made once (a few µs each on every call otherwise)."""
    key = t.stride()[:n]
    array = _stride_arrays.get(key)
    if array is None:
        if len(_stride_arrays) > 1024:      # shapes the engine never repeats: start over
            _stride_arrays.clear()
        array = _stride_arrays[key] = (ctypes.c_int64 * n)(*key)
    return array


def load() -> CpuKernels | None:
    """The kernels, built on first call (once per process); None where they cannot be had."""
    with _lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = _build_and_load()
        return _loaded["kernels"]


def _build_and_load() -> CpuKernels | None:
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        log.info("inflight: compiled CPU kernels off (INFLIGHT_CPU_KERNELS=0); attention uses the torch path")
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("inflight: no C++ compiler (g++) found, so the compiled CPU kernels are off and attention "
                    "uses the slower torch path; install g++ to enable them")
        return None
    try:
        path = _build(compiler)
        return CpuKernels(ctypes.CDLL(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("inflight: building the compiled CPU kernels failed, attention uses the torch path: %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def _build(compiler: str) -> str:
    with open(SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace",
                             timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(),
                                     " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    directory = cache_dir()
    path = os.path.join(directory, f"cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    # build beside the target and rename: processes building at once each publish a whole file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        # errors="replace": the compiler writes its quotes in the locale of the environment (UTF-8),
        # which need not be the Python stub's (C: ASCII)
        result = subprocess.run([compiler, *FLAGS, "-o", tmp, SOURCE], capture_output=True, text=True,
                                errors="replace", timeout=300)
        if result.returncode != 0:
            raise OSError(f"{os.path.basename(compiler)} exited with {result.returncode}: "
                          f"{result.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("inflight: built the compiled CPU kernels into %s", path)
    return path


def cache_dir() -> str:
    candidates = [os.environ.get("INFLIGHT_CACHE_DIR"),
                  os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inflight"),
                  os.path.join(tempfile.gettempdir(), f"inflight-{os.getuid()}")]
    for directory in filter(None, candidates):
        try:
            os.makedirs(directory, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
        except OSError:
            continue
    raise OSError("no writable cache directory for the compiled CPU kernels (set INFLIGHT_CACHE_DIR)")

"""Ahead-of-time compilation of every kernel launch for named GPU architectures, without a GPU.

    python -m inflight.kernels.aot [--arch sm_80,sm_90] [--head-dims 64,80,96,128,256]
        [--groups 1,2,4,8] [--block-sizes 16,32] [--dtypes fp16,bf16] [--kv-heads 8] [--jobs N]

For every model shape (head dim x query heads per KV head x cache block size x dtype, with
--kv-heads KV heads) it runs the real launchers (LAUNCHES: `unified_attention` on a decode step,
unsplit and split, and on a mixed prefill+decode step; `write_kv`; the multi-LoRA shrink/expand on
decode and prefill segments) on small CPU tensors with the
kernel launch intercepted. So each launch configuration is the one `choose_config` picks and the
arguments are the launch code's own; Triton's own argument specialisation (pointer alignment,
integers equal to 1 or divisible by 16) then gives the signature a GPU launch of that step would
compile. Every distinct compilation is compiled once per architecture by `triton.compile(...,
target=GPUTarget("cuda", cc, 32))` through ptxas, in a process pool, with an empty Triton cache
(every run compiles for real).

One row per compilation: the shapes and launches that share it, its compile-time configuration,
shared memory, registers and spills as ptxas reports them, and ok / the compiler's error. Exit
status 1 when a launch is refused, a compilation fails, or shared memory exceeds the
architecture's limit per block.

A new kernel joins by adding an entry to LAUNCHES: a function of a Shape that calls its launcher.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from multiprocessing import get_context

import torch
import triton
from triton.runtime.jit import JITFunction, create_function_from_signature

from .launch_config import MAX_SPLITS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True, slots=True)
class Shape:
    head_dim: int
    group: int          # query heads per KV head
    block_size: int     # cache block size
    dtype: str          # a DTYPES key
    kv_heads: int

    def __str__(self) -> str:
        return f"d{self.head_dim} g{self.group} bs{self.block_size} {self.dtype} kv{self.kv_heads}"


# ---- the launches -----------------------------------------------------------------------------
DECODE_STEP = [(1, 300), (1, 77), (1, 1)]            # (query tokens, seq_len) per sequence
MIXED_STEP = [(1, 300), (40, 100), (5, 18), (1, 1)]


def _attention(shape: Shape, cases, num_splits: int | None = None) -> None:
    from .unified_attention import unified_attention
    dtype = DTYPES[shape.dtype]
    blocks_per_seq = [-(-seq_len // shape.block_size) for _, seq_len in cases]
    num_blocks = sum(blocks_per_seq)
    block_table = torch.zeros(len(cases), max(blocks_per_seq), dtype=torch.int32)
    cache = torch.empty(num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    q = torch.empty(sum(n for n, _ in cases), shape.group * shape.kv_heads, shape.head_dim, dtype=dtype)
    cu = torch.tensor([0] + [n for n, _ in cases]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in cases], dtype=torch.int32)
    unified_attention(q, cache, torch.empty_like(cache), torch.empty_like(q), cu, seq_lens, block_table,
                      shape.head_dim ** -0.5, max_seq_len=max(s for _, s in cases), num_splits=num_splits)


def _write_kv(shape: Shape) -> None:
    from .write_kv import write_kv
    dtype = DTYPES[shape.dtype]
    # as the model calls it: K rotated (contiguous), V a view of the fused qkv projection
    qkv = torch.empty(5, (shape.group + 2) * shape.kv_heads, shape.head_dim, dtype=dtype)
    key = qkv[:, :shape.kv_heads].contiguous()
    value = qkv[:, -shape.kv_heads:]
    cache = torch.empty(4, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    write_kv(key, value, cache, torch.empty_like(cache), torch.zeros(5, dtype=torch.int64))


def _lora(shape: Shape, segment: int) -> None:
    """Both multi-LoRA kernels as the model calls them on the qkv projection: x [tokens, hidden],
    A stacked over 4 slots, the expand writing into the fused output's q/k/v columns; for each tile
    width the launcher picks from the stacked rank (x modules). One-token segments (decode) take
    the small tile, prefill-length ones the large tile."""
    from .lora import lora_expand, lora_shrink
    dtype = DTYPES[shape.dtype]
    hidden = shape.group * shape.kv_heads * shape.head_dim
    tokens = torch.arange(2 * segment, dtype=torch.int32)
    seg_starts = torch.tensor([0, segment, 2 * segment], dtype=torch.int32)
    seg_slots = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.empty(2 * segment, hidden, dtype=dtype)
    y = torch.empty(2 * segment, hidden + 2 * shape.kv_heads * shape.head_dim, dtype=dtype)
    for width in (16, 32, 64, 192):
        h = torch.empty(2 * segment, width, dtype=dtype)
        lora_shrink(x, torch.empty(4, hidden, width, dtype=dtype), h, tokens, seg_starts, seg_slots, segment)
        lora_expand(h, torch.empty(4, width, y.shape[1], dtype=dtype), y, tokens, seg_starts, seg_slots, segment)


# The heuristic picks split counts in [2, MAX_SPLITS] on a GPU; these two prove they share a kernel.
LAUNCHES: dict[str, Callable[[Shape], None]] = {
    "attention decode": lambda s: _attention(s, DECODE_STEP),
    "attention decode split=2": lambda s: _attention(s, DECODE_STEP, num_splits=2),
    f"attention decode split={MAX_SPLITS}": lambda s: _attention(s, DECODE_STEP, num_splits=MAX_SPLITS),
    "attention mixed": lambda s: _attention(s, MIXED_STEP),
    "write_kv": _write_kv,
    "lora decode": lambda s: _lora(s, 1),
    "lora prefill": lambda s: _lora(s, 64),
}


@contextmanager
def _recording_launches():
    """Within the block `kernel[grid](*args, **kwargs)` records (kernel, args, kwargs), runs nothing."""
    launches = []

    def getitem(kernel, grid):
        return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

    JITFunction.__getitem__ = getitem
    try:
        yield launches
    finally:
        del JITFunction.__getitem__     # the launch it inherits again


# ---- compilations -----------------------------------------------------------------------------
@dataclass(slots=True)
class Compilation:
    kernel: str                       # module:function
    cc: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict                     # num_warps, num_stages, ...
    users: list[tuple[Shape, str]] = field(default_factory=list)   # (shape, launch) that need it
    result: dict | None = None

    @property
    def key(self) -> str:
        return repr((self.kernel, self.cc, self.signature, sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items())))


def collect(shapes: list[Shape], archs: list[int]) -> tuple[dict[str, Compilation], list[str]]:
    """Every distinct compilation the launches need, and the launches that were refused."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    compilations: dict[str, Compilation] = {}
    refused = []
    backends = {cc: make_backend(GPUTarget("cuda", cc, 32)) for cc in archs}
    for shape in shapes:
        for name, launch in LAUNCHES.items():
            try:
                with _recording_launches() as launches:
                    launch(shape)
            except Exception as exc:        # a shape the launcher rejects: report it, naming the shape
                refused.append(f"{shape} {name}: launch refused: {type(exc).__name__}: {exc}")
                continue
            for kernel, args, kwargs in launches:
                for cc, backend in backends.items():
                    comp = _specialise(kernel, backend, cc, args, kwargs)
                    comp = compilations.setdefault(comp.key, comp)
                    comp.users.append((shape, name))
    return compilations, refused


def _specialise(kernel: JITFunction, backend, cc: int, args, kwargs) -> Compilation:
    """What `kernel[grid](*args, **kwargs)` would compile on `cc`, by Triton's own binder."""
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    launch_options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    return Compilation(f"{kernel.fn.__module__}:{kernel.fn.__name__}", cc, signature, constexprs, attrs,
                       launch_options)


def _init_worker(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"


def compile_one(comp: Compilation) -> dict:
    """Compile in this (worker) process; ptxas's report parsed from its log."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    module, name = comp.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    target = GPUTarget("cuda", comp.cc, 32)
    options = make_backend(target).parse_options(comp.options)
    log = io.StringIO()
    started = time.perf_counter()
    try:
        with redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, comp.signature, comp.constexprs, comp.attrs),
                                      target=target, options=options.__dict__)
    except Exception as exc:
        return {"error": _error_line(exc), "seconds": time.perf_counter() - started}
    text = log.getvalue()
    return {"shared": compiled.metadata.shared, "seconds": time.perf_counter() - started,
            "registers": _ptxas_number(r"Used (\d+) registers", text),
            "stack": _ptxas_number(r"(\d+) bytes stack frame", text),
            "spill_stores": _ptxas_number(r"(\d+) bytes spill stores", text),
            "spill_loads": _ptxas_number(r"(\d+) bytes spill loads", text)}


def _ptxas_number(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else None


def _error_line(exc: BaseException) -> str:
    """The innermost cause (Triton wraps errors of called @jit functions), its error line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
    return f"{type(exc).__name__}: {detail}"[:300]


def compile_all(compilations: list[Compilation], jobs: int) -> None:
    """Fill in each compilation's result; the slowest kernels (attention) start first."""
    order = sorted(compilations, key=lambda c: "attention" not in c.kernel)
    with tempfile.TemporaryDirectory(prefix="inflight-aot-") as cache_dir:
        if jobs == 1:
            _init_worker(cache_dir)
            for comp in order:
                comp.result = compile_one(comp)
            return
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_init_worker,
                                 initargs=(cache_dir,)) as pool:
            futures = {pool.submit(compile_one, comp): comp for comp in order}
            for future in as_completed(futures):
                futures[future].result = future.result()


# ---- the report -------------------------------------------------------------------------------
def problems(comp: Compilation) -> str | None:
    """Why this compilation fails the check, or None."""
    result = comp.result
    if "error" in result:
        return result["error"]
    limit = SMEM_LIMITS[comp.cc]
    if result["shared"] > limit:
        return f"shared memory {result['shared']} B > sm_{comp.cc} limit {limit} B"
    return None


def describe_users(users: list[tuple[Shape, str]]) -> tuple[str, str]:
    shapes = list(dict.fromkeys(shape for shape, _ in users))
    launches = ", ".join(dict.fromkeys(name.removeprefix("attention ") for _, name in users))
    more = f" (+{len(shapes) - 1} shapes)" if len(shapes) > 1 else ""
    return f"{shapes[0]}{more}", launches


def describe_config(comp: Compilation) -> str:
    kernel = getattr(importlib.import_module(comp.kernel.split(":")[0]), comp.kernel.split(":")[1])
    declared = [p.name for p in kernel.params if p.is_constexpr]
    values = {kernel.arg_names[path[0]]: value for path, value in comp.constexprs.items()}
    parts = [f"{name}={values[name]}" for name in declared if name in values]
    parts += [f"{k}={v}" for k, v in sorted(comp.options.items())]
    return " ".join(parts)


def print_report(compilations: list[Compilation], refused: list[str], out=sys.stdout) -> int:
    """The table and a summary; returns the number of failures."""
    rows = sorted(compilations, key=lambda c: (c.kernel, c.cc, str(c.users[0][0])))
    header = f"{'arch':<6}{'kernel':<28}{'shape':<38}{'launches':<34}{'smem B':>8}{'regs':>6}{'spill':>7}  result / config"
    print(header, file=out)
    print("-" * len(header), file=out)
    failures = 0
    for comp in rows:
        shape, launches = describe_users(comp.users)
        result = comp.result
        problem = problems(comp)
        failures += problem is not None
        spills = None if "error" in result else (result["spill_stores"] or 0) + (result["spill_loads"] or 0)
        print(f"sm_{comp.cc:<3}{comp.kernel.split(':')[1]:<28}{shape:<38}{launches:<34}"
              f"{_num(result.get('shared')):>8}{_num(result.get('registers')):>6}{_num(spills):>7}  "
              f"{problem or 'ok'} | {describe_config(comp)}", file=out)
    for line in refused:
        print(f"FAILED {line}", file=out)
    failures += len(refused)
    print(file=out)
    print_summary(rows, out)
    print(f"{len(rows)} compilations, {failures} failed"
          + ("" if failures else ": every launch compiles within the shared-memory limits"), file=out)
    return failures


def print_summary(rows: list[Compilation], out) -> None:
    groups: dict[tuple[str, int], list[Compilation]] = {}
    for comp in rows:
        groups.setdefault((comp.kernel.split(":")[1], comp.cc), []).append(comp)
    for (kernel, cc), comps in sorted(groups.items()):
        ok = [c.result for c in comps if "error" not in c.result]
        spilling = sum(1 for r in ok if (r["spill_stores"] or 0) + (r["spill_loads"] or 0))
        seconds = sum(c.result["seconds"] for c in comps)
        smem = max((r["shared"] for r in ok), default=0)
        regs = max((r["registers"] or 0 for r in ok), default=0)
        print(f"sm_{cc} {kernel}: {len(ok)}/{len(comps)} ok, shared memory up to {smem} B "
              f"({100 * smem / SMEM_LIMITS[cc]:.0f}% of the limit), registers up to {regs}, "
              f"{spilling} spilling, {seconds:.0f} s compiling", file=out)


def _num(value) -> str:
    return "-" if value is None else str(value)


# ---- command line -----------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _archs(text: str) -> list[int]:
    archs = []
    for name in text.split(","):
        match = re.fullmatch(r"sm_(\d+)", name.strip())
        if not match or int(match.group(1)) not in SMEM_LIMITS:
            raise argparse.ArgumentTypeError(
                f"unknown architecture {name!r}; known: {', '.join(f'sm_{cc}' for cc in SMEM_LIMITS)}")
        archs.append(int(match.group(1)))
    return archs


def _dtypes(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {unknown}; known: {list(DTYPES)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inflight.kernels.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=_archs, default=[80, 90], help="comma-separated, e.g. sm_80,sm_90")
    p.add_argument("--head-dims", type=_ints, default=[64, 80, 96, 128, 256])
    p.add_argument("--groups", type=_ints, default=[1, 2, 4, 8], help="query heads per KV head")
    p.add_argument("--block-sizes", type=_ints, default=[16, 32], help="KV-cache block sizes")
    p.add_argument("--dtypes", type=_dtypes, default=["fp16", "bf16"], help="of fp16, bf16, fp32")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the model shape")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .unified_attention import _unified_attention_kernel
    if not isinstance(_unified_attention_kernel, JITFunction):
        raise SystemExit("the kernels were built for the Triton interpreter (TRITON_INTERPRET is set); unset it")
    started = time.perf_counter()
    shapes = [Shape(d, g, b, t, args.kv_heads) for d in args.head_dims for g in args.groups
              for b in args.block_sizes for t in args.dtypes]
    compilations, refused = collect(shapes, args.arch)
    compile_all(list(compilations.values()), max(1, args.jobs))
    failures = print_report(list(compilations.values()), refused)
    print(f"{len(shapes)} shapes x {len(LAUNCHES)} launches x {len(args.arch)} archs in "
          f"{time.perf_counter() - started:.0f} s ({args.jobs} processes)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

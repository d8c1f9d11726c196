"""Every kernel launch compiles for sm_80 and sm_90 without a GPU (`python -m inflight.kernels.aot`).

The compiler runs in a subprocess without TRITON_INTERPRET: this session sets it, and Triton decides
when a kernel module is imported whether its kernels are interpreted or compiled.
"""
import os
import re
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("_unified_attention_kernel", "_reduce_splits_kernel", "_write_kv_kernel", "_lora_kernel")


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "backend_src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_default_grid_compiles_for_sm80_and_sm90_without_spills():
    proc = run_python("-m", "inflight.kernels.aot")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "80 shapes x 7 launches x 2 archs" in out and ", 0 failed: every launch compiles" in out
    summaries = re.findall(r"^(sm_\d+) (\w+): (\d+)/(\d+) ok, .* (\d+) spilling", out, flags=re.M)
    assert {(arch, kernel) for arch, kernel, *_ in summaries} == {(a, k) for a in ("sm_80", "sm_90") for k in KERNELS}
    for arch, kernel, ok, total, spilling in summaries:
        assert ok == total and spilling == "0", f"{arch} {kernel}: {ok}/{total} ok, {spilling} spilling"
    for head_dim in (64, 80, 96, 128, 256):          # every shape is in some row
        assert re.search(rf"\bd{head_dim} g\d+ bs(16|32) (fp16|bf16)", out), head_dim


def test_an_odd_shape_compiles_and_its_rows_name_it():
    proc = run_python("-m", "inflight.kernels.aot", "--head-dims", "112", "--groups", "6", "--block-sizes", "32")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("sm_") and "|" in line]
    assert all("d112 g6 bs32" in row and " ok |" in row for row in rows)
    assert len([row for row in rows if "_lora_" not in row]) == 16 and any("_lora_" in row for row in rows)


def test_a_failing_compilation_is_reported_with_its_shape_and_the_compilers_error():
    script = textwrap.dedent("""
        import sys
        from inflight.kernels import aot
        from inflight.kernels.write_kv import _write_kv_kernel
        comps, _ = aot.collect([aot.Shape(64, 1, 16, "fp16", 8)], [90])
        comp = next(c for c in comps.values() if c.kernel.endswith("_write_kv_kernel"))
        comp.constexprs[(_write_kv_kernel.arg_names.index("HEAD_PAD"),)] = 48   # tl.arange needs a power of 2
        aot.compile_all([comp], jobs=1)
        sys.exit(aot.print_report([comp], []))
    """)
    proc = run_python("-c", script)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("sm_90"))
    assert "d64 g1 bs16 fp16 kv8" in row and "power of 2" in row
    assert "1 compilations, 1 failed" in proc.stdout

"""`make gpu-check DRY_RUN=1`: every stage of the GPU check at toy size on CPU, so the script the GPU
machine runs is exercised in every test run."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["kernels", "exactness", "bench-kernels", "engine", "served"]


def test_gpu_check_dry_run_passes_every_stage_and_writes_both_reports(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(["make", "-o", ".venv/.installed", "gpu-check", "DRY_RUN=1", f"PY={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {out}"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert report["dry_run"] and list(stages) == STAGES
    assert all(s["status"] == "passed" for s in stages.values()), [(s["name"], s["summary"]) for s in stages.values()]

    assert stages["kernels"]["details"]["counts"]["passed"] >= 3
    assert stages["exactness"]["details"]["models"]["random-llama-gqa4"]["identical"] == 3
    assert len(stages["bench-kernels"]["details"]["results"]) == 5
    engine = stages["engine"]["details"]
    assert list(engine["tokens_per_s"]) == ["1", "32", "128", "256"]
    assert all(r["output_tokens_per_s"] > 0 for r in engine["tokens_per_s"].values())
    assert engine["kv_blocks"] > 0 and engine["ttft_prompt_s"] > 0
    assert all(r["step_ms"] > 0 for r in engine["step_split"].values())
    assert stages["served"]["details"]["metrics"]["inflight_requests_total"] == 64

    markdown = (out / "report.md").read_text()
    assert all(s["title"] in markdown for s in stages.values())
    assert "| sequences | output tok/s |" in markdown and "| case | splits |" in markdown


def test_gpu_check_names_a_missing_or_old_package_before_any_stage(monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import gpu_check
    import transformers
    assert gpu_check.missing_packages() is None
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    assert "has transformers 4.57.1; the model code needs 5 or newer" in gpu_check.missing_packages()


def test_kernel_tune_dry_run_reports_the_heuristic_and_the_best_configuration(tmp_path):
    """perf/kernel_tune.py (make tune-kernels) at toy size through the Triton interpreter."""
    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, "perf/kernel_tune.py", "--dry-run", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["context"]) for r in results] == [(1, 32), (1, 80), (2, 32), (2, 80)]
    for r in results:
        assert r["configs"] == 2 and r["best"]["us"] <= r["heuristic"]["us"]
        assert r["heuristic"]["num_splits"] == 1 and {c["num_splits"] for c in r["all"]} == {1, 2}

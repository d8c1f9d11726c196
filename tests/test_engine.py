"""LLMEngine behaviour a user sees: sampling knobs, stop conditions, log-probs, aborts,
rejections with messages that name the field, and step outputs that add up to the final output."""
import os
import random

import re

import pytest
import torch

from inflight import EngineConfig, LLMEngine, QueueFullError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", num_kv_blocks=512,
                                                                   max_num_batched_tokens=256))


def prompts(n, seed=0, low=3, high=512, max_len=60):
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def greedy(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(temperature=0, **params))[0]


def test_a_min_tokens_past_the_context_bans_the_stop_tokens_up_to_its_end(engine):
    """min_tokens (and max_tokens) of 2**32, which JSON allows: the stop token, favoured by a
    logit bias, stays banned and the output ends at the context length, as in vLLM (before: the
    bound wrapped around in int32 and the stop token came first)."""
    huge = 2**32
    out = greedy(engine, [5, 6, 7], max_tokens=huge, min_tokens=huge, stop_token_ids=[9], logit_bias={9: 100.0})
    assert out.finish_reason == "length" and len(out.token_ids) == engine.max_model_len - 3 and 9 not in out.token_ids


def test_a_temperature_too_small_to_divide_by_is_greedy(engine):
    """vLLM's rule (under 1e-5 is greedy): dividing the logits by 1e-40 overflowed into NaN, and
    the request came out as token 0 over and over."""
    prompt = prompts(1, seed=4)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    for temperature in (1e-40, 1e-6):
        out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=temperature, seed=1))[0]
        assert out.token_ids == greedy


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    target = prompts(1, seed=1)[0]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([target], params)[0].token_ids
    others = prompts(31, seed=2)
    mixed = [SamplingParams(max_tokens=random.Random(i).randint(1, 30), temperature=[0, 0.7, 1.3][i % 3],
                            top_k=[-1, 5, 0][i % 3], seed=i if i % 2 else None, ignore_eos=True) for i in range(31)]
    outs = engine.generate(others[:13] + [target] + others[13:], mixed[:13] + [params] + mixed[13:])
    assert outs[13].token_ids == alone
    again = engine.generate([target], params)[0].token_ids
    assert again == alone
    unseeded = engine.generate([target] * 4, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in unseeded}) > 1, "unseeded sampling should vary"


def test_top_k_one_is_greedy(engine):
    p = prompts(1, seed=5)[0]
    assert engine.generate([p], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True))[0].token_ids \
        == greedy(engine, p, max_tokens=10, ignore_eos=True).token_ids


def test_stop_token_ids_and_min_tokens(engine):
    p = prompts(1, seed=6)[0]
    full = greedy(engine, p, max_tokens=30, ignore_eos=True).token_ids
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i])
    stopped = greedy(engine, p, max_tokens=30, stop_token_ids=[full[stop_at]], ignore_eos=True)
    assert stopped.token_ids == full[:stop_at + 1] and stopped.finish_reason == "stop"
    held = greedy(engine, p, max_tokens=30, stop_token_ids=[full[stop_at]], min_tokens=stop_at + 2, ignore_eos=True)
    assert len(held.token_ids) >= stop_at + 2
    assert full[stop_at] not in held.token_ids[:stop_at + 1]


def test_eos_stops_unless_ignored(engine):
    p = prompts(1, seed=9)[0]
    full = greedy(engine, p, max_tokens=30, ignore_eos=True).token_ids
    at = next(i for i in range(2, 30) if full[i] not in full[:i])
    # the same weights with that token declared EOS (as generation_config.json would)
    eos_engine = LLMEngine(engine.runner, engine.config, (full[at],), engine.model_key)
    stopped = greedy(eos_engine, p, max_tokens=30)
    assert stopped.token_ids == full[:at + 1] and stopped.finish_reason == "stop"
    assert greedy(eos_engine, p, max_tokens=30, ignore_eos=True).token_ids == full


def test_bad_words_are_never_generated(engine):
    p = prompts(1, seed=11)[0]
    full = greedy(engine, p, max_tokens=20, ignore_eos=True).token_ids
    at = next(i for i in range(2, 20) if full[i] not in full[:i])
    banned = full[at]
    out = greedy(engine, p, max_tokens=20, ignore_eos=True, bad_words_ids=[[banned]]).token_ids
    assert banned not in out and out[:at] == full[:at]
    pair = [full[6], full[7]]
    out = greedy(engine, p, max_tokens=20, ignore_eos=True, bad_words_ids=[pair]).token_ids
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))


def test_thousands_of_bad_words_of_mixed_lengths_are_each_enforced(engine):
    """Bad words are looked up by prefix, not compared one by one: among 5,000 others, the
    output's own 3-gram and 2-gram still bite where their prefix was generated, and no word occurs."""
    p = prompts(1, seed=11)[0]
    full = greedy(engine, p, max_tokens=20, ignore_eos=True).token_ids
    rng = random.Random(0)
    others = [[rng.randrange(engine.vocab_size) for _ in range(rng.randint(1, 4))] for _ in range(5000)]
    words = [w for w in others if w[-1] not in full] + [full[3:6], full[9:11]]
    out = greedy(engine, p, max_tokens=20, ignore_eos=True, bad_words_ids=words).token_ids
    assert out[:5] == full[:5] and out[5] != full[5]
    banned = {tuple(w) for w in words}
    assert not [out[i:j] for j in range(len(out) + 1) for i in range(max(j - 4, 0), j) if tuple(out[i:j]) in banned]


def test_logprobs_are_the_models_own(engine, tiny_checkpoint):
    """vLLM's meaning: per token the sampled token's log-prob and rank, then the top N by rank."""
    from transformers import AutoModelForCausalLM
    p = prompts(1, seed=12)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    for params in (SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=1.5, seed=3, logprobs=5, ignore_eos=True)):
        out = engine.generate([p], params)[0]
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1], -1)
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry, row in zip(out.token_ids, out.logprobs, full):
            assert next(iter(entry)) == token, "the sampled token comes first"
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-9)
            assert entry[token].rank == int((row >= row[token]).sum())
            top = torch.topk(row, params.logprobs)
            expected = {token: entry[token].rank} | dict(zip(top.indices.tolist(), range(1, params.logprobs + 1)))
            assert {t: e.rank for t, e in entry.items()} == expected
            assert [entry[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-9)
        if params.temperature == 0:
            assert all(entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))
    assert engine.generate([p], SamplingParams(max_tokens=2))[0].logprobs is None


def test_step_outputs_add_up_to_the_final_output_and_aborts_free_everything(engine):
    ps = prompts(6, seed=13)
    reqs = [engine.add_request(f"s{i}", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            for i, p in enumerate(ps)]
    streamed = {r.request_id: [] for r in reqs}
    reasons = {}
    first = True
    while engine.has_unfinished():
        out = engine.step()
        for request_id, token, _, _ in out:
            streamed[request_id].append(token)
        reasons.update(out.finished)
        if first:                    # every prompt fits the first step: each has its first token
            assert len(out) == len(reqs)
            engine.abort("s0")
            engine.abort("s5")
            first = False
    assert reasons["s0"] == reasons["s5"] == "abort"
    for r in reqs[1:5]:
        assert reasons[r.request_id] == "length"
        assert r.output_token_ids == streamed[r.request_id] and len(r.output_token_ids) == 20
    engine.check_invariants()
    assert engine.stats()["kv_blocks_used"] == 0
    assert not engine.abort("s1"), "aborting a finished request is a no-op"


@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_a_step_that_fails_admitting_leaves_every_request_abortable(tiny_checkpoint, monkeypatch, policy):
    """A fault while admitting (the step raises): every request can still be aborted and the
    pool comes back whole (the serving loop aborts them all after a failed step), whatever the
    batching policy."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=64, policy=policy,
                                                                     batch_wait_timeout_s=0))
    for i, p in enumerate(prompts(3, seed=5)):
        engine.add_request(f"f{i}", p, SamplingParams(max_tokens=4))
    table = engine.scheduler.table

    def fault(req):
        raise RuntimeError("fault while admitting")

    monkeypatch.setattr(table, "add", fault)
    with pytest.raises(RuntimeError, match="fault while admitting"):
        engine.step()
    monkeypatch.undo()
    assert all(engine.abort(request_id) for request_id in list(engine.requests))
    assert set(engine.step().finished.values()) == {"abort"}
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0
    engine.check_invariants()


def test_a_step_whose_forward_raises_can_be_stepped_again_with_the_same_outputs(tiny_checkpoint, monkeypatch):
    """A transient fault in the forward, after schedule() took blocks for a chunk and admitted a
    request: stepping on computes that step again, with the outputs of an engine that never
    failed, and the pool comes back whole (the blocks already taken are not counted twice)."""
    config = dict(dtype="float32", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=4,
                  max_model_len=64)
    low, high = prompts(2, seed=9)
    low, high = (low * 4)[:12], (high * 4)[:20]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=8)
    want = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=64)).generate(
        [low, high], params)
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(**config))
    requests = [engine.add_request("low", low, params, priority="low")]
    engine.step()                                    # 8 of its 12 prompt tokens
    requests.append(engine.add_request("high", high, params, priority="high"))
    forward = engine.runner.execute

    def fails(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "execute", forward)
        raise RuntimeError("a transient device error")
    monkeypatch.setattr(engine.runner, "execute", fails)
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == [w.token_ids for w in want]
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_invariants()


def test_repeated_stop_token_ids_count_once():
    """The batch table keeps a column per stop id of the longest list its requests sent: a list of
    one id repeated must not widen it."""
    assert SamplingParams(stop_token_ids=[7, 5, 7] + [5] * 100_000).stop_token_ids == (7, 5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=10**400), "temperature"), (dict(presence_penalty=-10**400), "presence_penalty"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(seed="x"), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(bad_words_ids=[[]]), "bad_words_ids"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"), (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams(**kwargs)


def test_requests_that_can_never_run_are_rejected_at_once(engine):
    limit = engine.max_model_len
    with pytest.raises(ValueError, match=re.escape(f"prompt ({limit} tokens) + at least one output token exceeds "
                                                   f"max_model_len ({limit})")):
        engine.add_request("too-long", [5] * limit, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="'prompt_token_ids' is empty"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [5, engine.vocab_size])
    # the sampler indexes the logits with these: an unchecked one failed the whole step
    with pytest.raises(ValueError, match="'stop_token_ids': token id .* is outside the vocabulary"):
        engine.add_request("stop-oov", [5], SamplingParams(min_tokens=2, stop_token_ids=[engine.vocab_size]))
    with pytest.raises(ValueError, match="'bad_words_ids': token id .* is outside the vocabulary"):
        engine.add_request("bad-oov", [5], SamplingParams(bad_words_ids=[[5, engine.vocab_size + 7]]))
    with pytest.raises(ValueError, match="'allowed_token_ids': token id .* is outside the vocabulary"):
        engine.add_request("allowed-oov", [5], SamplingParams(allowed_token_ids=[5, engine.vocab_size]))
    with pytest.raises(ValueError, match="'priority'"):
        engine.add_request("prio", [5], priority="urgent")
    with pytest.raises(ValueError, match="'cache_salt' is not valid UTF-8"):      # JSON's "\ud800" is a str
        engine.add_request("salt", [5], cache_salt="\ud800")
    with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):    # it would share the unsalted
        engine.add_request("salt", [5], cache_salt="")
    for salt in (5, b"salt"):
        with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
            engine.add_request("salt", [5], cache_salt=salt)
    for prompt in ([[5, 6]], [[5, 6], [7]], [5, [6]], ["5"], [True]):
        with pytest.raises(ValueError, match="'prompt_token_ids' must be a list of integers"):
            engine.add_request("nested", prompt)
    engine.add_request("dup", [5], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5])
    engine.abort("dup")
    engine.step()


def test_preempted_requests_do_not_fill_the_queue(tiny_checkpoint):
    """max_queue_size counts requests that have not started: a preempted one is already streaming."""
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=10, block_size=4, max_num_seqs=2, max_model_len=40,
                                                                  max_queue_size=1, cpu_threads=1))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng.add_request("a", list(range(3, 15)), params)
    eng.step()
    eng.add_request("b", list(range(20, 32)), params)
    while not eng.scheduler.num_preemptions:
        eng.step()
    assert eng.scheduler.num_waiting == 1 and eng.scheduler.num_queued == 0
    eng.add_request("c", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="1 requests are already waiting"):
        eng.add_request("d", [5, 6, 7], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()


def test_a_request_arriving_as_another_finishes_takes_its_seat_not_a_queue_place(tiny_checkpoint):
    """A finished request's seat goes to a waiting one at the next step: an arrival in between is
    not refused for a queue that the step empties. (A client keeping max_num_seqs +
    max_queue_size requests in flight, as the OpenAI server behind `make serve`, met a 429 at
    every finish.)"""
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=1, max_queue_size=1, num_kv_blocks=64,
                                                                  cpu_threads=1))
    eng.add_request("a", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    eng.add_request("b", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(QueueFullError):
        eng.add_request("refused", [5, 6])
    assert eng.step().finished == {"a": "length"}
    eng.add_request("c", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))   # b takes a's seat next step
    with pytest.raises(QueueFullError):
        eng.add_request("refused-too", [5, 6])
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["kv_blocks_used"] == 0


def test_bad_words_take_both_forms_in_one_tokenizer_call(tokenizer):
    """vLLM's two forms of a bad word (as text starts, and mid-text after a space where that is
    another token), whitespace alone as it is; all words tokenized in one batched call (one by one,
    100,000 words held Triton's execute thread 4.4 s)."""
    from inflight.serving.loop import EngineLoop

    class Unused:
        config = EngineConfig()

    calls = []

    class Counting:                 # the tokenizer, counting its calls
        def __call__(self, texts, **kwargs):
            calls.append(texts)
            return tokenizer(texts, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    def ids(text):
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    words = ("import", " class", "  ", "x y")
    got = EngineLoop(Unused(), Counting())._bad_words_ids(words)
    expected = [ids("import"), ids(" import"), ids("class"), ids(" class"), ids("  "), ids("x y")]
    if len(ids("x y")) == len(ids(" x y")):
        expected.insert(6, ids(" x y"))
    assert got == tuple(expected) and len(calls) == 1
    assert ids("import") != ids(" import"), "the word reads as another token mid-text"


def test_a_pool_smaller_than_one_max_model_len_sequence_or_the_memory_fails_the_load(tiny_checkpoint):
    """As vLLM's start-up check: else the engine advertised a context it refused at each request
    (every chat completion without max_tokens asks for all of it). A pool past the memory there is
    is refused naming the setting (it was the allocator's traceback)."""
    with pytest.raises(ValueError, match=r"the KV pool of 4 blocks x 16 tokens holds 64 tokens, less than one "
                       r"sequence of 'max_model_len' 512: set 'max_model_len' to at most 64, or raise 'num_kv_blocks'"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=4, block_size=16))
    with pytest.raises(ValueError, match=r"holds \d+ tokens, less than .* or raise 'kv_cache_gb'"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(kv_cache_gb=2**-14, max_num_seqs=1))
    with pytest.raises(ValueError, match=r"the KV pool of 1000000000 blocks needs [\d.]+ GiB, more than the [\d.]+ GiB "
                       r"available on cpu: lower 'num_kv_blocks'"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=10**9))
    small = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=4, block_size=16, max_model_len=64))
    fits = small.add_request("fits", [5] * 60, SamplingParams(max_tokens=10, ignore_eos=True))
    while small.has_unfinished():
        small.step()
    assert (len(fits.output_token_ids), fits.finish_reason) == (4, "length"), "capped at the context"


def test_of_two_engines_loading_at_once_whose_pools_fit_once_the_second_fails_its_load(tiny_checkpoint, monkeypatch):
    """Triton loads a model's instances at once: each checked its pool against memory the other was
    about to take, both passed, and the OOM killer ended one. The host's memory is a counter here
    (/proc/meminfo would need gigabytes), lowered as pools are written, slowly."""
    import threading
    import time

    from inflight.runner import ModelRunner
    alone = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64)).runner
    pool_bytes = alone.num_blocks * alone.kv_block_bytes
    taken = []
    monkeypatch.setattr(ModelRunner, "_available_memory", lambda self: int(1.5 * pool_bytes) - sum(taken))
    write = ModelRunner._cache_tensor

    def slow_write(self, shape):
        time.sleep(0.05)
        tensor = write(self, shape)
        taken.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(ModelRunner, "_cache_tensor", slow_write)
    results = []

    def load():
        try:
            results.append(LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64)).runner)
        except ValueError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    sizes = {r.num_blocks * r.kv_block_bytes for r in results if not isinstance(r, str)}
    assert sizes == {pool_bytes}, (sizes, results)
    errors = [r for r in results if isinstance(r, str)]
    assert len(errors) == 1 and "the KV pool of 64 blocks needs" in errors[0] and "lower 'num_kv_blocks'" in errors[0]


def test_a_temp_dir_without_file_locks_leaves_the_load_unordered_not_failed(tiny_checkpoint, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")         # NFS without lockd

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64)).runner.num_blocks == 64


def test_a_full_queue_gives_up_a_lower_priority_request_for_a_higher_one(tiny_checkpoint):
    """As SGLang's priority scheduling: at max_queue_size a request is refused, unless one of a
    lower priority class waits never started; then the newest of the lowest class ends with the
    error instead, and the new request takes its place."""
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=1, max_queue_size=2, num_kv_blocks=64,
                                                                  cpu_threads=1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.add_request("running", [5, 6], params)
    eng.step()
    eng.add_request("low-1", [5, 6], params, priority="low")
    eng.add_request("low-2", [5, 6], params, priority="low")
    with pytest.raises(ValueError, match="max_model_len"):        # refused for itself: no place given up
        eng.add_request("too-long", [5] * eng.max_model_len, params, priority="high")
    with pytest.raises(QueueFullError):     # an n = 3 request needs 3 places, 2 can be given up: none is
        eng.add_request("n.0", [5, 6], params, priority="high", group=[], room_for=3)
    assert eng.scheduler.num_waiting == 2
    eng.add_request("high", [5, 6], params, priority="high")        # low-2 gives up its place
    with pytest.raises(QueueFullError, match="2 requests are already waiting"):
        eng.add_request("low-3", [5, 6], params, priority="low")     # no class below low
    eng.add_request("normal", [5, 6], params, priority=0)           # low-1 gives up its place
    with pytest.raises(QueueFullError, match="2 requests are already waiting"):
        eng.add_request("normal-2", [5, 6], params)                  # high and normal: none below normal
    out = eng.step()
    assert {k: out.finished.get(k) for k in ("low-1", "low-2")} == {"low-1": "error", "low-2": "error"}
    assert out.errors["low-2"] == ("queue full: a request of a higher priority took this one's place in the queue "
                                   "(max_queue_size 2)")
    ends = []
    while eng.has_unfinished():
        ends += [k for k, reason in eng.step().finished.items() if reason == "length"]
    assert ends == ["high", "running", "normal"]         # high preempts the running one
    assert eng.stats()["kv_blocks_used"] == 0
    eng.check_invariants()


def test_outputs_that_free_seats_take_do_not_count_against_the_queue(tiny_checkpoint):
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=2, max_queue_size=1, num_kv_blocks=64,
                                                                  cpu_threads=1))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.add_request("low", [5, 6], params, priority="low")
    group = []
    for i in range(3):          # of 4 requests, 2 take the seats; the queue holds 1 once low gives up its place
        eng.add_request(f"n.{i}", [5, 6], params, group=group, room_for=3 - i)
    assert eng.step().errors == {"low": "queue full: a request of a higher priority took this one's place in the "
                                        "queue (max_queue_size 1)"}
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()


def test_a_waiting_output_of_a_started_request_keeps_its_place_in_a_full_queue(tiny_checkpoint):
    """An n > 1 request has begun once one of its outputs has: the others waiting for a seat are
    not given up for a request of a higher priority."""
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=1, max_queue_size=1, num_kv_blocks=64,
                                                                  cpu_threads=1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    group = []
    for i in range(2):
        eng.add_request(f"n.{i}", [5, 6], params, priority="low", group=group)
    eng.step()
    with pytest.raises(QueueFullError, match="1 requests are already waiting"):
        eng.add_request("high", [5, 6], params, priority="high")
    while eng.has_unfinished():
        assert not eng.step().errors
    eng.check_invariants()


def test_queue_limits_refuse_or_expire_requests(tiny_checkpoint):
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=1, max_queue_size=2,
                                                                  max_queue_wait_s=0.05, num_kv_blocks=64))
    eng.add_request("a", [5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.add_request("b", [5, 6])
    eng.add_request("c", [5, 6])
    with pytest.raises(QueueFullError, match="max_queue_size"):
        eng.add_request("d", [5, 6])
    import time
    time.sleep(0.1)
    out = eng.step()
    assert out.finished == {"b": "error", "c": "error"}
    assert "timed out in queue" in out.errors["b"]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["kv_blocks_used"] == 0


def test_the_queue_timeout_spares_the_waiting_outputs_of_a_started_n_request(tiny_checkpoint):
    eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(max_num_seqs=1, max_queue_wait_s=0.05,
                                                                  num_kv_blocks=64))
    started, waiting = [], []
    for i in range(2):
        eng.add_request(f"s.{i}", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True), group=started)
    eng.step()                       # s.0 takes the only seat; s.1 waits behind it
    for i in range(2):
        eng.add_request(f"w.{i}", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True), group=waiting)
    import time
    time.sleep(0.1)
    finished = {}
    while eng.has_unfinished():
        finished |= eng.step().finished
    assert finished == {"s.0": "length", "s.1": "length", "w.0": "error", "w.1": "error"}
    assert eng.stats()["kv_blocks_used"] == 0


def test_static_and_dynamic_generate_padding_and_report_it(tiny_checkpoint):
    for policy in ("static", "dynamic"):
        eng = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(policy=policy, num_kv_blocks=256, max_num_seqs=4))
        outs = eng.generate(prompts(6, seed=3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 5 for o in outs)
        assert eng.stats()["padding_tokens"] > 0
        assert all(r is None for r in eng.scheduler.table.requests)
        assert eng.stats()["kv_blocks_used"] == 0


def test_stats_report_the_pool_and_the_queues(engine):
    engine.add_request("st", prompts(1, seed=14)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert stats["running"] == 1 and stats["kv_blocks_used"] > 0
    assert 0 < stats["kv_slot_utilization"] <= 1
    assert stats["kv_blocks_total"] == stats["kv_blocks_used"] + stats["kv_blocks_free"]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["running"] == 0 and engine.requests == {}


def test_max_tokens_past_the_context_is_capped_as_vllm_caps_it(engine):
    """A prompt that leaves room runs to max_model_len and ends with "length" (vLLM's
    FINISHED_LENGTH_CAPPED), whatever max_tokens asked for."""
    limit = engine.max_model_len
    (out,) = engine.generate([[5] * (limit - 3)], SamplingParams(max_tokens=10**9, ignore_eos=True))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("values, message", [
    (dict(enable_prefix_caching="False"), "'enable_prefix_caching' must be a boolean, got 'False'"),
    (dict(enable_chunked_prefill="false"), "'enable_chunked_prefill' must be a boolean"),
    (dict(device="cuda:abc"), "'device' must be 'auto', 'cpu' or 'cuda[:N]'"),
    (dict(device="auto:1"), "'device' must be 'auto', 'cpu' or 'cuda[:N]'"),
    (dict(seed=2**70), "'seed' must be an integer in [-2**63, 2**64)"),
    (dict(cpu_threads=10**6), "'cpu_threads' must be at most the"),
])
def test_engine_settings_that_would_misbehave_later_name_the_field(values, message):
    """Each passed before and then did something else: a string "False" left caching on, a bad
    device or seed failed in torch without a field's name, a million threads never stepped."""
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**values)


def test_cpu_threads_is_bounded_by_the_cpus_the_process_may_run_on(tokenizer, monkeypatch):
    """In a cpuset container (or under taskset) the process may run on fewer CPUs than the host
    has: threads past those only contend, so the check and the grammar pool count the mask."""
    from inflight.serving.loop import EngineLoop
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    with pytest.raises(ValueError, match=re.escape("'cpu_threads' must be at most the 2 CPUs this process may run "
                                                   "on, got 3")):
        EngineConfig(cpu_threads=3)

    class Unused:                   # the loop reads only its engine's config before it starts
        config = EngineConfig()
    assert EngineLoop(Unused(), tokenizer)._compiles._max_workers == 1     # half of 2, not of 64
    monkeypatch.delattr(os, "sched_getaffinity")            # macOS: no affinity call, the host's count
    assert EngineConfig(cpu_threads=64).cpu_threads == 64


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_without_cuda_names_what_was_asked(device):
    from inflight.runner import resolve_device
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ValueError, match=re.escape(f"'device' is '{device}' but no CUDA device is available")):
        resolve_device(device)


def test_the_triton_backend_on_a_cpu_is_refused_at_load(tiny_checkpoint, monkeypatch):
    """Else the first step failed ("0 active drivers") and took the serving loop down with it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'attention_backend' 'triton' needs a CUDA device"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", device="cpu",
                                                                attention_backend="triton", num_kv_blocks=8))


def test_an_unsupported_rope_type_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    import inflight.runner
    from inflight.testing import make_random_checkpoint
    directory = make_random_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, vocab_size=64,
                                       rope_scaling={"rope_type": "dynamic", "factor": 2.0})

    def read(_):
        raise AssertionError("the weights were read first")
    monkeypatch.setattr(inflight.runner, "iter_checkpoint", read)
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        LLMEngine.from_pretrained(directory, EngineConfig(dtype="float32", num_kv_blocks=8))

"""Scheduler and KV-block behaviour, driven directly (no model): budgets, order, chunking,
priorities, preemption, aborts, the thrash guard, static/dynamic policies, and property tests
that the block pool is conserved through any sequence of operations."""
import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight.config import EngineConfig, SamplingParams
from inflight.kv_cache import KVCacheManager
from inflight.request import Request, Status
from inflight.scheduler import Scheduler

EOS = 2
_ids = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, policy="continuous", prefix=False,
                   max_model_len=256, **extra):
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          policy=policy, enable_prefix_caching=prefix, **extra)
    return Scheduler(config, max_model_len, KVCacheManager(num_blocks, block_size, prefix), (EOS,))


def make_request(prompt, max_tokens=4, priority=1, **params) -> Request:
    if isinstance(prompt, int):
        prompt = [10 + i % 50 for i in range(prompt)]
    n = next(_ids)
    return Request(f"r{n}", list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens, **params), priority,
                   arrival_seq=n, arrival_time=time.monotonic(), cache_key=b"test")


def add(s: Scheduler, *args, **kwargs) -> Request:
    req = make_request(*args, **kwargs)
    s.add(req)
    return req


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_batched_tokens or s.policy != "continuous"
    assert s.num_running + len(s.held_rows) <= s.config.max_num_seqs
    s.update(out, np.full(int(out.sample_mask.sum()), token, dtype=np.int64))
    s.check_invariants()
    return out


def scheduled(s: Scheduler, out) -> dict[str, int]:
    return {s.table.request_ids[r] if s.table.requests[r] else "?": int(n)
            for r, n in zip(out.rows.tolist(), out.num_scheduled.tolist())}


def run_until_idle(s: Scheduler, max_steps=5000):
    for _ in range(max_steps):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not drain: livelock or deadlock")


def assert_pool_whole(s: Scheduler):
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert all(c == 0 for c in s.kv.ref_counts)
    assert s.table.num_free_rows == s.config.max_num_seqs
    assert s.num_running == 0 and s.num_waiting == 0


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_scheduler(budget=10)
    a, b = add(s, 3, max_tokens=10), add(s, 3, max_tokens=10)
    step(s)                                       # both prefills
    c = add(s, 20)
    out = step(s)
    assert list(scheduled(s, out).items()) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 8)]


def test_without_chunked_prefill_the_budget_must_hold_the_longest_request():
    """Else a prompt (or a preempted request's recompute) over the budget would wait forever, and
    every request behind it: refused at start, naming the field (vLLM's rule)."""
    with pytest.raises(ValueError, match=r"'max_num_batched_tokens' \(32\) is below max_model_len \(256\)"):
        make_scheduler(budget=32, enable_chunked_prefill=False)
    s = make_scheduler(budget=256, enable_chunked_prefill=False)
    s.add(make_request(200))
    out = s.schedule()
    assert out.num_tokens == 200, "the whole prompt in one step"
    make_scheduler(budget=32, policy="static", enable_chunked_prefill=False)    # request-level batching has no budget


def test_several_prompts_are_chunked_in_one_step():
    s = make_scheduler(budget=100, num_blocks=128)
    reqs = [add(s, 40, max_tokens=5) for _ in range(3)]
    out = s.schedule()
    assert out.num_scheduled.tolist() == [40, 40, 20]
    assert out.sample_mask.tolist() == [True, True, False]
    s.update(out, np.full(2, 7))
    out = step(s)
    assert out.num_scheduled.tolist() == [1, 1, 20]
    assert s.table.num_computed[reqs[2].row] == 40


def test_any_prompt_is_chunked_by_the_remaining_budget():
    s = make_scheduler(budget=8, num_blocks=128)
    req = add(s, 30, max_tokens=2)
    counts = [step(s).num_tokens for _ in range(4)]
    assert counts == [8, 8, 8, 6]                # the last chunk samples the first token
    assert len(s.table.output_ids(req.row)) == 1


def test_budget_smaller_than_running_set_rotates_nothing_out():
    s = make_scheduler(budget=2, num_blocks=128)
    reqs = [add(s, 1, max_tokens=3) for _ in range(4)]
    outs = [step(s) for _ in range(3)]
    assert all(o.num_tokens <= 2 for o in outs)
    run_until_idle(s)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 3 for r in reqs)


def test_max_num_seqs_caps_the_running_batch():
    s = make_scheduler(max_seqs=3, budget=100, num_blocks=128)
    for _ in range(5):
        add(s, 4, max_tokens=3)
    step(s)
    assert s.num_running == 3 and s.num_waiting == 2


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(max_seqs=1)
    low, normal1, high, normal2 = add(s, 2, priority=2), add(s, 2, priority=1), add(s, 2, priority=0), add(s, 2, priority=1)
    order = []
    while s.has_work():
        out = step(s)
        for rid in scheduled(s, out):
            if rid not in order and rid != "?":
                order.append(rid)
    assert order == [high.request_id, normal1.request_id, normal2.request_id, low.request_id]


def test_victims_are_low_then_normal_then_high_newest_first():
    s = make_scheduler(num_blocks=12, block_size=4, budget=64)
    high = add(s, 3, max_tokens=40, priority=0)
    low_old = add(s, 3, max_tokens=40, priority=2)
    normal = add(s, 3, max_tokens=40, priority=1)
    low_new = add(s, 3, max_tokens=40, priority=2)
    victims = []
    preempt = s.preempt
    s.preempt = lambda req: (victims.append(req.request_id), preempt(req))[1]
    step(s)
    assert s.num_running == 4
    while len(victims) < 3:
        step(s)
    assert victims[:3] == [low_new.request_id, low_old.request_id, normal.request_id]
    assert high.num_preemptions == 0
    run_until_idle(s)
    assert_pool_whole(s)


def test_a_waiting_request_never_preempts_higher_or_equal_priority():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, max_seqs=4)
    highs = [add(s, 8, max_tokens=20, priority=0) for _ in range(2)]
    step(s)
    low = add(s, 8, max_tokens=4, priority=2)
    for _ in range(5):
        step(s)
    assert low.status == Status.WAITING
    assert all(h.num_preemptions == 0 for h in highs)


def test_a_high_priority_arrival_preempts_low_priority_running_requests():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, max_seqs=4)
    lows = [add(s, 8, max_tokens=20, priority=2) for _ in range(2)]
    step(s)
    high = add(s, 8, max_tokens=4, priority=0)
    step(s)
    assert high.status == Status.RUNNING
    assert lows[1].num_preemptions == 1 and lows[0].num_preemptions == 0   # the newest low went first
    run_until_idle(s)
    assert all(r.finish_reason == "length" for r in lows + [high])
    assert_pool_whole(s)


def test_a_preempted_request_resumes_before_newer_arrivals_of_its_class():
    s = make_scheduler(num_blocks=12, block_size=4, budget=64, max_seqs=4)
    reqs = [add(s, 3, max_tokens=30) for _ in range(3)]
    while not any(r.num_preemptions for r in reqs):
        step(s)
    victim = next(r for r in reqs if r.num_preemptions)
    newcomer = add(s, 3, max_tokens=30)
    while victim.status == Status.WAITING:
        step(s)
        if victim.status == Status.WAITING:
            assert newcomer.status == Status.WAITING, "a newer arrival overtook the preempted request"
    run_until_idle(s)
    assert_pool_whole(s)


@pytest.mark.parametrize("where", ["waiting", "running", "prefilling", "preempted"])
def test_abort_frees_everything(where):
    s = make_scheduler(num_blocks=12, block_size=4, budget=4 if where == "prefilling" else 64, max_seqs=4)
    reqs = [add(s, 10 if where == "prefilling" else 3, max_tokens=30) for _ in range(3)]
    if where == "running":
        step(s)
        target = reqs[0]
    elif where == "prefilling":
        step(s)
        target = reqs[0]
        assert 0 < s.table.num_computed[target.row] < 10
    elif where == "preempted":
        while not any(r.num_preemptions and r.status == Status.WAITING for r in reqs):
            step(s)
        target = next(r for r in reqs if r.num_preemptions and r.status == Status.WAITING)
    else:
        target = reqs[2]
    s.abort(target)
    s.check_invariants()
    assert target.status == Status.FINISHED and s.finished[target.request_id] == "abort"
    for r in reqs:
        if r.status != Status.FINISHED:
            s.abort(r)
    run_until_idle(s)
    assert_pool_whole(s)


def test_thrash_guard_bounds_preemption_of_a_long_prompt():
    """Decoders that keep growing and a long chunked prompt: without the admission headroom the
    prompt would be readmitted and preempted again step after step."""
    s = make_scheduler(num_blocks=24, block_size=4, budget=4, max_seqs=8)
    decoders = [add(s, 4, max_tokens=40) for _ in range(3)]
    for _ in range(3):
        step(s)
    long_prompt = add(s, 40, max_tokens=4)
    steps = 0
    while s.has_work():
        step(s)
        steps += 1
        assert steps < 2000
    assert long_prompt.finish_reason == "length"
    assert long_prompt.num_preemptions <= 1
    assert s.num_preemptions <= 3
    assert all(d.finish_reason == "length" for d in decoders)
    assert_pool_whole(s)


def test_admission_keeps_a_block_of_headroom_per_running_request():
    """The thrash guard itself: a prompt that would fit the free pool, but not with one block of
    headroom per running request, waits (no preemption); it gets in once that room exists."""
    from inflight.request import Status
    s = make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8)
    decoders = [add(s, 2, max_tokens=3) for _ in range(3)]     # their next two tokens stay in block 1
    step(s)
    free = s.kv.num_free_blocks
    prompt = add(s, 4 * (free - 2), max_tokens=1)               # free - 2 blocks: fits, but not + 3 of headroom
    step(s)
    assert prompt.status == Status.WAITING and s.num_preemptions == 0
    assert s.kv.num_free_blocks == free, "nothing was allocated for it"
    run_until_idle(s)
    assert prompt.finish_reason == "length" and all(d.finish_reason == "length" for d in decoders)
    assert s.num_preemptions == 0
    assert_pool_whole(s)


def test_static_batching_keeps_finished_seats_as_padding_and_admits_no_joins():
    s = make_scheduler(policy="static", max_seqs=4, static_batch_size=3, budget=8, num_blocks=128)
    short, mid, long_ = add(s, 5, max_tokens=2), add(s, 9, max_tokens=4), add(s, 3, max_tokens=6)
    out = step(s)
    assert out.num_scheduled.tolist() == [5, 9, 3]          # whole prompts, over the token budget
    assert out.num_padding_tokens == 3 * 9 - 17              # padded to the longest prompt
    late = add(s, 2, max_tokens=1)
    paddings = [step(s).num_padding_tokens for _ in range(5)]
    assert short.status == mid.status == long_.status == Status.FINISHED
    assert paddings == [0, 1, 1, 2, 2]                       # finished seats stay until the longest ends
    assert late.status == Status.WAITING                     # no joins while the group runs
    run_until_idle(s)
    assert late.finish_reason == "length"
    assert_pool_whole(s)


def test_static_batching_waits_for_a_full_batch_or_the_timeout():
    s = make_scheduler(policy="static", static_batch_size=3, batch_wait_timeout_s=3600)
    add(s, 4)
    assert len(s.schedule()) == 0
    add(s, 4), add(s, 4)
    assert len(step(s)) == 3


def test_dynamic_batching_groups_similar_lengths_and_admits_no_joins():
    s = make_scheduler(policy="dynamic", max_seqs=8, dynamic_length_window=16, num_blocks=256, max_model_len=512)
    a, b, far = add(s, 10, max_tokens=2), add(s, 20, max_tokens=5), add(s, 200, max_tokens=2)
    out = step(s)
    assert set(scheduled(s, out)) == {a.request_id, b.request_id}
    assert out.num_padding_tokens == 10
    joiner = add(s, 12, max_tokens=1)
    step(s)
    out = step(s)
    assert a.status == Status.FINISHED and out.num_padding_tokens == 0   # finished requests leave
    assert joiner.status == far.status == Status.WAITING
    run_until_idle(s)
    assert_pool_whole(s)


def test_dynamic_batching_seats_higher_priority_before_closer_lengths():
    """Within the length window priority comes first: a low-priority request of the head's length
    took the seat of a high-priority one 30 tokens longer, which then waited for the whole group."""
    s = make_scheduler(policy="dynamic", max_seqs=2, dynamic_length_window=32, num_blocks=256, max_model_len=512)
    high, longer_high, low = add(s, 10, priority=0), add(s, 40, priority=0), add(s, 10, priority=2)
    assert set(scheduled(s, step(s))) == {high.request_id, longer_high.request_id}
    assert low.status == Status.WAITING
    run_until_idle(s)
    assert_pool_whole(s)


# ---- property tests: the pool is conserved through any sequence of operations ----------------
PREFIXES = [[], [5] * 8, [5] * 8 + [6] * 4, [7, 8, 9]]

step_op = st.tuples(st.just("step"), st.sampled_from([7, 8, 9, 10, 11, 12, 13, EOS]))
operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 40), st.integers(0, 2)),
    step_op, step_op,
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=10, max_size=80), prefix=st.booleans(), budget=st.sampled_from([3, 8, 64]),
       policy=st.sampled_from(["continuous", "continuous", "dynamic", "static"]))
def test_blocks_are_conserved_through_any_operations(ops, prefix, budget, policy):
    # 24 blocks of 4 hold the largest request (12 + 30 + 40 tokens) but not four growing ones
    s = make_scheduler(num_blocks=24, block_size=4, budget=budget, max_seqs=4, prefix=prefix, policy=policy,
                       batch_wait_timeout_s=0)
    reqs = []
    for op in ops:
        if op[0] == "add":
            _, p, tail, max_tokens, priority = op
            prompt = PREFIXES[p] + [20 + (i * 7) % 11 for i in range(tail)]
            reqs.append(add(s, prompt, max_tokens=max_tokens, priority=priority))
        elif op[0] == "step":
            step(s, op[1])
        elif reqs:
            req = reqs[op[1] % len(reqs)]
            if req.status != Status.FINISHED:
                s.abort(req)
                s.check_invariants()
    run_until_idle(s)
    assert all(r.status == Status.FINISHED for r in reqs)
    for r in reqs:
        assert len(r.output_token_ids) <= r.params.max_tokens
        if r.finish_reason == "length":
            assert len(r.output_token_ids) == r.params.max_tokens
    assert_pool_whole(s)


def test_a_high_priority_arrival_preempts_only_when_that_lets_it_in():
    """A victim's blocks that hold the newcomer's cached prefix are not room the newcomer gains;
    without chunked prefill, a prompt the step's budget cannot take is no reason to preempt."""
    s = make_scheduler(num_blocks=12, budget=64, max_seqs=4, prefix=True)
    prefix = list(range(10, 30))                                    # 5 full blocks
    add(s, list(range(40, 53)), max_tokens=30, priority=0)
    low = add(s, prefix + [50, 51], max_tokens=10, priority=2)
    step(s)
    high = add(s, prefix + list(range(60, 74)), max_tokens=4, priority=0)   # 9 blocks, 5 cached in low's
    step(s)
    assert (low.status, low.num_preemptions, high.status) == (Status.RUNNING, 0, Status.WAITING)

    s = make_scheduler(num_blocks=16, budget=32, max_seqs=4, max_model_len=32, enable_chunked_prefill=False)
    add(s, 10, max_tokens=20, priority=0)
    add(s, 9, max_tokens=20, priority=0)
    low = add(s, 9, max_tokens=20, priority=2)
    step(s)
    high = add(s, 31, max_tokens=1, priority=0)
    for _ in range(6):
        step(s)
    assert low.num_preemptions == 0 and high.status == Status.WAITING


def test_a_high_priority_arrival_preempts_victims_that_share_their_blocks():
    """Two low-priority requests sharing a cached prefix hold its blocks twice: preempting both
    frees them, so a high-priority arrival that needs that room gets in at once, not after one of
    them has run to its end."""
    s = make_scheduler(num_blocks=20, block_size=4, budget=64, max_seqs=8, prefix=True)
    prefix = list(range(100, 132))                                   # 8 full blocks
    low = [add(s, prefix + [1, 3], max_tokens=12, priority=2)]
    step(s)
    low.append(add(s, prefix + [4, 5], max_tokens=12, priority=2))
    step(s)
    assert all(s.kv.ref_counts[b] == 2 for b in s.table.blocks(low[0].row)[:8])
    high = add(s, list(range(200, 252)), max_tokens=1, priority=0)  # 13 blocks: more than one low frees
    step(s)
    assert high.status != Status.WAITING and [r.num_preemptions for r in low] == [1, 1]
    run_until_idle(s)
    assert all(r.finish_reason == "length" for r in [*low, high]) and s.kv.num_used_blocks == 0


def test_prefix_cache_counters_count_new_requests_that_look_up():
    """As vLLM's: resumptions after preemption and requests that skip the lookup (prompt
    log-probabilities) are not queries."""
    s = make_scheduler(num_blocks=64, prefix=True)
    prompt = list(range(10, 27))
    add(s, prompt, max_tokens=1)
    run_until_idle(s)
    add(s, prompt, max_tokens=1)
    run_until_idle(s)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (34, 16)
    add(s, prompt, max_tokens=1, prompt_logprobs=0)
    run_until_idle(s)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (34, 16)
    victim = add(s, list(range(100, 109)), max_tokens=20, priority=2)
    step(s)
    s.preempt(victim)
    run_until_idle(s)
    assert victim.num_preemptions == 1 and (s.prefix_query_tokens, s.prefix_hit_tokens) == (43, 16)


def test_a_long_stop_token_ids_list_widens_the_stop_check_only_while_its_request_runs():
    s = make_scheduler()
    short = add(s, 6, max_tokens=8, stop_token_ids=[3, 4])
    step(s)
    wide = add(s, 6, max_tokens=2, stop_token_ids=list(range(1000, 1500)))
    step(s)
    assert s.table.stop_ids.shape[1] == 501
    run_until_idle(s)
    assert wide.finish_reason == short.finish_reason == "length"
    add(s, 6, max_tokens=2)
    step(s)
    assert s.table.stop_ids.shape[1] == 1, "back to EOS alone once the wide request left"

"""Load and client-fault storms (`make test-stress`; each under 10 minutes on 2 cores):
500 concurrent gRPC streams, and 200 streams of which half are cancelled at random points."""
import asyncio
import random
import time

import pytest

from inflight import SamplingParams
from inflight_client.streams import grpc_inputs, grpc_stream

from .helpers import wait_for_metric

pytestmark = [pytest.mark.server, pytest.mark.stress]


def prompts(tokenizer, n, seed):
    rng = random.Random(seed)
    words = "the assert statement class object import module raise exception with block value".split()
    return [tokenizer(" ".join(rng.choice(words) for _ in range(rng.randint(2, 40))))["input_ids"] for _ in range(n)]


async def streams(server, requests, clients=8):
    """Spread the streams over several channels, as many clients would."""
    import tritonclient.grpc.aio as aio
    conns = [aio.InferenceServerClient(server.grpc_url) for _ in range(clients)]
    try:
        return await asyncio.gather(*(grpc_stream(conns[i % clients], **r) for i, r in enumerate(requests)))
    finally:
        for c in conns:
            await c.close()


def request(prompt, max_tokens, cancel_after=None):
    return {"model": "llm", "cancel_after": cancel_after,
            "inputs": grpc_inputs(prompt, True, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                                  return_token_ids=True, return_num_output_tokens=True, return_finish_reason=True)}


def test_500_concurrent_streams_all_complete_correctly(server, tokenizer, reference_engine):
    ps = prompts(tokenizer, 500, seed=1)
    lengths = [random.Random(i).randint(2, 12) for i in range(500)]
    started = time.monotonic()
    outs = asyncio.run(streams(server, [request(p, n) for p, n in zip(ps, lengths)]))
    elapsed = time.monotonic() - started
    refs = reference_engine.generate(ps, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    for out, ref, n in zip(outs, refs, lengths):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == ref.token_ids and out.num_output_tokens == n, "none lost, none duplicated"
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0
    assert server.metric("inflight_requests_running") == 0 and server.metric("inflight_requests_waiting") == 0
    print(f"\n500 streams, {sum(lengths)} tokens in {elapsed:.1f} s")


def test_cancel_storm_frees_everything_and_spares_the_rest(server, tokenizer, reference_engine):
    ps = prompts(tokenizer, 200, seed=2)
    rng = random.Random(3)
    plan = [(p, rng.randint(8, 40), rng.randint(1, 6) if i % 2 else None) for i, p in enumerate(ps)]
    cancelled_before = server.metric("inflight_requests_total", finish_reason="cancelled")
    outs = asyncio.run(streams(server, [request(p, n, c) for p, n, c in plan]))
    kept = [(p, n, out) for (p, n, c), out in zip(plan, outs) if c is None]
    refs = reference_engine.generate([p for p, _, _ in kept],
                                     [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n, _ in kept])
    for (_, n, out), ref in zip(kept, refs):
        assert out.error is None and out.token_ids == ref.token_ids
    assert all(out.cancelled for (_, _, c), out in zip(plan, outs) if c is not None)
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0, timeout_s=30) == 0
    assert wait_for_metric(server, "inflight_requests_running", 0) == 0
    cancelled = server.metric("inflight_requests_total", finish_reason="cancelled") - cancelled_before
    assert cancelled >= 90, f"only {cancelled} of 100 cancellations reached the engine before the request ended"

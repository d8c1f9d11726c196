"""Load and client-fault storms (`make test-stress`; each under 10 minutes on 2 cores):
500 concurrent gRPC streams, 200 streams of which half are cancelled at random points, 200
OpenAI streams of which a third have clients that leave, many while queued, and 300 OpenAI
requests mixing every feature under preemption."""
import asyncio
import json
import os
import random
import re
import time

import httpx
import jsonschema
import pytest

from inflight import SamplingParams
from inflight.detokenizer import decode
from inflight_client.streams import grpc_inputs, grpc_stream

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import openai_server, wait_for_metric

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


def test_openai_clients_that_leave_free_everything_and_spare_the_rest(server, tokenizer, reference_engine, tmp_path):
    """200 streamed completions at once through the OpenAI server (64 run, the rest queue); the
    clients of every third give up after 0.05-1.5 s, many while their request still waits in the
    queue. Every other stream gets the engine's text, every request that reached `llm` ends once
    (run to its length or cancelled), those whose client left are cancelled (but for the few that
    ended in the moment their client left), and nothing stays allocated."""
    ps = prompts(tokenizer, 200, seed=4)
    rng = random.Random(5)
    plan = [(p, rng.randint(8, 40), rng.uniform(0.05, 1.5) if i % 3 == 0 else None) for i, p in enumerate(ps)]
    ended_before = {reason: server.metric("inflight_requests_total", finish_reason=reason)
                    for reason in ("cancelled", "length")}
    received_before = server.metric("nv_inference_request_success", model="llm")
    with openai_server(server.http_url, tmp_path) as api:
        async def one(http, prompt, max_tokens, leave_after):
            body = {"model": os.path.basename(DEFAULT_MODEL), "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}

            async def read() -> str:
                text = []
                async with http.stream("POST", f"{api.base_url}/completions", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(text)
            try:
                return await asyncio.wait_for(read(), leave_after)
            except TimeoutError:
                return None

        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http:
                return await asyncio.gather(*(one(http, *item) for item in plan))
        outs = asyncio.run(main())
        kept = [(p, n, out) for (p, n, leave), out in zip(plan, outs) if leave is None]
        refs = reference_engine.generate([p for p, _, _ in kept], [SamplingParams(max_tokens=n, temperature=0,
                                                                                  ignore_eos=True) for _, n, _ in kept])
        assert [out for _, _, out in kept] == [decode(tokenizer, ref.token_ids) for ref in refs]
        left = sum(out is None for out in outs)
        assert left >= 30, f"only {left} clients left before their stream ended: the plan no longer tests leaving"
        assert wait_for_metric(server, "inflight_kv_blocks_used", 0, timeout_s=30) == 0
        assert wait_for_metric(server, "inflight_requests_running", 0) == 0
        assert server.metric("inflight_requests_waiting") == 0
        ended = {reason: server.metric("inflight_requests_total", finish_reason=reason) - before
                 for reason, before in ended_before.items()}
        # a client that left within a few ms can leave before the server sends its request on
        received = server.metric("nv_inference_request_success", model="llm") - received_before
        assert ended["cancelled"] + ended["length"] == received >= len(plan) - left, (received, ended)
        left_in_engine = left - (len(plan) - received)
        assert ended["cancelled"] >= 0.9 * left_in_engine, \
            f"only {ended['cancelled']} of {left_in_engine} requests whose client left were cancelled"
    print(f"\n{left} of {len(plan)} OpenAI clients left before their stream ended, {len(plan) - received:.0f} before "
          f"their request reached Triton; requests ended: {ended}")


# a constraint of each kind, with the check its finished output must pass
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
PATTERN = "[a-c]{2,5}-[0-9]{1,3}"


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def check_choice(text: str) -> None:
    assert text in CHOICES, text


def check_regex(text: str) -> None:
    assert re.fullmatch(PATTERN, text), text


CONSTRAINTS = {"json": ({"guided_json": SCHEMA}, check_json), "choice": ({"guided_choice": CHOICES}, check_choice),
               "regex": ({"guided_regex": PATTERN}, check_regex)}


def mixed_request(rng: random.Random, model: str) -> dict:
    """A completion or chat request with a random mix of what clients combine."""
    chat = rng.random() < 0.5
    body = {"model": rng.choice([model, "pydoc-json"]), "max_tokens": rng.randint(1, 160),
            "temperature": rng.choice([0, 0.8]), "n": rng.choice([1, 1, 2, 3]), "seed": rng.randint(0, 9)}
    extra = {"priority": rng.choice([-5, 0, 7])}
    if rng.random() < 0.3:
        body["stop"] = rng.sample([" the", "\n", "def", "):"], 2)
    if rng.random() < 0.2:
        body["presence_penalty"], body["frequency_penalty"] = 0.5, 0.3
    constraint = rng.choice([None, None, None, "json", "choice", "regex"])
    if constraint:
        extra.update(CONSTRAINTS[constraint][0])
    elif rng.random() < 0.3:
        extra["min_tokens"] = rng.randint(0, body["max_tokens"])
    if chat:
        body["messages"] = [{"role": "user", "content": "explain print() " * rng.randint(1, 30)}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 4)
    else:
        body["prompt"] = rng.choice(["def f(", "The assert statement " * rng.randint(1, 50),
                                     [5, 6, 7, 8] * rng.randint(1, 80)])
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 4)
    return {"chat": chat, "stream": rng.random() < 0.6, "constraint": constraint, "body": body, "extra": extra,
            "leave_after": rng.uniform(0.05, 3.0) if rng.random() < 0.3 else None}


def test_a_storm_of_mixed_requests_under_preemption_leaves_every_output_whole_and_nothing_allocated(tmp_path):
    """300 requests at once through the OpenAI SDK against a KV pool of 100 blocks (so the engine
    preempts): completions and chat, the base model and a LoRA adapter, streamed or not, n up to 3,
    logprobs, JSON-schema, choice and regex constraints, stop strings, seeds, penalties, min_tokens,
    priorities; a third of the clients leave at a random moment. Every client that stays gets its n
    outputs with a finish reason, every output its grammar ended is valid, requests sent twice with
    the same seed get the same text, and afterwards nothing is allocated or queued."""
    import openai
    from inflight.serving.launch import ServerProcess, make_repository
    # float64 as the test server (TEST_ENGINE): a seeded request's text must not depend on its batch
    rng = random.Random(11)
    model = os.path.basename(DEFAULT_MODEL)
    plan = [mixed_request(rng, model) for _ in range(280)]
    plan += [{**plan[i], "leave_after": None} for i in range(20)]     # the first 20 again, their clients staying
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, {**TEST_ENGINE, "num_kv_blocks": 100})
    with ServerProcess(repo) as server, \
            openai_server(server.http_url, tmp_path, "--lora-modules", "pydoc-json") as api:
        async def one(client, item):
            api_ = client.chat.completions if item["chat"] else client.completions
            body = {**item["body"], "extra_body": item["extra"]}

            async def run() -> list[tuple[str, str]]:
                if not item["stream"]:
                    reply = await api_.create(**body)
                    return [((c.message.content if item["chat"] else c.text) or "", c.finish_reason)
                            for c in sorted(reply.choices, key=lambda c: c.index)]
                texts, reasons = {}, {}
                async for chunk in await api_.create(stream=True, **body):
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + ((c.delta.content if item["chat"] else c.text) or "")
                        reasons[c.index] = c.finish_reason or reasons.get(c.index)
                return [(texts.get(i, ""), reasons.get(i)) for i in range(body["n"])]
            if item["leave_after"] is None:
                return await run()
            try:
                return await asyncio.wait_for(run(), item["leave_after"])
            except TimeoutError:
                return None

        async def main():
            async with openai.AsyncOpenAI(base_url=api.base_url, api_key="-", max_retries=0, timeout=600) as client:
                return await asyncio.gather(*(one(client, item) for item in plan))
        preempted = server.metric("inflight_preemptions_total")
        outs = asyncio.run(main())
        for item, out in zip(plan, outs):
            if out is None:
                continue
            assert len(out) == item["body"]["n"] and all(reason in ("stop", "length") for _, reason in out), (item, out)
            if item["constraint"] and not item["body"].get("stop"):
                for text, reason in out:
                    if reason == "stop":
                        CONSTRAINTS[item["constraint"]][1](text)
        for i in range(20):
            if outs[i] is not None:
                assert outs[i] == outs[280 + i], (plan[i], outs[i], outs[280 + i])
        left = sum(out is None for out in outs)
        assert left >= 30, f"only {left} clients left before their reply: the plan no longer tests leaving"
        assert server.metric("inflight_preemptions_total") > preempted, "the pool no longer makes the engine preempt"
        assert wait_for_metric(server, "inflight_kv_blocks_used", 0, timeout_s=30) == 0
        assert wait_for_metric(server, "inflight_requests_running", 0) == 0
        assert server.metric("inflight_requests_waiting") == 0
        print(f"\n{left} of {len(plan)} clients left; {server.metric('inflight_preemptions_total') - preempted:.0f} "
              f"preemptions")

"""Prompt log-probabilities (vLLM's `prompt_logprobs`; what lm-evaluation-harness's loglikelihood
requests read through `echo` + `logprobs`): per prompt token after the first, its log-probability
and rank under the model given the tokens before it, and the top N, equal to a full softmax of
transformers' forward pass, whether the prompt runs whole, in chunks, preempted and recomputed, or
next to a cached prefix."""
import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams

from .conftest import DEFAULT_MODEL
from .test_exactness import text_workload

TOP = 3


@pytest.fixture(scope="module")
def prompts_and_expected(tokenizer):
    """Prompts of many lengths (one shares another's first 40 tokens) and transformers' log-softmax
    at each prompt position."""
    from transformers import AutoModelForCausalLM
    pool, _ = text_workload(tokenizer, seed=21)
    prompts = [p[:n] for p, n in zip(pool, (1, 2, 17, 40, 63, 90, 130, 200))]
    prompts.append(prompts[6][:40] + pool[8][:30])
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = [torch.log_softmax(model(torch.tensor([p])).logits[0], -1) for p in prompts]
    return prompts, expected


def check(prompt, got, rows):
    """got: vLLM's list (None, then per prompt token {token id: Logprob}, that token first)."""
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        token, entry, row = prompt[position], got[position], rows[position - 1]
        assert next(iter(entry)) == token, "the prompt token comes first"
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-9)
        assert entry[token].rank == int((row >= row[token]).sum())
        best = torch.topk(row, TOP)
        assert {t: e.rank for t, e in entry.items()} == \
            {token: entry[token].rank} | dict(zip(best.indices.tolist(), range(1, TOP + 1)))
        assert [entry[t].logprob for t in best.indices.tolist()] == pytest.approx(best.values.tolist(), abs=1e-9)


@pytest.mark.parametrize("budget, blocks", [(2048, None), (16, None), (64, 20)], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_equal_a_full_softmax(prompts_and_expected, budget, blocks):
    prompts, expected = prompts_and_expected
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_batched_tokens=budget,
                                                                   num_kv_blocks=blocks,
                                                                   max_model_len=blocks and blocks * 16))
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    asking = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    engine.generate(prompts[6:7], plain)       # its first 40 tokens are cached for the last prompt
    # every other request asks: the rest of the batch is untouched
    params = [asking if i % 2 == 0 or i == len(prompts) - 1 else plain for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    assert (engine.stats()["preemptions"] > 0) == (blocks is not None), "a small pool must preempt (and resume)"
    assert engine.stats()["kv_blocks_used"] == 0
    for prompt, out, rows, p in zip(prompts, outs, expected, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check(prompt, out.prompt_logprobs, rows)
    again = engine.generate(prompts, plain)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again], "asking changes no generated token"


def test_a_step_reports_each_prompt_position_once(prompts_and_expected):
    """StepOutput.prompt_logprobs: a chunked prompt's entries, step by step, add up to the whole
    list; the positions a preemption makes the engine recompute are not reported again."""
    prompts, expected = prompts_and_expected
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_batched_tokens=32))
    req = engine.add_request("p", prompts[7], SamplingParams(max_tokens=4, prompt_logprobs=TOP, ignore_eos=True))
    reported = engine.step().prompt_logprobs["p"]
    assert len(reported) == 32
    engine.scheduler.preempt(req)           # after one chunk: its prompt is recomputed from the start
    while engine.has_unfinished():
        reported += engine.step().prompt_logprobs.get("p", [])
    assert req.num_preemptions == 1
    check(prompts[7], [None] + reported, expected[7])


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="'prompt_logprobs' must be None or an integer in \\[0, 20\\]"):
        SamplingParams(prompt_logprobs=21)


def test_a_step_that_raised_adds_no_prompt_entries(prompts_and_expected, monkeypatch):
    """A sampler that raises after the forward scored a chunk: the caller steps again, the chunk is
    recomputed, and its positions are on the request once."""
    prompts, expected = prompts_and_expected
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_batched_tokens=32))
    req = engine.add_request("p", prompts[7], SamplingParams(max_tokens=4, prompt_logprobs=TOP, ignore_eos=True))
    sample = engine.sampler

    def fails_once(*args):
        monkeypatch.setattr(engine, "sampler", sample)
        raise RuntimeError("sampler fault")

    monkeypatch.setattr(engine, "sampler", fails_once)
    with pytest.raises(RuntimeError, match="sampler fault"):
        engine.step()
    assert req.prompt_logprobs == []
    reported = []
    while engine.has_unfinished():
        reported += engine.step().prompt_logprobs.get("p", [])
    check(prompts[7], [None] + reported, expected[7])
    check(prompts[7], [None] + req.prompt_logprobs, expected[7])

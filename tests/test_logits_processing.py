"""vLLM's logits processing: repetition, frequency and presence penalties and logit_bias give the
greedy token ids of transformers' `generate` with the same settings (its own repetition_penalty
and sequence_bias; OpenAI's frequency/presence definition as a logits processor), each request
with its own settings in one mixed batch, chunked and not; min_p keeps only tokens that likely;
sampled tokens follow the model's softmax at the temperature, truncated by top_k, top_p and min_p."""
import math
import re

import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.testing import hf_greedy

from .conftest import DEFAULT_MODEL
from .test_exactness import text_workload

PENALTIES = [{}, {"repetition_penalty": 1.8}, {"repetition_penalty": 0.7}, {"frequency_penalty": 1.5},
             {"presence_penalty": 2.0}, {"frequency_penalty": -0.5, "presence_penalty": 0.8},
             {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": 0.4},
             {"logit_bias": {13: 6.0, 271: -100.0}}, {"logit_bias": {397: 100.0}}]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def cases_and_expected(tokenizer, hf_model):
    """(prompt, settings) pairs and transformers' greedy output for each."""
    prompts, _ = text_workload(tokenizer, seed=7)
    cases = [(prompts[i][:60], PENALTIES[i % len(PENALTIES)]) for i in range(2 * len(PENALTIES))]
    with torch.no_grad():
        return cases, [hf_greedy(hf_model, prompt, 64, penalties) for prompt, penalties in cases]


@pytest.mark.parametrize("budget, blocks, seqs", [(16, None, 256), (2048, None, 256), (64, 24, 256), (2048, None, 3)],
                         ids=["chunked", "whole", "preempted", "rows reused"])
def test_penalized_greedy_equals_transformers(cases_and_expected, budget, blocks, seqs):
    """The counts each batch row keeps (penalties.py) start over for each request that takes the
    row, and are rebuilt when a preempted request comes back."""
    cases, expected = cases_and_expected
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_batched_tokens=budget,
                                                                   num_kv_blocks=blocks, max_num_seqs=seqs,
                                                                   max_model_len=blocks and blocks * 16))
    got = engine.generate([p for p, _ in cases], [SamplingParams(max_tokens=64, temperature=0, **penalties)
                                                  for _, penalties in cases])
    assert engine.stats()["kv_blocks_used"] == 0
    assert (engine.stats()["preemptions"] > 0) == (blocks is not None), "a small pool must preempt (and resume)"
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g.token_ids != e]
    assert not mismatches, f"requests {mismatches} differ from transformers"
    plain = engine.generate([p for p, _ in cases], SamplingParams(max_tokens=64, temperature=0))
    changed = [cases[i][1] for i, (g, p) in enumerate(zip(got, plain)) if g.token_ids != p.token_ids]
    assert {} not in changed
    # each must bite: repetition alone, frequency/presence without it, the bias
    assert {"repetition_penalty": 1.8} in changed and any(set(p) <= {"frequency_penalty", "presence_penalty"}
                                                           for p in changed), changed
    assert all(t == 397 for t in got[-1].token_ids), "a bias of 100 makes the token certain"


def test_allowed_token_ids_restrict_every_token_to_the_set(reference_engine, tokenizer, hf_model):
    """vLLM's allowed_token_ids: a greedy output is the argmax of the logits restricted to the set
    (transformers' prefix_allowed_tokens_fn), a sampled one stays in it, unrestricted neighbours in
    the batch are unchanged; log-probabilities are the model's own, as for logit_bias. EOS ends an
    output only when allowed; where min_tokens bans every allowed token, the row samples freely."""
    prompts, _ = text_workload(tokenizer, seed=5)
    batch = [p[:30] for p in prompts[:3]]
    eos = tokenizer.eos_token_id
    plain = [o.token_ids for o in reference_engine.generate(batch, SamplingParams(max_tokens=16, temperature=0))]
    allowed = [t for t in range(300, 420) if t not in plain[0] + plain[1]]
    limited = SamplingParams(max_tokens=16, temperature=0, allowed_token_ids=allowed, logprobs=1)
    outs = reference_engine.generate(batch, [limited, limited, SamplingParams(max_tokens=16, temperature=0)])
    with torch.no_grad():
        expected = [hf_greedy(hf_model, p, 16, {"allowed_token_ids": allowed}) for p in batch[:2]]
    assert [o.token_ids for o in outs[:2]] == expected and outs[2].token_ids == plain[2]
    assert all(t in allowed for o in outs[:2] for t in o.token_ids)
    assert any(entry[t].rank > 1 for o in outs[:2] for t, entry in zip(o.token_ids, o.logprobs)), \
        "ranked in the model's own distribution, where the likeliest token may not be allowed"
    sampled = reference_engine.generate(batch, SamplingParams(max_tokens=16, temperature=1.5, seed=3,
                                                              allowed_token_ids=allowed[:5]))
    assert all(t in allowed[:5] for o in sampled for t in o.token_ids)
    pushed = dict(max_tokens=4, temperature=0, logit_bias={eos: 100.0})
    assert reference_engine.generate(batch[:1], SamplingParams(**pushed, allowed_token_ids=allowed))[0].token_ids \
        == expected[0][:4], "EOS, certain otherwise, is not allowed"
    assert reference_engine.generate(batch[:1], SamplingParams(**pushed, allowed_token_ids=[*allowed, eos]))[0] \
        .token_ids == [eos]
    held = reference_engine.generate(batch[:1], SamplingParams(**pushed, min_tokens=2, allowed_token_ids=[eos]))[0]
    free = reference_engine.generate(batch[:1], SamplingParams(**pushed, min_tokens=2))[0]
    assert held.token_ids == free.token_ids[:2] + [eos] and eos not in free.token_ids[:2], \
        "not token 0 (vLLM's pick from nothing) but what min_tokens alone gives"


def test_min_p_keeps_only_tokens_that_likely(tokenizer):
    """A sampled token's probability is at least min_p x the likeliest token's (logprobs are the
    model's own, at temperature 1); min_p = 1 leaves only the likeliest: the greedy output."""
    prompts, _ = text_workload(tokenizer, seed=3)
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64"))
    batch = [p[:40] for p in prompts[:8]]
    outs = engine.generate(batch, SamplingParams(max_tokens=32, temperature=1.0, min_p=0.2, seed=5, logprobs=1))
    for out in outs:
        for token, entry in zip(out.token_ids, out.logprobs):
            best = next(e.logprob for e in entry.values() if e.rank == 1)
            assert entry[token].logprob >= best + math.log(0.2) - 1e-9
    free = engine.generate(batch, SamplingParams(max_tokens=32, temperature=1.0, seed=5, logprobs=1))
    assert any(entry[t].logprob < next(e.logprob for e in entry.values() if e.rank == 1) + math.log(0.2)
               for out in free for t, entry in zip(out.token_ids, out.logprobs)), "without min_p such tokens occur"
    greedy = engine.generate(batch, SamplingParams(max_tokens=32, temperature=0))
    certain = engine.generate(batch, SamplingParams(max_tokens=32, temperature=1.0, min_p=1.0, seed=5))
    assert [o.token_ids for o in certain] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("knob, value, message", [
    ("repetition_penalty", 0, "'repetition_penalty' must be a number in [1e-06, 1e+06]"),
    ("repetition_penalty", 1e-40, "'repetition_penalty' must be a number in [1e-06, 1e+06]"),
    ("frequency_penalty", 2.5, "'frequency_penalty' must be a number in [-2, 2]"),
    ("presence_penalty", float("nan"), "'presence_penalty' must be a number in [-2, 2]"),
    ("min_p", 1.5, "'min_p' must be in [0, 1]"),
    ("logit_bias", {5: float("inf")}, "'logit_bias' must map token ids to numbers"),
    ("logit_bias", {-1: 1}, "'logit_bias' must map token ids"),
    ("allowed_token_ids", [], "'allowed_token_ids' must not be empty"),
    ("allowed_token_ids", [3, -1], "'allowed_token_ids' must be a list of non-negative integers"),
    ("skip_special_tokens", "false", "'skip_special_tokens' must be a boolean"),
    ("spaces_between_special_tokens", 0, "'spaces_between_special_tokens' must be a boolean"),
    # not lists at all: named, not "TypeError: 'int' object is not iterable"
    ("stop_token_ids", 5, "'stop_token_ids' must be a list of non-negative integers"),
    ("bad_words_ids", [5, 6], "'bad_words_ids' must be a list of non-empty lists"),
    ("allowed_token_ids", 5, "'allowed_token_ids' must be a list of non-negative integers"),
    ("stop", None, "'stop' must be a string or a list of non-empty strings"),
    ("stop", 5, "'stop' must be a string or a list of non-empty strings"),
])
def test_out_of_range_settings_name_the_field(knob, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{knob: value})


def test_a_logit_bias_past_openais_range_is_clamped_as_vllm_clamps_it():
    assert SamplingParams(logit_bias={5: 101, 6: -1e9, 7: 3}).logit_bias == ((5, 100.0), (6, -100.0), (7, 3.0))
    # a token given twice (JSON's "5" and "05") once, the last bias winning as in vLLM's dict
    assert SamplingParams(logit_bias=((5, 3.0), (6, 1.0), (5, 4.0))).logit_bias == ((5, 4.0), (6, 1.0))


def test_allowed_token_ids_repeated_are_kept_once():
    """The sampler spreads them into a mask every step: two million ids of a vocabulary of 8,192
    cost every step in the batch 0.35 s."""
    assert SamplingParams(allowed_token_ids=[7, 5, 7] * 100_000).allowed_token_ids == (7, 5)


def test_top_k_keeps_ties_and_top_p_keeps_what_the_nucleus_needs():
    """vLLM's and transformers' edges: top-k keeps every token tied with the k-th; top-p keeps a
    token while the ones more likely hold less than p (the likeliest always)."""
    import numpy as np

    from inflight.sampler import Sampler

    def probs(logits, top_k=0, top_p=1.0):
        one = np.ones(1, dtype=np.float32)
        return Sampler._probs(torch.tensor([logits]), one, np.array([top_k]), one * top_p, one * 0)[0].tolist()

    assert probs([0.0, 2.0, 2.0, 1.0], top_k=1) == [0.0, 0.5, 0.5, 0.0]
    halves = [math.log(p) for p in (0.5, 0.25, 0.25)]
    assert probs(halves, top_p=0.5) == [1.0, 0.0, 0.0]
    assert probs(halves, top_p=0.75) == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert probs(halves, top_p=0.2) == [1.0, 0.0, 0.0]
    assert probs(halves) == pytest.approx([0.5, 0.25, 0.25])


def test_extreme_knob_values_mean_what_they_say(tiny_checkpoint):
    """Valid values past what the batch table's float32 / int32 rows hold: a top_k of 2**63 is
    no top-k (it used to wrap, or raise on the engine thread and fail every request), a top_p
    that rounds to 0 keeps the likeliest token (it used to mask every one: NaN, token 0), a
    temperature that overflows float32 is uniform sampling, not NaN against min_tokens' bans."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=64))
    prompt = [[5, 6, 7, 8]]

    def tokens(**knobs):
        return engine.generate(prompt, SamplingParams(max_tokens=12, seed=3, ignore_eos=True, **knobs))[0].token_ids

    free = tokens(top_k=-1)
    assert free != tokens(top_k=1), "the seed samples more than the likeliest token"
    assert tokens(top_k=2**63) == free and tokens(top_k=2**32 + 1) == free
    assert tokens(top_p=1e-50) == tokens(temperature=0)
    hot = tokens(temperature=1e39, min_tokens=12)
    assert len(set(hot)) > 1, "a NaN row samples token 0 every time"
    assert engine.stats()["kv_blocks_used"] == 0


# ---- sampled tokens follow the model's distribution ------------------------------------------------
# The first token after "This": a moderately peaked distribution on the default model (the
# likeliest token 0.28 at T = 1), so that a sampler too sharp or too flat shows at these counts.
DISTRIBUTION_PROMPT = "This"
DRAWS = 2000
KNOBS = [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.5),
         dict(temperature=1.0, top_k=10), dict(temperature=1.0, top_p=0.6),
         dict(temperature=1.5, top_k=50, top_p=0.5), dict(temperature=1.5, min_p=0.1)]


def truncated_softmax(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's sampling distribution, from its definitions: softmax(logits / T); min_p drops the
    tokens less likely than min_p x the likeliest; top-k keeps the k likeliest (and ties with the
    k-th); top-p, on what top-k kept renormalised, keeps a token while the ones more likely than it
    hold less than top_p (the likeliest always); renormalised."""
    p = torch.softmax(logits / temperature, -1)
    p = torch.where(p >= min_p * p.max(), p, 0)
    if top_k:
        p = torch.where(p >= p.sort(descending=True).values[top_k - 1], p, 0)
    p = p / p.sum()
    if top_p < 1:
        ordered, order = p.sort(descending=True)
        dropped = ordered.cumsum(0) - ordered >= top_p
        dropped[0] = False
        p[order[dropped]] = 0
        p = p / p.sum()
    return p


@pytest.fixture(scope="module")
def first_token_logits(tokenizer, hf_model):
    prompt = tokenizer(DISTRIBUTION_PROMPT)["input_ids"]
    with torch.no_grad():
        return prompt, hf_model(torch.tensor([prompt])).logits[0, -1]


@pytest.fixture(scope="module")
def sampling_engine():
    return LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", num_kv_blocks=512, max_num_seqs=256,
                                                                 max_num_batched_tokens=4096))


@pytest.mark.parametrize("knobs", KNOBS, ids=["-".join(f"{k}={v}" for k, v in knobs.items()) for knobs in KNOBS])
def test_sampled_tokens_follow_the_models_truncated_tempered_softmax(first_token_logits, sampling_engine, knobs):
    """DRAWS seeded requests for one token: every token drawn is one the knobs leave in, and the
    counts pass a chi-square test against transformers' float64 softmax(logits / T), truncated by
    min_p / top_k / top_p and renormalised (bins of at least 5 expected draws; bound about 5 sigma
    above the statistic's mean). Seeded: the same counts every run. A temperature ignored, a
    sampler too sharp or too flat, a top-k or top-p edge one token off, top-p over the whole
    distribution instead of top-k's, min_p before the temperature: each fails here."""
    prompt, logits = first_token_logits
    p = truncated_softmax(logits, **knobs)
    outs = sampling_engine.generate([prompt] * DRAWS, [SamplingParams(max_tokens=1, seed=seed, ignore_eos=True, **knobs)
                                                       for seed in range(DRAWS)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=p.numel()).double()
    outside = torch.nonzero((p == 0) & (counts > 0)).flatten().tolist()
    assert not outside, f"{knobs} drew tokens it leaves out: {outside}"
    expected = DRAWS * p
    big = expected >= 5
    observed, expect = counts[big], expected[big]
    rest = (~big) & (p > 0)
    if expected[rest].sum() >= 5:           # the unlikely tokens together, as one bin
        observed = torch.cat([observed, counts[rest].sum().view(1)])
        expect = torch.cat([expect, expected[rest].sum().view(1)])
    else:                                    # too few to stand alone: in with the least likely bin
        least = int(expect.argmin())
        observed[least] += counts[rest].sum()
        expect[least] += expected[rest].sum()
    chi2 = (((observed - expect) ** 2) / expect).sum().item()
    df = observed.numel() - 1
    bound = df + 5 * math.sqrt(2 * df)
    assert chi2 < bound, f"{knobs}: chi-square {chi2:.1f} over {df} degrees of freedom (bound {bound:.1f})"
    assert sampling_engine.stats()["kv_blocks_used"] == 0


def test_min_tokens_bans_eos_under_ignore_eos_and_bad_words_ignore_the_prompt(tiny_checkpoint, tmp_path):
    """As vLLM: min_tokens bans every stop token, EOS also when ignore_eos keeps it from stopping;
    a bad word's leading tokens are matched in the output only, not in the prompt's tail. A
    generation_config.json of sampling defaults alone leaves config.json's EOS in force."""
    import shutil
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=64))
    (eos,) = engine.eos_token_ids
    pushed = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, min_tokens=3, ignore_eos=True, temperature=0,
                                                         logit_bias={eos: 100.0}))[0].token_ids
    assert eos not in pushed[:3] and pushed[3:] == [eos, eos]
    target = next(t for t in range(10, 500) if t not in (5, 6, 7))
    word = SamplingParams(max_tokens=2, temperature=0, logit_bias={target: 100.0}, bad_words_ids=[[7, target]])
    assert engine.generate([[5, 6, 7]], word)[0].token_ids[0] == target, "the prompt's 7 does not start the word"
    copy = shutil.copytree(tiny_checkpoint, tmp_path / "model")
    (copy / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    assert LLMEngine.from_pretrained(str(copy), EngineConfig(dtype="float32", num_kv_blocks=64)).eos_token_ids == (eos,)


def test_the_tokenizers_eos_ends_generation_as_the_configs_do(tmp_path):
    """As vLLM gathers them: the model's end tokens are the tokenizer's EOS and the generation
    config's (config.json's where it names none). A checkpoint whose configs name another end
    token still stops on its tokenizer's, which min_tokens bans like the others."""
    import json
    import shutil
    copy = shutil.copytree(DEFAULT_MODEL, tmp_path / "model")
    (copy / "generation_config.json").unlink()
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))
    engine = LLMEngine.from_pretrained(str(copy), EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=4))
    assert engine.eos_token_ids == (2, 3)
    pushed = SamplingParams(max_tokens=8, temperature=0, logit_bias={2: 100.0})
    out = engine.generate([[5, 6, 7]], pushed)[0]
    assert out.token_ids == [2] and out.finish_reason == "stop"
    held = SamplingParams(max_tokens=8, min_tokens=3, temperature=0, logit_bias={2: 100.0})
    held_ids = engine.generate([[5, 6, 7]], held)[0].token_ids
    assert 2 not in held_ids[:3] and held_ids[3:] == [2]
    (copy / "tokenizer.json").unlink()          # no tokenizer: the configs' end token alone
    assert LLMEngine.from_pretrained(str(copy), EngineConfig(dtype="float32", num_kv_blocks=64)).eos_token_ids == (3,)


@pytest.mark.parametrize("logprobs", [None, 3])
def test_a_step_edits_the_logits_in_place_and_its_logprobs_stay_raw(logprobs):
    """Bias, a min_tokens ban, a penalty and allowed_token_ids on one row: the step edits the
    logits in place, never copying the whole [rows, vocab] tensor, and the log-probabilities a
    row asked for are still those of the raw logits (vLLM's raw_logprobs)."""
    import numpy as np

    from inflight.sampler import Sampler

    from .test_scheduler import add, make_scheduler
    s = make_scheduler(budget=64)
    add(s, 6, logit_bias={3: 50.0}, min_tokens=2, presence_penalty=1.0, repetition_penalty=1.5,
        allowed_token_ids=[3, 4, 7], temperature=0, logprobs=logprobs)
    add(s, 6, temperature=0, logprobs=logprobs)
    rows = s.schedule().rows
    raw = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(0))
    given = raw.clone()
    copies = []
    clone = torch.Tensor.clone
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "clone", lambda t, *a, **k: copies.append(t) or clone(t, *a, **k))
        tokens, step_logprobs = Sampler(torch.device("cpu"), 0)(given, s.table, rows)
    assert tokens[0] == 3 and tokens[1] == int(raw[1].argmax())
    assert not copies
    assert given[0, 3] > raw[0, 3] + 40 and given[0, 5] == -torch.inf, "biased and restricted in place"
    if logprobs is None:
        assert step_logprobs is None
    else:
        expected = torch.log_softmax(raw, dim=-1)
        assert np.allclose(step_logprobs.sampled, [expected[0, 3], expected[1].max()], atol=1e-6)
        assert step_logprobs.ranks.tolist() == [int((expected[0] >= expected[0, 3]).sum()), 1]
        assert step_logprobs.top_ids.tolist() == expected.topk(3).indices.tolist()


@pytest.mark.parametrize("top_ids, ranks", [([0, 1], {0: 1, 1: 2}), ([1, 0], {0: 2, 1: 1})])
def test_a_sampled_token_tied_within_the_top_n_takes_its_place_there_as_in_vllm(top_ids, ranks):
    """Tokens 0 and 1 tie for the most likely; token 0 was sampled (count rank 2). vLLM writes
    the top-N entries after the sampled one into one dict, so the sampled token's rank is its
    top-N place where it has one; the sampled token stays first."""
    import numpy as np

    from inflight.logprobs import StepLogprobs
    value = float(np.log(0.5))
    step = StepLogprobs(np.array([0]), np.array([value]), np.array([2]), np.array([top_ids]),
                        np.array([[value, value]]), np.array([2]))
    entry = step.entry(0, 0)
    assert list(entry) == [0, 1]
    assert {token: e.rank for token, e in entry.items()} == ranks

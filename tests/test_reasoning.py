"""Reasoning models (vLLM's reasoning_parser): the engine's structured outputs wait for the end of
the model's reasoning, and the OpenAI server's --reasoning-parser splits a reply into reasoning and
content, streamed or not. The model: the test model with DeepSeek-R1's markers in its tokenizer."""
import re

import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import reasoning_checkpoint

AB = "[ab]{5}"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return reasoning_checkpoint(str(tmp_path_factory.mktemp("reasoning") / "think-tiny"))


@pytest.fixture(scope="module")
def think_tokenizer(think_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(think_model)


@pytest.fixture(scope="module")
def thinking_engine(think_model):
    return LLMEngine.from_pretrained(think_model, EngineConfig(**TEST_ENGINE, reasoning_parser="deepseek_r1"))


def constrained(seed: int, end: int, bias: float = 8.0) -> SamplingParams:
    """A regex the reasoning never meets, and a bias that makes the model end its reasoning soon."""
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, logit_bias={end: bias},
                          structured_outputs={"regex": AB})


def test_a_grammar_waits_for_the_end_of_reasoning(thinking_engine, think_tokenizer):
    """As vLLM's engine with a reasoning parser: text before </think> is free (the regex would
    refuse it, and </think> itself), the answer after it follows the grammar."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    prompt = think_tokenizer.encode("What is 2+2? <think>\n")
    outs = thinking_engine.generate([prompt] * 8, [constrained(seed, end) for seed in range(8)])
    ended = [out for out in outs if end in out.token_ids]
    assert ended and any(out.token_ids.index(end) > 0 for out in ended), "some reasoning before the end marker"
    for out in ended:
        at = out.token_ids.index(end)
        assert not re.fullmatch("[ab]*", think_tokenizer.decode(out.token_ids[:at])) or at == 0
        answer = think_tokenizer.decode(out.token_ids[at + 1:], skip_special_tokens=True)
        assert re.fullmatch(AB, answer) and out.finish_reason == "stop", answer
    for out in outs:
        if end not in out.token_ids:    # reasoned to its end (max_tokens or EOS): never constrained
            assert not re.fullmatch(AB, think_tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert thinking_engine.kv.num_free_blocks == thinking_engine.kv.num_blocks


def test_a_prompt_that_ended_the_reasoning_is_constrained_from_the_first_token(thinking_engine, think_tokenizer,
                                                                              think_model):
    """</think> as the prompt's last marker: the grammar starts at once (the bias cannot bring the
    marker in), as it does in an engine without a reasoning parser."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    prompt = think_tokenizer.encode("What is 2+2? <think>\nfour</think>\n")
    outs = thinking_engine.generate([prompt] * 4, [constrained(seed, end, 100.0) for seed in range(4)])
    plain = LLMEngine.from_pretrained(think_model, EngineConfig(**TEST_ENGINE)).generate(
        [think_tokenizer.encode("What is 2+2? <think>\n")] * 4, [constrained(seed, end, 100.0) for seed in range(4)])
    for out in outs + plain:
        assert end not in out.token_ids
        assert re.fullmatch(AB, think_tokenizer.decode(out.token_ids, skip_special_tokens=True))


def test_the_reasoning_parser_is_checked_at_start():
    with pytest.raises(ValueError, match="'reasoning_parser' must be one of"):
        EngineConfig(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="'reasoning_parser' 'deepseek_r1': the tokenizer has no '<think>' token"):
        LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**TEST_ENGINE, reasoning_parser="deepseek_r1"))

"""Repetition, frequency and presence penalties: greedy token ids equal transformers' `generate`
with the same penalties (its own repetition_penalty; OpenAI's frequency/presence definition as a
logits processor), each request with its own penalties in one mixed batch, chunked and not."""
import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams

from .conftest import DEFAULT_MODEL
from .test_exactness import text_workload

PENALTIES = [{}, {"repetition_penalty": 1.8}, {"repetition_penalty": 0.7}, {"frequency_penalty": 1.5},
             {"presence_penalty": 2.0}, {"frequency_penalty": -0.5, "presence_penalty": 0.8},
             {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": 0.4}]


class OpenAIPenalties:
    """The reference: logit -= f x count in the output + p x (count > 0), after transformers'
    repetition penalty (which runs first, as in the engine)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:],
                                                                                   dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_penalized(model, prompt, n, penalties) -> list[int]:
    from transformers import LogitsProcessorList
    processors = LogitsProcessorList([OpenAIPenalties(len(prompt), penalties.get("frequency_penalty", 0.0),
                                                      penalties.get("presence_penalty", 0.0))])
    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                         repetition_penalty=penalties.get("repetition_penalty", 1.0), logits_processor=processors,
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [16, 2048])
def test_penalized_greedy_equals_transformers(tokenizer, budget):
    from transformers import AutoModelForCausalLM
    prompts, _ = text_workload(tokenizer, seed=7)
    cases = [(prompts[i][:60], PENALTIES[i % len(PENALTIES)]) for i in range(14)]
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", max_num_batched_tokens=budget))
    got = engine.generate([p for p, _ in cases], [SamplingParams(max_tokens=64, temperature=0, **penalties)
                                                  for _, penalties in cases])
    assert engine.stats()["kv_blocks_used"] == 0
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = [hf_penalized(model, prompt, 64, penalties) for prompt, penalties in cases]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g.token_ids != e]
    assert not mismatches, f"requests {mismatches} differ from transformers"
    plain = engine.generate([p for p, _ in cases], SamplingParams(max_tokens=64, temperature=0))
    changed = [cases[i][1] for i, (g, p) in enumerate(zip(got, plain)) if g.token_ids != p.token_ids]
    assert {} not in changed
    # the penalties must bite: repetition alone, and frequency/presence without it
    assert {"repetition_penalty": 1.8} in changed and any("repetition_penalty" not in p for p in changed), changed


@pytest.mark.parametrize("knob, value, message", [
    ("repetition_penalty", 0, "'repetition_penalty' must be a finite number > 0"),
    ("frequency_penalty", 2.5, "'frequency_penalty' must be a number in [-2, 2]"),
    ("presence_penalty", float("nan"), "'presence_penalty' must be a number in [-2, 2]"),
])
def test_out_of_range_penalties_name_the_field(knob, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{knob: value})

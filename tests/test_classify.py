"""Classifiers (a *ForSequenceClassification checkpoint, runner "pooling"): each prompt's class
scores are transformers' logits at its last token through the activation vLLM picks from
config.json, through chunked prefill and the prefix cache; the engine refuses what a classifier
cannot do, by name; every block goes back."""
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from inflight import EngineConfig, LLMEngine
from inflight.pooling import PoolingParams
from inflight.serving.protocol import RequestError, parse_request
from inflight.testing import make_classifier_checkpoint, make_random_adapter, make_random_checkpoint

from .conftest import DEFAULT_MODEL

ENGINE = dict(dtype="float64", max_num_batched_tokens=16, num_kv_blocks=256)


def hf_logits(model_dir: str, prompts) -> list[torch.Tensor]:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 120))] for _ in range(count)] + [[7]]


def assert_close(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        # the head runs in float32 (vLLM's head_dtype for pooling models) on the float64 decoder
        assert torch.allclose(torch.tensor(g, dtype=torch.float64), w, atol=2e-6), (i, g, w.tolist())


@pytest.mark.parametrize("base, labels, config, activation", [
    ("llama-gqa2-tied-llama3rope", 3, {}, lambda x: torch.softmax(x, -1)),
    ("qwen3-qknorm-gqa2-headdim24", 1, {}, torch.sigmoid),
    ("qwen2-bias-gqa2", 2, {"problem_type": "multi_label_classification"}, torch.sigmoid),
    ("llama-mha-untied", 1, {"problem_type": "regression"}, lambda x: x),
    ("mistral-gqa4-tied", 1, {"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"},
     lambda x: x),
])
def test_class_scores_are_transformers_logits_through_vllms_activation(arch_checkpoints, tmp_path, base, labels,
                                                                        config, activation):
    model_dir = make_classifier_checkpoint(arch_checkpoints[base], str(tmp_path / "classifier"), labels, **config)
    batch = prompts(labels)
    logits = hf_logits(model_dir, batch)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE))        # runner "auto": pooling
    assert engine.config.runner == "pooling"
    outs = engine.classify(batch)
    assert_close([o.embedding for o in outs], [activation(x) for x in logits])
    assert all(o.token_ids == [] and o.finish_reason == "stop" for o in outs)
    assert_close([o.embedding for o in engine.classify(batch[:2], use_activation=False)], logits[:2])
    engine.check_invariants()
    assert engine.stats()["kv_blocks_used"] == 0 and engine.num_pooling == 0 and not engine.requests


def test_a_classifier_refuses_generation_and_embeddings_by_name(arch_checkpoints, tmp_path, tiny_checkpoint):
    model_dir = make_classifier_checkpoint(arch_checkpoints["llama-mha-untied"], str(tmp_path / "c"), 2)
    with pytest.raises(ValueError, match=r"is a classifier \(LlamaForSequenceClassification\): it has no LM head"):
        LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE, runner="generate"))
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match=r'runs as a classifier \(its engine\'s runner is "pooling"\): it serves '
                                         "classification requests, not generation"):
        engine.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"this model is a classifier, whose pooling task is classify "
                                         r"\(classification and cross-encoder scores\), not embed"):
        engine.embed([[1, 2, 3]])
    with pytest.raises(ValueError, match="'dimensions'"):
        engine.embed([[1, 2, 3]], PoolingParams(dimensions=4, task="classify"))
    embedder = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(**ENGINE, runner="pooling"))
    with pytest.raises(ValueError, match="this model is an embedding model, whose pooling task is embed .*, "
                                         "not classify"):
        embedder.classify([[1, 2, 3]])
    generator = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match="classification needs a classifier"):
        generator.classify([[1, 2, 3]])
    for engine in (engine, embedder, generator):
        assert engine.stats()["kv_blocks_used"] == 0 and not engine.requests


def test_a_classifiers_activation_from_outside_torch_nn_is_refused(arch_checkpoints, tmp_path):
    model_dir = make_classifier_checkpoint(arch_checkpoints["llama-mha-untied"], str(tmp_path / "c"), 1,
                                           sbert_ce_default_activation_function="os.system")
    with pytest.raises(ValueError, match="'os.system' is not a torch.nn.modules class"):
        LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE))


@pytest.mark.parametrize("params, message", [
    ({"task": "score"}, "'embedding_request.pooling_params.task' must be one of ['embed', 'classify'], got 'score'"),
    ({"use_activation": "no"}, "'embedding_request.pooling_params.use_activation' must be a boolean"),
    ({"normalize": True}, "unknown key(s) ['normalize']; known: ['dimensions', 'task', 'use_activation']"),
])
def test_the_classify_task_of_an_embedding_request_is_checked(params, message):
    with pytest.raises(RequestError) as error:
        parse_request({"embedding_request": _json({"input": [1, 2], "pooling_params": params})}, {})
    assert message in str(error.value)
    request = parse_request({"embedding_request": _json({"input": [1, 2], "pooling_params": {"task": "classify"}})}, {})
    assert request.pooling == PoolingParams(task="classify")


def _json(value) -> np.ndarray:
    return np.array([json.dumps(value).encode()], dtype=object)


def with_tokenizer(model_dir: str) -> str:
    for name in os.listdir(DEFAULT_MODEL):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(DEFAULT_MODEL, name), model_dir)
    return model_dir


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method, tokens", [("from_2_way_softmax", ["no", "er"]), ("no_post_processing", ["no", "er"]),
                                            ("no_post_processing", ["an"])])
def test_a_causal_lm_made_a_reranker_scores_with_its_lm_heads_rows(tmp_path, tied, method, tokens):
    """vLLM's hf_overrides classifier_from_token (Qwen3-Reranker's conversion): the score head is
    the LM head's rows for the tokens, yes minus no for from_2_way_softmax."""
    if tied:
        model_dir = DEFAULT_MODEL
    else:
        model_dir = with_tokenizer(make_random_checkpoint(str(tmp_path / "qwen3"), "qwen3", vocab_size=4096))
    overrides = {"architectures": ["Qwen3ForSequenceClassification" if not tied else "LlamaForSequenceClassification"],
                 "classifier_from_token": tokens, "method": method}
    batch = prompts(11)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(tokens)
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0, -1, ids] for p in batch]
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE, hf_overrides=overrides))
    if method == "from_2_way_softmax":
        want = [torch.sigmoid(x[1:] - x[:1]) for x in logits]
        raw = [x[1:] - x[:1] for x in logits]
    else:
        want = [torch.softmax(x, -1) if len(tokens) > 1 else torch.sigmoid(x) for x in logits]
        raw = logits
    assert_close([o.embedding for o in engine.classify(batch)], want)
    assert_close([o.embedding for o in engine.classify(batch, use_activation=False)], raw)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True},
     "is_original_qwen3_reranker needs classifier_from_token"),
    ({"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no"],
      "method": "from_2_way_softmax"}, "'method' 'from_2_way_softmax' needs classifier_from_token: two tokens"),
    ({"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
      "method": "from_2_way_softmax"}, r"classifier_from_token: \['yes'\] are not tokens of the tokenizer"),
    ({"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no"], "method": "mean"},
     "'method' 'mean': a reranker's score head is made by one of"),
])
def test_a_reranker_conversion_that_cannot_be_made_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**ENGINE, hf_overrides=overrides))
    with pytest.raises(ValueError, match="'hf_overrides' must be an object"):
        EngineConfig(hf_overrides=["no"])


def test_a_pooling_request_with_a_lora_adapter_gets_peft_models_output(tiny_checkpoint, tmp_path):
    """Embeddings and class scores computed with an adapter's weights (the request's lora_name),
    equal to peft's model over transformers'; requests of the base model beside them keep its."""
    from peft import PeftModel
    adapter = make_random_adapter(tiny_checkpoint, str(tmp_path / "adapter"), seed=4, r=8,
                                  target_modules=["q_proj", "v_proj", "down_proj"])
    classifier = make_classifier_checkpoint(tiny_checkpoint, str(tmp_path / "classifier"), 3)
    batch = prompts(13, count=4)
    lora = dict(enable_lora=True, max_lora_rank=8)
    for model_dir, auto, pooled in ((tiny_checkpoint, AutoModelForCausalLM, "hidden"),
                                    (classifier, AutoModelForSequenceClassification, "logits")):
        reference = PeftModel.from_pretrained(auto.from_pretrained(model_dir, dtype=torch.float64), adapter).eval()
        with torch.no_grad():
            outputs = [reference(input_ids=torch.tensor([p]), output_hidden_states=True) for p in batch]
        if pooled == "hidden":
            want = [torch.nn.functional.normalize(o.hidden_states[-1][0, -1], dim=-1) for o in outputs]
        else:
            want = [torch.softmax(o.logits[0], -1) for o in outputs]
        engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE, runner="pooling", **lora),
                                           lora_modules={"tuned": adapter})
        pool = engine.embed if pooled == "hidden" else engine.classify
        tuned = pool(batch, lora_name="tuned")
        assert_close([o.embedding for o in tuned], want)
        base = pool(batch)
        assert all(not torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding))
                   for a, b in zip(tuned, base))
        engine.check_invariants()
        assert engine.stats()["kv_blocks_used"] == 0

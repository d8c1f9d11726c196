"""Embeddings (runner "pooling"): each prompt's vector is transformers' final hidden state at its
last token, L2-normalized (vLLM's LAST pooling for a *ForCausalLM run as an embedding model),
through chunked prefill, the prefix cache and preemption; Matryoshka dimensions as vLLM allows
them; each runner refuses the other kind of request by name."""
import json
import os
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight import EngineConfig, LLMEngine
from inflight.pooling import PoolingParams


def hf_embeddings(model_dir: str, prompts, dims: int | None = None) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        last = [model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1] for p in prompts]
    return [torch.nn.functional.normalize(h[:dims], dim=-1) for h in last]


def assert_close(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) and torch.allclose(torch.tensor(g, dtype=torch.float64), w, atol=1e-9), i


@pytest.mark.parametrize("name", ["llama-gqa2-tied-llama3rope", "qwen3-qknorm-gqa2-headdim24"])
def test_embeddings_are_transformers_last_hidden_state_normalized(arch_checkpoints, name):
    model_dir = arch_checkpoints[name]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 150))] for _ in range(8)] + [[7]]
    want = hf_embeddings(model_dir, prompts)
    # a budget of 16 tokens a step: the long prompts run in chunks, several at once
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype="float64", runner="pooling",
                                                               max_num_batched_tokens=16, num_kv_blocks=256))
    outs = engine.embed(prompts)
    assert_close([o.embedding for o in outs], want)
    assert all(o.token_ids == [] and o.finish_reason == "stop" for o in outs)
    again = engine.embed([prompts[0]])           # its full blocks now come from the prefix cache
    assert engine.stats()["prefix_cache_hit_tokens"] >= 16 * ((len(prompts[0]) - 1) // 16) > 0
    assert_close([again[0].embedding], want[:1])
    engine.check_invariants()
    assert engine.stats()["kv_blocks_used"] == 0 and engine.num_pooling == 0 and not engine.requests


def test_an_embedding_preempted_for_a_higher_priority_one_is_recomputed(tiny_checkpoint):
    rng = random.Random(5)
    low, high = ([rng.randrange(3, 512) for _ in range(n)] for n in (150, 120))
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", runner="pooling",
                                                                     max_num_batched_tokens=32, num_kv_blocks=12,
                                                                     max_model_len=192))
    reqs = [engine.add_request("low", low, pooling=PoolingParams(), priority="low")]
    engine.step()                                    # 32 of its 150 tokens: it holds blocks
    reqs.append(engine.add_request("high", high, pooling=PoolingParams(), priority="high"))
    finished, embedded = [], {}
    while engine.has_unfinished():
        out = engine.step()
        assert not out.request_ids            # the token each samples reaches nobody
        finished += out.finished
        embedded.update(out.embeddings)
    assert finished == ["high", "low"] and engine.stats()["preemptions"] == 1
    assert embedded == {r.request_id: r.embedding for r in reqs}
    assert_close([r.embedding for r in reqs], hf_embeddings(tiny_checkpoint, [low, high]))
    assert engine.stats()["kv_blocks_used"] == 0


def test_matryoshka_dimensions_as_vllm_allows_them(tiny_checkpoint, tmp_path):
    plain = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", runner="pooling",
                                                                    num_kv_blocks=64))
    with pytest.raises(ValueError, match=r"'dimensions' \(8\): this model does not support Matryoshka"):
        plain.embed([[1, 2, 3]], PoolingParams(dimensions=8))
    unnormalized = plain.embed([[1, 2, 3]], PoolingParams(use_activation=False))[0].embedding
    assert abs(torch.tensor(unnormalized).norm().item() - 1) > 1e-3    # the raw state (use_activation false)
    listed = str(tmp_path / "matryoshka")
    shutil.copytree(tiny_checkpoint, listed)
    with open(os.path.join(listed, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(listed, "config.json"), "w") as f:
        json.dump({**config, "matryoshka_dimensions": [8, 16]}, f)
    engine = LLMEngine.from_pretrained(listed, EngineConfig(dtype="float64", runner="pooling", num_kv_blocks=64))
    [out] = engine.embed([[1, 2, 3]], PoolingParams(dimensions=16))
    assert_close([out.embedding], hf_embeddings(listed, [[1, 2, 3]], dims=16))
    with pytest.raises(ValueError, match=r"'dimensions' must be one of \[8, 16\], got 12"):
        engine.embed([[1, 2, 3]], PoolingParams(dimensions=12))
    hidden = engine.runner.spec.hidden_size
    with pytest.raises(ValueError, match=rf"'dimensions' must be an integer in \[1, {hidden}\], got 0"):
        engine.embed([[1, 2, 3]], PoolingParams(dimensions=0))
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.requests


def test_each_runner_refuses_the_other_kind_of_request(tiny_checkpoint):
    pooling = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(runner="pooling", num_kv_blocks=64))
    with pytest.raises(ValueError, match=r'runs as an embedding model \(its engine\'s runner is "pooling"\): it serves '
                                         "embedding requests, not generation"):
        pooling.generate([[1, 2, 3]])
    generating = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match=r'embeddings need a model run as an embedding model \(the engine setting '
                                         'runner "pooling"'):
        generating.embed([[1, 2, 3]])
    with pytest.raises(ValueError, match="'runner' must be one of"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match=r"'prompt_token_ids' \(4 tokens\) must be shorter than max_model_len \(4\)"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(runner="pooling", num_kv_blocks=64,
                                                                max_model_len=4)).embed([[1, 2, 3, 4]])


def sentence_transformers_checkpoint(tiny_checkpoint, path, pooling: dict, normalize: bool) -> str:
    """The checkpoint as sentence-transformers saves an embedding model: modules.json, the Pooling
    module's config.json, and a Normalize module where it normalizes."""
    shutil.copytree(tiny_checkpoint, path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "include_prompt": True, **pooling}, f)
    return str(path)


def test_runner_auto_pools_a_sentence_transformers_checkpoint_as_its_modules_say(tiny_checkpoint, tmp_path):
    """vLLM's runner "auto": a checkpoint with a sentence-transformers modules.json is an embedding
    model (Qwen3-Embedding is a *ForCausalLM saved so), normalized only where it has a Normalize
    module; any other checkpoint generates."""
    config = EngineConfig(dtype="float64", num_kv_blocks=64)
    assert config.runner == "auto"
    normalized = sentence_transformers_checkpoint(tiny_checkpoint, tmp_path / "normalized", {
        "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, normalize=True)
    engine = LLMEngine.from_pretrained(normalized, config)
    assert engine.config.runner == "pooling"
    assert_close([out.embedding for out in engine.embed([[1, 2, 3]])], hf_embeddings(normalized, [[1, 2, 3]]))
    raw = sentence_transformers_checkpoint(tiny_checkpoint, tmp_path / "raw", {"pooling_mode": "lasttoken"},
                                           normalize=False)
    engine = LLMEngine.from_pretrained(raw, config)
    [unnormalized] = engine.embed([[1, 2, 3]])
    assert abs(torch.tensor(unnormalized.embedding).norm().item() - 1) > 1e-3         # vLLM's use_activation false
    assert_close([out.embedding for out in engine.embed([[1, 2, 3]], PoolingParams(use_activation=True))],
                 hf_embeddings(raw, [[1, 2, 3]]))
    mean = sentence_transformers_checkpoint(tiny_checkpoint, tmp_path / "mean", {"pooling_mode_mean_tokens": True},
                                            normalize=True)
    with pytest.raises(ValueError, match="its sentence-transformers pooling is MEAN .modules.json.; inflight "
                                         "serves LAST pooling .lasttoken. only"):
        LLMEngine.from_pretrained(mean, config)
    most = sentence_transformers_checkpoint(tiny_checkpoint, tmp_path / "max", {"pooling_mode": "max"}, normalize=True)
    with pytest.raises(ValueError, match="its sentence-transformers pooling is MAX"):
        LLMEngine.from_pretrained(most, config)
    generating = LLMEngine.from_pretrained(tiny_checkpoint, config)
    assert generating.config.runner == "generate" and len(generating.generate([[1, 2, 3]])[0].token_ids) > 0

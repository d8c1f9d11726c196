"""Multi-LoRA in-process: greedy ids equal transformers + peft for a batch mixing the base model and
several adapters (chunked prefill, preemption, prefix caching, more adapters than slots), no more
than max_loras adapters run at once, adapters never share prefix-cache blocks, load-time refusals
name the adapter and the field, the SGMV kernels equal the torch path under the Triton interpreter
and compile for sm_80 / sm_90, and multi_lora.json is parsed strictly."""
import dataclasses
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.lora import GROUPS, LoraAdapter, LoraError, LoraModule, LoraWeights, module_shapes
from inflight.models import ModelSpec
from inflight.packed_linear import shape_bucket
from inflight.testing import make_random_adapter, make_random_checkpoint


# different ranks and target modules; rslora on one; per-module ranks and alphas on another
ADAPTERS = {
    # with other architectures' names too, as generic training scripts write them (PEFT needs one to match)
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "query_key_value", "c_attn", "W_pack"]),
    "ko-mlp-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                             target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "all-linear-patterns": dict(r=16, lora_alpha=8, target_modules="all-linear",
                                rank_pattern={"layers.1.mlp.down_proj": 2}, alpha_pattern={"v_proj": 32}),
}
NAMES = [None, *ADAPTERS]             # request i runs with NAMES[i % 4] (None: the base model)


@pytest.fixture(scope="session")
def adapters(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_random_adapter(tiny_checkpoint, str(root / name), seed=i, **config)
            for i, (name, config) in enumerate(ADAPTERS.items())}


def make_workload(seed: int = 11, num_prompts: int = 16):
    """Each prompt twice, under two different adapters (or base): with prefix caching on, a wrong
    cache key would hand one adapter's KV blocks to the other and change its tokens."""
    rng = random.Random(seed)
    pool = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 120))] for _ in range(num_prompts)]
    prompts, lengths, names = [], [], []
    for i, prompt in enumerate(pool):
        for j in range(2):
            prompts.append(prompt)
            lengths.append(rng.randint(1, 48))
            names.append(NAMES[(i + 2 * j + j) % len(NAMES)])
    return prompts, lengths, names


def peft_greedy(base_dir, adapters, prompts, lengths, names):
    """transformers + peft, one request at a time, float64; also how often each adapter changes
    the first greedy token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    first, *rest = adapters
    model = PeftModel.from_pretrained(model, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    model = model.to(torch.float64).eval()
    eos = model.generation_config.eos_token_id
    outs, changed = [], {name: 0 for name in adapters}
    with torch.no_grad():
        for prompt, n, name in zip(prompts, lengths, names):
            ids = torch.tensor([prompt])
            if name is None:
                with model.disable_adapter():
                    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            else:
                model.set_adapter(name)
                out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
                with model.disable_adapter():
                    base_first = int(model(ids).logits[0, -1].argmax())
                changed[name] += int(out[0, len(prompt)]) != base_first
            outs.append(out[0, len(prompt):].tolist())
    return outs, changed


def engine_greedy(base_dir, adapters, prompts, lengths, names, **config):
    engine = LLMEngine.from_pretrained(base_dir, EngineConfig(**{"dtype": "float64", "enable_lora": True,
                                                                 "max_loras": len(adapters), **config}),
                                       lora_modules=adapters)
    params = [SamplingParams(max_tokens=n, temperature=0, lora_name=name) for n, name in zip(lengths, names)]
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    return [o.token_ids for o in outs], stats


def test_mixed_adapter_batches_match_transformers_and_peft(tiny_checkpoint, adapters):
    prompts, lengths, names = make_workload()
    expected, changed = peft_greedy(tiny_checkpoint, adapters, prompts, lengths, names)
    per_adapter = {name: names.count(name) for name in adapters}
    for name, count in changed.items():     # the adapters really matter: most first tokens change
        assert count >= per_adapter[name] // 2, f"{name} changed only {count}/{per_adapter[name]} first tokens"
    # with fewer slots than adapters, the adapters take turns in the slots (a stale slot changes tokens)
    for budget, blocks, slots in ((8, 4096, 3), (2048, 4096, 3), (64, 16, 3), (2048, 4096, 1), (64, 16, 2)):
        got, stats = engine_greedy(tiny_checkpoint, adapters, prompts, lengths, names,
                                   max_num_batched_tokens=budget, num_kv_blocks=blocks,
                                   max_model_len=min(512, blocks * 16), max_loras=slots)
        if blocks == 16:
            assert stats["preemptions"] > 0, "the small pool should have forced preemptions"
        assert (stats["lora_loads"] > 0) == (slots < len(adapters))
        mismatches = [(i, names[i]) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        assert not mismatches, (f"budget {budget}, {blocks} blocks, {slots} slots: requests (i, adapter) {mismatches} "
                                "differ from peft")


def test_a_qwen3_adapter_on_q_and_k_matches_peft(arch_checkpoints, tmp_path):
    """Qwen3 norms each query and key head: an adapter's q/k terms go in before the norms, as PEFT's."""
    base = arch_checkpoints["qwen3-qknorm-gqa2-headdim24"]
    adapter = {"qk": make_random_adapter(base, str(tmp_path / "qk"), seed=3, r=8,
                                         target_modules=["q_proj", "k_proj", "v_proj"])}
    prompts, lengths, names = make_workload(seed=5, num_prompts=8)
    names = [None if name is None else "qk" for name in names]
    expected, changed = peft_greedy(base, adapter, prompts, lengths, names)
    assert changed["qk"] >= names.count("qk") // 2, "the adapter changes most first tokens"
    got, _ = engine_greedy(base, adapter, prompts, lengths, names, num_kv_blocks=1024)
    assert got == expected


def test_adapters_never_share_prefix_cache_blocks(tiny_checkpoint, adapters):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=256),
                                       lora_modules=adapters)
    prompt = list(range(3, 3 + 64))

    def hits(lora_name):
        before = engine.stats()["prefix_cache_hit_tokens"]
        out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, lora_name=lora_name))[0]
        return engine.stats()["prefix_cache_hit_tokens"] - before, out.token_ids

    assert hits(None)[0] == 0
    first, tokens = hits("qv-r8")
    assert first == 0, "an adapter request reused the base model's blocks"
    assert hits("ko-mlp-r4-rslora")[0] == 0, "an adapter reused another adapter's blocks"
    again, tokens_again = hits("qv-r8")
    assert again == 48 and tokens_again == tokens      # its own blocks: reused, same tokens
    assert hits(None)[0] == 48


def test_unknown_or_disabled_lora_name_is_refused_at_add_request(tiny_checkpoint, adapters):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=64),
                                       lora_modules=adapters)
    assert engine.lora_names == list(adapters)
    with pytest.raises(ValueError, match=r"unknown 'lora_name' 'nope'; known: \['qv-r8', 'ko-mlp-r4-rslora', "):
        engine.add_request("a", [1, 2, 3], SamplingParams(lora_name="nope"))
    assert not engine.has_unfinished()
    plain = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request("a", [1, 2, 3], SamplingParams(lora_name="qv-r8"))
    with pytest.raises(ValueError, match="'lora_name' must be a non-empty string"):
        SamplingParams(lora_name="")


@pytest.mark.parametrize("values, message", [
    ({"enable_lora": "yes"}, "'enable_lora' must be a boolean"),
    ({"max_loras": 0}, "'max_loras' must be a positive integer"),
    ({"max_lora_rank": 2.5}, "'max_lora_rank' must be a positive integer"),
    ({"max_cpu_loras": 0}, "'max_cpu_loras' must be a positive integer or None"),
    ({"allow_runtime_lora_updating": "true", "enable_lora": True}, "'allow_runtime_lora_updating' must be a boolean"),
])
def test_engine_config_validates_lora_fields(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**values)


@pytest.fixture(scope="session")
def refused_adapters(tiny_checkpoint, tmp_path_factory):
    """name -> (adapter directory, the error it must get), made with peft itself."""
    root = tmp_path_factory.mktemp("refused")
    wider = make_random_checkpoint(str(root / "base-hidden-32"), "llama", seed=5, hidden_size=32)
    deeper = make_random_checkpoint(str(root / "base-3-layers"), "llama", seed=6, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cases = {
        "dora": (tiny_checkpoint, dict(r=4, target_modules=["q_proj"], use_dora=True), "'use_dora' is set: DoRA"),
        "embedding": (tiny_checkpoint, dict(r=4, target_modules=["embed_tokens", "q_proj"]),
                      "embedding adapters are not supported"),
        "lm-head-regex": (tiny_checkpoint, dict(r=4, target_modules=r".*lm_head"), "lm_head adapters are not supported"),
        "modules-to-save": (tiny_checkpoint, dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                            "'modules_to_save' is set"),
        "rank-32": (tiny_checkpoint, dict(r=32, target_modules=["v_proj"]), "has rank 32, over 'max_lora_rank' 16"),
        "pissa": (tiny_checkpoint, dict(r=4, target_modules=["q_proj"], init_lora_weights="pissa"),
                  "'init_lora_weights' is 'pissa': PEFT changes the base weights"),
        "other-hidden-size": (wider, dict(r=4, target_modules=["q_proj"]),
                              r"model.layers.0.self_attn.q_proj has lora_A \[4, 32\] and lora_B \[32, 4\], but the "
                              r"base model's q_proj maps 64 -> 64 features"),
        "other-depth": (deeper, dict(r=4, target_modules=["o_proj"]), "is for layer 2, but the base model has 2 layers"),
    }
    return {name: (make_random_adapter(base, str(root / name), **config), message)
            for name, (base, config, message) in cases.items()}


@pytest.mark.parametrize("case", ["dora", "embedding", "lm-head-regex", "modules-to-save", "rank-32", "pissa",
                                  "other-hidden-size", "other-depth"])
def test_unsupported_adapters_are_refused_naming_adapter_and_field(tiny_checkpoint, refused_adapters, case):
    path, message = refused_adapters[case]
    with pytest.raises(LoraError, match=message) as error:
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=16),
                                  lora_modules={case: path})
    assert f"LoRA adapter {case!r} ({path})" in str(error.value)


def test_an_adapter_tensor_of_no_dimensions_is_refused_naming_it(tiny_checkpoint, adapters, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    copy = shutil.copytree(adapters["qv-r8"], tmp_path / "scalar")
    tensors = load_file(copy / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.tensor(1.0)
    save_file(tensors, copy / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"LoRA adapter 'a' .*has lora_A \[\] and lora_B"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=16),
                                  lora_modules={"a": str(copy)})


def test_adapter_keys_without_peft_prefix_load_the_same(tiny_checkpoint, adapters, tmp_path):
    """Adapters saved by other tools name their tensors without PEFT's base_model.model. prefix;
    vLLM reads them, and so does inflight, with the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file
    copy = shutil.copytree(adapters["qv-r8"], tmp_path / "no-prefix")
    tensors = load_file(copy / "adapter_model.safetensors")
    save_file({k.removeprefix("base_model.model."): v for k, v in tensors.items()}, copy / "adapter_model.safetensors")
    prompts, lengths, _ = make_workload(seed=5, num_prompts=4)
    with_prefix = engine_greedy(tiny_checkpoint, {"a": adapters["qv-r8"]}, prompts, lengths, ["a"] * len(prompts))
    without = engine_greedy(tiny_checkpoint, {"a": str(copy)}, prompts, lengths, ["a"] * len(prompts))
    assert without[0] == with_prefix[0]


def test_no_more_adapters_than_max_loras_run_at_once(tiny_checkpoint, adapters):
    """vLLM's rule: a request whose adapter would be one too many waits, and the requests behind it
    (its own adapter's, other adapters' already running, the base model's) go first."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, max_loras=1, num_kv_blocks=256),
                                       lora_modules=adapters)
    order = ["qv-r8", "ko-mlp-r4-rslora", "qv-r8", None, "all-linear-patterns", "ko-mlp-r4-rslora"]
    for i, name in enumerate(order):
        engine.add_request(f"r{i}", [3 + i] * (10 + i), SamplingParams(max_tokens=4 + i, temperature=0, lora_name=name))
    first_step, finished = None, []
    while engine.has_unfinished():
        step = engine.step()
        engine.check_invariants()        # asserts no more than max_loras adapters in the running batch
        table = engine.scheduler.table
        running = {table.requests[row].request_id for row in engine.scheduler.running.tolist()}
        if first_step is None:
            first_step, first_stats = running, engine.stats()
        finished += list(step.finished)
    assert first_step == {"r0", "r2", "r3"}, "the qv-r8 and base requests run; the others wait for the slot"
    # per adapter id (the order of lora_names): what the metrics' lora_requests_info is made from
    ids = [engine.lora_names.index(name) for name in ("qv-r8", "ko-mlp-r4-rslora", "all-linear-patterns")]
    assert first_stats["lora_running"][ids].tolist() == [2, 0, 0]
    assert first_stats["lora_waiting"][ids].tolist() == [0, 2, 1]
    # one adapter at a time: ko-mlp's two requests come after qv-r8's, all-linear's after ko-mlp's
    assert finished.index("r1") > finished.index("r2") and finished.index("r4") > max(finished.index("r1"),
                                                                                       finished.index("r5"))
    assert engine.stats()["lora_loads"] == 2 and engine.stats()["kv_blocks_used"] == 0


def runtime_engine(base_dir, static: dict, **config) -> LLMEngine:
    return LLMEngine.from_pretrained(base_dir, EngineConfig(**{
        "dtype": "float64", "enable_lora": True, "allow_runtime_lora_updating": True, "num_kv_blocks": 512,
        **config}), lora_modules=static)


def test_adapters_loaded_at_runtime_match_peft(tiny_checkpoint, adapters):
    """Requests that name an adapter with its path load it on first use (vLLM's LoRARequest): the
    same tokens as peft, beside an adapter named at start-up, with fewer slots than adapters."""
    prompts, lengths, names = make_workload(seed=5, num_prompts=8)
    expected, _ = peft_greedy(tiny_checkpoint, adapters, prompts, lengths, names)
    engine = runtime_engine(tiny_checkpoint, {"qv-r8": adapters["qv-r8"]}, max_loras=2, max_cpu_loras=2)
    assert engine.lora_names == ["qv-r8"]
    params = [SamplingParams(max_tokens=n, temperature=0, lora_name=name,
                             lora_path=None if name in (None, "qv-r8") else adapters[name])
              for n, name in zip(lengths, names)]
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert [i for i, (g, e) in enumerate(zip(got, expected)) if g != e] == []
    assert engine.lora_names[0] == "qv-r8"
    assert sorted(engine.lora_names[1:]) == ["all-linear-patterns", "ko-mlp-r4-rslora"]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["lora_loads"] > 0
    # once loaded, a request may name it alone, or with its path again (nothing is read again)
    again = engine.generate([prompts[1]], SamplingParams(max_tokens=lengths[1], temperature=0,
                                                         lora_name=names[1]))[0].token_ids
    assert again == expected[1]


def test_runtime_adapters_take_turns_in_max_cpu_loras_rows(tiny_checkpoint, adapters, tmp_path):
    """max_cpu_loras rows: a new adapter takes the least recently named one's row unless requests hold
    it; an adapter whose files change is read again, and its old blocks are not reused."""
    engine = runtime_engine(tiny_checkpoint, {}, max_cpu_loras=1)
    prompt = list(range(3, 3 + 40))

    def run(name, path):
        return engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, lora_name=name,
                                                        lora_path=path))[0].token_ids

    ko = run("ko", adapters["ko-mlp-r4-rslora"])
    qv = run("qv", adapters["qv-r8"])                          # takes ko's row: ko is forgotten
    assert engine.lora_names == ["qv"]
    with pytest.raises(ValueError, match=r"unknown 'lora_name' 'ko'; known: \['qv'\]"):
        engine.add_request("x", prompt, SamplingParams(lora_name="ko"))
    assert run("ko", adapters["ko-mlp-r4-rslora"]) == ko      # read again, the same tokens
    # a row held by a waiting request is not taken
    engine.add_request("held", prompt, SamplingParams(max_tokens=2, lora_name="ko"))
    with pytest.raises(ValueError, match=r"'lora_path': LoRA adapter 'qv' cannot be loaded: requests hold all 1 "
                                         r"runtime adapter rows \('max_cpu_loras'\)"):
        engine.add_request("y", prompt, SamplingParams(lora_name="qv", lora_path=adapters["qv-r8"]))
    while engine.has_unfinished():
        engine.step()
    # trained again in place: the next request reads the new files and computes its own KV
    moving = tmp_path / "moving"
    shutil.copytree(adapters["qv-r8"], moving, copy_function=shutil.copy)     # files written now, as training does
    assert run("m", str(moving)) == qv
    shutil.rmtree(moving)
    shutil.copytree(adapters["ko-mlp-r4-rslora"], moving, copy_function=shutil.copy)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert run("m", str(moving)) == ko
    assert engine.stats()["prefix_cache_hit_tokens"] == hits, "blocks of the adapter's old weights were reused"
    assert run("m", str(moving)) == ko and engine.stats()["prefix_cache_hit_tokens"] > hits   # its own: reused
    assert engine.stats()["kv_blocks_used"] == 0


def test_an_adapter_read_again_takes_its_own_row(tiny_checkpoint, adapters, tmp_path):
    """Files changed under a loaded name: the new weights replace the old ones in their row, and the
    other runtime adapter stays loaded (it was the least recently named one, and was forgotten)."""
    engine = runtime_engine(tiny_checkpoint, {}, max_cpu_loras=2)
    lora, prompt = engine.runner.lora, list(range(3, 3 + 40))
    moving = tmp_path / "moving"
    shutil.copytree(adapters["qv-r8"], moving, copy_function=shutil.copy)

    def run(name, path):
        return engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, lora_name=name,
                                                        lora_path=path))[0].token_ids

    run("m", str(moving))
    ko = run("ko", adapters["ko-mlp-r4-rslora"])
    run("m", str(moving))                                   # "ko" is now the least recently named
    rows = dict(lora.ids)
    shutil.rmtree(moving)
    shutil.copytree(adapters["ko-mlp-r4-rslora"], moving, copy_function=shutil.copy)
    assert run("m", str(moving)) == ko                      # the new files
    assert lora.ids == rows and sorted(engine.lora_names) == ["ko", "m"]
    assert lora.lookup("ko", adapters["ko-mlp-r4-rslora"]) == rows["ko"]      # still loaded: not read again


def test_runtime_adapter_refusals_name_the_field(tiny_checkpoint, adapters, tmp_path):
    static = {"qv-r8": adapters["qv-r8"]}
    engine = runtime_engine(tiny_checkpoint, static)
    with pytest.raises(ValueError, match=r"'lora_path': LoRA adapter 'qv-r8' is served from .*qv-r8 \(named at "
                                         r"start-up\), not .*ko-mlp"):
        engine.add_request("a", [1, 2, 3], SamplingParams(lora_name="qv-r8", lora_path=adapters["ko-mlp-r4-rslora"]))
    engine.add_request("b", [1, 2, 3], SamplingParams(lora_name="qv-r8", lora_path=adapters["qv-r8"]))  # its own
    with pytest.raises(LoraError, match=f"LoRA adapter 'gone': directory '{tmp_path}/gone' does not exist"):
        engine.add_request("c", [1, 2, 3], SamplingParams(lora_name="gone", lora_path=str(tmp_path / "gone")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="LoRA adapter 'empty' .*: no adapter_config.json in the directory"):
        engine.add_request("d", [1, 2, 3], SamplingParams(lora_name="empty", lora_path=str(tmp_path / "empty")))
    off = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=64),
                                    lora_modules=static)
    with pytest.raises(ValueError, match=r"'lora_path' '.*ko-mlp-r4-rslora': loading LoRA adapters at runtime is "
                                         r"off \('allow_runtime_lora_updating' is false\)"):
        off.add_request("e", [1, 2, 3], SamplingParams(lora_name="ko", lora_path=adapters["ko-mlp-r4-rslora"]))
    with pytest.raises(ValueError, match="'lora_path' needs 'lora_name'"):
        SamplingParams(lora_path=adapters["qv-r8"])
    with pytest.raises(ValueError, match="'allow_runtime_lora_updating' needs 'enable_lora'"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(allow_runtime_lora_updating=True))
    assert sorted(engine.requests) == ["b"] and not off.has_unfinished()


def test_an_adapter_that_will_not_read_is_the_requests_error(tiny_checkpoint, adapters, tmp_path):
    """Whatever reading an adapter raises is a ValueError naming it (the serving loop refuses the
    request alone; anything else failed the engine and every request after it), also for an adapter
    loaded before whose directory is gone; only a request that is taken reads its adapter (and makes
    another give its row up)."""
    engine = runtime_engine(tiny_checkpoint, {}, max_cpu_loras=1)
    prompt = list(range(3, 3 + 40))

    def run(name, path):
        return engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, lora_name=name,
                                                        lora_path=str(path)))[0].token_ids

    def copy(name, source):
        shutil.copytree(source, tmp_path / name)
        return tmp_path / name

    expected = run("qv", adapters["qv-r8"])
    linked = copy("linked", adapters["qv-r8"])          # a pruned download's link to nothing beside the files
    os.symlink(tmp_path / "no-blob", linked / "adapter_model.safetensors.part")
    assert run("linked", linked) == expected and run("linked", linked) == expected     # read, then looked up
    pattern = copy("pattern", adapters["qv-r8"])
    config = json.loads((pattern / "adapter_config.json").read_text())
    (pattern / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"(": 4}}))
    with pytest.raises(LoraError, match=r"'alpha_pattern' key '\(' is not a regular expression"):
        engine.add_request("pattern", prompt, SamplingParams(lora_name="pattern", lora_path=str(pattern)))
    nested = copy("nested", adapters["qv-r8"])
    (nested / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoraError, match=r"LoRA adapter 'nested' .*: cannot be read: RecursionError"):
        engine.add_request("nested", prompt, SamplingParams(lora_name="nested", lora_path=str(nested)))
    gone = copy("gone", adapters["ko-mlp-r4-rslora"])
    run("gone", gone)
    shutil.rmtree(gone)
    with pytest.raises(LoraError, match=f"LoRA adapter 'gone': directory '{gone}' does not exist"):
        run("gone", gone)
    assert engine.lora_names == ["gone"]
    with pytest.raises(ValueError, match="'thinking_token_budget' needs"):   # refused: reads nothing, evicts nobody
        engine.add_request("x", prompt, SamplingParams(lora_name="qv", lora_path=adapters["qv-r8"],
                                                       thinking_token_budget=4))
    assert engine.lora_names == ["gone"] and engine.stats()["kv_blocks_used"] == 0


def test_files_that_change_while_read_are_refused_and_a_home_path_is_read(tiny_checkpoint, adapters, tmp_path,
                                                                         monkeypatch):
    """A training run saving new files while the adapter is read: the weights read would be filed
    under the new files' key (every later request would run them, and cache their blocks as the new
    ones'); refused instead, and read whole at the next request. '~' is the home directory, as in vLLM."""
    import inflight.lora as lora_module
    engine = runtime_engine(tiny_checkpoint, {})
    prompt = list(range(3, 3 + 40))
    moving = tmp_path / "moving"
    shutil.copytree(adapters["qv-r8"], moving)
    read = lora_module._read_tensors

    def read_then_save(path, fail):
        tensors = read(path, fail)
        shutil.rmtree(moving)
        shutil.copytree(adapters["ko-mlp-r4-rslora"], moving)       # the next checkpoint lands meanwhile
        return tensors

    monkeypatch.setattr(lora_module, "_read_tensors", read_then_save)
    with pytest.raises(LoraError, match="its files changed, or went away, while they were read: load it again"):
        engine.add_request("a", prompt, SamplingParams(lora_name="m", lora_path=str(moving)))
    monkeypatch.setattr(lora_module, "_read_tensors", read)
    params = dict(max_tokens=6, temperature=0)
    expected = engine.generate([prompt], SamplingParams(**params, lora_name="ko",
                                                        lora_path=adapters["ko-mlp-r4-rslora"]))[0].token_ids
    assert engine.generate([prompt], SamplingParams(**params, lora_name="m", lora_path=str(moving)))[0].token_ids \
        == expected
    monkeypatch.setenv("HOME", str(tmp_path))
    assert engine.generate([prompt], SamplingParams(**params, lora_name="home", lora_path="~/moving"))[0].token_ids \
        == expected


def test_an_adapters_requests_count_under_its_name_while_old_weights_run_on(tiny_checkpoint, adapters, tmp_path):
    """Files changed while a request runs: the new request reads them into another row, the old one
    runs on in its own; both are the name's running requests (vLLM's lora_requests_info counts by name)."""
    engine = runtime_engine(tiny_checkpoint, {}, max_cpu_loras=2, max_loras=2)
    moving = tmp_path / "moving"
    shutil.copytree(adapters["qv-r8"], moving, copy_function=shutil.copy)
    engine.add_request("old", list(range(3, 20)), SamplingParams(max_tokens=30, lora_name="m", lora_path=str(moving)))
    engine.step()
    shutil.rmtree(moving)
    shutil.copytree(adapters["ko-mlp-r4-rslora"], moving, copy_function=shutil.copy)
    engine.add_request("new", list(range(3, 20)), SamplingParams(max_tokens=30, lora_name="m", lora_path=str(moving)))
    engine.step()
    stats = engine.stats()
    assert stats["lora_names"] == ["m"] and stats["lora_running"].tolist() == [2]
    assert stats["lora_waiting"].tolist() == [0]


def test_naming_a_runtime_adapter_without_its_path_counts_as_use(tiny_checkpoint, adapters):
    engine = runtime_engine(tiny_checkpoint, {}, max_cpu_loras=2, max_loras=2)
    paths = {"qv": adapters["qv-r8"], "ko": adapters["ko-mlp-r4-rslora"], "all": adapters["all-linear-patterns"]}
    for name in ("qv", "ko"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, lora_name=name, lora_path=paths[name]))
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, lora_name="qv"))     # by name: qv is now the recent one
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, lora_name="all", lora_path=paths["all"]))   # evicts ko
    assert sorted(engine.lora_names) == ["all", "qv"]


def test_adapter_switch_is_checked(tiny_checkpoint, adapters, tmp_path):
    with pytest.raises(ValueError, match=r"'lora_modules' \['qv-r8'\] given but 'enable_lora' is false"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(), lora_modules={"qv-r8": adapters["qv-r8"]})
    with pytest.raises(LoraError, match=f"LoRA adapter 'gone': directory '{tmp_path}/gone' does not exist"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True),
                                  lora_modules={"gone": str(tmp_path / "gone")})


def test_lora_enabled_engine_gives_base_requests_the_base_tokens(tiny_checkpoint, adapters):
    prompts, lengths, _ = make_workload(seed=3, num_prompts=6)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    plain = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=512))
    with_lora = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(enable_lora=True, num_kv_blocks=512),
                                          lora_modules=adapters)
    assert [o.token_ids for o in plain.generate(prompts, params)] == \
        [o.token_ids for o in with_lora.generate(prompts, params)]


@pytest.mark.parametrize("kernels", ["triton", "cpu"])
def test_kernels_give_the_torch_paths_tokens(tiny_checkpoint, adapters, kernels):
    """The whole engine with the SGMV kernels (interpreted on CPU) or the compiled CPU kernel
    against the torch LoRA path: a chunked prefill (budget 32) mixed with decodes of three adapters
    and the base model."""
    prompts = [[5 + i for i in range(n)] for n in (1, 45, 20, 9)]
    params = [SamplingParams(max_tokens=n, temperature=0, lora_name=name) for n, name in zip((5, 3, 4, 4), NAMES)]

    def run(backend):
        engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(
            attention_backend=backend, dtype="float32", enable_lora=True, num_kv_blocks=64, max_num_batched_tokens=32),
            lora_modules=adapters)
        assert engine.runner.lora.use_kernels == (backend == "triton")
        assert (engine.runner.lora.cpu_kernels is not None) == (backend == "cpu")
        return [o.token_ids for o in engine.generate(prompts, params)]

    assert run(kernels) == run("torch")


# ---- the kernels against the torch path, on synthetic stacked weights ----------------------------
SPEC = ModelSpec(vocab_size=64, hidden_size=96, intermediate_size=160, num_layers=1, num_heads=6, num_kv_heads=2,
                 head_dim=16, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, mlp_bias=False,
                 tie_word_embeddings=True, context_length=64, longest_context=64)
# per adapter: rank and modules (slot 1 leaves k and gate/up alone: their columns stay zero)
SYNTHETIC = [(8, ("q_proj", "k_proj", "v_proj", "down_proj")), (4, ("q_proj", "v_proj", "o_proj", "down_proj")),
             (16, ("k_proj", "gate_proj", "up_proj", "down_proj"))]
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# the SGMV kernels run compiled where CUDA is (make gpu-check's kernel stage), else interpreted (no bf16 dot)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available(),
                                        ids=["fp32", "fp16", "bf16"][:2 + torch.cuda.is_available()])


def synthetic_adapters(dtype: torch.dtype, spec: ModelSpec = SPEC) -> list[LoraAdapter]:
    g = torch.Generator().manual_seed(0)
    shapes = module_shapes(spec)
    adapters = []
    for i, (rank, targets) in enumerate(SYNTHETIC):
        modules = {}
        for name in targets:
            fan_in, fan_out = shapes[name]
            # weights representable in `dtype`, so the fp32 reference sees the same numbers
            a = (torch.randn(rank, fan_in, generator=g) * 0.1).to(dtype).float()
            b = (torch.randn(fan_out, rank, generator=g) * 0.1).to(dtype).float()
            modules[(0, name)] = LoraModule(a, b, scale=0.5 + 0.25 * i)
        adapters.append(LoraAdapter(f"a{i}", "", rank, modules))
    return adapters


@KERNEL_DTYPES
@pytest.mark.parametrize("group, lengths", [("qkv", (3, 70, 1)), ("down", (1, 1, 5)), ("gate_up", (2, 0, 40)),
                                            ("o", (17, 4, 0))])
def test_sgmv_kernels_match_the_torch_path(dtype, group, lengths):
    """Base tokens, then runs of `lengths` tokens per adapter slot (64+ takes the large tiles), as
    the runner packs them; the module columns are strided views of the fused output."""
    adapters = synthetic_adapters(dtype)
    kernels = LoraWeights(adapters, SPEC, dtype, KERNEL_DEVICE, kernels="triton")
    reference = LoraWeights(adapters, SPEC, torch.float32, KERNEL_DEVICE, kernels="torch")
    assert kernels.use_kernels and not reference.use_kernels
    row_slots = np.concatenate([np.full(3, -1)] + [np.full(n, slot) for slot, n in enumerate(lengths)])
    counts = np.ones(len(row_slots), dtype=np.int64)
    counts[:3] = (2, 1, 4)                        # base rows: a prefill chunk among decodes
    fan_in = {"qkv": 96, "o": 96, "gate_up": 96, "down": 160}[group]
    fan_out = {"qkv": 96 + 2 * 32, "o": 96, "gate_up": 2 * 160, "down": 96}[group]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), fan_in, generator=g).to(KERNEL_DEVICE, dtype)
    y = (torch.randn(len(x), fan_out, generator=g) * 0.25).to(KERNEL_DEVICE, dtype)
    expected = y.float().clone()
    reference.batch_runs(row_slots, counts).layer(0).add(group, x.float(), expected)
    got = y.clone()
    kernels.batch_runs(row_slots, counts).layer(0).add(group, x, got)
    assert torch.equal(got[:7], y[:7]), "base tokens must not change"
    assert not torch.equal(got, y)
    torch.testing.assert_close(got.float(), expected, atol=ATOL[dtype], rtol=0)


# columns that are not multiples of 16 (q 88, k/v 44, intermediate 100): the kernel's scalar tails
ODD_SPEC = dataclasses.replace(SPEC, hidden_size=88, num_heads=4, head_dim=22, intermediate_size=100)


@pytest.mark.parametrize("spec", [SPEC, ODD_SPEC], ids=["vectors", "tails"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
def test_the_compiled_cpu_kernel_matches_float64(group, dtype, spec, monkeypatch):
    """A mixed step: base rows, a run of 130 tokens (over CPU_KERNEL_MAX_TOKENS) through the matmul
    pair on a window of a shape bucket's rows (144, reaching into the next runs, which it must not
    touch), runs of 5 and 9 tokens (register blocks of four and remainders) through the compiled
    kernel, into a strided view of the fused output; against float64 products."""
    from inflight.lora import CPU_KERNEL_MAX_TOKENS
    matmul_rows, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: matmul_rows.append(len(a)) or mm(a, b))
    weights = LoraWeights(synthetic_adapters(dtype, spec), spec, dtype, torch.device("cpu"), kernels="cpu")
    assert weights.cpu_kernels is not None
    row_slots = np.array([-1, -1, 1, 0, 1, 1, 2, 1, 2])        # grouped by slot below, as the runner packs them
    counts = np.array([3, 1, 1, 130, 1, 1, 8, 2, 1])
    order = np.argsort(row_slots, kind="stable")
    row_slots, counts = row_slots[order], counts[order]
    shapes = module_shapes(spec)
    fan_in = shapes[GROUPS[group][0]][0]
    fan_out = sum(shapes[m][1] for m in GROUPS[group])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(int(counts.sum()), fan_in + 8, generator=g).to(dtype)[:, 8:]
    y = (torch.randn(len(x), fan_out + 8, generator=g) * 0.25).to(dtype)
    batch = weights.batch_runs(row_slots, counts)
    stacked = weights.layers[0][group]
    expected = y.double()
    for slot, start, end in batch.segments:       # the same stacked weights, in float64
        expected[start:end, 8 + stacked.start:8 + stacked.end] += \
            x[start:end].double() @ stacked.a[slot].double() @ stacked.b[slot].double()
    assert [e - s for _, s, e in batch.long_segments] == [130] > [CPU_KERNEL_MAX_TOKENS]
    assert [e - s for _, s, e in batch.short_segments.tolist()] == [5, 9]
    got = y.clone()
    batch.layer(0).add(group, x, got[:, 8:])
    assert matmul_rows == [shape_bucket(130)] == [144]
    assert torch.equal(got[:4], y[:4]) and torch.equal(got[:, :8], y[:, :8]), "base rows and other columns unchanged"
    assert not torch.equal(got, y)
    short = slice(134, 148)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    else:       # the kernel rounds y once; the matmul pair also rounds x A to bfloat16 on the way
        torch.testing.assert_close(got[short].double(), expected[short], atol=1e-6, rtol=2 ** -8)
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("group", ["qkv", "down"])
def test_a_requests_adapter_term_on_cpu_does_not_depend_on_the_other_requests_of_its_adapter(group):
    """The kernel and the matmul pair round differently in bf16, so the path is chosen by each
    request's own tokens in the step: a 60-token prompt takes the kernel alone and beside three
    100-token prompts of its adapter (whose run of 360 tokens took the matmul pair, and the
    fuzz's seeded adapter requests changed with the load); a 200-token chunk takes the matmul."""
    from inflight.lora import CPU_KERNEL_MAX_TOKENS
    weights = LoraWeights(synthetic_adapters(torch.bfloat16, SPEC), SPEC, torch.bfloat16, torch.device("cpu"),
                          kernels="cpu")
    shapes = module_shapes(SPEC)
    fan_in, fan_out = shapes[GROUPS[group][0]][0], sum(shapes[m][1] for m in GROUPS[group])
    g = torch.Generator().manual_seed(7)
    mine = torch.randn(60, fan_in, generator=g).to(torch.bfloat16)
    others = torch.randn(500, fan_in, generator=g).to(torch.bfloat16)

    def my_rows(counts: list[int], mine_at: int) -> torch.Tensor:
        sizes = counts[:mine_at] + counts[mine_at + 1:]
        parts = list(others[:sum(sizes)].split(sizes))
        x = torch.cat(parts[:mine_at] + [mine] + parts[mine_at:])
        y = torch.zeros(len(x), fan_out, dtype=torch.bfloat16)
        batch = weights.batch_runs(np.zeros(len(counts), dtype=np.int64), np.array(counts))
        batch.layer(0).add(group, x, y)
        start = sum(counts[:mine_at])
        return y[start:start + 60]

    alone = my_rows([60], 0)
    assert torch.equal(my_rows([100, 100, 60, 100], 2), alone)
    assert torch.equal(my_rows([100, 60, 200, 1], 1), alone)
    batch = weights.batch_runs(np.zeros(4, dtype=np.int64), np.array([100, 60, 200, 1]))
    assert [e - s for _, s, e in batch.long_segments] == [200] > [CPU_KERNEL_MAX_TOKENS]
    assert batch.short_segments.tolist() == [[0, 0, 160], [0, 360, 361]]


@KERNEL_DTYPES
def test_sgmv_kernels_gather_and_scatter_any_token_order(dtype):
    """The kernels take any token list (shuffled here, segments of 1 to 70 tokens) and strided
    operands; against a per-token float64 product."""
    from inflight.kernels.lora import lora_expand, lora_shrink
    g = torch.Generator().manual_seed(4)
    n, fan_in, rank, fan_out, slots = 120, 80, 24, 72, 3
    x = torch.randn(n, fan_in + 8, generator=g).to(KERNEL_DEVICE, dtype)[:, 4:4 + fan_in]
    a = (torch.randn(slots, fan_in, rank, generator=g) * 0.1).to(KERNEL_DEVICE, dtype)
    b = (torch.randn(slots, rank, fan_out, generator=g) * 0.1).to(KERNEL_DEVICE, dtype)
    y0 = (torch.randn(n, fan_out + 16, generator=g) * 0.25).to(KERNEL_DEVICE, dtype)
    lengths = (70, 1, 30)
    tokens = torch.randperm(n, generator=g)[:sum(lengths)].to(KERNEL_DEVICE, torch.int32)
    starts = torch.tensor([0, 70, 71, 101], dtype=torch.int32, device=KERNEL_DEVICE)
    seg_slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=KERNEL_DEVICE)
    h = torch.full((n, rank * 2), float("nan"), dtype=dtype, device=KERNEL_DEVICE)[:, :rank]
    lora_shrink(x, a, h, tokens, starts, seg_slots, max(lengths))
    y = y0.clone()
    lora_expand(h, b, y[:, 8:8 + fan_out], tokens, starts, seg_slots, max(lengths))
    expected = y0.double().clone()
    for seg, slot in enumerate(seg_slots.tolist()):
        for t in tokens[starts[seg]:starts[seg + 1]].long().tolist():
            expected[t, 8:8 + fan_out] += x[t].double() @ a[slot].double() @ b[slot].double()
    atol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]     # h is rounded to dtype on the way
    torch.testing.assert_close(y.double(), expected, atol=atol, rtol=0)


def test_rows_are_grouped_by_adapter_and_sampling_rows_mapped_back():
    from inflight.batch_table import BatchTable
    from inflight.scheduler import SchedulerOutput
    weights = LoraWeights(synthetic_adapters(torch.float32), SPEC, torch.float32, torch.device("cpu"), False)
    table = BatchTable(8, 64, 16)
    table.lora_id[:5] = (2, -1, 0, 2, 0)
    out = SchedulerOutput(np.arange(5), np.array([1, 5, 1, 1, 3]), np.zeros(5, dtype=np.int64),
                          np.array([True, False, True, True, True]))
    grouped, batch, sample_order = weights.group_step(out, table)
    assert grouped.rows.tolist() == [1, 2, 4, 0, 3] and grouped.num_scheduled.tolist() == [5, 1, 3, 1, 1]
    assert batch.segments == [(0, 5, 9), (2, 9, 11)]
    # out samples rows 0, 2, 3, 4; packed, they are the grouped step's sampling rows 2, 0, 3, 1
    assert grouped.sample_rows[sample_order].tolist() == out.sample_rows.tolist()
    table.lora_id[:5] = -1
    assert weights.group_step(out, table) == (out, None, None)


def test_a_missing_adapter_takes_the_least_recently_used_slot_of_an_adapter_not_in_the_step():
    """On CUDA (make gpu-check) the slots are loaded from pinned host memory, asynchronously."""
    weights = LoraWeights(synthetic_adapters(torch.float32), SPEC, torch.float32, KERNEL_DEVICE, "torch",
                          max_loras=2)
    assert weights.layers[0]["qkv"].a.device.type == KERNEL_DEVICE.type
    assert weights.host[0]["qkv"].a.is_pinned() == (KERNEL_DEVICE.type == "cuda")

    def holds(slot, adapter_id):        # the whole slot: a module the new adapter leaves alone is zero again
        return all(torch.equal(w.a[slot].cpu(), weights.host[0][group].a[adapter_id])
                   and torch.equal(w.b[slot].cpu(), weights.host[0][group].b[adapter_id])
                   for group, w in weights.layers[0].items())

    assert weights.slot_of.tolist() == [0, 1, -1] and weights.num_loads == 0      # the first two fill the slots
    assert holds(0, 0) and holds(1, 1)
    assert weights.activate(np.array([-1, 1, 1])).tolist() == [-1, 1, 1]
    assert weights.activate(np.array([2, -1])).tolist() == [0, -1]       # slot 0 was used least recently
    assert holds(0, 2) and holds(1, 1) and weights.num_loads == 1
    assert weights.activate(np.array([0, 2])).tolist() == [1, 0]         # not slot 0: adapter 2 is in the step
    assert holds(1, 0) and holds(0, 2) and weights.slot_of.tolist() == [1, -1, 0] and weights.num_loads == 2


# ---- model.json / multi_lora.json -------------------------------------------------------------------
def write_version_dir(tmp_path, model_json: dict, multi_lora=None) -> str:
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    (version / "model.json").write_text(json.dumps(model_json))
    if multi_lora is not None:
        (version / "multi_lora.json").write_text(multi_lora if isinstance(multi_lora, str) else json.dumps(multi_lora))
    return str(version)


def test_settings_read_lora_keys_and_multi_lora_json(tmp_path, adapters):
    from inflight.serving.triton_models import Settings
    version = write_version_dir(tmp_path, {"model": "m", "enable_lora": True, "max_loras": 3,
                                           "engine": {"max_lora_rank": 8}},
                                {"qv": os.path.relpath(adapters["qv-r8"], tmp_path / "llm" / "1")})
    settings = Settings.load(version)
    assert (settings.engine.enable_lora, settings.engine.max_loras, settings.engine.max_lora_rank) == (True, 3, 8)
    assert settings.lora_modules == {"qv": os.path.normpath(adapters["qv-r8"])}
    assert settings.lora_file == os.path.join(version, "multi_lora.json")
    off = Settings.load(write_version_dir(tmp_path / "off", {"model": "m"}, "not even JSON"))
    assert not off.engine.enable_lora and off.lora_modules == {}     # LoRA off: multi_lora.json unread


def test_a_repository_for_another_checkpoint_leaves_the_demo_adapter_out(tmp_path, tiny_checkpoint):
    """make_repository (make serve MODEL=...) for another checkpoint: an enable_lora override serves
    no adapter until one is named, instead of failing the load on the shipped model's demo adapter."""
    from inflight.serving.launch import make_repository
    from inflight.serving.triton_models import Settings
    other = Settings.load(os.path.join(make_repository(str(tmp_path / "other"), tiny_checkpoint,
                                                       {"enable_lora": True}), "llm", "1"))
    assert other.engine.enable_lora and other.lora_modules == {}
    shipped = Settings.load(os.path.join(make_repository(str(tmp_path / "shipped")), "llm", "1"))
    assert shipped.engine.enable_lora and list(shipped.lora_modules) == ["pydoc-json"]


@pytest.mark.parametrize("model_json, multi_lora, message", [
    ({"enable_lora": True}, "{nope", "multi_lora.json: not valid JSON"),
    ({"enable_lora": True}, ["a"], "multi_lora.json: must be a JSON object"),
    ({"enable_lora": True}, {"a": 3}, "multi_lora.json: entry 'a': the adapter directory must be a non-empty string"),
    ({"enable_lora": True}, {"a": "missing"}, "multi_lora.json: entry 'a': adapter directory '.*missing' does not exist"),
    ({"enable_lora": True}, '{"a": "one", "a": "two"}', "multi_lora.json: the adapter name 'a' is given 2 times"),
    ({"enable_lora": True, "engine": {"enable_lora": True}}, None,
     "'enable_lora' is given both at the top level and in 'engine'"),
    ({"enable_lora": "yes"}, None, "'enable_lora' must be a boolean"),
    ({"lora_modules": {}}, None, r"unknown key\(s\) \['lora_modules'\]"),
])
def test_bad_lora_settings_name_the_file_and_entry(tmp_path, model_json, multi_lora, message):
    from inflight.serving.startup import StartupError
    from inflight.serving.triton_models import Settings
    with pytest.raises(StartupError, match=message):
        Settings.load(write_version_dir(tmp_path, {"model": "m", **model_json}, multi_lora))

"""Where the llm model loads its engine: on a thread of its own that exits (see run_on_own_thread)."""
import os
import shutil
import threading

import pytest

from inflight.serving.triton_models import run_on_own_thread

from .conftest import DEFAULT_MODEL


def test_work_runs_on_a_thread_that_is_gone_afterwards():
    ran_on = []
    assert run_on_own_thread(lambda: ran_on.append(threading.current_thread()) or 42) == 42
    assert ran_on[0] is not threading.current_thread()
    assert not ran_on[0].is_alive()


def test_its_error_is_raised_on_the_calling_thread():
    def load():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        run_on_own_thread(load)


def test_an_index_file_names_the_shards_that_load(tiny_checkpoint, tmp_path):
    """Mistral's repositories hold sharded weights with an index and a consolidated.safetensors in
    Mistral's own naming: only what model.safetensors.index.json names loads, as in vLLM."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from inflight import EngineConfig, LLMEngine, SamplingParams
    copy = shutil.copytree(tiny_checkpoint, tmp_path / "model")
    weights = load_file(str(copy / "model.safetensors"))
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        name: "model.safetensors" for name in weights}}))
    save_file({"layers.0.attention.wq.weight": next(iter(weights.values()))}, str(copy / "consolidated.safetensors"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = EngineConfig(dtype="float32", num_kv_blocks=64)
    expected = LLMEngine.from_pretrained(tiny_checkpoint, config).generate([[5, 6, 7]], params)[0].token_ids
    assert LLMEngine.from_pretrained(str(copy), config).generate([[5, 6, 7]], params)[0].token_ids == expected


def test_a_tied_config_with_its_own_lm_head_gives_transformers_tokens(tiny_checkpoint, tmp_path):
    """config.json ties the word embeddings, yet the checkpoint holds an lm_head.weight of other
    values: transformers (5.x) keeps that lm_head untied, and so does the engine; one equal to the
    embedding changes nothing."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from inflight import EngineConfig, LLMEngine, SamplingParams
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = EngineConfig(dtype="float64", num_kv_blocks=64)
    tied = LLMEngine.from_pretrained(tiny_checkpoint, config).generate([prompt], params)[0].token_ids
    for name, head in (("own-head", None), ("same-head", "embedding")):
        copy = shutil.copytree(tiny_checkpoint, tmp_path / name)
        weights = load_file(str(copy / "model.safetensors"))
        embedding = weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = (embedding.clone() if head else
                                     torch.randn(embedding.shape, generator=torch.Generator().manual_seed(1)))
        save_file(weights, str(copy / "model.safetensors"))
        got = LLMEngine.from_pretrained(str(copy), config).generate([prompt], params)[0].token_ids
        model = transformers.AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float64)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want
        assert (got == tied) == (head is not None)


def test_loading_a_checkpoint_draws_no_random_weights_first(tiny_checkpoint, monkeypatch):
    """The checkpoint sets every parameter, so the modules are built without their random
    initialisation (seconds per billion parameters); a tied head is the embedding itself, and the
    tokens are transformers' (as every exactness test checks)."""
    import torch
    import transformers

    from inflight import EngineConfig, LLMEngine, SamplingParams
    drawn = []
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        init = getattr(torch.nn.init, name)
        monkeypatch.setattr(torch.nn.init, name,
                            lambda tensor, *a, _init=init, **k: drawn.append(tensor.device.type) or _init(tensor, *a, **k))
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float64", num_kv_blocks=64))
    assert drawn and set(drawn) == {"meta"}
    assert engine.runner.model.lm_head.weight.dtype == torch.float64
    model = engine.runner.model
    assert model.spec.tie_word_embeddings and model.model.embed_tokens.weight.device.type == "cpu"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = [5, 6, 7, 8]
    got = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want


def test_loading_never_changes_torchs_default_dtype(tiny_checkpoint, monkeypatch):
    """torch's default dtype is the whole process's: an engine that set it while building its
    modules, from two threads at once, left it bfloat16 for everything after (a later test's
    float32 tensors came out bfloat16)."""
    import torch

    from inflight import EngineConfig, LLMEngine
    from inflight.models.llama import LlamaForCausalLM
    seen = []
    build = LlamaForCausalLM.__init__

    def building(self, spec):
        seen.append(torch.get_default_dtype())
        build(self, spec)
    monkeypatch.setattr(LlamaForCausalLM, "__init__", building)
    for dtype in ("bfloat16", "float64"):
        engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype=dtype, num_kv_blocks=64))
        assert engine.runner.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert seen == [torch.float32] * 2 and torch.get_default_dtype() == torch.float32


def test_an_index_that_names_a_missing_shard_is_refused_before_loading(tmp_path):
    import json

    from inflight.serving.startup import StartupError, check_shard_index
    index = tmp_path / "model.safetensors.index.json"
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(StartupError, match="names 1 shard file.*'model-00002-of-00002.safetensors'"):
        check_shard_index(str(index))
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(StartupError, match="no 'weight_map'"):
        check_shard_index(str(index))


def test_the_ensemble_steps_read_the_newest_llm_version(tmp_path):
    """preprocessing and postprocessing call `llm` at model_version -1 and read its tokenizer from
    that version's model.json: a repository serving only llm/2 must start them, and the launcher
    find its checkpoint, too."""
    from inflight.serving.launch import make_repository
    from inflight.serving.startup import StartupError
    from inflight.serving.triton_models import llm_settings

    from inflight.serving.launch import served_model
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL)
    os.rename(os.path.join(repo, "llm", "1"), os.path.join(repo, "llm", "2"))
    assert os.path.samefile(llm_settings(os.path.join(repo, "preprocessing")).model_dir, DEFAULT_MODEL)
    assert os.path.samefile(served_model(repo), DEFAULT_MODEL), "the launcher (banner, OpenAI server) too"
    shutil.rmtree(os.path.join(repo, "llm"))
    with pytest.raises(StartupError, match="no llm model"):
        llm_settings(os.path.join(repo, "postprocessing"))


def test_a_config_without_architectures_is_read_by_its_model_type(arch_checkpoints, tmp_path):
    """transformers picks the class by model_type where `architectures` is missing: a Mistral config
    without it was served as a Llama, its sliding window ignored (wrong tokens, no message). One
    whose model_type this engine does not serve is refused naming both fields, as vLLM refuses it."""
    import json
    import shutil

    from inflight import EngineConfig, LLMEngine
    from inflight.serving.startup import StartupError, check_checkpoint
    copy = shutil.copytree(arch_checkpoints["mistral-gqa4-tied"], tmp_path / "mistral")
    config = json.loads((copy / "config.json").read_text())
    config["sliding_window"] = 32
    del config["architectures"]
    (copy / "config.json").write_text(json.dumps(config))
    engine = LLMEngine.from_pretrained(str(copy), EngineConfig(dtype="float32", num_kv_blocks=64))
    assert engine.max_model_len == 32, "the window bounds the context, as for a config that names Mistral"
    served = shutil.copytree(DEFAULT_MODEL, tmp_path / "falcon")
    config = json.loads((served / "config.json").read_text())
    del config["architectures"]
    config["model_type"] = "falcon"
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match="'architectures' is missing and 'model_type' is 'falcon'"):
        check_checkpoint(str(served), "test")


def test_a_checkpoint_directory_named_with_glob_characters_loads(tmp_path):
    """'[8]' in a path is a character class to glob: the weights were not found."""
    import shutil

    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.startup import check_checkpoint
    copy = shutil.copytree(DEFAULT_MODEL, tmp_path / "tiny_[8]*")
    check_checkpoint(str(copy), "test")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    config = EngineConfig(dtype="float32", num_kv_blocks=64)
    expected = LLMEngine.from_pretrained(DEFAULT_MODEL, config).generate([[5, 6, 7]], params)[0].token_ids
    assert LLMEngine.from_pretrained(str(copy), config).generate([[5, 6, 7]], params)[0].token_ids == expected


def test_a_checkpoint_without_tokenizer_files_takes_its_eos_from_its_configs(arch_checkpoints):
    """transformers 5 builds an empty Qwen2 tokenizer for a directory without tokenizer files, whose
    '<|endoftext|>' is id 0: the engine took it as an EOS and ended outputs there."""
    import json

    from inflight import EngineConfig, LLMEngine
    path = arch_checkpoints["qwen2-bias-gqa2"]
    with open(f"{path}/config.json") as f:
        eos = json.load(f).get("eos_token_id")
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", num_kv_blocks=64))
    assert engine.eos_token_ids == (() if eos is None else (eos,))

"""Where the llm model loads its engine: on a thread of its own that exits (see run_on_own_thread)."""
import threading

import pytest

from inflight.serving.triton_models import run_on_own_thread


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

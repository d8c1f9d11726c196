"""Multi-LoRA through a real tritonserver: the shipped repository serves the demo adapter
(model.json enable_lora + multi_lora.json), so the session server has it; `lora_name` over HTTP
and gRPC streaming changes the text and equals the in-process engine, the ensemble passes it on,
per-adapter metrics count it, an unknown name gets an error naming the known ones, and a bad
adapter in multi_lora.json fails the model load naming the file and the entry."""
import json
import os
import shutil

import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.serving.launch import ServerProcess, make_repository
from inflight.testing import make_random_adapter
from inflight_client.streams import grpc_inputs, http_generate, http_stream

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import run_streams, wait_for_metric

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(bool(os.environ.get("INFLIGHT_TEST_MODEL")),
                                 reason="the demo adapter belongs to the shipped model")]

DEMO = "pydoc-json"
DEMO_DIR = os.path.join(os.path.dirname(DEFAULT_MODEL), "loras", DEMO)
PROMPTS = ["The json module", "The assert statement", "A class definition"]


@pytest.fixture(scope="module")
def lora_engine():
    """The in-process engine with the server's settings and the demo adapter."""
    return LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**TEST_ENGINE, enable_lora=True),
                                     lora_modules={DEMO: DEMO_DIR})


def greedy(max_tokens=24, **extra):
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def test_lora_name_over_grpc_streaming_changes_the_output_and_equals_the_engine(server, tokenizer, lora_engine):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    requests = [{"model": "llm", "inputs": grpc_inputs(p, True, greedy(**({"lora_name": DEMO} if lora else {})),
                                                        return_token_ids=True)}
                for lora in (True, False) for p in prompts]
    outs = run_streams(server, requests)          # adapter and base requests in the same batches
    assert all(o.error is None for o in outs)
    with_lora, base = outs[:len(prompts)], outs[len(prompts):]
    expected = lora_engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, lora_name=DEMO))
    assert [o.token_ids for o in with_lora] == [e.token_ids for e in expected]
    expected_base = lora_engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert [o.token_ids for o in base] == [e.token_ids for e in expected_base]
    assert all(a.text != b.text for a, b in zip(with_lora, base)), "the adapter should change every output"


def test_lora_name_over_http_generate_stream_and_the_ensemble(server):
    prompt = PROMPTS[0]
    grpc_text = run_streams(server, [{"model": "llm",
                                      "inputs": grpc_inputs(prompt, True, greedy(lora_name=DEMO))}])[0].text
    reply = http_generate(server.http_url, "llm", {"text_input": prompt, "exclude_input_in_output": True,
                                                   "sampling_parameters": json.dumps(greedy(lora_name=DEMO))})
    assert reply["text_output"] == grpc_text
    as_parameter = http_stream(server.http_url, "llm", {"text_input": prompt, "stream": True, "lora_name": DEMO,
                                                        **greedy()})
    assert as_parameter.error is None and as_parameter.text == grpc_text
    ensemble = http_generate(server.http_url, "ensemble", {"text_input": prompt, "max_tokens": 24, "temperature": 0.0,
                                                           "exclude_input_in_output": True, "lora_name": DEMO})
    assert ensemble["text_output"] == grpc_text
    base = http_generate(server.http_url, "ensemble", {"text_input": prompt, "max_tokens": 24, "temperature": 0.0,
                                                       "exclude_input_in_output": True})
    assert base["text_output"] != grpc_text


def test_unknown_lora_name_is_refused_and_the_server_keeps_serving(server):
    for model in ("llm", "ensemble"):
        reply = http_generate(server.http_url, model, {"text_input": "The", "max_tokens": 4, "lora_name": "nope"})
        assert f"unknown 'lora_name' 'nope'; known: ['{DEMO}']" in reply.get("error", ""), reply
        assert "Traceback" not in reply["error"] and "At:" not in reply["error"]
    streamed = run_streams(server, [{"model": "llm", "inputs": grpc_inputs("The", True, greedy(4, lora_name="nope"))}])[0]
    assert "unknown 'lora_name' 'nope'" in (streamed.error or "")
    assert "text_output" in http_generate(server.http_url, "llm", {"text_input": "The", "max_tokens": 2,
                                                                    "lora_name": DEMO})
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


def test_per_adapter_metrics_count_requests_and_tokens(server):
    labels = {"lora_name": DEMO}
    requests = server.metric("inflight_lora_requests_total", **labels)
    tokens = server.metric("inflight_lora_generation_tokens_total", **labels)
    run_streams(server, [{"model": "llm", "inputs": grpc_inputs(p, True, greedy(5, lora_name=DEMO, ignore_eos=True))}
                         for p in PROMPTS[:2]])
    assert wait_for_metric(server, "inflight_lora_requests_total", requests + 2, **labels) == requests + 2
    assert server.metric("inflight_lora_generation_tokens_total", **labels) == tokens + 10
    assert server.metric("inflight_lora_prompt_tokens_total", **labels) > 0
    refused = http_generate(server.http_url, "llm", {"text_input": "The", "max_tokens": 2, "lora_name": "nope"})
    assert "unknown 'lora_name' 'nope'" in refused.get("error", "")
    assert 'lora_name="nope"' not in server.metrics_text()        # refused names add no series


def test_a_bad_adapter_in_multi_lora_json_fails_the_load_naming_file_and_entry(tmp_path):
    repo = make_repository(str(tmp_path / "repo"), None, TEST_ENGINE)
    version = os.path.join(repo, "llm", "1")
    make_random_adapter(DEFAULT_MODEL, os.path.join(version, "loras", "dora"), r=4, target_modules=["q_proj"],
                        use_dora=True)
    with open(os.path.join(version, "multi_lora.json"), "w") as f:
        json.dump({DEMO: f"loras/{DEMO}", "dora": "loras/dora"}, f)
    shutil.rmtree(os.path.join(repo, "ensemble"))         # only the llm model matters here
    server = ServerProcess(repo, log_path=str(tmp_path / "server.log"), ready_timeout_s=120)
    with pytest.raises(RuntimeError, match="tritonserver exited"):
        server.start()
    log = open(server.log_path, encoding="utf-8", errors="replace").read()
    assert f"{version}/multi_lora.json: LoRA adapter 'dora'" in log and "'use_dora' is set: DoRA" in log, log[-3000:]

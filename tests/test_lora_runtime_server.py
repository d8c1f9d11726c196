"""LoRA adapters loaded while serving, as vLLM's server loads them: POST /v1/load_lora_adapter
through the OpenAI server makes `llm` (engine setting allow_runtime_lora_updating) read the
adapter, the name becomes a model id whose completions and chats equal the in-process engine's,
an adapter that gave its row up (max_cpu_loras) is read again by its next request, unload takes
the name off, and every refusal has vLLM's status and names its field. KV blocks go back."""
import json
import os

import httpx
import openai
import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.detokenizer import decode
from inflight.serving.launch import ServerProcess, make_repository
from inflight.testing import make_random_adapter
from inflight_client.streams import http_generate

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import openai_server, wait_for_metric
from .test_lora_server import DEMO, DEMO_DIR

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(bool(os.environ.get("INFLIGHT_TEST_MODEL")),
                                 reason="the demo adapter belongs to the shipped model")]

# one row for adapters loaded at runtime: a second one takes the first's, and its next request reads it again
ENGINE = {**TEST_ENGINE, "enable_lora": True, "allow_runtime_lora_updating": True, "max_cpu_loras": 1}
PROMPT = "The json module"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {name: make_random_adapter(DEFAULT_MODEL, str(root / name), seed=seed, r=8, lora_alpha=16,
                                      target_modules=modules)
            for name, seed, modules in (("qv", 1, ["q_proj", "v_proj"]), ("mlp", 2, ["gate_proj", "down_proj"]))}


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    with ServerProcess(make_repository(str(tmp_path_factory.mktemp("runtime-lora")), engine=ENGINE)) as server:
        yield server


@pytest.fixture(scope="module")
def api(triton, tmp_path_factory):
    with openai_server(triton.http_url, tmp_path_factory.mktemp("openai"), "--allow-runtime-lora-updating",
                       "--lora-modules", DEMO) as process:
        yield process


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**ENGINE), lora_modules={DEMO: DEMO_DIR})


def route(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(api.base_url.removesuffix("v1") + path.lstrip("/"), json=body, timeout=60)


def expected_text(engine, tokenizer, name: str, path: str, max_tokens: int = 16) -> str:
    out = engine.generate([tokenizer(PROMPT).input_ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                        lora_name=name, lora_path=path))[0]
    return decode(tokenizer, out.token_ids)


def test_a_loaded_adapter_is_a_model_whose_text_equals_the_engines(api, triton, engine, tokenizer, adapters):
    client = openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)
    reply = route(api, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": adapters["qv"]})
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'qv' added successfully.")
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == ["inflight-tiny", DEMO, "qv"]
    assert (listed["qv"].root, listed["qv"].parent) == (adapters["qv"], "inflight-tiny")
    qv = client.completions.create(model="qv", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert qv == expected_text(engine, tokenizer, "qv", adapters["qv"])
    base = client.completions.create(model="inflight-tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert base.choices[0].text != qv, "the adapter should change the text"
    # a second adapter takes the one runtime row (max_cpu_loras 1): qv's next request reads it again
    assert route(api, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": adapters["mlp"]}).status_code == 200
    streamed = client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert client.completions.create(model="qv", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text == qv
    demo = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert demo == expected_text(engine, tokenizer, DEMO, None)
    assert wait_for_metric(triton, "inflight_kv_blocks_used", 0) == 0
    # loaded adapters have their series too: requests (the load's one-token check, then the
    # completions) and the queue gauges vLLM's lora_requests_info is made from
    assert wait_for_metric(triton, "inflight_lora_requests_total", 3, lora_name="qv") == 3
    assert wait_for_metric(triton, "inflight_lora_requests_total", 2, lora_name="mlp") == 2
    assert 'inflight_lora_requests_running{lora_name="qv"' in triton.metrics_text()


def test_load_and_unload_refusals_have_vllms_status(api, adapters, tmp_path):
    cases = [
        ({"lora_name": "qv", "lora_path": adapters["qv"]}, 400,
         "The lora adapter 'qv' has already been loaded. If you want to load the adapter in place, set 'load_inplace' "
         "to True."),
        ({"lora_name": "", "lora_path": adapters["qv"]}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "inflight-tiny", "lora_path": adapters["qv"]}, 400,
         "The lora adapter 'inflight-tiny' conflicts with a served base model."),
        ({"lora_name": DEMO, "lora_path": adapters["qv"]}, 400, f"The lora adapter '{DEMO}' is one of `llm`'s"),
        ({"lora_name": "gone", "lora_path": str(tmp_path / "gone")}, 404,
         f"Loading lora gone failed: No adapter found for {tmp_path}/gone"),
        ({"lora_name": "x", "lora_path": adapters["qv"], "is_3d_lora_weight": True}, 400,
         "'is_3d_lora_weight' is not supported"),
    ]
    route(api, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": adapters["qv"]})
    (tmp_path / "empty").mkdir()            # no adapter_config.json: vLLM's PEFT helper finds no adapter there
    cases.append(({"lora_name": "empty", "lora_path": str(tmp_path / "empty")}, 404,
                  f"Loading lora empty failed: No adapter found for {tmp_path}/empty"))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    cases.append(({"lora_name": "dora", "lora_path": str(tmp_path / "dora")}, 400,
                  "LoRA adapter 'dora' (" + str(tmp_path / "dora") + "): 'use_dora' is set: DoRA adapters are not "
                  "supported"))
    for body, status, message in cases:
        reply = route(api, "/v1/load_lora_adapter", body)
        assert reply.status_code == status and message in reply.json()["error"]["message"], (body, reply.text)
        assert "Traceback" not in reply.text
    models = [m["id"] for m in httpx.get(api.base_url + "/models").json()["data"]]
    assert "gone" not in models and "dora" not in models
    # load_inplace: the same adapter again (nothing changed: nothing is read)
    again = {"lora_name": "qv", "lora_path": adapters["qv"], "load_inplace": True}
    assert route(api, "/v1/load_lora_adapter", again).status_code == 200
    assert route(api, "/v1/unload_lora_adapter", {"lora_name": "qv"}).text == \
        "Success: LoRA adapter 'qv' removed successfully."
    client = openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="The model 'qv' does not exist"):
        client.completions.create(model="qv", prompt=PROMPT, max_tokens=2)
    missing = route(api, "/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The lora adapter 'qv' cannot be found."


def test_llm_loads_by_path_only_where_allowed(triton, server, adapters):
    """`llm`'s own contract: sampling_parameters' lora_path next to lora_name; an engine without
    allow_runtime_lora_updating (the session server's) refuses it by name."""
    params = {"max_tokens": 4, "temperature": 0, "lora_name": "mlp", "lora_path": adapters["mlp"]}
    reply = http_generate(triton.http_url, "llm", {"text_input": PROMPT, "sampling_parameters": json.dumps(params)})
    assert "text_output" in reply, reply
    refused = http_generate(server.http_url, "llm", {"text_input": PROMPT, "sampling_parameters": json.dumps(params)})
    assert "loading LoRA adapters at runtime is off ('allow_runtime_lora_updating' is false)" in refused["error"]
    without_name = http_generate(triton.http_url, "llm", {"text_input": PROMPT, "sampling_parameters": json.dumps(
        {"lora_path": adapters["mlp"]})})
    assert "'lora_path' needs 'lora_name'" in without_name["error"]


def test_the_routes_are_absent_without_the_flag(server, tmp_path):
    with openai_server(server.http_url, tmp_path) as plain:
        reply = httpx.post(plain.base_url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert reply.status_code == 404

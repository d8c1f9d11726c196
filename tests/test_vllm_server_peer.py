"""The OpenAI server side by side with vLLM's own OpenAI server (`make test-vllm-backend`), both in
float32 on the test model, every reply compared but its id and time (floats to 2e-4): embeddings,
score and rerank with `llm` and vLLM run as embedding models; classify, and score and rerank as a
cross-encoder, on the test model made a classifier; greedy completions, chats (streamed too),
tokenize and detokenize, and prompt truncation with both generating; and `llm`'s
`embedding_request` against Triton's real vLLM backend."""
import contextlib
import json
import math
import os
import subprocess
import tempfile
import time

import httpx
import pytest

from inflight.serving.launch import ServerProcess, free_port, make_repository
from inflight.testing import make_classifier_checkpoint
from inflight_client.openai_server.process import OpenAIServerProcess
from inflight_client.streams import http_generate

from .conftest import DEFAULT_MODEL
from .helpers import SOURCE_PATH_ENV, openai_server
from .test_lora_server import DEMO, DEMO_DIR
from .test_vllm_backend_peer import assert_same
from .vllm_peer import PEER_ENGINE, PEER_MODEL, vllm_backend_server

pytestmark = pytest.mark.peer

MAX_MODEL_LEN = 64
MODEL = "inflight-tiny"
QUERY, DOCUMENTS = "What does assert do?", ["The assert statement", "A list", "x"]


@contextlib.contextmanager
def vllm_openai_server(tmp_path, *args, model_dir: str = DEFAULT_MODEL, env: dict | None = None):
    """vLLM's OpenAI server (`vllm serve`) for the test model (or another), with `env` added to its
    environment; its base URL."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail("the peer tests need VLLM_PYTHON (README: OpenAI API)")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("PYTHONPATH", None)
    log = open(tmp_path / "vllm.log", "w")
    process = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                os.path.abspath(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                                "--enforce-eager", "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT,
                               env=env, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, f"vLLM's server did not start: {log.name}"
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        process.wait(60)
        log.close()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """vLLM's server, the test model run as an embedding model."""
    with vllm_openai_server(tmp_path_factory.mktemp("vllm-pooling"), "--runner", "pooling", "--max-model-len",
                            str(MAX_MODEL_LEN), "--enable-lora", "--max-lora-rank", "16", "--lora-modules",
                            f"{DEMO}={DEMO_DIR}") as url:
        yield url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def pooling_llm(tmp_path_factory):
    engine = {"dtype": "float32", "runner": "pooling", "max_model_len": MAX_MODEL_LEN, "cpu_threads": 1}
    with ServerProcess(make_repository(str(tmp_path_factory.mktemp("llm")), DEFAULT_MODEL, engine)) as server:
        yield server


@pytest.fixture(scope="module")
def ours(pooling_llm, tmp_path_factory):
    with openai_server(pooling_llm.http_url, tmp_path_factory.mktemp("openai"), "--max-model-len",
                       str(MAX_MODEL_LEN), "--lora-modules", DEMO) as api:
        yield api.base_url.removesuffix("/v1")


SAME = {
    "embeddings of a list": ("/v1/embeddings", {"input": DOCUMENTS}),
    "embeddings of token ids": ("/v1/embeddings", {"input": [[1, 450, 3974], [1, 319]]}),
    "embeddings, truncated": ("/v1/embeddings", {"input": DOCUMENTS[0], "truncate_prompt_tokens": 3}),
    "embeddings, truncated on the left": ("/v1/embeddings", {"input": DOCUMENTS[0], "truncate_prompt_tokens": 3,
                                                             "truncation_side": "left"}),
    "embeddings, unnormalized": ("/v1/embeddings", {"input": DOCUMENTS[1], "use_activation": False}),
    "embeddings of a conversation": ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
    "embeddings with a LoRA adapter": ("/v1/embeddings", {"input": DOCUMENTS, "model": DEMO}),
    "score 1:N": ("/score", {"queries": QUERY, "documents": DOCUMENTS}),
    "score N:N": ("/score", {"queries": DOCUMENTS, "documents": DOCUMENTS[::-1]}),
    "score, text_1 and text_2 cut per side": ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS,
                                                            "max_tokens_per_query": 3, "max_tokens_per_doc": 2}),
    "score, data_1 and data_2": ("/score", {"data_1": [QUERY], "data_2": DOCUMENTS[:1]}),
    "rerank, top 2": ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    "rerank at Cohere's path": ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    "rerank at Jina's path, one document": ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[2]}),
}


@pytest.mark.parametrize("case", SAME)
def test_the_same_request_gets_the_same_reply(ours, vllm_server, case):
    assert_same_reply(*_both(ours, vllm_server, *SAME[case]), case)


def _both(ours: str, theirs: str, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """The two servers' replies to the same request, the model named (the base, unless it names one)."""
    body = {"model": MODEL, **body}
    return tuple(httpx.post(url + path, json=body, timeout=60) for url in (ours, theirs))


def assert_same_reply(mine: httpx.Response, theirs: httpx.Response, case: str) -> None:
    """Both 200, with the same JSON but the id (its kind's prefix aside) and time."""
    assert (mine.status_code, theirs.status_code) == (200, 200), (mine.text, theirs.text)
    mine, theirs = mine.json(), theirs.json()
    for reply in (mine, theirs):
        reply.pop("created", None)
        assert reply.pop("id").split("-")[0] in ("embd", "score", "classify")
    assert_same(mine, theirs, case)


@pytest.mark.parametrize("path, body", [
    ("/score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}),
    ("/rerank", {"query": QUERY, "documents": []}),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_doc": MAX_MODEL_LEN}),
    ("/v1/embeddings", {"input": "word " * 80}),
])
def test_both_refuse_the_same_requests(ours, vllm_server, path, body):
    body = {"model": MODEL, **body}
    assert [httpx.post(url + path, json=body, timeout=60).status_code for url in (ours, vllm_server)] == [400, 400]


@pytest.fixture(scope="module", params=[1, 3], ids=["one label", "three labels"])
def classifiers(request, tmp_path_factory):
    """(ours, vLLM's): the OpenAI servers of the test model with a score head of 1 or 3 labels."""
    labels = {i: name for i, name in enumerate(["relevant", "neutral", "off-topic"][:request.param])}
    model_dir = make_classifier_checkpoint(DEFAULT_MODEL, str(tmp_path_factory.mktemp("classifier") / MODEL),
                                           request.param, id2label=labels)
    engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "cpu_threads": 1}
    with ServerProcess(make_repository(str(tmp_path_factory.mktemp("llm")), model_dir, engine)) as triton, \
            OpenAIServerProcess(triton.http_url, model_dir, extra=["--max-model-len", str(MAX_MODEL_LEN)],
                                env=SOURCE_PATH_ENV, log_path=str(tmp_path_factory.mktemp("openai") / "log")) as api, \
            vllm_openai_server(tmp_path_factory.mktemp("vllm-classifier"), "--max-model-len", str(MAX_MODEL_LEN),
                               model_dir=model_dir) as theirs:
        yield request.param, api.base_url.removesuffix("/v1"), theirs


CLASSIFIER_SAME = {
    "classify a list": ("/classify", {"input": DOCUMENTS}),
    "classify token ids, raw logits": ("/classify", {"input": [1, 450, 3974], "use_activation": False}),
    "classify, truncated": ("/classify", {"input": DOCUMENTS[0], "truncate_prompt_tokens": 3}),
    "classify a conversation": ("/classify", {"messages": [{"role": "user", "content": "hi"}]}),
    "cross-encoder score 1:N": ("/score", {"queries": QUERY, "documents": DOCUMENTS}),
    "cross-encoder score N:N": ("/score", {"queries": DOCUMENTS, "documents": DOCUMENTS[::-1]}),
    "cross-encoder score cut per side": ("/score", {"queries": "word " * 20, "documents": "other text " * 9,
                                                    "max_tokens_per_query": 5, "max_tokens_per_doc": 3}),
    "cross-encoder score, pair truncated": ("/score", {"queries": "word " * 20, "documents": "other text " * 9,
                                                       "truncate_prompt_tokens": 20}),
    "cross-encoder score, pair truncated on the left": ("/score", {"queries": "word " * 20, "documents": "text " * 9,
                                                                   "truncate_prompt_tokens": 20,
                                                                   "truncation_side": "left"}),
    "cross-encoder rerank, top 2": ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
}


@pytest.mark.parametrize("case", CLASSIFIER_SAME)
def test_a_classifier_replies_as_vllms(classifiers, case):
    labels, ours, theirs = classifiers
    path, body = CLASSIFIER_SAME[case]
    mine, vllms = _both(ours, theirs, path, body)
    if labels > 1 and path != "/classify":      # scores need one label: vLLM serves no such route, ours says why
        assert (mine.status_code, vllms.status_code) == (400, 404), (mine.text, vllms.text)
        assert "needs a classifier of one label" in mine.json()["error"]["message"]
        return
    assert_same_reply(mine, vllms, case)


RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "er"],
            "method": "from_2_way_softmax"}
SCORE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'query' %}<Query>: {{ m.content }}{% else %}\n"
                  "<Document>: {{ m.content }}{% endif %}{% endfor %}"
                  "{% if instruction %}\n<Instruct>: {{ instruction }}{% endif %}")


@pytest.fixture(scope="module", params=[False, True], ids=["two texts", "score template"])
def converted(request, tmp_path_factory):
    """(ours, vLLM's): the test model made a reranker by hf_overrides (as vLLM serves
    Qwen3-Reranker), each server with or without the same score template."""
    root = tmp_path_factory.mktemp("converted")
    template = root / "score.jinja"
    template.write_text(SCORE_TEMPLATE)
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--hf-overrides", json.dumps(RERANKER),
             *(["--chat-template", str(template)] if request.param else [])]
    engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "cpu_threads": 1, "hf_overrides": RERANKER}
    with ServerProcess(make_repository(str(root / "repository"), DEFAULT_MODEL, engine)) as triton, \
            OpenAIServerProcess(triton.http_url, DEFAULT_MODEL, extra=flags, env=SOURCE_PATH_ENV,
                                log_path=str(root / "openai.log")) as api, \
            vllm_openai_server(tmp_path_factory.mktemp("vllm-converted"), *flags) as theirs:
        yield api.base_url.removesuffix("/v1"), theirs


CONVERTED_SAME = {
    "score 1:N": ("/score", {"queries": QUERY, "documents": DOCUMENTS}),
    "rerank with an instruction": ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruction": "Judge it"}),
    "score, pair truncated": ("/score", {"queries": "word " * 20, "documents": "text " * 9,
                                         "truncate_prompt_tokens": 20}),
    "classify": ("/classify", {"input": DOCUMENTS}),
}


@pytest.mark.parametrize("case", CONVERTED_SAME)
def test_a_converted_reranker_replies_as_vllms(converted, case):
    assert_same_reply(*_both(*converted, *CONVERTED_SAME[case]), case)


@pytest.fixture(scope="module")
def pooling_backend(tmp_path_factory):
    engine = {**PEER_ENGINE, "runner": "pooling", "max_model_len": MAX_MODEL_LEN}
    with vllm_backend_server(tmp_path_factory, engine) as server:
        yield server


def test_llms_embedding_request_gets_the_vllm_backends_vector(pooling_llm, pooling_backend):
    """The request Triton's OpenAI frontend sends for /v1/embeddings, to both backends. The one
    difference: the vLLM backend reads only `dimensions` of pooling_params, where `llm` also takes
    vLLM's use_activation (false: the vector unnormalized, as vLLM's server gives it)."""
    for request in ({"input": DOCUMENTS[0], "pooling_params": {}}, {"input": [1, 450, 3974]},
                    {"input": DOCUMENTS[1], "pooling_params": {"use_activation": False}}):
        inputs = {"embedding_request": json.dumps(request), "return_num_input_tokens": True,
                  "return_num_output_tokens": True}
        mine = http_generate(pooling_llm.http_url, "llm", inputs)
        theirs = http_generate(pooling_backend.http_url, PEER_MODEL, inputs)
        assert "error" not in mine and "error" not in theirs, (mine, theirs)
        vector = json.loads(mine["text_output"])
        norm = math.sqrt(sum(v * v for v in vector))
        if request.get("pooling_params", {}).get("use_activation") is False:
            assert abs(norm - 1) > 1e-3
            vector = [v / norm for v in vector]
        assert_same(vector, json.loads(theirs["text_output"]), json.dumps(request))
        assert (mine["num_input_tokens"], mine["num_output_tokens"]) == \
            (theirs["num_input_tokens"], theirs["num_output_tokens"])


@pytest.fixture(scope="module")
def generating(tmp_path_factory):
    """Both servers generating: vLLM's, and the OpenAI server in front of `llm`."""
    engine = {"dtype": "float32", "max_model_len": 256, "cpu_threads": 1}
    repository = make_repository(str(tmp_path_factory.mktemp("llm-generate")), DEFAULT_MODEL, engine)
    with vllm_openai_server(tmp_path_factory.mktemp("vllm-generate"), "--max-model-len", "256") as theirs, \
            ServerProcess(repository) as llm, \
            openai_server(llm.http_url, tmp_path_factory.mktemp("openai-generate"), "--max-model-len", "256") as api:
        yield api.base_url.removesuffix("/v1"), theirs


@pytest.mark.parametrize("side", [None, "left", "right"])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "The assert statement is a convenient way"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "The assert "
                                                                  "statement is a convenient way"}]})])
def test_a_prompt_is_truncated_as_vllm_truncates_it(generating, side, path, body):
    """truncate_prompt_tokens without a side (the tokenizer's truncation: the BOS it adds stays)
    and with either side given (the token ids cut), as `prompt_token_ids` shows it."""
    body = {"model": MODEL, **body, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": 4,
            "return_token_ids": True, **({"truncation_side": side} if side else {})}
    replies = [httpx.post(url + path, json=body, timeout=60).json() for url in generating]
    ids = [reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"] for reply in replies]
    assert ids[0] == ids[1] and len(ids[0]) == 4


def _without_vllms_nulls(mine, theirs):
    """vLLM's reply less the fields it sends as null (or empty) where this server leaves them out
    (kv_transfer_params, token_ids, ...), and the ids and times; the prompt_logprobs vLLM adds to
    an echo with logprobs, whose values this server gives in `logprobs` as OpenAI's API does."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return {key: _without_vllms_nulls(mine.get(key), value) for key, value in theirs.items()
                if key in mine or (value not in (None, [], {}) and key != "prompt_logprobs")}
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        return [_without_vllms_nulls(a, b) for a, b in zip(mine, theirs)]
    return theirs


def _comparable(reply):
    if isinstance(reply, dict):
        return {key: _comparable(value) for key, value in reply.items() if key not in ("id", "created",
                                                                                      "system_fingerprint")}
    return [_comparable(value) for value in reply] if isinstance(reply, list) else reply


CHAT = [{"role": "user", "content": "The assert statement"}]
GENERATION = {
    "a completion": ("/v1/completions", {"prompt": "The assert statement", "max_tokens": 8}),
    "two prompts, echo and logprobs": ("/v1/completions", {"prompt": ["The assert statement", "Hi"], "max_tokens": 5,
                                                           "logprobs": 2, "echo": True}),
    "a stop string": ("/v1/completions", {"prompt": "The assert statement", "max_tokens": 30, "stop": ["non"]}),
    "a chat with top logprobs": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 8,
                                                          "logprobs": True, "top_logprobs": 2}),
    "a streamed completion with usage": ("/v1/completions", {"prompt": "The assert statement", "max_tokens": 4,
                                                             "stream": True,
                                                             "stream_options": {"include_usage": True}}),
    "a streamed chat with usage": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True,
                                                            "stream_options": {"include_usage": True}}),
    "tokenize a prompt": ("/tokenize", {"prompt": "The assert statement"}),
    "tokenize a chat": ("/tokenize", {"messages": CHAT}),
    "detokenize": ("/detokenize", {"tokens": [1, 450, 3974]}),
}


def _reply(url: str, body: dict):
    if not body.get("stream"):
        return httpx.post(url, json=body, timeout=60).json()
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("case", GENERATION)
def test_generation_replies_as_vllms_server(generating, case):
    """Greedy, so the same tokens: every field vLLM's server sends, equal (its null extras aside)."""
    path, body = GENERATION[case]
    body = {"model": MODEL, "temperature": 0, **body} if path.startswith("/v1") else {"model": MODEL, **body}
    mine, theirs = (_comparable(_reply(url + path, body)) for url in generating)
    assert_same(mine, _without_vllms_nulls(mine, theirs), case)


@pytest.fixture(scope="module")
def runtime_lora(tmp_path_factory):
    """Both servers loading adapters at runtime: vLLM's (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the
    OpenAI server in front of `llm` with allow_runtime_lora_updating."""
    engine = {"dtype": "float32", "max_model_len": 256, "cpu_threads": 1, "enable_lora": True,
              "allow_runtime_lora_updating": True}
    repository = make_repository(str(tmp_path_factory.mktemp("llm-runtime-lora")), DEFAULT_MODEL, engine)
    with vllm_openai_server(tmp_path_factory.mktemp("vllm-runtime-lora"), "--max-model-len", "256", "--enable-lora",
                            "--max-lora-rank", "16", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as theirs, \
            ServerProcess(repository) as llm, \
            openai_server(llm.http_url, tmp_path_factory.mktemp("openai-runtime-lora"), "--max-model-len", "256",
                          "--allow-runtime-lora-updating") as api:
        yield api.base_url.removesuffix("/v1"), theirs


def test_adapters_load_and_unload_at_runtime_as_in_vllms_server(runtime_lora, tmp_path):
    """The same replies, step by step: a load, the adapter listed and its greedy completion, a
    second load refused, an unload, a second unload refused, a directory that is not there or holds no
    adapter."""
    def both(method: str, path: str, body: dict | None = None) -> list[httpx.Response]:
        return [httpx.request(method, url + path, json=body, timeout=120) for url in runtime_lora]

    def same(replies: list[httpx.Response], step: str) -> None:
        mine, theirs = replies
        assert mine.status_code == theirs.status_code, (step, mine.text, theirs.text)
        if mine.status_code == 200:
            assert mine.text == theirs.text, step
        else:       # vLLM writes <path> for any path in an error message; this server leaves it
            assert mine.json()["error"]["message"].replace(str(tmp_path / "gone"), "<path>") == \
                theirs.json()["error"]["message"], step

    load = {"lora_name": "demo", "lora_path": DEMO_DIR}
    same(both("POST", "/v1/load_lora_adapter", load), "load")
    listed = [r.json()["data"] for r in both("GET", "/v1/models")]
    assert [(m["id"], m["root"], m["parent"]) for m in listed[0] if m["id"] != MODEL] == \
        [(m["id"], m["root"], m["parent"]) for m in listed[1] if m["id"] != MODEL] == [("demo", DEMO_DIR, MODEL)]
    completion = {"model": "demo", "prompt": "The assert statement", "max_tokens": 8, "temperature": 0}
    mine, theirs = (_comparable(r.json()) for r in both("POST", "/v1/completions", completion))
    assert_same(mine, _without_vllms_nulls(mine, theirs), "a completion with the loaded adapter")
    same(both("POST", "/v1/load_lora_adapter", load), "loaded twice")
    same(both("POST", "/v1/unload_lora_adapter", {"lora_name": "demo"}), "unload")
    same(both("POST", "/v1/unload_lora_adapter", {"lora_name": "demo"}), "unloaded twice")
    assert [r.status_code for r in both("POST", "/v1/completions", completion)] == [404, 404]
    same(both("POST", "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "gone")}),
         "a directory that is not there")
    (tmp_path / "empty").mkdir()
    replies = both("POST", "/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": str(tmp_path / "empty")})
    assert [r.status_code for r in replies] == [404, 404], [r.text for r in replies]     # no adapter_config.json

"""Embeddings served: `llm` with runner "pooling" behind a real tritonserver answers the vLLM
backend's `embedding_request` exactly as Triton's OpenAI frontend sends it, and the OpenAI
server's /v1/embeddings through the official `openai` SDK (base64, as the SDK asks by default,
and floats); both equal the engine's own vectors; every refusal names its field; KV blocks go back."""
import json

import httpx
import openai
import pytest

from inflight import EngineConfig, LLMEngine
from inflight.pooling import PoolingParams
from inflight.serving.launch import ServerProcess, make_repository
from inflight_client.streams import http_generate

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .test_lora_server import DEMO, DEMO_DIR
from .helpers import openai_server

pytestmark = pytest.mark.server

# LoRA as the shipped repository has it, and adapters loaded at runtime too
POOLING_ENGINE = {**TEST_ENGINE, "runner": "pooling", "max_model_len": 64, "enable_lora": True,
                  "allow_runtime_lora_updating": True}
TEXTS = ["The assert statement", "A class definition defines a class object", "x"]


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    repo = make_repository(str(tmp_path_factory.mktemp("pooling")), DEFAULT_MODEL, POOLING_ENGINE)
    with ServerProcess(repo) as server:
        yield server


@pytest.fixture(scope="module")
def client(pooling_server, tmp_path_factory):
    with openai_server(pooling_server.http_url, tmp_path_factory.mktemp("openai"), "--max-model-len", "64",
                       "--lora-modules", DEMO, "--allow-runtime-lora-updating") as api:
        yield openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**POOLING_ENGINE))


def test_the_openai_frontends_embedding_request_gets_the_engines_vector(pooling_server, engine, tokenizer):
    """The inputs Triton's OpenAI frontend sends the vLLM backend (embedding_request's JSON, the
    two counts), and what it reads back (text_output's JSON, num_input_tokens)."""
    ids = tokenizer(TEXTS[0]).input_ids
    [want] = engine.embed([ids])
    reply = http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": TEXTS[0], "pooling_params": {}}),
        "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert json.loads(reply["text_output"]) == want.embedding
    assert (reply["num_input_tokens"], reply["num_output_tokens"]) == (len(ids), 0)
    reply = http_generate(pooling_server.http_url, "llm", {"embedding_request": json.dumps({"input": ids})})
    assert json.loads(reply["text_output"]) == want.embedding
    for request, message in (
            ({"input": []}, "'embedding_request.input' must be a string or a non-empty list of token ids"),
            ({"input": "x", "pooling_params": {"dimensions": [8]}}, "'dimensions' (8): this model does not support "
                                                                     "Matryoshka embeddings"),
            ({"input": "x", "pooling_params": {"normalize": False}}, "unknown key(s) ['normalize']"),
            ({"text": "x"}, "'embedding_request' must be a JSON object with an 'input'")):
        assert message in http_generate(pooling_server.http_url, "llm",
                                        {"embedding_request": json.dumps(request)})["error"]
    too_long = http_generate(pooling_server.http_url, "llm", {"embedding_request": json.dumps({"input": [5] * 64})})
    assert "'embedding_request.input' (64 tokens) must be shorter than max_model_len (64)" in too_long["error"]
    assert "give it without ['text_input']" in http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": "x"}), "text_input": "x"})["error"]
    assert "'queue_heartbeat' needs 'stream' = true" in http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": "x"}), "queue_heartbeat": True})["error"]
    assert "it serves embedding requests, not generation" in http_generate(
        pooling_server.http_url, "llm", {"text_input": "x", "max_tokens": 2})["error"]
    assert pooling_server.metric("inflight_kv_blocks_used") == 0


def test_a_generating_llm_refuses_an_embedding_request(server):
    reply = http_generate(server.http_url, "llm", {"embedding_request": json.dumps({"input": "x"})})
    assert 'embeddings need a model run as an embedding model (the engine setting runner "pooling"' in reply["error"]


def test_openai_sdk_embeddings_equal_the_engines(client, engine, tokenizer):
    ids = [tokenizer(text).input_ids for text in TEXTS]
    want = [out.embedding for out in engine.embed(ids)]
    default = client.embeddings.create(model="inflight-tiny", input=TEXTS)       # the SDK asks for base64
    floats = client.embeddings.create(model="inflight-tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list"
    assert [d.embedding for d in floats.data] == want
    as_ids = client.embeddings.create(model="inflight-tiny", input=ids, encoding_format="float")
    assert [d.embedding for d in as_ids.data] == want
    assert all(abs(a - b) < 1e-6 for d, w in zip(default.data, want) for a, b in zip(d.embedding, w))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    raw = client.embeddings.create(model="inflight-tiny", input=ids[1], extra_body={"use_activation": False})
    assert abs(sum(v * v for v in raw.data[0].embedding) - 1) > 1e-3          # the hidden state itself
    [unit] = engine.embed([ids[1]], PoolingParams(use_activation=True))
    norm = sum(v * v for v in raw.data[0].embedding) ** 0.5
    assert all(abs(v / norm - u) < 1e-6 for v, u in zip(raw.data[0].embedding, unit.embedding))     # float32
    cut = client.embeddings.create(model="inflight-tiny", input=TEXTS[1], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 3})
    [first] = engine.embed([ids[1][:3]])       # a pooling model's prompt keeps its first tokens, as in vLLM
    assert cut.usage.prompt_tokens == 3 and cut.data[0].embedding == first.embedding
    tail = client.embeddings.create(model="inflight-tiny", input=TEXTS[1], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 3, "truncation_side": "left"})
    [last] = engine.embed([ids[1][-3:]])       # an explicit side cuts the ids, as vLLM's: the BOS goes
    assert tail.data[0].embedding == last.embedding


def test_a_lora_adapters_embeddings_are_the_engines_with_its_weights(client, pooling_server, tokenizer):
    """`model` naming an adapter (the shipped demo one, in multi_lora.json) computes the vectors
    with its weights; `llm`'s embedding_request takes its lora_name."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**POOLING_ENGINE), lora_modules={DEMO: DEMO_DIR})
    ids = [tokenizer(text).input_ids for text in TEXTS]
    want = [out.embedding for out in engine.embed(ids, lora_name=DEMO)]
    got = client.embeddings.create(model=DEMO, input=TEXTS, encoding_format="float")
    assert all(close(d.embedding, w) for d, w in zip(got.data, want)) and got.model == DEMO
    base = client.embeddings.create(model="inflight-tiny", input=TEXTS[:1], encoding_format="float")
    assert not close(base.data[0].embedding, want[0])
    reply = http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": ids[0], "lora_name": DEMO})})
    assert close(json.loads(reply["text_output"]), want[0])
    refused = http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": ids[0], "lora_name": "nope"})})
    assert "unknown 'lora_name' 'nope'" in refused["error"]
    # the same adapter loaded at runtime under another name (the server's one-token check is an
    # embedding on this model): the same vectors, through the SDK and embedding_request's lora_path
    loaded = httpx.post(str(client.base_url) + "load_lora_adapter", json={"lora_name": "again", "lora_path": DEMO_DIR})
    assert loaded.status_code == 200, loaded.text
    again = client.embeddings.create(model="again", input=TEXTS, encoding_format="float")
    assert all(close(d.embedding, w) for d, w in zip(again.data, want))
    reply = http_generate(pooling_server.http_url, "llm", {
        "embedding_request": json.dumps({"input": ids[0], "lora_name": "by-path", "lora_path": DEMO_DIR})})
    assert close(json.loads(reply["text_output"]), want[0])
    assert pooling_server.metric("inflight_kv_blocks_used") == 0


def close(got, want) -> bool:
    return len(got) == len(want) and all(abs(g - w) < 1e-6 for g, w in zip(got, want))


def test_chat_form_embeddings_render_the_conversation_with_the_chat_template(client, engine, tokenizer):
    """vLLM's chat form of /v1/embeddings: `messages` (or chat messages as `input`), one
    conversation or several, rendered without a generation prompt or added special tokens by
    default."""
    first = [{"role": "system", "content": "Embed the query."}, {"role": "user", "content": "The assert statement"}]
    second = [{"role": "user", "content": "A list"}]
    url = str(client.base_url) + "embeddings"

    def engine_vector(conversation, **template):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **template)
        return engine.embed([tokenizer(text, add_special_tokens=False).input_ids])[0].embedding

    for body in ({"messages": first}, {"input": first}):
        reply = httpx.post(url, json=body).json()
        assert reply["data"][0]["embedding"] == engine_vector(first, add_generation_prompt=False)
    both = httpx.post(url, json={"messages": [first, second]}).json()
    assert [d["embedding"] for d in both["data"]] == [engine_vector(first), engine_vector(second)]
    prompted = httpx.post(url, json={"messages": second, "add_generation_prompt": True}).json()
    assert prompted["data"][0]["embedding"] == engine_vector(second, add_generation_prompt=True)
    for body, param, message in (({"input": "x", "add_generation_prompt": True}, "add_generation_prompt",
                                  "'add_generation_prompt' goes with 'messages', not 'input'"),
                                 ({"input": "x", "messages": second}, "input", "give exactly one of 'input' and "
                                                                              "'messages'"),
                                 ({"messages": [[]]}, "messages", "'messages' must not hold an empty conversation")):
        error = httpx.post(url, json=body).json()["error"]
        assert (error["param"], message in error["message"]) == (param, True), error


def test_cache_salt_keeps_embeddings_from_each_others_prefix_cache(client, pooling_server):
    """vLLM's cache_salt on a pooling request: only requests with the same salt share cached blocks;
    the vector is the same either way."""
    text = "A class definition defines a class object, " * 3         # a few blocks of tokens
    vectors = []
    for salt, shares in (("tenant-a", False), ("tenant-a", True), ("tenant-b", False)):
        hits = pooling_server.metric("inflight_prefix_cache_hits_total")
        reply = client.embeddings.create(model="inflight-tiny", input=text, encoding_format="float",
                                         extra_body={"cache_salt": salt})
        vectors.append(reply.data[0].embedding)
        assert (pooling_server.metric("inflight_prefix_cache_hits_total") > hits) == shares, salt
    assert all(abs(a - b) < 1e-9 for v in vectors[1:] for a, b in zip(v, vectors[0]))


@pytest.mark.parametrize("kwargs, status, param, message", [
    (dict(input=[]), 400, "input", "'input' must not be empty"),
    (dict(input="x", dimensions=8), 400, "dimensions", "does not support Matryoshka embeddings"),
    (dict(input=[1, 10**6]), 400, "input", "'input': token id 1000000 at position 1 is outside the vocabulary"),
    (dict(input="word " * 80), 400, "input", "This model's maximum context length is 64 tokens. However, you "
                                              "requested"),
    (dict(input="x", model="other"), 404, "model", "The model 'other' does not exist"),
    (dict(input="x", extra_body={"embed_dtype": "float16"}), 400, "embed_dtype", "'embed_dtype'"),
])
def test_embedding_errors_name_their_field(client, pooling_server, kwargs, status, param, message):
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(**{"model": "inflight-tiny", "encoding_format": "float", **kwargs})
    error = caught.value
    assert (error.status_code, error.body["param"]) == (status, param) and message in error.body["message"]
    assert pooling_server.metric("inflight_kv_blocks_used") == 0


def test_completions_on_an_embedding_model_are_refused(client):
    base = str(client.base_url)
    reply = httpx.post(base + "completions", json={"model": "inflight-tiny", "prompt": "x"})
    assert reply.status_code == 400
    assert "it serves embedding requests, not generation" in reply.json()["error"]["message"]


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5


def test_score_and_rerank_are_the_cosines_of_the_engines_embeddings(client, engine, tokenizer, pooling_server):
    """vLLM's /score and /rerank for an embedding model: each text embedded once, a pair scored by
    the cosine of its vectors, 1:N and N:N, under every pair of field names vLLM takes."""
    base = str(client.base_url).removesuffix("v1/")
    query, documents = "What is an assert statement?", TEXTS
    vectors = [out.embedding for out in engine.embed([tokenizer(t).input_ids for t in [query, *documents]])]
    want = [cosine(vectors[0], v) for v in vectors[1:]]
    tokens = sum(len(tokenizer(t).input_ids) for t in [query, *documents])
    for path, sides in (("score", ("queries", "documents")), ("v1/score", ("queries", "items")),
                        ("score", ("data_1", "data_2")), ("score", ("text_1", "text_2"))):
        reply = httpx.post(base + path, json={"model": "inflight-tiny", sides[0]: query, sides[1]: documents}).json()
        assert [d["index"] for d in reply["data"]] == [0, 1, 2] and reply["object"] == "list"
        assert all(abs(d["score"] - w) < 1e-6 for d, w in zip(reply["data"], want)), (reply, want)
        assert reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"] == tokens
        assert reply["id"].startswith("score-")
    pairs = httpx.post(base + "score", json={"queries": documents[::-1], "documents": documents}).json()
    by_position = [cosine(a, b) for a, b in zip(vectors[1:][::-1], vectors[1:])]
    assert all(abs(d["score"] - w) < 1e-6 for d, w in zip(pairs["data"], by_position))
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    for path in ("rerank", "v1/rerank", "v2/rerank"):
        reply = httpx.post(base + path, json={"model": "inflight-tiny", "query": query, "documents": documents}).json()
        assert [r["index"] for r in reply["results"]] == order
        assert [r["document"]["text"] for r in reply["results"]] == [documents[i] for i in order]
        assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-6 for r in reply["results"])
        assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    best = httpx.post(base + "rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
    assert [r["index"] for r in best["results"]] == order[:2]
    cut = httpx.post(base + "score", json={"queries": query, "documents": documents, "max_tokens_per_doc": 2,
                                           "max_tokens_per_query": 3}).json()
    short = [tokenizer(t).input_ids[:4] for t in [query]] + [tokenizer(t).input_ids[:3] for t in documents]
    cut_vectors = [out.embedding for out in engine.embed(short)]
    assert all(abs(d["score"] - cosine(cut_vectors[0], v)) < 1e-6 for d, v in zip(cut["data"], cut_vectors[1:]))
    assert cut["usage"]["prompt_tokens"] == sum(map(len, short))
    assert pooling_server.metric("inflight_kv_blocks_used") == 0


@pytest.mark.parametrize("path, body, param, message", [
    ("score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}, "documents",
     "Input lengths must be either 1:1, 1:N or N:N (got 2 'queries' and 3 'documents')"),
    ("score", {"text_1": "a", "documents": ["b"]}, "queries", "give one pair of sides to score"),
    ("score", {"queries": "a", "documents": []}, "documents", "'documents' must hold at least one text"),
    ("score", {"queries": "a", "documents": "b", "max_tokens_per_doc": 64}, "max_tokens_per_doc",
     "'max_tokens_per_doc' (64) must be less than max_model_len (64)"),
    ("score", {"queries": "a", "documents": ["word " * 80]}, "documents",
     "This model's maximum context length is 64 tokens"),
    ("rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("rerank", {"query": "a", "documents": [{"content": [{"type": "text", "text": "b"}]}]}, "documents",
     "'documents': Input should be a valid string"),         # multimodal parts: text models only
    ("rerank", {"query": "a", "documents": ["b"], "model": "other"}, "model", "The model 'other' does not exist"),
])
def test_score_and_rerank_errors_name_their_field(client, pooling_server, path, body, param, message):
    reply = httpx.post(str(client.base_url).removesuffix("v1/") + path, json=body)
    assert reply.status_code == (404 if param == "model" else 400)
    error = reply.json()["error"]
    assert param in error["param"] and message in error["message"], error
    assert pooling_server.metric("inflight_kv_blocks_used") == 0

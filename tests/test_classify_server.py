"""A classifier served: `llm` answers an `embedding_request` of task "classify" with the engine's
class scores; the OpenAI server's /classify names the likeliest label from config.json, and its
/score and /rerank on a one-label classifier score each pair whole (vLLM's cross-encoder: the
tokenizer's pair encoding), with vLLM's truncation rules; refusals name their field; KV blocks
go back."""
import json
import os

import httpx
import pytest

from inflight import EngineConfig, LLMEngine
from inflight.serving.launch import ServerProcess, make_repository
from inflight.testing import make_classifier_checkpoint
from inflight_client.openai_server.process import OpenAIServerProcess
from inflight_client.streams import http_generate

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import SOURCE_PATH_ENV

pytestmark = pytest.mark.server

ENGINE = {**TEST_ENGINE, "max_model_len": 64}
QUERY, DOCUMENTS = "What is an assert statement?", ["The assert statement", "A class definition defines a class", "x"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """The test model's decoder with a one-label score head: a cross-encoder."""
    path = str(tmp_path_factory.mktemp("checkpoints") / "inflight-tiny-reranker")
    return make_classifier_checkpoint(DEFAULT_MODEL, path, 1, id2label={0: "relevant"})


@pytest.fixture(scope="module")
def triton(reranker, tmp_path_factory):
    repo = make_repository(str(tmp_path_factory.mktemp("classify")), reranker, ENGINE)
    with ServerProcess(repo) as server:
        yield server


@pytest.fixture(scope="module")
def base(triton, reranker, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("openai") / "openai.log")
    with OpenAIServerProcess(triton.http_url, reranker, extra=["--max-model-len", "64"], env=SOURCE_PATH_ENV,
                             log_path=log) as api:
        yield api.base_url.removesuffix("v1")


@pytest.fixture(scope="module")
def engine(reranker):
    return LLMEngine.from_pretrained(reranker, EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def tokenizer(reranker):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(reranker)


def scores(engine, prompts, use_activation=None) -> list[float]:
    return [out.embedding[0] for out in engine.classify(prompts, use_activation)]


def close(got, want) -> bool:
    return len(got) == len(want) and all(abs(g - w) < 1e-6 for g, w in zip(got, want))


def test_llm_classifies_the_embedding_request_of_task_classify(triton, engine, tokenizer):
    ids = tokenizer(DOCUMENTS[0]).input_ids
    reply = http_generate(triton.http_url, "llm", {
        "embedding_request": json.dumps({"input": DOCUMENTS[0], "pooling_params": {"task": "classify"}}),
        "return_num_input_tokens": True})
    assert close(json.loads(reply["text_output"]), [scores(engine, [ids])[0]])
    assert reply["num_input_tokens"] == len(ids)
    refused = http_generate(triton.http_url, "llm", {"embedding_request": json.dumps({"input": "x"})})
    assert "this model is a classifier, whose pooling task is classify" in refused["error"]
    assert triton.metric("inflight_kv_blocks_used") == 0


def test_classify_gives_the_engines_probabilities_and_the_configs_label(base, engine, tokenizer, reranker):
    ids = [tokenizer(text).input_ids for text in DOCUMENTS]
    reply = httpx.post(base + "classify", json={"model": "inflight-tiny-reranker", "input": DOCUMENTS}).json()
    assert reply["id"].startswith("classify-") and reply["object"] == "list"
    assert reply["model"] == os.path.basename(reranker)
    assert [d["index"] for d in reply["data"]] == [0, 1, 2]
    assert all(d["label"] == "relevant" and d["num_classes"] == 1 for d in reply["data"])
    assert close([d["probs"][0] for d in reply["data"]], scores(engine, ids))
    tokens = sum(map(len, ids))
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
    raw = httpx.post(base + "classify", json={"input": ids[1], "use_activation": False}).json()
    assert close(raw["data"][0]["probs"], scores(engine, [ids[1]], use_activation=False))
    chat = [{"role": "user", "content": QUERY}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    reply = httpx.post(base + "classify", json={"messages": chat}).json()
    want = scores(engine, [tokenizer(rendered, add_special_tokens=False).input_ids])
    assert close(reply["data"][0]["probs"], want)


def test_score_and_rerank_on_a_classifier_score_each_pair_as_a_cross_encoder(base, engine, tokenizer, triton):
    pairs = [tokenizer(QUERY, text_pair=document).input_ids for document in DOCUMENTS]
    want = scores(engine, pairs)
    tokens = sum(map(len, pairs))
    for path, sides in (("score", ("queries", "documents")), ("v1/score", ("text_1", "text_2"))):
        reply = httpx.post(base + path, json={sides[0]: QUERY, sides[1]: DOCUMENTS}).json()
        assert close([d["score"] for d in reply["data"]], want), (reply, want)
        assert reply["usage"]["prompt_tokens"] == tokens
    by_position = httpx.post(base + "score", json={"queries": DOCUMENTS[::-1], "documents": DOCUMENTS}).json()
    assert close([d["score"] for d in by_position["data"]],
                 scores(engine, [tokenizer(a, text_pair=b).input_ids for a, b in zip(DOCUMENTS[::-1], DOCUMENTS)]))
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    reply = httpx.post(base + "rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
    assert [r["index"] for r in reply["results"]] == order[:2]
    assert close([r["relevance_score"] for r in reply["results"]], [want[i] for i in order[:2]])
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert triton.metric("inflight_kv_blocks_used") == 0


def test_a_cross_encoders_pairs_are_cut_as_vllm_cuts_them(base, engine, tokenizer):
    long_query, document = "word " * 20, "another text " * 8

    def score(**body) -> float:
        reply = httpx.post(base + "score", json={"queries": long_query, "documents": document, **body}).json()
        return reply["data"][0]["score"], reply["usage"]["prompt_tokens"]

    # no side: the tokenizer truncates the pair, longest first; a side: the ids themselves
    ids = tokenizer(long_query, text_pair=document, truncation=True, max_length=20).input_ids
    assert score(truncate_prompt_tokens=20) == pytest.approx((scores(engine, [ids])[0], 20), abs=1e-6)
    whole = tokenizer(long_query, text_pair=document).input_ids
    assert score(truncate_prompt_tokens=20, truncation_side="left") == \
        pytest.approx((scores(engine, [whole[-20:]])[0], 20), abs=1e-6)
    # a side's limit: the text cut to its first tokens
    query_ids = tokenizer(long_query, add_special_tokens=False).input_ids[:5]
    doc_ids = tokenizer(document, add_special_tokens=False).input_ids[:3]
    cut = tokenizer(tokenizer.decode(query_ids), text_pair=tokenizer.decode(doc_ids)).input_ids
    assert score(max_tokens_per_query=5, max_tokens_per_doc=3) == pytest.approx((scores(engine, [cut])[0], len(cut)),
                                                                                  abs=1e-6)


@pytest.mark.parametrize("path, body, status, param, message", [
    ("v1/embeddings", {"input": "x"}, 400, None, "this model is a classifier, whose pooling task is classify"),
    ("v1/completions", {"prompt": "x"}, 400, None, "this model runs as a classifier"),
    ("classify", {"input": "x", "dimensions": 4}, 400, "dimensions", "'dimensions': unknown parameter"),
    ("classify", {"input": []}, 400, "input", "'input' must not be empty"),
    ("classify", {"input": "word " * 80}, 400, "input", "This model's maximum context length is 64 tokens"),
    ("classify", {"input": "x", "model": "other"}, 404, "model", "The model 'other' does not exist"),
    ("score", {"queries": "a", "documents": ["word " * 80]}, 400, "documents",
     "This model's maximum context length is 64 tokens"),
    ("rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 64}, 400, "max_tokens_per_doc",
     "'max_tokens_per_doc' (64) must be less than max_model_len (64)"),
])
def test_classifier_errors_name_their_field(base, triton, path, body, status, param, message):
    reply = httpx.post(base + path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert triton.metric("inflight_kv_blocks_used") == 0


RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "er"],
            "method": "from_2_way_softmax"}
SCORE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'query' %}<Query>: {{ m.content }}{% else %}\n"
                  "<Document>: {{ m.content }}{% endif %}{% endfor %}"
                  "{% if instruction %}\n<Instruct>: {{ instruction }}{% endif %}")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The test model made a reranker as vLLM makes Qwen3-Reranker one (hf_overrides), and the
    OpenAI servers in front of it with and without a score template."""
    engine = {**ENGINE, "hf_overrides": RERANKER}
    root = tmp_path_factory.mktemp("converted")
    template = root / "score.jinja"
    template.write_text(SCORE_TEMPLATE)
    flags = ["--max-model-len", "64", "--hf-overrides", json.dumps(RERANKER)]
    with ServerProcess(make_repository(str(root / "repository"), DEFAULT_MODEL, engine)) as triton, \
            OpenAIServerProcess(triton.http_url, DEFAULT_MODEL, extra=flags, env=SOURCE_PATH_ENV,
                                log_path=str(root / "plain.log")) as plain, \
            OpenAIServerProcess(triton.http_url, DEFAULT_MODEL, extra=[*flags, "--chat-template", str(template)],
                                env=SOURCE_PATH_ENV, log_path=str(root / "templated.log")) as templated:
        yield triton, plain.base_url.removesuffix("v1"), templated.base_url.removesuffix("v1"), \
            LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**engine))


def test_a_converted_reranker_scores_the_two_texts_or_its_score_template(converted):
    from transformers import AutoTokenizer
    triton, plain, templated, engine = converted
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    # no template: the query and the document one after the other, no pair separator (vLLM's use_sep_token false)
    reply = httpx.post(plain + "score", json={"queries": QUERY, "documents": DOCUMENTS}).json()
    joined = [tokenizer(QUERY + d).input_ids for d in DOCUMENTS]
    assert close([d["score"] for d in reply["data"]], scores(engine, joined))
    for body, instruction in (({}, None), ({"instruction": "Judge it"}, "Judge it"),
                              ({"chat_template_kwargs": {"instruction": "Be strict"}, "instruction": "no"},
                               "Be strict")):
        reply = httpx.post(templated + "rerank", json={"query": QUERY, "documents": DOCUMENTS, **body}).json()
        rendered = [tokenizer.apply_chat_template([{"role": "query", "content": QUERY},
                                                   {"role": "document", "content": d}],
                                                  chat_template=SCORE_TEMPLATE, tokenize=False, instruction=instruction)
                    for d in DOCUMENTS]
        want = scores(engine, [tokenizer(text).input_ids for text in rendered])
        assert close([r["relevance_score"] for r in sorted(reply["results"], key=lambda r: r["index"])], want), body
    classified = httpx.post(plain + "classify", json={"input": QUERY}).json()
    assert classified["data"][0]["label"] == "LABEL_0" and classified["data"][0]["num_classes"] == 1
    refused = httpx.post(templated + "score", json={"queries": "a", "documents": "b",
                                                    "chat_template_kwargs": {"tokenize": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    assert triton.metric("inflight_kv_blocks_used") == 0

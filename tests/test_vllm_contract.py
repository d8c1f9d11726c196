"""The `llm` tensor contract pinned to Triton's vLLM backend (src/utils/request.py there), through
a real tritonserver: num_output_tokens deltas, the logprobs JSON checked against a full softmax of
the model, cumulative_logprob, finish_reason strings, exclude_input_in_output, stop strings, `n`;
and the exact requests Triton's OpenAI frontend builds (engine/utils/triton.py), read as it reads
them."""
import asyncio
import json

import jsonschema
import numpy as np
import pytest
import torch

from inflight import SamplingParams
from inflight.detokenizer import decode
from inflight_client.streams import grpc_inputs, grpc_responses

from .conftest import DEFAULT_MODEL

pytestmark = pytest.mark.server

PROMPT = "The assert statement"
ALL_OUTPUTS = dict(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
                   return_logprobs=True, return_cumulative_logprob=True)


def llm(server, inputs) -> list[tuple[dict, bool]]:
    """Every response of one request: (outputs, final); fails on an error response."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        async with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return [r async for r in grpc_responses(client, "llm", inputs)]

    results = asyncio.run(main())
    errors = [error for _, _, error in results if error is not None]
    assert not errors, errors
    return [(outputs, final) for outputs, final, _ in results]


def llm_error(server, inputs) -> str:
    import tritonclient.grpc.aio as grpcclient

    async def main():
        async with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return [r async for r in grpc_responses(client, "llm", inputs)]

    return next(error for _, _, error in asyncio.run(main()) if error is not None)


def strings(array) -> list[str]:
    return [v.decode() for v in array.reshape(-1)]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64)


def full_logprobs(hf_model, prompt_ids, output_ids) -> torch.Tensor:
    """[len(output_ids), vocab]: the model's log-softmax at each generated position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits, -1)


def test_a_stream_carries_deltas_logprobs_and_the_cumulative_logprob(server, tokenizer, hf_model):
    top = 4
    sampling = {"max_tokens": 20, "temperature": 0.8, "seed": 5, "logprobs": top, "ignore_eos": True}
    responses = llm(server, grpc_inputs(PROMPT, True, sampling, return_token_ids=True, **ALL_OUTPUTS))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    ids = sum((o["token_ids"].tolist() for o, _ in responses), [])
    deltas = [int(o["num_output_tokens"][0]) for o, _ in responses]
    assert len(responses) > 1 and sum(deltas) == len(ids) == 20, "num_output_tokens: this response's tokens"
    assert [final for _, final in responses] == [False] * (len(responses) - 1) + [True]
    assert [strings(o["finish_reason"]) for o, _ in responses] == [["None"]] * (len(responses) - 1) + [["length"]]
    assert all(o["num_input_tokens"].tolist() == [len(prompt_ids)] for o, _ in responses)
    positions = []
    cumulative = 0.0
    for outputs, _ in responses:
        chunk = json.loads(strings(outputs["logprobs"])[0])
        assert len(chunk) == int(outputs["num_output_tokens"][0]), "one entry per token of this response"
        positions += chunk
        cumulative += sum(next(iter(p.values()))["logprob"] for p in chunk)
        assert outputs["cumulative_logprob"].dtype == np.float32
        assert float(outputs["cumulative_logprob"][0]) == pytest.approx(cumulative, rel=1e-5)
    rows = full_logprobs(hf_model, prompt_ids, ids)
    for token, position, row in zip(ids, positions, rows):
        entries = {int(t): e for t, e in position.items()}
        assert next(iter(entries)) == token, "the sampled token comes first"
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entries.values())
        assert entries[token]["logprob"] == pytest.approx(row[token].item(), abs=1e-9)
        assert entries[token]["rank"] == int((row >= row[token]).sum()), "rank in the model's own distribution"
        best = torch.topk(row, top)
        for rank, (t, value) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
            assert entries[t]["rank"] == rank and entries[t]["logprob"] == pytest.approx(value, abs=1e-9)
        assert len(entries) == top + (entries[token]["rank"] > top)
        assert all(e["decoded_token"] == tokenizer.decode([t]) for t, e in entries.items())
    assert any(entries[token]["rank"] > 1 for token, entries in
               zip(ids, ({int(t): e for t, e in p.items()} for p in positions))), "sampled, not greedy"


def test_one_response_defaults_to_the_prompt_and_the_full_counts(server, tokenizer, reference_engine):
    sampling = {"max_tokens": 10, "temperature": 0}
    ref = reference_engine.generate([tokenizer(PROMPT)["input_ids"]],
                                    SamplingParams(max_tokens=10, temperature=0, logprobs=0))[0]
    text = decode(tokenizer, ref.token_ids)
    [(outputs, final)] = llm(server, grpc_inputs(PROMPT, False, sampling, **ALL_OUTPUTS))
    assert final and strings(outputs["text_output"]) == [PROMPT + text], "exclude_input_in_output defaults to false"
    assert outputs["num_output_tokens"].tolist() == [10] and strings(outputs["finish_reason"]) == ["length"]
    assert strings(outputs["logprobs"]) == ["null"], "no 'logprobs' in sampling_parameters: null"
    expected = sum(entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs))
    assert float(outputs["cumulative_logprob"][0]) == pytest.approx(expected, rel=1e-5)
    [(excluded, _)] = llm(server, grpc_inputs(PROMPT, False, sampling, exclude_input_in_output=True))
    assert strings(excluded["text_output"]) == [text]
    streamed = llm(server, grpc_inputs(PROMPT, True, sampling))
    assert "".join(strings(o["text_output"])[0] for o, _ in streamed) == text, "a stream never repeats the prompt"
    error = llm_error(server, grpc_inputs(PROMPT, True, sampling, exclude_input_in_output=False))
    assert "When streaming, `exclude_input_in_output` = False is not allowed." in error


def test_the_vllm_backends_own_test_client_knobs_in_the_tensor_and_as_parameters(server, tokenizer, reference_engine):
    """The request the vLLM backend's CI builds (ci/common/test_util.py, create_vllm_request) and
    sends with tritonclient's callback stream: every knob both in `sampling_parameters` and as a
    request parameter. The tensor's value counts where the two differ, as that backend reads it alone."""
    import queue

    import tritonclient.grpc as grpcclient
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": "9"}
    ref = reference_engine.generate([tokenizer(PROMPT)["input_ids"]], SamplingParams(max_tokens=9, temperature=0))[0]
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for stream in (False, True):
            client.async_stream_infer(model_name="llm", inputs=grpc_inputs(PROMPT, stream, sampling),
                                      outputs=[grpcclient.InferRequestedOutput("text_output")],
                                      request_id=str(stream), parameters={**sampling, "max_tokens": "3"})
            texts = []
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                texts += strings(result.as_numpy("text_output"))
                if not stream or result.get_response().parameters["triton_final_response"].bool_param:
                    break
            assert "".join(texts) == (PROMPT if not stream else "") + decode(tokenizer, ref.token_ids)
    finally:
        client.stop_stream()
        client.close()


def test_stop_strings_with_and_without_include_stop_str_in_output(server, tokenizer, reference_engine):
    ref = reference_engine.generate([tokenizer(PROMPT)["input_ids"]], SamplingParams(max_tokens=30, temperature=0))[0]
    full = decode(tokenizer, ref.token_ids)
    stop = full[12:15]
    for include, expected in ((False, full[:full.index(stop)]), (True, full[:full.index(stop) + len(stop)])):
        sampling = {"max_tokens": 30, "temperature": 0, "stop": [stop], "include_stop_str_in_output": include}
        for stream in (True, False):
            responses = llm(server, grpc_inputs(PROMPT, stream, sampling, exclude_input_in_output=True,
                                                return_finish_reason=True, return_stop_reason=True))
            assert "".join(strings(o["text_output"])[0] for o, _ in responses) == expected
            assert strings(responses[-1][0]["finish_reason"]) == ["stop"]
            # inflight's stop_reason (vLLM's OpenAI field): the string, as JSON, in the response that ends it
            assert [strings(o["stop_reason"]) if "stop_reason" in o else None for o, _ in responses] == \
                [None] * (len(responses) - 1) + [[json.dumps(stop)]]


def sampled_ids(responses) -> list[int]:
    """The generated token ids of a request asked for logprobs 0 (the sampled token of each map)."""
    return [int(next(iter(position))) for o, _ in responses for position in json.loads(strings(o["logprobs"])[0])]


def test_stop_tokens_min_tokens_and_bad_words_as_vllm(server, tokenizer, reference_engine):
    """A stop_token_ids token ends the output without its text (unless include_stop_str_in_output);
    stop strings count only from min_tokens on; a bad word is banned with and without the space
    that precedes it mid-text — each as vLLM does it."""
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    ref = reference_engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    ids = ref.token_ids
    base = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    flags = dict(exclude_input_in_output=True, return_finish_reason=True, return_logprobs=True,
                 return_stop_reason=True)
    i = next(i for i in range(2, 24) if ids[i] not in ids[:i] and decode(tokenizer, [ids[i]]))
    for include, text in ((False, decode(tokenizer, ids[:i])), (True, decode(tokenizer, ids[:i + 1]))):
        for stream in (True, False):
            responses = llm(server, grpc_inputs(PROMPT, stream, {**base, "stop_token_ids": [ids[i]],
                                                                 "include_stop_str_in_output": include}, **flags))
            assert "".join(strings(o["text_output"])[0] for o, _ in responses) == text
            assert sampled_ids(responses) == ids[:i + 1] and strings(responses[-1][0]["finish_reason"]) == ["stop"]
            assert strings(responses[-1][0]["stop_reason"]) == [str(ids[i])], "the stop token's id"
    full = decode(tokenizer, ids)
    stop = decode(tokenizer, [ids[1]]).strip() or decode(tokenizer, [ids[1]])
    early = llm(server, grpc_inputs(PROMPT, False, {**base, "stop": [stop]}, **flags))
    assert len(sampled_ids(early)) <= 3, "without min_tokens the stop string ends it at once"
    late = llm(server, grpc_inputs(PROMPT, False, {**base, "stop": [stop], "min_tokens": 12}, **flags))
    [(outputs, _)] = late
    text, count = strings(outputs["text_output"])[0], len(sampled_ids(late))
    assert count >= 12 and full.startswith(text)
    searched_from = len(decode(tokenizer, ids[:12])) - (len(stop) - 1)
    if strings(outputs["finish_reason"]) == ["stop"]:
        assert full[len(text):].startswith(stop) and len(text) >= searched_from
    assert stop not in full[searched_from:len(text)]
    word = next(t for t in ids if decode(tokenizer, [t]).startswith(" ") and decode(tokenizer, [t])[1:].isalpha())
    spelled = decode(tokenizer, [word]).strip()
    alone = tokenizer(spelled, add_special_tokens=False)["input_ids"]
    assert alone != [word], "the mid-text form is a token of its own"
    banned = sampled_ids(llm(server, grpc_inputs(PROMPT, False, {**base, "bad_words": [spelled]}, **flags)))
    assert word not in banned and banned != ids


def test_allowed_token_ids_and_special_tokens_in_the_text_as_vllm(server, tokenizer, reference_engine):
    """vLLM's allowed_token_ids (here over HTTP generate, in sampling_parameters) and
    skip_special_tokens = false: special tokens the model generates mid-output (BOS, forced by a
    bias and kept from repeating by a bad word) are in the text, streamed or not, as transformers
    decodes them; by default they are left out, as before."""
    from inflight_client.streams import http_generate
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    allowed = list(range(300, 340))
    ref = reference_engine.generate([prompt_ids], SamplingParams(max_tokens=8, temperature=0,
                                                                 allowed_token_ids=allowed))[0]
    sampling = {"max_tokens": 8, "temperature": 0, "allowed_token_ids": allowed}
    reply = http_generate(server.http_url, "llm", {"text_input": PROMPT, "exclude_input_in_output": True,
                                                   "sampling_parameters": json.dumps(sampling)})
    assert reply["text_output"] == decode(tokenizer, ref.token_ids) and set(ref.token_ids) <= set(allowed)
    bos = tokenizer.bos_token_id
    forced = {"max_tokens": 9, "temperature": 0, "ignore_eos": True, "logit_bias": {str(bos): 100},
              "bad_words_ids": [[bos, bos]], "logprobs": 0}
    for stream in (True, False):
        texts = {}
        for skip in (True, False):
            responses = llm(server, grpc_inputs(PROMPT, stream, {**forced, "skip_special_tokens": skip,
                                                                 "spaces_between_special_tokens": skip},
                                                exclude_input_in_output=True, return_logprobs=True))
            ids = sampled_ids(responses)
            assert ids[::2] == [bos] * 5 and bos not in ids[1::2], "BOS, then a word, and again"
            texts[skip] = "".join(strings(o["text_output"])[0] for o, _ in responses)
            assert texts[skip] == tokenizer.decode(ids, skip_special_tokens=skip)
        assert texts[False].count("<s>") == 5 and texts[False].replace("<s>", "") == texts[True]


def test_n_outputs_are_elements_of_every_tensor_with_seed_plus_index(server):
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 3, "ignore_eos": True}
    flags = dict(exclude_input_in_output=True, return_finish_reason=True, return_num_output_tokens=True)
    [(whole, _)] = llm(server, grpc_inputs(PROMPT, False, sampling, **flags))
    texts = strings(whole["text_output"])
    assert len(texts) == 3 and len(set(texts)) == 3
    assert whole["num_output_tokens"].tolist() == [12] * 3 and strings(whole["finish_reason"]) == ["length"] * 3
    streamed = llm(server, grpc_inputs(PROMPT, True, sampling, **flags))
    assert all(o["text_output"].shape == (3,) for o, _ in streamed)
    assert ["".join(strings(o["text_output"])[i] for o, _ in streamed) for i in range(3)] == texts
    assert np.sum([o["num_output_tokens"] for o, _ in streamed], axis=0).tolist() == [12] * 3
    for i in range(3):                        # output i is the request with seed + i, alone
        [(alone, _)] = llm(server, grpc_inputs(PROMPT, False, {**sampling, "n": 1, "seed": 11 + i}, **flags))
        assert strings(alone["text_output"]) == [texts[i]]
    # from the largest seed, seed + i wraps to 0, 1, ... (the error had named a seed never sent)
    [(top, _)] = llm(server, grpc_inputs(PROMPT, False, {**sampling, "seed": 2**64 - 1}, **flags))
    for i, seed in enumerate((2**64 - 1, 0, 1)):
        [(alone, _)] = llm(server, grpc_inputs(PROMPT, False, {**sampling, "n": 1, "seed": seed}, **flags))
        assert strings(alone["text_output"]) == [strings(top["text_output"])[i]]


def test_stream_interval_sends_a_streams_tokens_n_at_a_time_as_vllm(server):
    """vLLM's stream_interval: the first token goes at once, then one response per N tokens, and
    one as the output ends; the texts and counts add up to the unstreamed output."""
    sampling = {"max_tokens": 14, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 2}
    flags = dict(return_finish_reason=True, return_num_output_tokens=True)
    [(whole, _)] = llm(server, grpc_inputs(PROMPT, False, sampling, exclude_input_in_output=True, **flags))
    streamed = llm(server, grpc_inputs(PROMPT, True, {**sampling, "stream_interval": 4}, **flags))
    assert [o["num_output_tokens"].tolist() for o, _ in streamed] == [[1, 1], [4, 4], [4, 4], [4, 4], [1, 1]]
    assert ["".join(strings(o["text_output"])[i] for o, _ in streamed) for i in range(2)] == strings(
        whole["text_output"])
    assert strings(streamed[-1][0]["finish_reason"]) == ["length"] * 2
    assert "'stream_interval' must be at least 1" in llm_error(server, grpc_inputs(PROMPT, True, {
        "max_tokens": 2, "stream_interval": 0}))


def test_the_models_stream_interval_is_the_floor_of_a_requests(tokenizer):
    """EngineConfig.stream_interval (vLLM's --stream-interval) applies to every stream; a request
    may ask for more tokens per response, not fewer."""
    from inflight import EngineConfig, LLMEngine
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(
        dtype="float32", max_num_seqs=4, num_kv_blocks=64, cpu_threads=1, stream_interval=3))
    loop = EngineLoop(engine, tokenizer).start()
    prompt = tokenizer(PROMPT)["input_ids"]
    try:
        sinks = {asked: RecordingSink() for asked in (1, 5)}
        for asked, sink in sinks.items():
            params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
            loop.submit(GenerateRequest(None, prompt, params, stream=True, exclude_input_in_output=True,
                                        stream_interval=asked), sink)
        assert all(sink.finished.wait(60) for sink in sinks.values())
    finally:
        loop.shutdown()
    # 11 tokens: 1 + 3 + 3 + 3 + 1 at the model's 3; 1 + 5 + 5 at the request's 5
    assert [len(sinks[asked].sends) for asked in (1, 5)] == [5, 3]
    assert sinks[1].text == sinks[5].text == decode(tokenizer, engine.generate([prompt], SamplingParams(
        max_tokens=11, temperature=0, ignore_eos=True))[0].token_ids)


def openai_frontend_request(prompt: str, stream: bool, sampling: dict, logprobs: bool):
    """The tensors _create_vllm_generate_request builds: sampling_parameters is the request's
    model_dump(exclude=..., exclude_none=True), so its defaults arrive too (n, penalties,
    ignore_eos, temperature, top_p), then max_tokens and logprobs."""
    import tritonclient.grpc as grpcclient
    tensors = {"return_logprobs": np.bool_([logprobs]), "text_input": np.array([prompt.encode()], dtype=object),
               "stream": np.bool_([stream]), "exclude_input_in_output": np.bool_([True]),
               "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
               "return_num_input_tokens": np.bool_([True]), "return_num_output_tokens": np.bool_([True])}
    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def read_like_the_openai_frontend(responses, stream: bool):
    """What engine/triton_engine.py reads: text_output as one string, num_input_tokens and
    num_output_tokens (summed over a stream for usage), logprobs JSON where sent (null -> None) whose
    lowest-rank entry it takes as the chosen token, and the final flag."""
    if not stream:
        assert 1 <= len(responses) <= 2 and responses[-1][1]
        responses = responses[:1]
    text, prompt_tokens, completion_tokens, chosen = "", None, 0, []
    for outputs, _ in responses:
        assert outputs["text_output"].size == 1, "the frontend reads exactly one string"
        text += strings(outputs["text_output"])[0]
        assert outputs["num_input_tokens"].dtype == outputs["num_output_tokens"].dtype == np.uint32
        prompt_tokens = int(outputs["num_input_tokens"].reshape(-1)[0])
        completion_tokens += int(outputs["num_output_tokens"].reshape(-1)[0])
        parsed = json.loads(strings(outputs["logprobs"])[0]) if "logprobs" in outputs else None
        for position in parsed or []:
            chosen.append(min(position.values(), key=lambda e: e["rank"])["decoded_token"])
    assert responses[-1][1], "the last response is final"
    return text, prompt_tokens, completion_tokens, chosen


def chat_prompt(tokenizer, content: str) -> str:
    """The frontend renders the chat template and sends the text."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.parametrize("kind, stream", [("completions", False), ("completions", True), ("chat", True),
                                          ("chat", False)])
def test_the_requests_tritons_openai_frontend_builds(server, tokenizer, reference_engine, kind, stream):
    """No logprobs: the frontend refuses them for any model whose config's backend is not "vllm"
    (`llm`'s is "python"), whatever its --backend."""
    if kind == "chat":     # CreateChatCompletionRequest(max_completion_tokens=16, temperature=0, stop=["\n\n"])
        prompt = chat_prompt(tokenizer, "What is a dict?")
        sampling = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "stop": ["\n\n"],
                    "temperature": 0.0, "top_p": 1, "max_tokens": 16}
    else:                  # CreateCompletionRequest(prompt=..., max_tokens=16, temperature=0, seed=4)
        prompt = PROMPT
        sampling = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "seed": 4,
                    "temperature": 0.0, "top_p": 1, "max_tokens": 16}
    responses = llm(server, openai_frontend_request(prompt, stream, sampling, logprobs=False))
    text, prompt_tokens, completion_tokens, chosen = read_like_the_openai_frontend(responses, stream)
    prompt_ids = tokenizer(prompt)["input_ids"]       # `llm` tokenizes text_input as the vLLM backend does
    ref = reference_engine.generate([prompt_ids], SamplingParams(max_tokens=16, temperature=0))[0]
    expected = decode(tokenizer, ref.token_ids)
    stopped = "stop" in sampling and "\n\n" in expected
    if stopped:
        expected = expected[:expected.index("\n\n")]
    assert text == expected and prompt_tokens == len(prompt_ids) and chosen == []
    assert stopped or completion_tokens == len(ref.token_ids)


TOOL_PARAMETERS = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                   "required": ["name"], "additionalProperties": False}


@pytest.mark.parametrize("stream, key", [(False, "structured_outputs"), (True, "structured_outputs"),
                                         (True, "guided_decoding")])
def test_a_tool_call_from_tritons_openai_frontend(server, tokenizer, reference_engine, stream, key):
    """tool_choice named or "required": the frontend sends the tool's parameters as
    json.dumps(asdict(vllm.StructuredOutputsParams(json=...))), vLLM's private fields included
    (as vLLM 0.32's dataclass writes them), which the vLLM backend reads back and ignores; its
    versions for vLLM before 0.11 sent asdict(GuidedDecodingParams(...)) as 'guided_decoding'."""
    schema_text = json.dumps(TOOL_PARAMETERS)
    common = {"json": schema_text, "regex": None, "choice": None, "grammar": None, "json_object": None,
              "disable_any_whitespace": False, "disable_additional_properties": False,
              "whitespace_pattern": None, "structural_tag": None}
    structured = {**common, "_backend": None, "_backend_was_auto": False} if key == "structured_outputs" else \
        {**common, "backend": None, "backend_was_auto": False, "disable_fallback": False}
    prompt = chat_prompt(tokenizer, "Count the dicts.")
    sampling = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "temperature": 0.0,
                "top_p": 1, "max_tokens": 64, key: json.dumps(structured)}
    responses = llm(server, openai_frontend_request(prompt, stream, sampling, logprobs=False))
    text, *_ = read_like_the_openai_frontend(responses, stream)
    prompt_ids = tokenizer(prompt)["input_ids"]
    ref = reference_engine.generate([prompt_ids], SamplingParams(max_tokens=64, temperature=0,
                                                                  structured_outputs={"json": schema_text}))[0]
    assert text == decode(tokenizer, ref.token_ids) and ref.finish_reason == "stop"
    jsonschema.validate(json.loads(text), TOOL_PARAMETERS)


def test_prompt_logprobs_come_whole_in_the_first_response(server, tokenizer, hf_model):
    """inflight's `prompt_logprobs` output (the vLLM backend has none): vLLM's list in the logprobs
    JSON, null for the first prompt token, in the first response of a stream and `null` after it."""
    sampling = {"max_tokens": 6, "temperature": 0, "prompt_logprobs": 2}
    responses = llm(server, grpc_inputs(PROMPT, True, sampling, return_prompt_logprobs=True))
    assert len(responses) > 1 and all(strings(o["prompt_logprobs"]) == ["null"] for o, _ in responses[1:])
    got = json.loads(strings(responses[0][0]["prompt_logprobs"])[0])
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        rows = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1], -1)
    assert got[0] is None and len(got) == len(ids)
    for token, position, row in zip(ids[1:], got[1:], rows):
        entries = {int(t): e for t, e in position.items()}
        assert next(iter(entries)) == token, "the prompt token comes first"
        assert entries[token]["logprob"] == pytest.approx(row[token].item(), abs=1e-9)
        assert entries[token]["rank"] == int((row >= row[token]).sum())
        assert entries[token]["decoded_token"] == tokenizer.decode([token])
        assert [t for t, e in entries.items() if e["rank"] <= 2] == \
            ([token] if entries[token]["rank"] <= 2 else []) + [t for t in torch.topk(row, 2).indices.tolist()
                                                                 if t != token]
    [(outputs, _)] = llm(server, grpc_inputs(PROMPT, False, {"max_tokens": 2}, return_prompt_logprobs=True))
    assert strings(outputs["prompt_logprobs"]) == ["null"], "not asked in sampling_parameters: null"
    # a prompt of several chunks (the server's budget is 256 tokens): the chunks' steps bring no token
    long_ids = (ids * 200)[:700]
    [(outputs, _)] = llm(server, grpc_inputs(long_ids, False, {"max_tokens": 1, "prompt_logprobs": 0},
                                             return_prompt_logprobs=True))
    got = json.loads(strings(outputs["prompt_logprobs"])[0])
    with torch.no_grad():
        rows = torch.log_softmax(hf_model(torch.tensor([long_ids])).logits[0, :-1], -1)
    assert len(got) == len(long_ids) and got[0] is None
    assert [p[str(t)]["logprob"] for t, p in zip(long_ids[1:], got[1:])] == \
        pytest.approx(rows.gather(1, torch.tensor(long_ids[1:])[:, None]).squeeze(1).tolist(), abs=1e-9)


def test_the_vllm_backends_metrics_with_report_custom_metrics(tmp_path, tokenizer):
    """config.pbtxt's REPORT_CUSTOM_METRICS adds the vLLM backend's `vllm:` metrics (labels model
    and version): tokens counted as delivered — also after a stop string ends an output while the
    engine has stepped on — one gap observation per token after the first, one of each per-request
    histogram per output; a request refused, by the parser or by the engine, counts as an error
    and in no histogram."""
    from inflight.serving.launch import ServerProcess, make_repository
    from perf.vllm_backend import REPORT_CUSTOM_METRICS

    from .conftest import TEST_ENGINE
    from .helpers import wait_for_metric
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, TEST_ENGINE, models=("llm",))
    with open(tmp_path / "repo" / "llm" / "config.pbtxt", "a") as f:
        f.write("\n" + REPORT_CUSTOM_METRICS)
    with ServerProcess(repo) as server:
        ref = decode(tokenizer, tokenizer(PROMPT)["input_ids"])
        requests = [{"max_tokens": 6, "temperature": 0, "ignore_eos": True},
                    {"max_tokens": 5, "temperature": 0.8, "seed": 1, "ignore_eos": True, "n": 2},
                    {"max_tokens": 30, "temperature": 0, "stop": [ref[4:6]]}]
        delivered, prompts, gaps = 0, 0, 0
        for sampling in requests:
            counts = np.zeros(sampling.get("n", 1), dtype=int)
            for outputs, _ in llm(server, grpc_inputs(PROMPT, True, sampling, return_num_output_tokens=True,
                                                      return_num_input_tokens=True)):
                counts += outputs["num_output_tokens"]
                prompt_tokens = int(outputs["num_input_tokens"][0])
            delivered += int(counts.sum())
            prompts += prompt_tokens * len(counts)
            gaps += int((counts - 1).sum())
        assert "unknown sampling parameter" in llm_error(server, grpc_inputs(PROMPT, True, {"max_tokenz": 3}))
        # refused by the engine itself: no histogram sees it either (vLLM's input processor refuses it)
        assert "exceeds max_model_len" in llm_error(server, grpc_inputs(PROMPT * 400, True, {"max_tokens": 4}))
        labels = {"model": "llm", "version": "1"}
        assert wait_for_metric(server, "vllm:generation_tokens_total", delivered, **labels) == delivered
        assert server.metric("inflight_generation_tokens_total") == delivered
        assert server.metric("vllm:prompt_tokens_total", **labels) == prompts
        assert server.metric("vllm:time_per_output_token_seconds_count", **labels) == gaps
        assert server.metric("vllm:time_to_first_token_seconds_count", **labels) == 4
        assert server.metric("vllm:request_params_n_count", **labels) == 3
        assert server.metric("vllm:request_generation_tokens_sum", **labels) == delivered
        assert server.metric("vllm:e2e_request_latency_seconds_count", **labels) == 4
        assert server.metric("vllm:request_prompt_tokens_count", **labels) == 4
        assert server.metric("inflight_e2e_request_latency_seconds_count") == 3
        assert wait_for_metric(server, "inflight_requests_total", 2, finish_reason="error") == 2
        # the latencies of one more request, alone: TTFT is not the end-to-end latency, and the
        # token gaps add up to the time between the first token and the end
        from .helpers import assert_latencies_add_up, latency_sums
        before = latency_sums(server, "vllm:", **labels)
        llm(server, grpc_inputs(PROMPT, True, {"max_tokens": 30, "temperature": 0, "ignore_eos": True}))
        assert wait_for_metric(server, "vllm:e2e_request_latency_seconds_count", 5, **labels) == 5
        ttft, e2e, gaps_s = (after - b for after, b in zip(latency_sums(server, "vllm:", **labels), before))
        assert_latencies_add_up(ttft, e2e, gaps_s / 29, tokens=30)
        # a first token is observed as it comes, not when the request ends; a request the client
        # leaves is counted as cancelled and in no latency histogram (vLLM's loggers never see an
        # aborted request: a dashboard's e2e would read the client's patience)
        import http.client
        conn = http.client.HTTPConnection(server.http_url, timeout=30)
        conn.request("POST", "/v2/models/llm/generate_stream", json.dumps(
            {"text_input": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}))
        stream = conn.getresponse()
        assert stream.readline().startswith(b"data:")
        for name, want in (("vllm:time_to_first_token_seconds_count", 6), ("vllm:e2e_request_latency_seconds_count", 5)):
            assert wait_for_metric(server, name, want, **labels) == want, name
        assert server.metric("inflight_time_to_first_token_seconds_count") == 5
        conn.close()              # Triton cancels the request at its next response
        assert wait_for_metric(server, "inflight_requests_total", 1, finish_reason="cancelled") == 1
        assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0
        assert server.metric("vllm:e2e_request_latency_seconds_count", **labels) == 5
        assert server.metric("vllm:request_generation_tokens_count", **labels) == 5
        assert server.metric("inflight_e2e_request_latency_seconds_count") == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_holding_part_of_a_character_is_decoded_as_vllm_decodes_it(server, tokenizer, stream):
    """vLLM 0.32 decodes a byte-fallback token that alone is an unfinished character after the
    sampled tokens before it: "" until the character is whole, then all of it (its
    _correct_decoded_token), so the sampled tokens' texts add up to the output. A stream cuts
    the positions across responses; prompt log-probabilities get the same."""
    text = "🐱日本é"
    sampling = {"max_tokens": 24, "temperature": 0, "logprobs": 1, "prompt_logprobs": 1,
                "structured_outputs": {"choice": [text]}}
    responses = llm(server, grpc_inputs("cats 🐱🐱", stream, sampling, exclude_input_in_output=True,
                                        return_logprobs=True, return_prompt_logprobs=not stream))
    assert "".join(strings(o["text_output"])[0] for o, _ in responses) == text
    positions = [p for o, _ in responses for p in json.loads(strings(o["logprobs"])[0]) or []]
    assert int(next(iter(positions[-1]))) == tokenizer.eos_token_id, "the grammar's end"
    positions = positions[:-1]
    sampled = [next(iter(p.values()))["decoded_token"] for p in positions]
    assert "".join(sampled) == text and "\ufffd" not in "".join(sampled)
    assert "" in sampled, "the pieces before a character's last byte"
    alone = [tokenizer.decode([int(next(iter(p)))]) for p in positions]
    assert [s for s, a in zip(sampled, alone) if not a.endswith("\ufffd")] == \
        [a for a in alone if not a.endswith("\ufffd")], "whole tokens stay decoded alone"
    if not stream:
        prompt = json.loads(strings(responses[0][0]["prompt_logprobs"])[0])
        ids = tokenizer("cats 🐱🐱")["input_ids"]
        assert "".join(next(iter(p.values()))["decoded_token"] for p in prompt[1:]) == tokenizer.decode(ids[1:])


def test_num_cached_tokens_is_the_prompts_prefix_cache_hit(server, tokenizer):
    """inflight's num_cached_tokens (vLLM's num_cached_tokens; the OpenAI server's cached_tokens): the
    prompt tokens the request found in the prefix cache when first admitted, whole blocks of it, in
    every response; none the first time a prompt is seen."""
    prompt = "A prompt seen twice: " + " ".join(f"cached{i}" for i in range(40))
    ids = tokenizer(prompt)["input_ids"]
    flags = dict(return_num_input_tokens=True, return_num_cached_tokens=True)
    sampling = {"max_tokens": 3, "ignore_eos": True}
    first = llm(server, grpc_inputs(prompt, True, sampling, **flags))
    again = llm(server, grpc_inputs(prompt, True, sampling, **flags))
    whole = llm(server, grpc_inputs(prompt, False, sampling, exclude_input_in_output=True, **flags))
    assert [int(o["num_cached_tokens"][0]) for o, _ in first] == [0] * len(first)
    cached = {int(o["num_cached_tokens"][0]) for o, _ in again + whole}
    block = 16      # the engine's block size: the last prompt token is always computed, so a block less
    assert cached == {(len(ids) - 1) // block * block} and int(whole[0][0]["num_input_tokens"][0]) == len(ids)
    assert "num_cached_tokens" not in llm(server, grpc_inputs(prompt, False, sampling))[0][0]

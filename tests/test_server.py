"""Through a real tritonserver: gRPC streaming, HTTP generate / generate_stream, the ensemble,
64 concurrent streams, cancellation, error responses that name the field, and metrics."""
import concurrent.futures
import os

import pytest
import torch

from inflight import SamplingParams
from inflight.detokenizer import decode
from inflight.serving.launch import DEFAULT_REPOSITORY, ServerProcess
from inflight_client.streams import grpc_inputs, http_generate, http_stream

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import assert_latencies_add_up, computed_tokens, latency_sums, run_streams, wait_for_metric

pytestmark = pytest.mark.server

PROMPTS = ["The assert statement", "A class definition defines a class object", "Boolean operations",
           "The import system", "def", "Exceptions can be raised", "Augmented assignment is the combination",
           "The with statement is used"]


def greedy(max_tokens=24, **extra):
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def llm_stream(prompt, max_tokens=24, **flags):
    return {"model": "llm", "inputs": grpc_inputs(prompt, True, greedy(max_tokens), **flags)}


def test_grpc_stream_matches_the_engine_and_transformers(server, tokenizer, reference_engine):
    from transformers import AutoModelForCausalLM
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    outs = run_streams(server, [llm_stream(p, return_token_ids=True) for p in prompts])
    engine = reference_engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64)
    for prompt, out, ref in zip(prompts, outs, engine):
        assert out.error is None
        assert out.token_ids == ref.token_ids
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        assert out.text == decode(tokenizer, out.token_ids)


def test_http_generate_and_generate_stream_give_the_grpc_text(server):
    prompt = PROMPTS[1]
    grpc_text = run_streams(server, [llm_stream(prompt)])[0].text
    reply = http_generate(server.http_url, "llm", {"text_input": prompt, "exclude_input_in_output": True,
                                                   "return_finish_reason": True, **greedy()})
    assert reply["text_output"] == grpc_text and reply["finish_reason"] in ("length", "stop")
    with_prompt = http_generate(server.http_url, "llm", {"text_input": prompt, **greedy()})
    assert with_prompt["text_output"] == prompt + grpc_text
    streamed = http_stream(server.http_url, "llm", {"text_input": prompt, "stream": True, **greedy()})
    assert streamed.error is None and streamed.text == grpc_text and len(streamed.chunks) > 1


def test_an_empty_text_input_starts_from_the_bos_as_the_vllm_backend(server, tokenizer):
    """The vLLM backend tokenizes "" to the BOS alone and generates from it."""
    empty = http_generate(server.http_url, "llm", {"text_input": "", "return_num_input_tokens": True, **greedy()})
    from_bos = http_generate(server.http_url, "llm", {"input_ids": [tokenizer.bos_token_id], **greedy()})
    assert empty["num_input_tokens"] == 1 and empty["text_output"] == from_bos["text_output"] != ""


def test_ensemble_streams_the_same_text_as_llm(server):
    from inflight_client.streams import ensemble_inputs
    prompt = PROMPTS[2]
    llm = run_streams(server, [llm_stream(prompt)])[0]
    inputs = ensemble_inputs(prompt, True, max_tokens=24, temperature=0.0)
    ensemble = run_streams(server, [{"model": "ensemble", "inputs": inputs}])[0]
    assert ensemble.error is None and ensemble.text == llm.text and len(ensemble.chunks) > 1
    # a knob sent as a request parameter, as the vLLM backend takes them, is told to be a tensor
    as_parameter = run_streams(server, [{"model": "ensemble", "inputs": ensemble_inputs(prompt, True),
                                         "parameters": {"max_tokens": 4}}])[0]
    assert "['max_tokens'] sent as request parameter(s); the ensemble reads them only as input tensors" \
        in as_parameter.error, as_parameter.error
    http = http_stream(server.http_url, "ensemble", {"text_input": prompt, "max_tokens": 24, "temperature": 0.0,
                                                     "stream": True})
    assert http.text == llm.text
    penalized = {"max_tokens": 24, "temperature": 0.0, "stream": True, "repetition_penalty": 1.8,
                 "frequency_penalty": 0.5}
    via_ensemble = http_stream(server.http_url, "ensemble", {"text_input": prompt, **penalized})
    via_llm = http_stream(server.http_url, "llm", {"text_input": prompt, **penalized})
    assert via_ensemble.error is None and via_ensemble.text == via_llm.text != llm.text
    whole = http_generate(server.http_url, "ensemble", {"text_input": prompt, "max_tokens": 24, "temperature": 0.0,
                                                        "exclude_input_in_output": True})
    assert whole["text_output"] == llm.text
    # TensorRT-LLM reads a top_p of 0 as none given
    off = http_generate(server.http_url, "ensemble", {"text_input": prompt, "max_tokens": 24, "temperature": 0.0,
                                                      "top_p": 0.0, "exclude_input_in_output": True})
    assert off.get("text_output") == llm.text, off


def test_the_ensemble_samples_and_ends_as_tensorrt_llm_reads_its_inputs(server):
    """TensorRT-LLM is greedy unless top_k or top_p is above 0, whatever the temperature (its
    example request, with no knobs, gives one text), and end_id is the token that ends generation,
    in place of EOS."""
    def ensemble(**inputs):
        return http_generate(server.http_url, "ensemble", {"text_input": "hi", "max_tokens": 24,
                                                           "exclude_input_in_output": True, **inputs})
    greedy_text = ensemble(temperature=0.0)["text_output"]
    for knobs in ({}, {}, {"top_k": 0, "top_p": 0.0}, {"temperature": 0.7, "seed": 8}):
        assert ensemble(**knobs).get("text_output") == greedy_text, knobs
    # sampled with seed 8, "hi" ends on EOS after 6 tokens
    sampled = ensemble(top_p=1.0, seed=8)["text_output"]
    assert sampled != greedy_text and ensemble(top_p=1.0, seed=8, end_id=2)["text_output"] == sampled
    past_eos = ensemble(top_p=1.0, seed=8, end_id=4095)["text_output"]
    assert past_eos.startswith(sampled) and len(past_eos) > len(sampled)
    assert "'top_k' must be 0 (off) or more, got -1" in ensemble(top_k=-1).get("error", "")
    # a key that is no ensemble input reaches the steps as a parameter: refused by name
    error = ensemble(length_penalty=1.0).get("error", "")
    assert "unknown input(s) ['length_penalty']; the ensemble's inputs: [" in error, error
    # postprocessing is a public model too
    reply = http_generate(server.http_url, "postprocessing", {"token_ids": [-1], "context_ids": []})
    assert "'token_ids' must hold token ids (0 or more), got -1" in reply.get("error", ""), reply


def test_streamed_text_equals_non_streamed_text(server):
    for prompt in PROMPTS[3:6]:
        stream = run_streams(server, [llm_stream(prompt, 40)])[0]
        whole = run_streams(server, [{"model": "llm", "inputs": grpc_inputs(prompt, False, greedy(40),
                                                                            exclude_input_in_output=True)}])[0]
        assert len(whole.chunks) == 1 and stream.text == whole.text


def test_64_concurrent_streams_complete_with_correct_outputs(server, tokenizer, reference_engine):
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))["input_ids"] for i in range(64)]
    lengths = [8 + (i * 7) % 41 for i in range(64)]
    outs = run_streams(server, [llm_stream(p, n, return_token_ids=True, return_finish_reason=True)
                                for p, n in zip(prompts, lengths)])
    refs = reference_engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    for out, ref in zip(outs, refs):
        assert out.error is None and out.finish_reason == ref.finish_reason
        assert out.token_ids == ref.token_ids
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


# a cancelled request asks for 900 tokens: the engine must stop it within a few steps of the
# cancel, not run it to its end for nobody (which would also free its blocks, in seconds)
CANCELLED_MAX_TOKENS = 900
AFTER_CANCEL_BOUND = 300


@pytest.mark.parametrize("n", [1, 2])
def test_grpc_cancel_aborts_the_request_and_frees_its_blocks(server, n):
    """With n = 2, both outputs: the cancel aborts each of them, not only the first."""
    cancelled_before = server.metric("inflight_requests_total", finish_reason="cancelled")
    long = {"model": "llm", "inputs": grpc_inputs(PROMPTS[0], True, {"max_tokens": CANCELLED_MAX_TOKENS,
                                                                      "ignore_eos": True, "n": n}),
            "cancel_after": 3}
    others = [llm_stream(p) for p in PROMPTS[:3]]
    start = computed_tokens(server)
    alone = run_streams(server, others)
    middle = computed_tokens(server)
    outs = run_streams(server, [long] + others)
    assert outs[0].cancelled and len(outs[0].chunks) == 3
    assert [o.text for o in outs[1:]] == [o.text for o in alone], "other streams are unaffected"
    long_ran = (computed_tokens(server) - middle) - (middle - start)      # less what the others ran alone
    assert long_ran < AFTER_CANCEL_BOUND, f"the cancelled request ran {long_ran} tokens"
    assert server.metric("inflight_requests_total", finish_reason="cancelled") == cancelled_before + 1


def test_http_disconnect_aborts_the_request_and_frees_its_blocks(server):
    cancelled_before = server.metric("inflight_requests_total", finish_reason="cancelled")
    start = computed_tokens(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        dropped = pool.submit(http_stream, server.http_url, "llm",
                              {"text_input": PROMPTS[4], "stream": True, "max_tokens": CANCELLED_MAX_TOKENS,
                               "ignore_eos": True},
                              cancel_after=2)
        normal = pool.submit(http_stream, server.http_url, "llm", {"text_input": PROMPTS[5], "stream": True, **greedy()})
        assert dropped.result().cancelled and normal.result().error is None
    assert wait_for_metric(server, "inflight_requests_total", cancelled_before + 1, finish_reason="cancelled") \
        == cancelled_before + 1
    middle = computed_tokens(server)
    assert normal.result().text == run_streams(server, [llm_stream(PROMPTS[5])])[0].text
    dropped_ran = (middle - start) - (computed_tokens(server) - middle)   # less what the other ran alone
    assert dropped_ran < AFTER_CANCEL_BOUND, f"the dropped request ran {dropped_ran} tokens"


ERRORS = [
    ({"max_tokens": 4}, "'text_input' or 'input_ids'"),
    ({"text_input": "hi", "input_ids": [1, 2], "max_tokens": 4}, "not both"),
    ({"text_input": "word " * 1100, "max_tokens": 4}, "max_model_len"),
    ({"text_input": "hi", "max_tokens": 0}, "'max_tokens'"),
    ({"text_input": "hi", "sampling_parameters": "{nope"}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "[1]"}, "'sampling_parameters' must be a JSON object"),
    ({"text_input": "hi", "temprature": 0.1}, "unknown sampling parameter(s) ['temprature']"),
    ({"text_input": "hi", "max_tokens": "lots"}, "'max_tokens' must be an integer"),
    ({"text_input": "hi", "temperature": -1}, "'temperature'"),
    ({"text_input": "hi", "top_p": 0}, "'top_p'"),
    ({"text_input": "hi", "top_p": 1.5}, "'top_p'"),
    ({"text_input": "hi", "top_k": -2}, "'top_k'"),
    ({"text_input": "hi", "priority": "urgent"}, "'priority'"),
    ({"input_ids": [1, 99999], "max_tokens": 4}, "'input_ids': token id 99999 at position 1 is outside the vocabulary"),
    ({"text_input": "hi", "sampling_parameters": '{"min_tokens": 2, "stop_token_ids": [99999]}'},
     "'stop_token_ids': token id 99999 is outside the vocabulary"),
    ({"text_input": "hi", "sampling_parameters": '{"bad_words_ids": [[99999]]}'},
     "'bad_words_ids': token id 99999 is outside the vocabulary"),
    ({"text_input": "hi", "sampling_parameters": '{"allowed_token_ids": []}'}, "'allowed_token_ids' must not be empty"),
    ({"text_input": "hi", "sampling_parameters": '{"allowed_token_ids": [5, 99999]}'},
     "'allowed_token_ids': token id 99999 is outside the vocabulary"),
    ({"text_input": "hi", "skip_special_tokens": "sometimes"}, "'skip_special_tokens' must be a boolean"),
    ({"text_input": "hi", "max_tokens": 2, "queue_heartbeat": True}, "'queue_heartbeat' needs 'stream' = true"),
]


@pytest.mark.parametrize("payload, message", ERRORS, ids=[m for _, m in ERRORS])
def test_bad_requests_get_an_error_naming_the_field_and_the_server_keeps_serving(server, payload, message):
    reply = http_generate(server.http_url, "llm", payload)
    assert message in reply.get("error", ""), reply
    assert "Traceback" not in reply["error"] and "At:" not in reply["error"]
    ok = http_generate(server.http_url, "llm", {"text_input": "The", "max_tokens": 2})
    assert "error" not in ok and ok["text_output"].startswith("The")


def test_ensemble_errors_name_the_field(server):
    reply = http_generate(server.http_url, "ensemble", {"text_input": "hi", "max_tokens": 0})
    assert "'max_tokens'" in reply.get("error", "")
    reply = http_generate(server.http_url, "ensemble", {"text_input": "", "max_tokens": 3})
    assert "'text_input' is empty" in reply.get("error", "")
    for end_id in (-1, 10**6):
        reply = http_generate(server.http_url, "ensemble", {"text_input": "hi", "max_tokens": 3, "end_id": end_id})
        assert "'end_id' must be a token id in [0, " in reply.get("error", ""), reply
    assert "error" not in http_generate(server.http_url, "ensemble", {"text_input": "hi", "max_tokens": 3, "end_id": 0})
    assert "text_output" in http_generate(server.http_url, "ensemble", {"text_input": "The", "max_tokens": 2})
    # TensorRT-LLM's own example request: empty bad/stop words mean none
    example = http_generate(server.http_url, "ensemble", {"text_input": "What is machine learning?", "max_tokens": 20,
                                                          "bad_words": "", "stop_words": ""})
    assert "error" not in example and example["text_output"], example
    # the bounds on word lists, named as the ensemble's inputs (not llm's 'stop' and 'bad_words')
    for name, limit in (("stop_words", 1_000), ("bad_words", 10_000)):
        reply = http_generate(server.http_url, "ensemble", {"text_input": "hi", "max_tokens": 3,
                                                            name: [f"w{i}" for i in range(limit + 1)]})
        assert f"'{name}' holds {limit + 1} entries, more than {limit}" in reply.get("error", ""), reply


def test_engine_metrics_are_served_next_to_tritons(server):
    steps = server.metric("inflight_scheduler_step_seconds_count")
    tokens = server.metric("inflight_generation_tokens_total")
    ended = server.metric("inflight_e2e_request_latency_seconds_count")
    latencies = latency_sums(server, "inflight_")
    run_streams(server, [{"model": "llm", "inputs": grpc_inputs(PROMPTS[0], True, {**greedy(8), "ignore_eos": True})}])
    # alone on the server: one prefill step (the first token) and 7 decode steps, counted as they
    # ran (idle polls are not steps)
    assert wait_for_metric(server, "inflight_generation_tokens_total", tokens + 8) == tokens + 8
    assert wait_for_metric(server, "inflight_scheduler_step_seconds_count", steps + 8) == steps + 8
    assert wait_for_metric(server, "inflight_e2e_request_latency_seconds_count", ended + 1) == ended + 1
    assert_latencies_add_up(*(after - before for after, before in zip(latency_sums(server, "inflight_"), latencies)),
                            tokens=8)
    text = server.metrics_text()
    assert "nv_inference_request_success" in text            # Triton's own
    assert server.metric("inflight_kv_blocks_total") == 2048
    for name in ("inflight_generation_tokens_total", "inflight_time_to_first_token_seconds_count",
                 "inflight_time_per_output_token_seconds_count", "inflight_scheduler_step_seconds_count",
                 "inflight_prompt_and_decode_tokens_total"):
        assert server.metric(name) > 0, name
    for name in ("inflight_requests_running", "inflight_requests_waiting", "inflight_preemptions_total"):
        assert name in text


def test_the_shipped_repository_serves_the_default_model(tmp_path):
    """`make serve` as is: the repository unchanged (model.json defaults, dtype auto)."""
    if os.environ.get("INFLIGHT_TEST_MODEL"):
        pytest.skip("the shipped repository serves the shipped model")
    with ServerProcess(DEFAULT_REPOSITORY, log_path=str(tmp_path / "server.log")) as shipped:
        reply = http_generate(shipped.http_url, "llm", {"text_input": "The assert statement", "max_tokens": 16,
                                                        "temperature": 0})
        assert reply["text_output"].startswith("The assert statement") and len(reply["text_output"]) > 25


def test_several_instances_each_serve_with_their_own_metrics_and_stop_cleanly(tmp_path, tokenizer, reference_engine):
    """instance_group count 2 (or KIND_GPU on several GPUs): Triton starts two llm processes, each
    its own engine. Both serve, each on half the cores, and each labels its metrics with its
    instance name (under one set of labels each gauge showed one instance's value)."""
    from inflight.serving.launch import make_repository
    engine = {key: value for key, value in TEST_ENGINE.items() if key != "cpu_threads"}
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, engine, models=("llm",))
    config = tmp_path / "repo" / "llm" / "config.pbtxt"
    config.write_text(config.read_text().replace("instance_group [ { count: 1 kind: KIND_CPU } ]",
                                                 "instance_group [ { count: 2 kind: KIND_CPU } ]"))
    log = tmp_path / "server.log"
    with ServerProcess(repo, log_path=str(log)) as two:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: http_generate(two.http_url, "llm", {
                "text_input": PROMPTS[i % 8], "exclude_input_in_output": True, **greedy(12)}), range(32)))
        expected = reference_engine.generate([tokenizer(p)["input_ids"] for p in PROMPTS],
                                             SamplingParams(max_tokens=12, temperature=0))
        assert [reply["text_output"] for reply in replies] == [decode(tokenizer, expected[i % 8].token_ids)
                                                               for i in range(32)]
        served = {name: two.metric("inflight_requests_total", model_instance=name) for name in ("llm_0_0", "llm_0_1")}
        assert sum(served.values()) == 32 and all(served.values()), served
        assert two.metric("inflight_kv_blocks_total", model_instance="llm_0_0") == 2048
        assert two.metric("inflight_kv_blocks_total", model_instance="llm_0_1") == 2048
        assert two.stop() == 0
    text = log.read_text()
    for name in ("llm_0_0", "llm_0_1"):
        assert f"inflight: model_instance={name} loading" in text
    assert text.count(f"cpu_threads={max(len(os.sched_getaffinity(0)) // 2, 1)},") == 2
    assert "Segfault" not in text and "malloc" not in text


@pytest.mark.parametrize("count", [1, 2])
def test_reloading_llm_leaves_tritonserver_serving(tmp_path, count):
    """A reload (explicit model control, `POST /v2/repository/models/llm/load` after a config
    change, as platforms that manage Triton do it) starts the new instances before the old ones
    leave. A metric series the two processes shared (the same labels) was freed under the new
    one as the old one let it go: tritonserver died (Signal 11, or 6 with a corrupt heap) in 8 of
    8 reloads. Each process's series carry its pid now."""
    import urllib.request

    from inflight.serving.launch import make_repository
    from perf.vllm_backend import REPORT_CUSTOM_METRICS
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, TEST_ENGINE, models=("llm",))
    config = tmp_path / "repo" / "llm" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1 kind", f"count: {count} kind") + "\n" + REPORT_CUSTOM_METRICS)
    log = tmp_path / "server.log"
    request = {"text_input": PROMPTS[2], "exclude_input_in_output": True, **greedy(8)}
    with ServerProcess(repo, log_path=str(log), extra=["--model-control-mode=explicit", "--load-model=llm"]) as server:
        before = [http_generate(server.http_url, "llm", request)["text_output"] for _ in range(4)]
        config.write_text(config.read_text() + "\n# changed\n")
        load = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/llm/load", data=b"{}",
                                      method="POST")
        assert urllib.request.urlopen(load, timeout=120).status == 200
        after = [http_generate(server.http_url, "llm", request)["text_output"] for _ in range(8)]
        assert after == before[:1] * 8 and before == before[:1] * 4
        assert wait_for_metric(server, "vllm:generation_tokens_total", 64) == 64       # the new instances'
        assert server.stop() == 0
    text = log.read_text()
    assert "Signal (11)" not in text and "Signal (6)" not in text and "malloc" not in text, text[-2000:]


@pytest.mark.server
def test_grpc_headers_that_triton_forwards_as_parameters_do_not_fail_requests(tmp_path):
    """--grpc-header-forward-pattern turns each matching header (x-request-id, as tracing and auth
    proxies add) into a request parameter: before, llm refused every such request as an unknown
    sampling parameter, and the ensemble as an unknown input."""
    import queue

    import tritonclient.grpc as grpcclient

    from inflight.serving.launch import make_repository
    from inflight_client.streams import ensemble_inputs
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, TEST_ENGINE)
    forwarding = ["--grpc-header-forward-pattern=x-.*"]
    with ServerProcess(repo, log_path=str(tmp_path / "server.log"), extra=forwarding) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)),
                            headers={"x-request-id": "abc", "x-b3-traceid": "1"})
        try:
            for model, inputs in (("llm", grpc_inputs(PROMPTS[0], stream=False, sampling={"max_tokens": 2})),
                                  ("ensemble", ensemble_inputs(PROMPTS[0], stream=False, max_tokens=2))):
                client.async_stream_infer(model, inputs)
                result, error = results.get(timeout=60)
                assert error is None, (model, error)
                assert result.as_numpy("text_output")[0].decode().startswith(PROMPTS[0]), model
        finally:
            client.stop_stream()
            client.close()


def test_logprobs_stop_strings_priority_and_cache_salt_over_http(server, tokenizer, reference_engine):
    import json
    prompt = PROMPTS[6]
    reply = http_generate(server.http_url, "llm", {"text_input": prompt, "max_tokens": 6, "temperature": 0,
                                                   "logprobs": 0, "return_logprobs": True,
                                                   "exclude_input_in_output": True,
                                                   "priority": "high", "cache_salt": "tenant-a"})
    ref = reference_engine.generate([tokenizer(prompt)["input_ids"]],
                                    SamplingParams(max_tokens=6, temperature=0, logprobs=0))[0]
    got = [(int(token), entry["logprob"]) for position in json.loads(reply["logprobs"])
           for token, entry in position.items()]
    assert got == [(t, pytest.approx(e[t].logprob, abs=1e-9)) for t, e in zip(ref.token_ids, ref.logprobs)]
    full = http_generate(server.http_url, "llm", {"text_input": prompt, "max_tokens": 30, "temperature": 0,
                                                  "exclude_input_in_output": True})["text_output"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = http_stream(server.http_url, "llm", {"text_input": prompt, "stream": True, "return_finish_reason": True,
                                               "sampling_parameters": json.dumps({"max_tokens": 30, "temperature": 0,
                                                                                  "stop": [stop]})})
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_cli_streams_the_text_and_ctrl_c_cancels_the_request(server, protocol):
    """inflight-client as a user runs it: the streamed text is the server's; Ctrl-C mid-stream is
    one line and exit status 130 (not a traceback), and the server aborts the request."""
    import signal
    import subprocess
    import sys
    url = server.grpc_url if protocol == "grpc" else server.http_url
    cli = [sys.executable, "-m", "inflight_client.cli", "--protocol", protocol, "--url", url]
    done = subprocess.run([*cli, "--max-tokens", "24", PROMPTS[0]], capture_output=True, text=True, timeout=60)
    expected = run_streams(server, [llm_stream(PROMPTS[0])])[0].text
    assert done.returncode == 0 and done.stdout == expected + "\n"
    assert "[24 responses, first after" in done.stderr and "finish_reason=length" in done.stderr
    whole = subprocess.run([*cli, "--max-tokens", "24", "--no-stream", PROMPTS[0]], capture_output=True, text=True,
                           timeout=60)
    assert whole.stdout == expected + "\n" and "[1 responses," in whole.stderr
    for extra in ([], ["--no-stream"]):     # the ensemble, streamed or not: the completion alone, as llm's
        ensemble = subprocess.run([*cli, "--model", "ensemble", "--max-tokens", "24", *extra, PROMPTS[0]],
                                  capture_output=True, text=True, timeout=60)
        assert ensemble.returncode == 0 and ensemble.stdout == expected + "\n", ensemble.stdout
        assert "finish_reason" not in ensemble.stderr       # the ensemble returns none
    cancelled_before = server.metric("inflight_requests_total", finish_reason="cancelled")
    # Ctrl-C's default action restored in the child: a suite started as a background job (`cmd &`)
    # inherits SIGINT ignored, and Python then never installs its KeyboardInterrupt handler
    child = subprocess.Popen([*cli, "--max-tokens", "900", PROMPTS[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.stdout.read(1)                 # it is streaming
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 130 and "Traceback" not in err and "[interrupted: request cancelled]" in err
    assert wait_for_metric(server, "inflight_requests_total", cancelled_before + 1, finish_reason="cancelled") \
        == cancelled_before + 1
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


def test_the_client_library_keeps_each_of_n_outputs(server):
    """n > 1: every response carries the n outputs' deltas; the client keeps one text each (it used
    to join them into one string, or fail on HTTP's list)."""
    sampling = {"max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0}
    grpc_out = run_streams(server, [{"model": "llm", "inputs": grpc_inputs(
        PROMPTS[2], True, sampling, exclude_input_in_output=True, return_finish_reason=True)}])[0]
    http_out = http_stream(server.http_url, "llm", {"text_input": PROMPTS[2], "stream": True,
                                                    "exclude_input_in_output": True, "return_finish_reason": True,
                                                    **sampling})
    whole = http_generate(server.http_url, "llm", {"text_input": PROMPTS[2], "exclude_input_in_output": True,
                                                   **sampling})
    assert len(whole["text_output"]) == 3 and len(set(whole["text_output"])) > 1
    for out in (grpc_out, http_out):
        assert out.error is None and out.texts == whole["text_output"]
        assert out.text == out.texts[0] and out.finish_reasons == ["length"] * 3

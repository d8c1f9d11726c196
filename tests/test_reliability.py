"""What happens when clients misbehave, memory runs out, load spikes, the engine fails or the
server stops: nothing lost, nothing leaked, nothing hung, clear errors. Real tritonservers."""
import glob
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from inflight.serving.launch import PRODUCTION_FLAGS, ServerProcess, make_repository, request_shutdown
from inflight_client.streams import grpc_inputs, http_generate, http_stream

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import child_processes, run_streams, wait_for_metric

pytestmark = pytest.mark.server


@pytest.fixture
def start_server(tmp_path):
    """Start a server with engine overrides / env / flags; stopped at the end of the test."""
    servers = []

    def start(engine: dict | None = None, env: dict | None = None, extra: list[str] = (),
              llm_config: str = "") -> ServerProcess:
        """llm_config: text added to llm's config.pbtxt."""
        repo = make_repository(str(tmp_path / f"repo{len(servers)}"), DEFAULT_MODEL, {**TEST_ENGINE, **(engine or {})})
        with open(os.path.join(repo, "llm", "config.pbtxt"), "a") as f:
            f.write("\n" + llm_config)
        server = ServerProcess(repo, extra=list(extra), env=env)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def stream(prompt, max_tokens, **sampling):
    return {"model": "llm", "inputs": grpc_inputs(prompt, True, {"max_tokens": max_tokens, "temperature": 0, **sampling},
                                                  return_finish_reason=True, return_token_ids=True)}


def ok(server) -> bool:
    reply = http_generate(server.http_url, "llm", {"text_input": "The", "max_tokens": 2})
    return "error" not in reply and reply["text_output"].startswith("The")


# ---- bad input: every malformed request gets an error naming the problem ------------------------
def t(name, array, dtype):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def text(value):
    return np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)


DEEP_SCHEMA = {"type": "array"}
for _ in range(600):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
HTTP_LLM = [
    ({"max_tokens": 4}, "'text_input' or 'input_ids'"),
    ({"text_input": "hi", "input_ids": [1, 2]}, "not both"),
    ({"text_input": "word " * 1100, "max_tokens": 4}, "max_model_len"),
    ({"text_input": "x" * 110000}, "'text_input' is 110000 bytes, more than the context of 1024 tokens"),
    ({"text_input": "hi", "max_tokens": 0}, "'max_tokens'"),
    ({"text_input": "hi", "max_tokens": -5}, "'max_tokens'"),
    ({"text_input": "hi", "max_tokens": "abc"}, "'max_tokens' must be an integer"),
    ({"text_input": "hi", "temperature": -1}, "'temperature'"),
    ({"text_input": "hi", "temperature": "NaN"}, "'temperature' must be a finite number"),
    ({"text_input": "hi", "top_p": 0}, "'top_p'"),
    ({"text_input": "hi", "top_p": 2}, "'top_p'"),
    ({"text_input": "hi", "top_k": -5}, "'top_k'"),
    ({"text_input": "hi", "top_k": 1.5}, "'top_k' must be an integer"),
    ({"text_input": "hi", "min_tokens": 9, "max_tokens": 3}, "'min_tokens'"),
    ({"text_input": "hi", "seed": "x"}, "'seed' must be an integer"),
    ({"text_input": "hi", "temprature": 0.1}, "unknown sampling parameter(s) ['temprature']"),
    ({"text_input": "hi", "sampling_parameters": "{nope"}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "[1, 2]"}, "'sampling_parameters' must be a JSON object"),
    ({"text_input": "hi", "sampling_parameters": "null"}, "'sampling_parameters' must be a JSON object"),
    ({"text_input": "hi", "priority": "urgent"}, "'priority' must be 'high', 'normal', 'low' or an integer"),
    ({"text_input": "hi", "stop": 5}, "'stop' must be a string or a list of strings"),
    ({"text_input": "hi", "stop_token_ids": "x"}, "'stop_token_ids' must be a list of integers"),
    ({"text_input": "hi", "ignore_eos": "maybe"}, "'ignore_eos' must be a boolean"),
    ({"text_input": "hi", "sampling_parameters": '{"bad_words": [""]}'}, "'bad_words' must hold non-empty strings"),
    ({"text_input": "hi", "bad_words": ["x"]}, "parameter 'bad_words' has invalid type"),   # lists: JSON only
    ({"text_input": "hi", "sampling_parameters": '{"bad_words": ["\\ud800"]}'},
     "'bad_words' holds a lone UTF-16 surrogate"),
    ({"text_input": "hi", "sampling_parameters": '{"\\ud800": 1}'}, "'\\ud800' holds a lone UTF-16 surrogate"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"structured_outputs": {"json": DEEP_SCHEMA}})},
     "'structured_outputs.json' is nested too deeply"),
    ({"input_ids": [1, 99999], "max_tokens": 4}, "token id 99999 at position 1 is outside the vocabulary"),
    ({"input_ids": [-3], "max_tokens": 4}, "token id -3 at position 0 is outside the vocabulary"),
    # type errors in the generate JSON are caught by Triton itself, in its own words
    ({"text_input": "hi", "stream": "yes"}, "attempt to access JSON non-boolean as boolean"),
    ({"input_ids": ["a", "b"]}, "attempt to access JSON non-signed-integer as signed-integer"),
]
HTTP_ENSEMBLE = [
    ({"text_input": "hi", "max_tokens": 0}, "'max_tokens'"),
    ({"text_input": "", "max_tokens": 3}, "'text_input' is empty"),
    ({"text_input": "hi", "temperature": -1.0}, "'temperature'"),
    ({"text_input": "hi", "top_p": 5.0}, "'top_p'"),
    ({"text_input": "hi", "return_log_probs": True}, "'return_log_probs' is not available through the ensemble"),
    ({"max_tokens": 3}, "text_input"),
    ({"text_input": "x" * 110000}, "'text_input' is 110000 bytes, more than the context of 1024 tokens"),      # before tokenizing
    ({"text_input": "hi", "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "9" * 5000},
     "'guided_decoding_guide' is not valid JSON: Exceeds the limit"),
    ({"text_input": "hi", "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "[" * 100000},
     "'guided_decoding_guide' is nested too deeply"),
]
GRPC = [
    ("llm", [t("text_input", np.array([5], dtype=np.int32), "INT32")],
     "inference input 'text_input' data-type is 'INT32', but model 'llm' expects 'BYTES'"),
    ("llm", [t("text_input", np.array([b"a", b"b"], dtype=object), "BYTES")], "text_input"),
    ("llm", [t("text_input", text(b"\xff\xfe\xfd"), "BYTES")], "'text_input' is not valid UTF-8"),
    ("llm", [t("text_input", text("hi"), "BYTES"), t("stream", np.array([1], dtype=np.int32), "INT32")], "stream"),
    ("llm", [t("text_input", text("hi"), "BYTES"),
             t("sampling_parameters", text('{"max_tokens": "NaN"}'), "BYTES")], "'max_tokens' must be an integer"),
    ("llm", [t("input_ids", np.array([1.5], dtype=np.float32), "FP32")], "input_ids"),
    ("llm", [t("text_input", text("hi"), "BYTES"), t("priority", text("urgent"), "BYTES")], "'priority' must be 'high', 'normal', 'low' or an integer"),
    ("llm", [t("input_ids", np.zeros(0, dtype=np.int32), "INT32")], "'input_ids' is empty"),
    ("llm", [t("text_input", text("hi"), "BYTES"), t("sampling_parameters", text("[" * 100000 + "]" * 100000), "BYTES")],
     "'sampling_parameters' is nested too deeply"),
    ("llm", [t("text_input", text("hi"), "BYTES"), t("cache_salt", text(""), "BYTES")],
     "'cache_salt' must be a non-empty string"),
    ("ensemble", [t("text_input", text("hi"), "BYTES"), t("max_tokens", np.array([3.0], dtype=np.float32), "FP32")],
     "max_tokens"),
    ("ensemble", [t("text_input", text("hi"), "BYTES"), t("temperature", np.array([np.nan], dtype=np.float32), "FP32")],
     "'temperature' must be a finite number"),
    ("ensemble", [t("text_input", text(b"\xc3"), "BYTES")], "'text_input' is not valid UTF-8"),
    # not replaced by U+FFFD: b"\xff" and b"\xfe" would be one tenant's cache_salt, one stop word
    ("ensemble", [t("text_input", text("hi"), "BYTES"), t("cache_salt", text(b"\xff"), "BYTES")],
     "'cache_salt' is not valid UTF-8"),
    ("ensemble", [t("text_input", text("hi"), "BYTES"), t("stop_words", np.array([b"ok", b"\xfe"], dtype=object),
                                                          "BYTES")], "'stop_words' is not valid UTF-8"),
]
CASES = ([("http", "llm", p, m) for p, m in HTTP_LLM] + [("http", "ensemble", p, m) for p, m in HTTP_ENSEMBLE]
         + [("grpc", model, inputs, m) for model, inputs, m in GRPC])


@pytest.mark.parametrize("protocol, model, request_, message", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_malformed_requests_get_an_error_naming_the_problem(server, protocol, model, request_, message):
    if protocol == "http":
        error = http_generate(server.http_url, model, request_).get("error", "")
    else:
        error = run_streams(server, [{"model": model, "inputs": request_}])[0].error or ""
    assert message in error, error
    assert "Traceback" not in error and "\nAt:" not in error
    assert ok(server), "the server answers a valid request right after"


def test_refusals_from_several_clients_at_once_leave_the_server_up(server):
    """Requests refused while Triton reads them and requests the engine refuses, at once: both
    are counted in one metric, which the Python backend cannot update from two threads at once
    (it corrupted its shared memory and crashed tritonserver within a second)."""
    bad = [{"text_input": "The", "temperature": -1}, {"text_input": "word " * 1100, "max_tokens": 4}]
    before = server.metric("inflight_requests_total", finish_reason="error")
    errors = []

    def send(payload):
        errors.extend(http_generate(server.http_url, "llm", payload).get("error", "") for _ in range(40))
    threads = [threading.Thread(target=send, args=(bad[i % 2],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 240 and all(errors)
    assert ok(server)
    assert wait_for_metric(server, "inflight_requests_total", before + 240, finish_reason="error") == before + 240


# ---- client faults ------------------------------------------------------------------------------------
def test_a_client_that_stops_reading_does_not_leak_blocks(server):
    """A client that never reads and then closes: the server notices, aborts the request (it is
    counted cancelled, not left to run to its 900 tokens) and frees its blocks."""
    cancelled_before = server.metric("inflight_requests_total", finish_reason="cancelled")
    body = json.dumps({"text_input": "The import system", "max_tokens": 900, "ignore_eos": True, "stream": True})
    host, port = server.http_url.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        time.sleep(1.0)                              # never reads a byte
    others = run_streams(server, [stream("Boolean operations", 12) for _ in range(3)])
    assert all(o.error is None and len(o.token_ids) == 12 for o in others)
    assert wait_for_metric(server, "inflight_requests_total", cancelled_before + 1, timeout_s=60,
                           finish_reason="cancelled") == cancelled_before + 1
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0, timeout_s=60) == 0
    assert wait_for_metric(server, "inflight_requests_running", 0) == 0


# ---- queue limits and KV exhaustion -------------------------------------------------------------------
def test_bounded_queue_refuses_or_expires_requests_and_spares_the_running_one(start_server):
    import asyncio
    import tritonclient.grpc.aio as aio
    from inflight_client.streams import grpc_stream
    s = start_server({"max_num_seqs": 1, "max_queue_size": 2, "max_queue_wait_s": 1.0, "dtype": "float32"})

    async def main():
        async with aio.InferenceServerClient(s.grpc_url) as client:
            running = asyncio.Event()
            long = asyncio.create_task(grpc_stream(client, **stream("The assert statement", 600, ignore_eos=True),
                                                   on_chunk=lambda _: running.set()))
            await running.wait()             # it holds the only seat; the rest queue behind it
            rest = [asyncio.create_task(grpc_stream(client, **stream(f"Question {i}", 4))) for i in range(4)]
            return [await long] + [await r for r in rest]

    outs = asyncio.run(main())
    assert outs[0].error is None and len(outs[0].token_ids) == 600, "in-flight work is unaffected"
    errors = sorted(o.error or "" for o in outs[1:])
    assert sum("queue full: 2 requests are already waiting (max_queue_size)" in e for e in errors) == 2, errors
    assert sum("timed out in queue after 1 s (max_queue_wait_s)" in e for e in errors) == 2, errors
    assert wait_for_metric(s, "inflight_requests_waiting", 0) == 0 and ok(s)
    # each output waits as a request: more of them than the queue holds could never be queued
    many = http_generate(s.http_url, "llm", {"text_input": "hi", "max_tokens": 2, "sampling_parameters": '{"n": 3}'})
    assert "'n' (3) is more than max_queue_size (2)" in many["error"]
    # the second output waits for the only seat for longer than the limit, but as part of a
    # request already running: it waits on, and both outputs complete
    both = http_generate(s.http_url, "llm", {"text_input": "The assert statement", "max_tokens": 600,
                                             "sampling_parameters": '{"n": 2, "ignore_eos": true}',
                                             "return_num_output_tokens": True})
    assert "error" not in both and both["num_output_tokens"] == [600, 600], both


def test_kv_exhaustion_completes_through_preemption_with_exact_outputs(start_server, tokenizer):
    from transformers import AutoModelForCausalLM
    s = start_server({"num_kv_blocks": 24, "max_num_seqs": 16, "max_model_len": 384})
    prompts = [tokenizer(f"{i} " + "The with statement is used to wrap the execution of a block " * 4)["input_ids"][:60]
               for i in range(16)]
    outs = run_streams(s, [stream(p, 40) for p in prompts])           # demand ~4.5x the pool
    assert s.metric("inflight_preemptions_total") > 0
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == expected
    never = run_streams(s, [stream([5] * 400, 10)])[0]
    assert "prompt (400 tokens) + at least one output token exceeds max_model_len (384)" in never.error
    assert wait_for_metric(s, "inflight_kv_blocks_used", 0) == 0


# ---- engine failure and shutdown ------------------------------------------------------------------------
def ready(server, path: str = "/v2/health/ready") -> int:
    """The status of a readiness (or liveness) endpoint; 0 when the server no longer listens."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0                                     # not listening any more


def test_an_engine_failure_fails_requests_logs_the_cause_and_takes_the_server_out(start_server):
    s = start_server(env={"INFLIGHT_FAULT_AFTER_STEPS": "25"})
    outs = run_streams(s, [stream(f"Prompt {i}", 200, ignore_eos=True) for i in range(3)])
    for out in outs:
        assert out.error and "the engine failed: RuntimeError: injected fault after 25 steps" in out.error
    try:                                             # the server may stop listening at any moment from here
        after = http_stream(s.http_url, "llm", {"text_input": "late", "max_tokens": 3, "stream": True})
        assert after.error, "no request succeeds once the engine has failed"
    except (ConnectionError, http.client.HTTPException):
        pass
    deadline = time.monotonic() + 45
    while ready(s) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready(s) != 200, "readiness must fail"
    assert s.process.wait(45) is not None, "the server exits within its exit timeout"
    log = open(s.log_path, errors="replace").read()
    assert "inflight engine thread failed" in log and "injected fault" in log and "Traceback" in log


HEALTH_CHECK = 'parameters: { key: "ENABLE_VLLM_HEALTH_CHECK" value: { string_value: "true" } }'


LLM_READY, PREPROCESSING_READY = "/v2/models/llm/ready", "/v2/models/preprocessing/ready"


def test_with_the_vllm_backends_health_check_a_failed_engine_unloads_its_model_and_the_server_goes_on(start_server):
    """config.pbtxt's ENABLE_VLLM_HEALTH_CHECK, as the vLLM backend reads it: under explicit model
    control the failed model is unloaded (not ready) while the server and its other models serve
    on; where Triton refuses to unload (its default control mode) the server shuts down as without
    the switch, never leaving a ready model that fails every request."""
    s = start_server(env={"INFLIGHT_FAULT_AFTER_STEPS": "5"}, llm_config=HEALTH_CHECK,
                     extra=["--model-control-mode=explicit", "--load-model=*"])
    out = run_streams(s, [stream("Prompt", 50, ignore_eos=True)])[0]
    assert "the engine failed: RuntimeError: injected fault after 5 steps" in out.error
    deadline = time.monotonic() + 45
    while ready(s, LLM_READY) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready(s, LLM_READY) != 200, "the failed model is no longer ready"
    assert s.process.poll() is None and ready(s, PREPROCESSING_READY) == 200, "the server and its other models go on"
    assert ready(s, "/v2/health/live") == 200
    unloaded = "successfully unloaded 'llm'"       # once its stub has finalized, after readiness went
    while unloaded not in open(s.log_path, errors="replace").read() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = open(s.log_path, errors="replace").read()
    assert "unloading model 'llm' (ENABLE_VLLM_HEALTH_CHECK)" in log and unloaded in log
    assert s.process.poll() is None and ready(s, PREPROCESSING_READY) == 200
    refused = start_server(env={"INFLIGHT_FAULT_AFTER_STEPS": "5"}, llm_config=HEALTH_CHECK)
    out = run_streams(refused, [stream("Prompt", 50, ignore_eos=True)])[0]
    assert "the engine failed" in out.error
    assert refused.process.wait(60) is not None, "default model control: the server shuts down instead"
    assert "Triton did not unload 'llm'" in open(refused.log_path, errors="replace").read()


def test_stopping_the_server_ends_every_in_flight_request_with_a_final_response(start_server):
    s = start_server({"max_num_seqs": 1, "dtype": "float32"})
    import asyncio
    import tritonclient.grpc.aio as aio
    from inflight_client.streams import grpc_stream

    async def main():
        async with aio.InferenceServerClient(s.grpc_url) as client:
            tasks = [asyncio.create_task(grpc_stream(client, **stream(f"Prompt {i}", 900, ignore_eos=True)))
                     for i in range(8)]       # one runs at a time: most are still queued at the signal
            await asyncio.sleep(1.5)
            signalled.append(time.monotonic())
            request_shutdown(s.shutdown_flag, s.process, signal.SIGINT)      # what Ctrl-C on `make serve` does
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    signalled: list[float] = []
    outs = asyncio.run(main())
    for out in outs:
        assert out.finish_reason == "length" or "the server is shutting down" in (out.error or ""), out
    assert any(o.error for o in outs), "at least the queued requests were still in flight"
    assert s.process.wait(40) is not None
    # well inside the 30 s exit timeout: nothing (no request, no stream) keeps the model alive
    assert time.monotonic() - signalled[0] < 15


def test_a_server_that_served_many_streams_stops_promptly(start_server):
    """Triton 2.51's gRPC frontend can keep a finished stream's request (and so the model) alive
    when the client drops the stream right after its final response; shutdown then waits the
    whole exit timeout. Clients that half-close and read the stream to its end never hit that."""
    s = start_server()
    for round_ in range(6):          # each round ends by closing its client's channel, the racy moment
        outs = run_streams(s, [stream(f"Round {round_} prompt {i}", 8) for i in range(8)] + [stream("Bad", 0)])
        assert all(o.finish_reason in ("length", "stop") for o in outs[:-1]), outs
        assert "max_tokens" in outs[-1].error
    started = time.monotonic()
    request_shutdown(s.shutdown_flag, s.process, signal.SIGINT)
    assert s.process.wait(40) is not None
    assert time.monotonic() - started < 15, "the model outlived shutdown: something still holds it"


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:                 # gone
        return False


def test_a_killed_server_leaves_no_model_process_behind(start_server):
    """tritonserver killed (kill -9, the OOM killer) while it streams: every model's process exits
    within a second or so, the engine's memory with it, even while the dead server is not yet
    reaped (the Python backend's own check misses that, and its exit could hang behind a metric
    update waiting for the dead server: `llm`'s process stayed for good)."""
    s = start_server()
    stubs = list(child_processes(s.process.pid))
    assert len(stubs) == 3, "llm, preprocessing and postprocessing each run in a process"
    body = json.dumps({"text_input": "The import system", "max_tokens": 900, "ignore_eos": True, "stream": True})
    host, port = s.http_url.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        assert sock.recv(4096), "the stream has started"
        assert wait_for_metric(s, "inflight_requests_running", 1) == 1
        os.kill(s.process.pid, signal.SIGKILL)         # and not reaped until the end
        deadline = time.monotonic() + 10
        while any(map(running, stubs)) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = [pid for pid in stubs if running(pid)]
    for pid in left:                                    # not to outlive a failed test either
        os.kill(pid, signal.SIGKILL)
    assert not left, "a model's process outlived the server"
    s.process.wait()
    regions = glob.glob(f"/dev/shm/{s.shm_prefix}*")
    assert len(regions) == 3, "the dead server's stubs' shared-memory regions, under its own prefix"
    s.stop()
    assert not glob.glob(f"/dev/shm/{s.shm_prefix}*"), "stopping a killed server removes its regions"


# ---- production profile ----------------------------------------------------------------------------------
def test_production_profile_restricts_admin_apis_and_keeps_prompts_out_of_logs(start_server, tmp_path):
    key = "s3cret-admin-key"
    flags = [f.replace("${INFLIGHT_ADMIN_KEY}", key) for f in PRODUCTION_FLAGS]
    s = start_server(extra=flags)

    def call(method, path, headers=None, body=b""):
        req = urllib.request.Request(f"http://{s.http_url}{path}", data=body if method == "POST" else None,
                                     method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/llm/unload"),
                         ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/logging")):
        status, body = call(method, path)
        assert status == 403, (path, status, body)
    assert call("GET", "/v2/systemsharedmemory/status", {"admin-key": key})[0] == 200
    status, body = call("POST", "/v2/repository/models/llm/unload", {"admin-key": key})
    assert status != 200 and "not allowed" in body, "model control is off even with the key"
    marker = "zebra-quokka-7781 private words"
    reply = http_generate(s.http_url, "llm", {"text_input": marker, "max_tokens": 4})
    assert "error" not in reply
    assert http_generate(s.http_url, "llm", {"text_input": marker, "max_tokens": 0}).get("error")
    assert marker not in open(s.log_path, errors="replace").read()


def assert_drains(engine, timeout_s: float) -> None:
    """The engine ends every request and its pool comes back whole within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (engine.has_unfinished() or engine.kv.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()


class FailingMetrics:
    """Metrics whose per-request hook raises: stands for any bug in the response thread."""

    def snapshot(self, engine, force=False):
        return None

    def publish(self, snapshot):
        pass

    def delivered(self, job, gap):
        pass

    def first_token(self, job, now):
        pass

    def publish_delivered(self):
        pass

    def refused(self):
        pass

    def after_request(self, job, reason, now):
        raise RuntimeError("a bug in after_request")


def test_a_failure_in_the_response_thread_fails_every_request_instead_of_hanging(tokenizer):
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=8, num_kv_blocks=256,
                                                                   cpu_threads=1))
    failures = []
    loop = EngineLoop(engine, tokenizer, FailingMetrics(), on_failure=failures.append).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        running, short = RecordingSink(), RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=500, ignore_eos=True), stream=True),
                    running)
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=2, ignore_eos=True), stream=True), short)
        assert short.finished.wait(30) and running.finished.wait(30), "a request was left waiting"
        assert failures == ["the server failed: RuntimeError: a bug in after_request"]
        assert running.sends[-1][2:] == (True, failures[0])
        later = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=2)), later)
        assert later.finished.wait(5) and later.sends[-1][2:] == (True, failures[0])
        assert_drains(engine, 10)
    finally:
        loop.shutdown()


def test_a_failure_around_the_step_fails_every_request_and_refuses_later_ones(tokenizer, monkeypatch):
    """An exception in the engine thread outside engine.step() (here: admitting a request) ends
    every request in flight with the error, refuses later requests with it, frees every block, and
    leaves the thread answering (not dead, with every later request hanging)."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=8, num_kv_blocks=256,
                                                                   cpu_threads=1))
    failures = []
    loop = EngineLoop(engine, tokenizer, on_failure=failures.append).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        running = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=500, ignore_eos=True), stream=True),
                    running)
        deadline = time.monotonic() + 10
        while not running.outputs and time.monotonic() < deadline:
            time.sleep(0.01)

        def broken(*args, **kwargs):
            raise RuntimeError("a bug admitting a request")
        monkeypatch.setattr(engine, "add_request", broken)
        admitted = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=4)), admitted)
        assert admitted.finished.wait(10) and running.finished.wait(10), "a request was left waiting"
        message = "the engine failed: RuntimeError: a bug admitting a request"
        assert admitted.sends[-1][2:] == (True, message) and running.sends[-1][2:] == (True, message)
        assert failures == [message] and not loop.healthy
        later = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=2)), later)
        assert later.finished.wait(5) and later.sends[-1][2:] == (True, message)
        assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()
        assert loop._engine_thread.is_alive()
    finally:
        loop.shutdown()
    assert not loop._engine_thread.is_alive()


class BrokenSendSink:
    """A sink whose third response cannot be sent (say, the backend's shared memory would not
    grow) while its client is still there: later sends work."""

    def __init__(self):
        from .helpers import RecordingSink
        self.record = RecordingSink()
        self.calls = 0

    def send(self, outputs, final, error=None):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the response could not be sent")
        self.record.send(outputs, final, error)

    def is_cancelled(self):
        return False


class CountingMetrics(FailingMetrics):
    """Metrics that note how each request ended."""

    def __init__(self):
        self.reasons = []

    def after_request(self, job, reason, now):
        self.reasons.append(reason)


def test_a_response_that_cannot_be_sent_ends_its_request_with_an_error(tokenizer):
    """...and is counted once, as an error."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=8, num_kv_blocks=256,
                                                                   cpu_threads=1))
    metrics = CountingMetrics()
    loop = EngineLoop(engine, tokenizer, metrics, cancel_poll_s=0.05).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sink = BrokenSendSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=200, ignore_eos=True), stream=True), sink)
        assert sink.record.finished.wait(10), "the client was left waiting"
        assert sink.record.sends[-1][2:] == (True, "sending a response failed: RuntimeError: the response could not "
                                                   "be sent")
        assert len(sink.record.sends) == 3        # two tokens, then the end
        assert metrics.reasons == ["error"]
        assert_drains(engine, 5)
    finally:
        loop.shutdown()


def test_requests_failed_by_a_fault_in_the_response_thread_are_counted_as_errors(tokenizer, monkeypatch):
    """Every request ends once in the metrics, also when the response thread fails under it."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving import loop as loop_module
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    calls = []

    def failing_outputs(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("a bug in building a response")
        return real_outputs(*args, **kwargs)
    real_outputs = loop_module.response_outputs
    monkeypatch.setattr(loop_module, "response_outputs", failing_outputs)
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=8, num_kv_blocks=256,
                                                                   cpu_threads=1))
    metrics = CountingMetrics()
    loop = EngineLoop(engine, tokenizer, metrics, on_failure=lambda message: None).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sinks = [RecordingSink() for _ in range(3)]
        for sink in sinks:
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=200, ignore_eos=True), stream=True),
                        sink)
        assert all(sink.finished.wait(30) for sink in sinks), "a request was left waiting"
        assert all("a bug in building a response" in sink.sends[-1][3] for sink in sinks)
        assert metrics.reasons == ["error"] * 3
        assert_drains(engine, 10)
    finally:
        loop.shutdown()


def test_a_request_registered_after_the_loop_failed_gets_the_failure_at_once(tokenizer):
    """submit() checked the loop before it failed, and its registration reaches the response
    thread after the failure: no step will ever end the request, so it ends there."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", num_kv_blocks=64, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer)          # not started: the messages are handed over by hand
    sink = RecordingSink()
    job = loop._make_job(GenerateRequest(None, tokenizer("The assert statement")["input_ids"],
                                         SamplingParams(max_tokens=5), stream=True), sink)
    loop.failure = "the server failed: RuntimeError: a bug"
    loop._dispatch("register", job)
    assert sink.sends == [(sink.sends[0][0], "", True, loop.failure)] and job.job_id not in loop._jobs


def test_a_request_cancelled_before_the_engine_takes_it_is_never_admitted(tokenizer):
    """Its cancellation can reach the engine thread before its "add" (the response thread polls
    between submit()'s two messages): the request must not then run to its end holding blocks, and
    the response thread, to which no step will ever report it, keeps nothing of it."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", num_kv_blocks=64, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer)          # not started: the messages are handed over by hand, in that order
    sink = RecordingSink()
    job = loop._make_job(GenerateRequest(None, tokenizer("The assert statement")["input_ids"],
                                         SamplingParams(max_tokens=50), stream=True, n=2), sink)
    loop._dispatch("register", job)
    sink.left = True
    loop._poll_cancelled()
    assert sink.sends[-1][2:] == (True, None)
    while not loop.inbox.empty():                 # the aborts, which find nothing to abort
        loop._handle(loop.inbox.get())
    loop._handle(("add", job))
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0
    assert (loop._jobs, loop._samples, loop._owner) == ({}, {}, {})


@pytest.mark.parametrize("per_s, share", [(10, 1.0), (20, 0.5)])
def test_a_queued_stream_with_queue_heartbeat_gets_empty_responses_and_is_cancelled_in_the_queue(tokenizer,
                                                                                                  monkeypatch, per_s,
                                                                                                  share):
    """Behind a running request (max_num_seqs 1): the streams that asked for queue_heartbeat get a
    response without outputs while they wait, spaced by heartbeat_s or, with more waiting than
    this loop's share of HEARTBEATS_PER_S allows (an instance's, where Triton runs several),
    further apart (also when they arrived at different times); one that did not ask gets nothing;
    when a client leaves, its request is cancelled in the queue and never runs."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving import loop as serving_loop
    from inflight.serving.protocol import GenerateRequest
    monkeypatch.setattr(serving_loop, "HEARTBEATS_PER_S", per_s)     # 10 a second here: two streams each every 0.2 s
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=1, num_kv_blocks=256,
                                                                   cpu_threads=1))
    loop = serving_loop.EngineLoop(engine, tokenizer, cancel_poll_s=0.05, heartbeat_s=0.1,
                                   heartbeat_share=share).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    from .helpers import RecordingSink
    sinks = {name: RecordingSink() for name in ("running", "heartbeat", "heartbeat too", "quiet")}
    try:
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=800, ignore_eos=True), stream=True),
                    sinks["running"])
        deadline = time.monotonic() + 10
        while not sinks["running"].outputs and time.monotonic() < deadline:
            time.sleep(0.01)
        submitted = time.monotonic()
        for name, heartbeat in (("heartbeat", True), ("heartbeat too", True), ("quiet", False)):
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=4), stream=True,
                                        queue_heartbeat=heartbeat), sinks[name])
            time.sleep(0.07)       # out of phase: each is silent heartbeat_s at a different poll
        while len(sinks["heartbeat"].outputs) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sinks["heartbeat"].outputs[:3] == [{}, {}, {}] and sinks["quiet"].outputs == []
        times = [submitted] + [sent[0] for sent in sinks["heartbeat"].sends[:3]]
        assert all(later - earlier >= 0.19 for earlier, later in zip(times, times[1:])), times
        assert engine.scheduler.num_waiting == 3
        sinks["heartbeat"].left = True
        assert sinks["heartbeat"].finished.wait(5)
        assert sinks["heartbeat"].outputs[-1] is None and all(o == {} for o in sinks["heartbeat"].outputs[:-1])
        assert not sinks["running"].finished.is_set(), "cancelled while the running request still ran"
        for name in ("running", "heartbeat too", "quiet"):
            sinks[name].left = True
        assert all(sinks[name].finished.wait(10) for name in ("running", "heartbeat too", "quiet"))
        assert_drains(engine, 5)
    finally:
        loop.shutdown()


def test_queued_requests_are_checked_for_cancellation_a_share_at_a_time(tokenizer, monkeypatch):
    """Each check is a round trip to tritonserver: 1,000 queued requests checked every poll took
    the response thread 70% of a core. The running ones are checked every poll; the queued ones
    QUEUED_CHECKS_PER_S in all, in turn, so that each is still checked, and one whose client left is
    cancelled in the queue within len(queue) / share polls."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving import loop as serving_loop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    monkeypatch.setattr(serving_loop, "QUEUED_CHECKS_PER_S", 200)      # 10 a poll of 0.05 s

    class CountingSink(RecordingSink):
        checks = 0

        def is_cancelled(self):
            CountingSink.checks += 1
            return super().is_cancelled()
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=1, num_kv_blocks=256,
                                                                   cpu_threads=1))
    loop = serving_loop.EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    running, queued = CountingSink(), [CountingSink() for _ in range(60)]
    try:
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=2000, ignore_eos=True), stream=True),
                    running)
        deadline = time.monotonic() + 10
        while not running.outputs and time.monotonic() < deadline:
            time.sleep(0.01)
        for sink in queued:
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=4), stream=True), sink)
        time.sleep(0.2)
        before, started = CountingSink.checks, time.monotonic()
        time.sleep(1.0)
        polls = (time.monotonic() - started) / 0.05
        assert CountingSink.checks - before <= (10 + 1) * (polls + 1), (CountingSink.checks - before, polls)
        left = time.monotonic()
        for sink in queued:
            sink.left = True
        assert all(sink.finished.wait(10) for sink in queued)
        assert time.monotonic() - left < 60 / 10 * 0.05 + 1.0, "every queued request is checked in turn"
        while engine.scheduler.num_waiting and time.monotonic() < deadline + 10:     # the aborts, on the engine thread
            time.sleep(0.01)
        assert not running.finished.is_set() and engine.scheduler.num_waiting == 0, "cancelled in the queue"
        running.left = True
        assert running.finished.wait(5)
        assert_drains(engine, 5)
    finally:
        loop.shutdown()


def test_a_running_stream_whose_stream_interval_holds_its_tokens_gets_heartbeats(tokenizer):
    """With queue_heartbeat, a stream silent for heartbeat_s gets an empty response also while it
    runs (its stream_interval holding tokens back): the write by which Triton's HTTP frontend finds
    a client that left, which would otherwise come only with its next batch of tokens."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", num_kv_blocks=256, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.02, heartbeat_s=0.05).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sink = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=800, ignore_eos=True), stream=True,
                                    stream_interval=10_000, queue_heartbeat=True, return_num_output_tokens=True), sink)
        deadline = time.monotonic() + 30
        while sum(o == {} for o in sink.outputs[1:]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = sink.outputs[0]
        assert first and first["num_output_tokens"][0] == 1, "the first token comes at once"
        assert sink.outputs[1:3] == [{}, {}] and not sink.finished.is_set(), "no heartbeat while it ran"
        sink.left = True
        assert sink.finished.wait(5)
        assert_drains(engine, 5)
        assert engine.num_generated_tokens < 800, "it ran to its end"
    finally:
        loop.shutdown()


def test_a_high_priority_request_is_served_before_normal_ones_that_came_first(tokenizer):
    """priority reaches the engine through the serving loop: with one seat, a "high" request queued
    behind two "normal" ones runs first; the normal ones keep their arrival order."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=1, num_kv_blocks=256,
                                                                   cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05)
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sinks = {name: RecordingSink() for name in ("first", "second", "high")}
        # all queued before the loop starts, so the engine thread adds them in one go, in this order
        for name, priority in (("first", "normal"), ("second", "normal"), ("high", "high")):
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=8, ignore_eos=True), priority=priority,
                                        stream=True), sinks[name])
        loop.start()
        assert all(sink.finished.wait(60) for sink in sinks.values()), "a request was left waiting"
        assert all(sink.sends[-1][3] is None for sink in sinks.values())
        ends = {name: sink.sends[-1][0] for name, sink in sinks.items()}
        assert sorted(ends, key=ends.get) == ["high", "first", "second"], ends
    finally:
        loop.shutdown()


def test_a_full_queue_gives_a_low_priority_client_the_error_for_a_high_priority_one(tokenizer):
    """The serving loop sends a request a higher priority took the place of its error (Triton's
    UNAVAILABLE: "queue full"), the other clients their outputs."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=1, max_queue_size=3,
                                                                   num_kv_blocks=256, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05)
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        # "n=3" needs three places where two could be given up: it is refused, and no one's is taken
        order = (("first", "normal"), ("low-1", "low"), ("low-2", "low"), ("mid", "normal"), ("n=3", "normal"),
                 ("high", "high"), ("refused", "low"))
        sinks = {name: RecordingSink() for name, _ in order}
        # all queued before the loop starts, so the engine thread adds them in one go, in this order
        for name, priority in order:
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=8, ignore_eos=True), priority=priority,
                                        stream=True, n=3 if name == "n=3" else 1), sinks[name])
        loop.start()
        assert all(sink.finished.wait(60) for sink in sinks.values()), "a request was left waiting"
        errors = {name: sink.sends[-1][3] for name, sink in sinks.items()}
        took = "queue full: a request of a higher priority took this one's place in the queue (max_queue_size 3)"
        full = "queue full: 3 requests are already waiting (max_queue_size)"
        assert errors == {"first": None, "low-1": None, "low-2": took, "mid": None, "n=3": full, "high": None,
                          "refused": full}, errors
        assert all(len(sinks[name].sends) == 1 for name in ("low-2", "n=3", "refused")), "no tokens before"
        ends = {name: sinks[name].sends[-1][0] for name in ("first", "low-1", "mid", "high")}
        assert sorted(ends, key=ends.get) == ["high", "first", "mid", "low-1"], ends
        assert_drains(engine, 5)
    finally:
        loop.shutdown()


def test_cache_salt_reaches_the_engine_so_tenants_share_no_prefix_cache(tokenizer):
    """cache_salt reaches the engine through the serving loop: a prompt sent again with the same
    salt is found in the prefix cache; the same prompt with another tenant's salt is not."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=256,
                                                                   cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    prompt = tokenizer("The assert statement is a convenient way to insert debugging assertions into a program. "
                       * 3)["input_ids"]
    assert len(prompt) > 2 * engine.config.block_size, "whole blocks to cache"
    try:
        hits = []
        for salt in ("tenant-a", "tenant-a", "tenant-b"):
            sink = RecordingSink()
            loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=2), cache_salt=salt), sink)
            assert sink.finished.wait(60) and sink.sends[-1][3] is None
            hits.append(engine.stats()["prefix_cache_hit_tokens"])
        assert hits[1] > hits[0], "the same tenant's prompt is found in the cache"
        assert hits[2] == hits[1], "another tenant's is not"
    finally:
        loop.shutdown()


def test_a_cancelled_n_request_stops_every_one_of_its_outputs(tokenizer):
    """A client that leaves an n = 2 stream: both outputs are aborted, not only the first, so the
    engine does not generate the other's 900 tokens for nobody."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=256,
                                                                   cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sink = RecordingSink()
        loop.submit(GenerateRequest(None, prompt, SamplingParams(max_tokens=900, ignore_eos=True, temperature=1.0,
                                                                 seed=1), stream=True, n=2), sink)
        deadline = time.monotonic() + 30
        while len(sink.sends) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.sends) >= 3 and not sink.finished.is_set(), "it streams"
        sink.left = True
        assert sink.finished.wait(5) and sink.sends[-1][2:] == (True, None)
        assert_drains(engine, 30)
        # a few steps ran between the last response and the abort; the 2 x 900 tokens did not
        assert engine.num_generated_tokens < 300, engine.num_generated_tokens
    finally:
        loop.shutdown()


def test_the_serving_loop_keeps_nothing_of_requests_that_ended(tokenizer):
    """Refused requests (a prompt that fills max_model_len, a full queue), finished ones and
    n > 1 ones all leave the response thread's bookkeeping: nothing grows with the requests served."""
    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(
        dtype="float32", max_num_seqs=2, num_kv_blocks=64, max_model_len=256, max_queue_size=3, cpu_threads=1))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05)
    prompt = tokenizer("The assert statement")["input_ids"]
    try:
        sinks = []
        # all queued before the loop starts, so the engine thread adds them in one go, in order
        # the 2 free seats and the queue's 3 places: 5 outputs
        for params, n in [(SamplingParams(max_tokens=40, ignore_eos=True), 2),     # two of them
                          *[(SamplingParams(max_tokens=4, ignore_eos=True), 1)] * 3,          # the other three
                          *[(SamplingParams(max_tokens=4, ignore_eos=True), 1)] * 5,          # queue full
                          *[(SamplingParams(max_tokens=4, ignore_eos=True), 1)] * 5]:         # too long
            sinks.append(RecordingSink())
            ids = prompt if len(sinks) <= 9 else prompt[-1:] * 256
            loop.submit(GenerateRequest(None, ids, params, stream=True, n=n), sinks[-1])
        loop.start()
        assert all(sink.finished.wait(60) for sink in sinks), "a request was left waiting"
        errors = [sink.sends[-1][3] for sink in sinks]
        assert errors[:4] == [None] * 4
        assert all(e.startswith("queue full") for e in errors[4:9]) and all("max_model_len" in e for e in errors[9:])
        deadline = time.monotonic() + 5
        while (loop._jobs or loop._samples or loop._owner) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (loop._jobs, loop._samples, loop._owner) == ({}, {}, {})
        assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()
    finally:
        loop.shutdown()


def test_an_empty_text_input_without_a_bos_is_refused_by_name():
    """"" is the BOS alone (as in vLLM); a tokenizer that adds no BOS leaves no token to start from."""
    from transformers import AutoTokenizer

    from inflight import EngineConfig, LLMEngine, SamplingParams
    from inflight.serving.loop import EngineLoop
    from inflight.serving.protocol import GenerateRequest

    from .helpers import RecordingSink
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float32", max_num_seqs=2, num_kv_blocks=64,
                                                                   cpu_threads=1))
    loop = EngineLoop(engine, AutoTokenizer.from_pretrained(DEFAULT_MODEL, add_bos_token=False)).start()
    try:
        refused, served = RecordingSink(), RecordingSink()
        loop.submit(GenerateRequest("", None, SamplingParams(max_tokens=2)), refused)
        loop.submit(GenerateRequest("The", None, SamplingParams(max_tokens=2)), served)
        assert refused.finished.wait(30) and served.finished.wait(30)
        assert refused.sends[-1][3] == "input 'text_input' is empty, and this tokenizer adds no BOS to start from"
        assert served.sends[-1][3] is None
        assert engine.kv.num_used_blocks == 0
    finally:
        loop.shutdown()

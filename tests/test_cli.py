"""inflight-client without a server to reach: one line naming where it looked, exit status 1."""
import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inflight.serving.launch import free_port
from inflight_client.cli import main


@contextlib.contextmanager
def canned_server(status: int, body: bytes, headers: dict | None = None, protocol: str = "HTTP/1.0"):
    """A local HTTP server answering every POST with this status, headers and body: host:port."""
    class Canned(BaseHTTPRequestHandler):
        protocol_version = protocol

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.parametrize("protocol, extra", [("grpc", []), ("http", []), ("http", ["--no-stream"])])
def test_no_server_is_one_line_not_a_traceback(capsys, protocol, extra):
    url = f"127.0.0.1:{free_port()}"
    assert main(["--protocol", protocol, "--url", url, *extra, "The assert statement"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the server at {url} ({protocol})") and "Traceback" not in err


def test_a_response_cut_short_is_one_line_not_a_traceback(capsys):
    """A server that starts a streamed reply and drops the connection mid-chunk (the process died):
    one line saying so, exit status 1."""
    import socket
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_half_a_reply():
        conn, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, body = request.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        event = b'data: {"text_output": "The"}\n\n'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(event):x}\r\n".encode() + event + b"\r\n40\r\ndata: {\"text_output\": \"half")
        conn.close()

    thread = threading.Thread(target=serve_half_a_reply, daemon=True)
    thread.start()
    try:
        assert main(["--protocol", "http", "--url", f"127.0.0.1:{port}", "The assert statement"]) == 1
    finally:
        thread.join(5)
        listener.close()
    err = capsys.readouterr().err
    assert f"error: the server at 127.0.0.1:{port} ended the response early" in err and "Traceback" not in err


@pytest.mark.parametrize("extra", [[], ["--no-stream"]])
@pytest.mark.parametrize("status, body", [(502, b"<html><body>Bad Gateway</body></html>\n"), (503, b"")])
def test_an_error_page_that_is_not_json_is_one_line_with_the_status(capsys, extra, status, body):
    """A proxy in front of Triton (an ingress) answers with its own page, or nothing: the status in
    one line, exit status 1, streamed or not."""
    with canned_server(status, body) as url:
        assert main(["--protocol", "http", "--url", url, *extra, "The assert statement"]) == 1
    err = capsys.readouterr().err
    assert f"error: HTTP {status} " in err and "Traceback" not in err


@pytest.mark.parametrize("argv, flag", [
    (["--url", "localhost:abc"], "--url"), (["--url", "localhost:0"], "--url"), (["--url", "localhost:65536"], "--url"),
    (["--url", ":8001"], "--url"), (["--url", "http://localhost:8000"], "--url"),
    (["--max-tokens", "0"], "--max-tokens"), (["--max-tokens", "3000000000"], "--max-tokens"),
    (["--top-k", "-2"], "--top-k"), (["--top-k", str(2**31)], "--top-k"), (["--model", "ensemble", "--top-k", "-1"], "--top-k"),
    (["--seed", str(2**64)], "--seed"), (["--model", "ensemble", "--seed", "-1"], "--seed"),
    (["--temperature", "nan"], "--temperature"), (["--top-p", "1e39"], "--top-p"),
    (["--cancel-after", "0"], "--cancel-after")])
def test_a_flag_out_of_range_is_refused_naming_it(capsys, argv, flag):
    """Checked before any request: the ensemble's INT32/UINT64/FP32 inputs would wrap the value (or
    numpy would warn), and a bad --url was blamed on the server."""
    with pytest.raises(SystemExit) as exit:
        main([*argv, "The assert statement"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"argument {flag}: " in err and "Traceback" not in err, err


def test_the_extreme_values_in_range_reach_the_request(monkeypatch):
    import inflight_client.cli as cli
    sent = []
    monkeypatch.setattr(cli, "_complete", lambda args, url, sampling, stream, show: sent.append((url, sampling)) or cli.Completion())
    assert main(["--model", "ensemble", "--url", "[::1]:65535", "--seed", str(2**64 - 1), "--top-k", "0",
                 "--max-tokens", str(2**31 - 1), "The assert statement"]) == 0
    assert main(["--seed", str(-2**63), "--top-k", "-1", "The assert statement"]) == 0    # llm's seed is signed or not
    assert sent[0] == ("[::1]:65535", {"max_tokens": 2**31 - 1, "temperature": 0.0, "top_k": 0, "seed": 2**64 - 1})
    assert sent[1][1]["seed"] == -2**63 and sent[1][1]["top_k"] == -1
    assert cli._http_payload("ensemble", "x", sent[0][1], True) == {
        "text_input": "x", "stream": True, "exclude_input_in_output": True, **sent[0][1]}


def test_ensemble_inputs_are_typed_as_the_ensemble_declares_and_range_checked():
    from inflight_client.streams import ensemble_inputs
    inputs = ensemble_inputs("x", False, max_tokens=8, temperature=0.5, seed=2**64 - 1, stop_words=["a", "b"],
                             priority="high", exclude_input_in_output=True)
    assert [(t.name(), t.datatype(), t.shape()) for t in inputs] == [
        ("text_input", "BYTES", [1]), ("stream", "BOOL", [1]), ("max_tokens", "INT32", [1]), ("temperature", "FP32", [1]),
        ("seed", "UINT64", [1]), ("stop_words", "BYTES", [2]), ("priority", "BYTES", [1]),
        ("exclude_input_in_output", "BOOL", [1])]
    for bad in ({"max_tokens": 2**31}, {"seed": -1}, {"top_p": 1e39}, {"temperature": float("nan")}, {"top_k": 1.5}):
        with pytest.raises(ValueError, match=f"'{next(iter(bad))}'"):
            ensemble_inputs("x", **bad)


@pytest.mark.parametrize("model, said", [("llm", "[interrupted: request cancelled]"),
                                         ("ensemble", "[interrupted: the ensemble's llm request runs to its end on the server]")])
def test_ctrl_c_says_whether_the_server_stops(capsys, monkeypatch, model, said):
    """Triton checks an ensemble's cancellation only between its steps: its llm step runs on."""
    import inflight_client.cli as cli

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_complete", interrupted)
    assert main(["--model", model, "The assert statement"]) == 130
    assert capsys.readouterr().err.strip() == said


@pytest.mark.parametrize("extra", [[], ["--no-stream"]])
def test_an_http_client_at_the_grpc_port_is_told_so(capsys, extra):
    """Triton's gRPC port answers an HTTP/1.1 request with HTTP/2 frames: not the server's fault."""
    import concurrent.futures
    import grpc
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        assert main(["--protocol", "http", "--url", url, *extra, "The assert statement"]) == 1
    finally:
        server.stop(0)
    assert capsys.readouterr().err.startswith(f"error: {url} is not an HTTP Triton endpoint")


def test_a_closed_stdout_ends_quietly():
    """`inflight-client ... | head -c 5`: Python's documented SIGPIPE handling (stdout to devnull,
    exit status 1), no message blaming the server and no traceback at exit."""
    import os
    import subprocess
    import sys

    import inflight_client
    events = b"".join(b'data: {"text_output": "word "}\n\n' for _ in range(64))
    read, write = os.pipe()
    os.close(read)                  # the reader has gone before the first write
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(inflight_client.__file__))}
    try:
        with canned_server(200, events, {"Content-Type": "text/event-stream"}, "HTTP/1.1") as url:
            done = subprocess.run([sys.executable, "-m", "inflight_client.cli", "--protocol", "http", "--url",
                                   url, "The assert statement"],
                                  stdout=write, stderr=subprocess.PIPE, env=env, timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stderr == b"", done.stderr.decode()


def test_a_grpc_client_at_the_http_port_is_told_so(capsys):
    """gRPC against Triton's HTTP port sees only a closed socket: the error says what answers there."""
    with canned_server(200, b"{}") as url:
        assert main(["--url", url, "The assert statement"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the server at {url} (grpc)") and "the HTTP port?" in err, err


EVENTS = b'data: {"text_output": "The"}\n\ndata: {"text_output": " end", "finish_reason": "length"}\n\n'


@pytest.mark.parametrize("model, cancel_after, said", [
    ("llm", 2, "[2 responses, first after"),                   # the last event ended it: nothing to cancel
    ("llm", 1, "cancelled]"),
    ("ensemble", 1, "cancelled: the ensemble's llm request runs to its end on the server]")])
def test_cancel_after_says_what_happened_on_the_server(capsys, model, cancel_after, said):
    """Triton checks an ensemble's cancellation only between its steps (its llm step runs on), as
    Ctrl-C says; and a stream whose Nth event was its last was not cancelled."""
    with canned_server(200, EVENTS, {"Content-Type": "text/event-stream"}) as url:
        assert main(["--protocol", "http", "--url", url, "--model", model, "--cancel-after", str(cancel_after),
                     "The assert statement"]) == 0
    err = capsys.readouterr().err.strip()
    assert said in err and ("cancelled" in err) == (cancel_after == 1), err


def test_llms_knobs_go_over_http_in_sampling_parameters_where_a_seed_past_int64_stays_exact():
    """Triton's HTTP generate reads a top-level integer past int64 as a double: 2**63 + 1 reached
    llm as 2**63 (the same text as that seed); in sampling_parameters it stays exact, as over gRPC."""
    import json
    import inflight_client.cli as cli
    payload = cli._http_payload("llm", "x", {"max_tokens": 4, "seed": 2**63 + 1}, True)
    assert json.loads(payload["sampling_parameters"]) == {"max_tokens": 4, "seed": 2**63 + 1}
    assert "seed" not in payload and payload["return_finish_reason"] is True

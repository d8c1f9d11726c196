"""inflight-client without a server to reach: one line naming where it looked, exit status 1."""
import pytest

from inflight.serving.launch import free_port
from inflight_client.cli import main


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
    import threading
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
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Proxy(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"127.0.0.1:{server.server_address[1]}"
        assert main(["--protocol", "http", "--url", url, *extra, "The assert statement"]) == 1
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert f"error: HTTP {status} " in err and "Traceback" not in err

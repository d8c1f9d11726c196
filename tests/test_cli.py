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

"""The OpenAI server as a child process (used by `make serve`, the tests and the benchmark):
`with OpenAIServerProcess("localhost:8000", model_dir) as server: server.base_url`."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from inflight.serving.launch import free_port


PARENT_ENV = "INFLIGHT_OPENAI_PARENT"      # the pid of the process that started the server (cli.py)


class OpenAIServerProcess:
    def __init__(self, triton_url: str, model_dir: str, port: int | None = None, host: str = "127.0.0.1",
                 extra: list[str] = (), env: dict[str, str] | None = None, log_path: str | None = None):
        self.port = port or free_port()
        self.host = host
        self.cmd = [sys.executable, "-m", "inflight_client.openai_server", "--triton-url", triton_url,
                    "--model-dir", model_dir, "--host", host, "--port", str(self.port), *extra]
        self.env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{'localhost' if self.host in ('0.0.0.0', '127.0.0.1') else self.host}:{self.port}/v1"

    def start(self, wait: bool = True, timeout_s: float = 120.0) -> "OpenAIServerProcess":
        assert self.process is None, "already started"
        log = open(self.log_path, "ab") if self.log_path else None
        # a session of its own: a terminal's Ctrl-C reached it during its imports, before uvicorn
        # handles signals (a KeyboardInterrupt traceback); whoever started it stops it with SIGTERM
        self.process = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                        start_new_session=True)
        if log is not None:
            log.close()          # the child holds its own descriptor
        if wait:
            self.wait_listening(timeout_s)
        return self

    def wait_listening(self, timeout_s: float) -> None:
        """Until the server answers /health (with any status: 503 while Triton is not ready)."""
        deadline = time.monotonic() + timeout_s
        url = self.base_url.removesuffix("/v1") + "/health"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"inflight-openai exited with {self.process.returncode}"
                                   + (f"; log: {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except urllib.error.HTTPError:
                return
            except (OSError, http.client.HTTPException):      # not up yet
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"inflight-openai did not answer on {url} within {timeout_s} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "OpenAIServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Helpers for tests that talk to a real server, or to the serving loop in-process."""
import asyncio
import os
import re
import threading
import time

from inflight_client.openai_server.process import OpenAIServerProcess
from inflight_client.streams import Completion, grpc_stream

from .conftest import DEFAULT_MODEL, REPO

# for a child process that imports the engine and the clients from this checkout
SOURCE_PATH_ENV = {"PYTHONPATH": os.pathsep.join(os.path.join(REPO, p) for p in ("backend_src", "client", ""))}


def openai_server(triton_url: str, tmp_path, *extra) -> OpenAIServerProcess:
    """The OpenAI server for the test model in front of `triton_url`; started and stopped by `with`."""
    return OpenAIServerProcess(triton_url, DEFAULT_MODEL, extra=list(extra), env=SOURCE_PATH_ENV,
                               log_path=str(tmp_path / f"openai-{time.monotonic_ns()}.log"))


# Triton's vLLM backend's tensors (src/model.py there, _auto_complete_inputs_and_outputs), less the
# image and embedding_request inputs, which `llm` does not serve
VLLM_BACKEND_INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
                       "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                       "return_num_output_tokens")
VLLM_BACKEND_OUTPUTS = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                        "num_output_tokens")


def as_vllm_backend(repository: str) -> str:
    """Declare in the repository's `llm` exactly the vLLM backend's tensors (text_input required,
    as there): Triton then refuses every input of inflight's own, as it would for that backend, so
    the model stands in for it in tests of its clients."""
    path = os.path.join(repository, "llm", "config.pbtxt")
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if not (m := re.match(r'\s*\{ name: "(\w+)"', line))
            or m.group(1) in VLLM_BACKEND_INPUTS + VLLM_BACKEND_OUTPUTS]
    text = re.sub(r",(\s*\])", r"\1", "".join(kept))          # the comma a dropped last entry left
    text = re.sub(r'(name: "text_input" [^}]*?) optional: true', r"\1", text)
    with open(path, "w") as f:
        f.write(text)
    return repository


def run_streams(server, requests: list[dict]) -> list[Completion]:
    """Run gRPC streams concurrently; each request is grpc_stream's keyword arguments
    (model, inputs, parameters, cancel_after)."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        async with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return await asyncio.gather(*(grpc_stream(client, **r) for r in requests))

    return asyncio.run(main())


def wait_for_metric(server, name: str, expected: float, timeout_s: float = 10.0, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = server.metric(name, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


class RecordingSink:
    """Collects what the serving loop sends for one request (Triton's response sender, in a server);
    setting `left` is its client going away (is_cancelled turns true)."""

    def __init__(self):
        self.sends: list[tuple[float, str, bool, str | None]] = []
        self.outputs: list[dict | None] = []        # each send's outputs as given
        self.left = False
        self.finished = threading.Event()

    def send(self, outputs, final, error=None):
        text = b"".join(outputs["text_output"].reshape(-1)).decode() if outputs else ""
        self.sends.append((time.monotonic(), text, final, error))
        self.outputs.append(outputs)
        if final:
            self.finished.set()

    def is_cancelled(self):
        return self.left

    @property
    def text(self):
        return "".join(s[1] for s in self.sends)


def rss_mib(pid: int) -> float:
    """The resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def child_processes(pid: int) -> dict[int, str]:
    """pid -> command line of each child process of pid (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            children[int(entry)] = command
    return children

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
# image input, which `llm` does not serve
VLLM_BACKEND_INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
                       "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                       "return_num_output_tokens", "embedding_request")
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


def assert_left_stream_cancelled(server, stream, cancelled: float, start: float) -> None:
    """Close a 900-token stream once its request holds KV blocks, as a client that goes away does,
    and check that the engine cancels the request and frees its blocks within a few steps (not at
    its 900th token). cancelled, start: the cancelled-requests metric and computed_tokens before it."""
    deadline = time.monotonic() + 10          # metrics are published every 50 ms while running
    while server.metric("inflight_kv_blocks_used") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("inflight_kv_blocks_used") > 0, "the request holds blocks while it runs"
    stream.close()
    left = server.metric("inflight_prompt_and_decode_tokens_total")
    assert wait_for_metric(server, "inflight_requests_total", cancelled + 1, finish_reason="cancelled") \
        == cancelled + 1
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0
    end = computed_tokens(server)
    assert end - start < 900 and end - left < 300, f"{left - start} tokens before the client left, {end - left} after"


def computed_tokens(server) -> float:
    """Tokens the engine has run through the model, read once it is idle (its metrics are then exact)."""
    assert wait_for_metric(server, "inflight_requests_running", 0, timeout_s=60) == 0
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0, timeout_s=60) == 0
    return server.metric("inflight_prompt_and_decode_tokens_total")


def latency_sums(server, prefix: str, **labels) -> tuple[float, float, float]:
    """The sums of the time-to-first-token, end-to-end and time-per-output-token histograms."""
    return tuple(server.metric(f"{prefix}{name}_sum", **labels) for name in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"))


def assert_latencies_add_up(ttft: float, e2e: float, tpot: float, tokens: int) -> None:
    """One request's latencies, as a dashboard reads them: the first token before the end, and the
    time per output token the rest of the request spread over its other tokens."""
    assert 0 < ttft < e2e, (ttft, e2e)
    per_token = (e2e - ttft) / (tokens - 1)
    assert 0.5 * per_token < tpot <= 1.01 * per_token + 1e-4, (tpot, per_token)


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


def reasoning_checkpoint(directory: str, markers: tuple[str, ...] = ("<think>", "</think>"),
                         chat_template: str | None = None, special: bool = False) -> str:
    """A copy of the test model whose tokenizer has reasoning markers (DeepSeek-R1's <think> and
    </think> by default) as tokens of their own (not special, as R1's, unless `special`), in place of
    its last-learned tokens; and another chat template if given."""
    import json
    import shutil
    shutil.copytree(DEFAULT_MODEL, directory)
    path = os.path.join(directory, "tokenizer.json")
    with open(path) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    for marker, token_id in zip(markers, sorted(vocab.values())[-len(markers):]):
        replaced = next(text for text, i in vocab.items() if i == token_id)
        del vocab[replaced]
        vocab[marker] = token_id
        tokenizer["model"]["merges"] = [m for m in tokenizer["model"]["merges"] if "".join(m) != replaced]
        tokenizer["added_tokens"].append({"id": token_id, "content": marker, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": special})
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    if chat_template is not None:
        config_path = os.path.join(directory, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        with open(config_path, "w") as f:
            json.dump({**config, "chat_template": chat_template}, f)
    return directory


# the test model's chat template, refusing a tool call id that is not Mistral's 9 characters as Mistral's own do
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% for call in message.tool_calls or [] %}"
                    "{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings "
                    "with length 9!') }}{% endif %}{% endfor %}{{ message['role'] | capitalize }}: "
                    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def mistral_checkpoint(directory: str, args: bool = True, think: bool = False) -> str:
    """A copy of the test model whose tokenizer has Mistral's tool-call marker [TOOL_CALLS] (and with
    `args` v11's [ARGS], after a call's name; with `think` Magistral's [THINK] and [/THINK]) as special
    tokens, as Mistral's Hugging Face tokenizers have them, and whose chat template refuses a call id
    of another form, as Mistral's do."""
    markers = ("[TOOL_CALLS]", "[ARGS]")[:1 + args] + ("[THINK]", "[/THINK]")[:2 * think]
    return reasoning_checkpoint(directory, markers, MISTRAL_TEMPLATE, special=True)

"""Client calls for the inflight models: gRPC streaming (tritonclient's asyncio API, one stream per
request, cancellable) and HTTP `generate` / `generate_stream` (server-sent events, cancel by
closing the connection). Used by the CLI, the tests and the benchmarks."""
from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Completion:
    """A request's responses. With `n` > 1 every response carries the n outputs' deltas: `texts`
    and `finish_reasons` hold one per output, and `text`, `chunks` and `finish_reason` the first's."""
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)   # time.monotonic() of each response
    start: float = 0.0
    token_ids: list[int] = field(default_factory=list)       # with return_token_ids=True
    finish_reason: str | None = None
    num_output_tokens: int | None = None                     # the sum of the responses' counts
    error: str | None = None
    cancelled: bool = False
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    deltas: list[list[str]] = field(default_factory=list, repr=False)     # each output's, response by response

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    def add(self, texts: list[str], finish_reasons: list[str] | None = None) -> str:
        """One response's outputs (their text deltas; finish reasons where sent); returns the
        first output's delta."""
        while len(self.deltas) < len(texts):
            self.deltas.append([])
            self.finish_reasons.append(None)
        for parts, delta in zip(self.deltas, texts):
            parts.append(delta)
        for i, reason in enumerate(finish_reasons or ()):
            self.finish_reasons[i] = reason
        self.finish_reason = self.finish_reasons[0] if self.finish_reasons else None
        self.chunks.append(texts[0] if texts else "")
        self.chunk_times.append(time.monotonic())
        return self.chunks[-1]

    def close(self) -> "Completion":
        self.texts = ["".join(parts) for parts in self.deltas]
        self.text = self.texts[0] if self.texts else ""
        return self


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _tensor(name: str, array: np.ndarray, dtype: str):
    import tritonclient.grpc as grpcclient
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def grpc_inputs(prompt: str | list[int], stream: bool = True, sampling: dict | None = None,
                **flags: bool | str):
    """InferInputs for the llm model: text_input or input_ids, stream, sampling_parameters JSON,
    and any BOOL flags (return_finish_reason=True, ...) or STRING inputs (priority='high')."""
    inputs = []
    if isinstance(prompt, str):
        inputs.append(_tensor("text_input", np.array([prompt.encode()], dtype=object), "BYTES"))
    else:
        inputs.append(_tensor("input_ids", np.asarray(prompt, dtype=np.int32), "INT32"))
    inputs.append(_tensor("stream", np.array([stream]), "BOOL"))
    if sampling:
        inputs.append(_tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"))
    for name, value in flags.items():
        if isinstance(value, bool):
            inputs.append(_tensor(name, np.array([value]), "BOOL"))
        else:
            inputs.append(_tensor(name, np.array([str(value).encode()], dtype=object), "BYTES"))
    return inputs


# the ensemble's numeric inputs and their types (model_repository/ensemble/config.pbtxt)
ENSEMBLE_TYPES = {"max_tokens": "INT32", "min_tokens": "INT32", "min_length": "INT32", "top_k": "INT32",
                  "end_id": "INT32", "pad_id": "INT32", "temperature": "FP32", "top_p": "FP32",
                  "repetition_penalty": "FP32", "frequency_penalty": "FP32", "presence_penalty": "FP32",
                  "seed": "UINT64", "random_seed": "UINT64"}
FP32_MAX = float(np.finfo(np.float32).max)
_TYPE_RANGES = {"INT32": (np.int32, int, -2**31, 2**31 - 1, "an integer in [-2**31, 2**31)"),
                "UINT64": (np.uint64, int, 0, 2**64 - 1, "an integer in [0, 2**64)"),
                "FP32": (np.float32, (int, float), -FP32_MAX, FP32_MAX, f"a finite number within +-{FP32_MAX:.7g}")}


def ensemble_inputs(prompt: str, stream: bool = True, **values):
    """InferInputs for the ensemble (TensorRT-LLM's tensor names, no batch dimension): text_input,
    stream, and one tensor per value: numbers as ENSEMBLE_TYPES declares them, bools as BOOL,
    strings (a list of them for stop_words, bad_words) as BYTES. A number outside its input's type
    is a ValueError naming the input, where numpy would wrap it or overflow to inf."""
    inputs = [_tensor("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
              _tensor("stream", np.array([stream]), "BOOL")]
    for name, value in values.items():
        if isinstance(value, bool):
            inputs.append(_tensor(name, np.array([value]), "BOOL"))
        elif name in ENSEMBLE_TYPES:
            dtype = ENSEMBLE_TYPES[name]
            np_type, kinds, low, high, wording = _TYPE_RANGES[dtype]
            if not isinstance(value, kinds) or not low <= value <= high:      # NaN fails too
                raise ValueError(f"'{name}' ({dtype}) must be {wording}, got {value!r}")
            inputs.append(_tensor(name, np.array([value], dtype=np_type), dtype))
        else:
            words = value if isinstance(value, list) else [value]
            inputs.append(_tensor(name, np.array([str(w).encode() for w in words], dtype=object), "BYTES"))
    return inputs


def numpy_outputs(response) -> dict[str, np.ndarray]:
    """A ModelInferResponse's output tensors in one pass over them (InferResult.as_numpy searches
    the outputs by name for each one; per streamed token that is most of the decoding's cost)."""
    from tritonclient.utils import deserialize_bf16_tensor, deserialize_bytes_tensor, triton_to_np_dtype
    assert len(response.raw_output_contents) == len(response.outputs), "Triton sends outputs as raw contents"
    arrays = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        elif output.datatype == "BF16":
            array = deserialize_bf16_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(output.datatype))
        arrays[output.name] = array.reshape(output.shape)
    return arrays


async def grpc_responses(client, model: str, inputs, parameters: dict | None = None, request_id: str = ""):
    """One request on its own bidirectional stream (`client` is a tritonclient.grpc.aio client);
    yields (outputs, final, error) per response, outputs being {name: numpy array}.

    After the final response the stream is half-closed and read until the server ends it: a
    client that drops the stream right after its final response can leave Triton 2.51's gRPC
    frontend holding the request, and the model then outlives shutdown's timeout. Leaving
    before the final response (break, an exception, task cancellation) cancels the stream, so
    the server aborts the request and frees its KV blocks."""
    done = asyncio.Event()

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id,
               "parameters": {"triton_enable_empty_final_response": True, **(parameters or {})}}
        await done.wait()          # keep the stream open until the last response

    stream = client.stream_infer(requests())
    try:
        async for result, error in stream:
            if error is not None:        # the request's one (final) response
                done.set()
                yield {}, True, str(error)
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if final:
                done.set()
            yield numpy_outputs(response), final, None
    finally:
        if not done.is_set():
            stream.cancel()
        else:
            async for _ in stream:     # read to the end (normally nothing is left)
                pass
        done.set()


async def grpc_stream(client, model: str, inputs, parameters: dict | None = None,
                      cancel_after: int | None = None, on_chunk: Callable[[str], None] | None = None,
                      request_id: str = "") -> Completion:
    """One request's responses gathered into a Completion; cancel_after=N cancels the stream
    after N responses (the server must abort the request)."""
    out = Completion(start=time.monotonic())
    responses = grpc_responses(client, model, inputs, parameters, request_id)
    try:
        async for outputs, final, error in responses:
            if error is not None:
                out.error = error
                continue
            if "text_output" in outputs:
                reasons = outputs.get("finish_reason")
                chunk = out.add([t.decode("utf-8") for t in outputs["text_output"].reshape(-1)],
                                None if reasons is None else [r.decode() for r in reasons.reshape(-1)])
                if on_chunk is not None:
                    on_chunk(chunk)
                if "token_ids" in outputs:
                    out.token_ids.extend(outputs["token_ids"].reshape(-1).tolist())
                if "num_output_tokens" in outputs:
                    out.num_output_tokens = (out.num_output_tokens or 0) + int(outputs["num_output_tokens"].sum())
            if cancel_after is not None and len(out.chunks) >= cancel_after and not final:
                out.cancelled = True
                break
    finally:
        await responses.aclose()
    return out.close()


def _json_object(raw: bytes) -> dict | None:
    """The JSON object in raw, or None (a proxy's HTML error page, say)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def http_generate(url: str, model: str, payload: dict, timeout: float = 300) -> dict:
    """POST /v2/models/<model>/generate; the JSON reply (an 'error' key on failure)."""
    conn = http.client.HTTPConnection(url, timeout=timeout)
    try:
        conn.request("POST", f"/v2/models/{model}/generate", json.dumps(payload), {"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = _json_object(response.read() or b"{}")
        if response.status != 200 and (reply is None or "error" not in reply):
            return {"error": f"HTTP {response.status} {response.reason}"}
        return reply if reply is not None else {"error": "the reply is not a JSON object"}
    finally:
        conn.close()


def http_stream(url: str, model: str, payload: dict, cancel_after: int | None = None,
                on_chunk: Callable[[str], None] | None = None, timeout: float = 300) -> Completion:
    """POST /v2/models/<model>/generate_stream and read the server-sent events; cancel_after=N
    drops the connection after N events."""
    out = Completion(start=time.monotonic())
    conn = http.client.HTTPConnection(url, timeout=timeout)
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(payload),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        for line in response:
            if line.startswith(b"data:"):
                event = _json_object(line[5:]) or {"error": f"an event that is not a JSON object: {line[:80]!r}"}
            elif response.status != 200 and line.strip():
                event = _json_object(line)           # refused before streaming: a plain JSON body
                if event is None:                    # not JSON (a proxy's error page): the status says it
                    continue
            else:
                continue
            if "error" in event:
                out.error = event["error"]
                break
            reasons = event.get("finish_reason")
            chunk = out.add(as_list(event.get("text_output", "")), None if reasons is None else as_list(reasons))
            if on_chunk is not None:
                on_chunk(chunk)
            ended = reasons is not None and all(r not in (None, "None") for r in as_list(reasons))
            if cancel_after is not None and len(out.chunks) >= cancel_after and not ended:
                out.cancelled = True
                break
        if response.status != 200 and out.error is None:
            out.error = f"HTTP {response.status} {response.reason}"
    finally:
        conn.close()
    return out.close()

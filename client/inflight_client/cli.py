"""inflight-client: stream a completion from an inflight Triton server and print it as it arrives.

  inflight-client "The assert statement"                         # gRPC stream from localhost:8001
  inflight-client --protocol http --url localhost:8000 "A class"  # HTTP generate_stream
  inflight-client --cancel-after 5 "..."                          # cancel after 5 responses
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import sys
import time

from .streams import Completion, as_list, grpc_inputs, grpc_stream, http_generate, http_stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight-client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", help="host:port (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    parser.add_argument("--model", default="llm", help="llm (vLLM-style tensors) or ensemble")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--priority", choices=("high", "normal", "low"))
    parser.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    parser.add_argument("--cancel-after", type=int, help="cancel the request after this many responses")
    args = parser.parse_args(argv)
    if args.url is not None and "://" in args.url:
        parser.error(f"--url takes host:port, without a scheme (got {args.url!r})")

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for key in ("top_p", "top_k", "seed", "priority"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    stream = not args.no_stream

    shown = []

    def show(chunk: str) -> None:
        shown.append(chunk)
        sys.stdout.write(chunk)
        sys.stdout.flush()

    url = args.url or _DEFAULT_URL[args.protocol]
    try:
        out = _complete(args, url, sampling, stream, show)
    except KeyboardInterrupt:        # leaving the stream has cancelled the request on the server
        print("\n[interrupted: request cancelled]", file=sys.stderr)
        return 130
    except (OSError, http.client.HTTPException, grpc_errors()) as exc:     # one line, not a traceback
        if shown or isinstance(exc, http.client.HTTPException):      # it answered, then broke off
            print(f"\nerror: the server at {url} ended the response early ({type(exc).__name__})", file=sys.stderr)
            return 1
        print(f"error: cannot reach the server at {url} ({args.protocol}): "
              f"{getattr(exc, 'details', lambda: None)() or exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    ttft = f"{out.ttft * 1000:.0f} ms" if out.ttft is not None else "-"
    state = ", cancelled" if out.cancelled else "" if out.finish_reason is None else f", finish_reason={out.finish_reason}"
    print(f"[{len(out.chunks)} responses, first after {ttft}{state}]", file=sys.stderr)      # the ensemble has none
    return 0


_DEFAULT_URL = {"grpc": "localhost:8001", "http": "localhost:8000"}


def grpc_errors() -> type[Exception]:
    import grpc            # tritonclient's: its aio client raises grpc's own errors for a dead channel
    return grpc.RpcError


def _complete(args, url: str, sampling: dict, stream: bool, show) -> Completion:
    if args.protocol == "grpc":
        return asyncio.run(_grpc(args, url, sampling, stream, show))
    if stream:
        return http_stream(url, args.model, _http_payload(args.model, args.prompt, sampling, True),
                           cancel_after=args.cancel_after, on_chunk=show)
    out = Completion(start=time.monotonic())
    reply = http_generate(url, args.model, _http_payload(args.model, args.prompt, sampling, False))
    out.error = reply.get("error")
    if out.error is None:
        reasons = reply.get("finish_reason")
        show(out.add(as_list(reply.get("text_output", "")), None if reasons is None else as_list(reasons)))
    return out.close()


def _http_payload(model: str, prompt: str, sampling: dict, stream: bool) -> dict:
    if model == "ensemble":     # TensorRT-LLM-style tensors
        names = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed", "priority": "priority"}
        return {"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
                **{names[k]: v for k, v in sampling.items()}}
    return {"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
            "return_finish_reason": True, **sampling}


async def _grpc(args, url: str, sampling: dict, stream: bool, show) -> Completion:
    import tritonclient.grpc.aio as grpcclient
    async with grpcclient.InferenceServerClient(url) as client:
        if args.model == "ensemble":
            inputs = _ensemble_inputs(args.prompt, sampling, stream)
        else:
            inputs = grpc_inputs(args.prompt, stream, sampling, exclude_input_in_output=True, return_finish_reason=True)
        return await grpc_stream(client, args.model, inputs, cancel_after=args.cancel_after, on_chunk=show)


def _ensemble_inputs(prompt: str, sampling: dict, stream: bool):
    import numpy as np
    import tritonclient.grpc as grpcclient
    kinds = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
             "top_k": ("INT32", np.int32), "seed": ("UINT64", np.uint64)}
    values = {"text_input": ("BYTES", np.array([prompt.encode()], dtype=object)), "stream": ("BOOL", np.array([stream])),
              "exclude_input_in_output": ("BOOL", np.array([True]))}    # the completion alone, as from llm
    for key, value in sampling.items():
        if key in kinds:
            dtype, np_type = kinds[key]
            values[key] = (dtype, np.array([value], dtype=np_type))
        else:
            values[key] = ("BYTES", np.array([str(value).encode()], dtype=object))
    inputs = []
    for name, (dtype, array) in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


if __name__ == "__main__":
    sys.exit(main())

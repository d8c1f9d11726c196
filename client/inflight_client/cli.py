"""inflight-client: stream a completion from an inflight Triton server and print it as it arrives.

  inflight-client "The assert statement"                         # gRPC stream from localhost:8001
  inflight-client --protocol http --url localhost:8000 "A class"  # HTTP generate_stream
  inflight-client --cancel-after 5 "..."                          # cancel after 5 responses
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import sys
import time

from .streams import (FP32_MAX, Completion, as_list, ensemble_inputs, grpc_inputs, grpc_stream, http_generate,
                      http_stream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight-client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", type=_host_port,
                        help="host:port (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    parser.add_argument("--model", default="llm", help="llm (vLLM-style tensors) or ensemble")
    parser.add_argument("--max-tokens", type=_integer(1, 2**31 - 1), default=64)      # the ensemble's INT32
    parser.add_argument("--temperature", type=_finite, default=0.0,
                        help="the ensemble samples only with --top-k or --top-p above 0 (TensorRT-LLM's rule)")
    parser.add_argument("--top-p", type=_finite)
    parser.add_argument("--top-k", type=_integer(-1, 2**31 - 1), help="0 (or -1 for llm): off")
    parser.add_argument("--seed", type=_integer(-2**63, 2**64 - 1), help="the ensemble's: 0 to 2**64-1")
    parser.add_argument("--priority", choices=("high", "normal", "low"))
    parser.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    parser.add_argument("--cancel-after", type=_integer(1, None), help="cancel the request after this many responses")
    args = parser.parse_args(argv)
    if args.model == "ensemble" and args.seed is not None and args.seed < 0:     # its seed input is UINT64
        parser.error(f"argument --seed: the ensemble's seed must be in [0, 2**64), got {args.seed}")
    if args.model == "ensemble" and args.top_k is not None and args.top_k < 0:   # TensorRT-LLM's top_k: 0 is off
        parser.error(f"argument --top-k: the ensemble's top_k must be 0 (off) or more, got {args.top_k}")

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for key in ("top_p", "top_k", "seed", "priority"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    stream = not args.no_stream

    shown = []

    def show(chunk: str) -> None:
        shown.append(chunk)
        try:
            sys.stdout.write(chunk)
            sys.stdout.flush()
        except BrokenPipeError as exc:      # the reader went away (| head): not the server's fault
            raise _StdoutClosed from exc

    url = args.url or _DEFAULT_URL[args.protocol]
    try:
        out = _complete(args, url, sampling, stream, show)
        show("\n")
    except _StdoutClosed:            # leaving the stream has cancelled the request, as below
        return _stdout_closed()
    except KeyboardInterrupt:
        if args.model == "ensemble":     # Triton checks an ensemble's cancellation only between its steps
            print("\n[interrupted: the ensemble's llm request runs to its end on the server]", file=sys.stderr)
        else:                        # leaving the stream has cancelled the request on the server
            print("\n[interrupted: request cancelled]", file=sys.stderr)
        return 130
    except (OSError, http.client.HTTPException, grpc_errors()) as exc:     # one line, not a traceback
        if not shown and isinstance(exc, http.client.BadStatusLine) and not isinstance(exc, ConnectionError):
            print(f"error: {url} is not an HTTP Triton endpoint: its reply is not HTTP/1.1 "
                  f"(the gRPC port? Triton's HTTP port is 8000 by default)", file=sys.stderr)
            return 1
        if shown or isinstance(exc, http.client.HTTPException):      # it answered, then broke off
            print(f"\nerror: the server at {url} ended the response early ({type(exc).__name__})", file=sys.stderr)
            return 1
        hint = " (that is an HTTP endpoint: the HTTP port? Triton's gRPC port is 8001 by default)" \
            if args.protocol == "grpc" and _answers_http(url) else ""
        print(f"error: cannot reach the server at {url} ({args.protocol}): "
              f"{getattr(exc, 'details', lambda: None)() or exc}{hint}", file=sys.stderr)
        return 1
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    ttft = f"{out.ttft * 1000:.0f} ms" if out.ttft is not None else "-"
    state = "" if out.finish_reason is None else f", finish_reason={out.finish_reason}"      # the ensemble has none
    if out.cancelled:
        state = ", cancelled" + (": the ensemble's llm request runs to its end on the server"
                                 if args.model == "ensemble" else "")
    print(f"[{len(out.chunks)} responses, first after {ttft}{state}]", file=sys.stderr)
    return 0


_DEFAULT_URL = {"grpc": "localhost:8001", "http": "localhost:8000"}


class _StdoutClosed(Exception):
    """stdout's reader is gone (a BrokenPipeError writing to it)."""


def _stdout_closed() -> int:
    """Python's documented handling of SIGPIPE: point stdout at devnull, so that the flush at exit
    does not raise again, and exit with status 1, quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def _host_port(value: str) -> str:
    """--url: host:port, the port an integer in 1..65535 (an IPv6 host in brackets: [::1]:8001)."""
    if "://" in value:
        raise argparse.ArgumentTypeError(f"takes host:port, without a scheme (got {value!r})")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"takes host:port, the port an integer in 1..65535 (got {value!r})")
    return value


def _integer(low: int, high: int | None):
    """An argparse type: an integer in [low, high] (high None: no bound)."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
        if number < low or (high is not None and number > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return number
    return parse


def _finite(value: str) -> float:
    """An argparse type: a finite number within float32's range (the ensemble's FP32 inputs)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
    if not math.isfinite(number) or abs(number) > FP32_MAX:
        raise argparse.ArgumentTypeError(f"must be a finite number within +-3.4e38, got {value}")
    return number


def _answers_http(url: str) -> bool:
    """Whether an HTTP server answers at url (a gRPC client pointed at Triton's HTTP port sees only
    a closed socket)."""
    conn = http.client.HTTPConnection(url, timeout=2)
    try:
        conn.request("GET", "/v2/health/live")
        conn.getresponse()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


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
    """The ensemble takes the knobs as its typed inputs (TensorRT-LLM's names) and returns no
    finish_reason; `llm` in sampling_parameters, as over gRPC: Triton's HTTP generate reads a
    top-level integer past int64 (a seed of 2**63 or more) as a double, rounded."""
    payload = {"text_input": prompt, "stream": stream, "exclude_input_in_output": True}
    if model == "ensemble":
        return {**payload, **sampling}
    return {**payload, "sampling_parameters": json.dumps(sampling), "return_finish_reason": True}


async def _grpc(args, url: str, sampling: dict, stream: bool, show) -> Completion:
    import tritonclient.grpc.aio as grpcclient
    async with grpcclient.InferenceServerClient(url) as client:
        if args.model == "ensemble":
            inputs = ensemble_inputs(args.prompt, stream, exclude_input_in_output=True, **sampling)   # the completion alone, as from llm
        else:
            inputs = grpc_inputs(args.prompt, stream, sampling, exclude_input_in_output=True, return_finish_reason=True)
        return await grpc_stream(client, args.model, inputs, cancel_after=args.cancel_after, on_chunk=show)


if __name__ == "__main__":
    sys.exit(main())

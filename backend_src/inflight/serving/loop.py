"""The serving loop behind a decoupled Triton model: one engine thread, one response thread.

The engine thread owns the LLMEngine: it drains the inbox (add / abort / shutdown), steps the
engine while anything is unfinished, and hands each StepOutput to the response thread. The
response thread owns the per-request state (detokenizer, stop strings, timings) and talks to the
response senders, so Triton IPC never stalls the step loop. Every request gets exactly one final
response: finished, aborted, cancelled, refused or failed.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..config import SamplingParams
from ..detokenizer import IncrementalDetokenizer, StopStrings, decode
from ..engine import LLMEngine, QueueFullError
from .protocol import GenerateRequest, RequestError

log = logging.getLogger("inflight")


MAX_BYTES_PER_TOKEN = 32     # a prompt of more bytes than max_model_len x this is refused untokenized


class ResponseSink(Protocol):
    """Where a request's responses go (a Triton response sender, in production)."""

    def send(self, outputs: dict[str, np.ndarray] | None, final: bool, error: str | None = None) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(eq=False)
class Job:
    request_id: str
    request: GenerateRequest
    sink: ResponseSink
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    detokenizer: IncrementalDetokenizer
    stops: StopStrings | None
    output_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)            # non-streaming: accumulated output text
    first_token_time: float | None = None
    done: bool = False
    grammar: object = None        # structured outputs: compiled on the request's thread, not the engine's


class EngineLoop:
    def __init__(self, engine: LLMEngine, tokenizer, metrics=None, cancel_poll_s: float = 0.2,
                 on_failure: Callable[[str], None] | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cancel_poll_s = cancel_poll_s
        self.on_failure = on_failure             # called once every request has its error
        # test hook: make the engine step raise after this many steps (fault-injection tests)
        self._fault_after_steps = int(os.environ.get("INFLIGHT_FAULT_AFTER_STEPS", "0"))
        # set by inflight's launcher when the server is asked to stop (see serving/launch.py)
        self._shutdown_flag = os.environ.get("INFLIGHT_SHUTDOWN_FLAG")
        self._next_flag_check = 0.0
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()     # to the engine thread
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()    # to the response thread
        self.failure: str | None = None          # set once the loop can no longer serve
        self._ids = 0
        self._id_lock = threading.Lock()
        self._engine_thread = threading.Thread(target=self._run_engine, name="inflight-engine", daemon=True)
        self._response_thread = threading.Thread(target=self._run_responses, name="inflight-responses", daemon=True)

    def start(self) -> "EngineLoop":
        self._engine_thread.start()
        self._response_thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._engine_thread.is_alive()

    # ---- called from Triton's execute() thread ------------------------------------------------------
    def submit(self, request: GenerateRequest, sink: ResponseSink) -> None:
        """Queue a parsed request; errors (bad prompt, loop down) go back through the sink."""
        if self.failure is not None:
            sink.send(None, final=True, error=self.failure)
            return
        try:
            job = self._make_job(request, sink)
        except RequestError as exc:
            sink.send(None, final=True, error=str(exc))
            return
        self.outbox.put(("register", job))        # before the engine can produce its first token
        self.inbox.put(("add", job))

    def _make_job(self, request: GenerateRequest, sink: ResponseSink) -> Job:
        if request.prompt_ids is not None:
            prompt_ids = request.prompt_ids
        else:
            # bound the tokenizer's work before it starts: no prompt this long can fit anyway
            limit = self.engine.max_model_len * MAX_BYTES_PER_TOKEN
            size = len(request.prompt_text.encode("utf-8"))
            if size > limit:
                raise RequestError(f"'text_input' is {size} bytes; the limit is {limit} "
                                   f"(max_model_len {self.engine.max_model_len} x {MAX_BYTES_PER_TOKEN})")
            prompt_ids = self.tokenizer(request.prompt_text)["input_ids"]
        params = request.params
        if request.bad_words:
            words = tuple(tuple(self.tokenizer(w, add_special_tokens=False)["input_ids"]) for w in request.bad_words)
            params = _replace(params, bad_words_ids=params.bad_words_ids + words)
        if request.return_logprobs and not params.logprobs:
            params = _replace(params, logprobs=True)
        with self._id_lock:
            self._ids += 1
            request_id = f"req-{self._ids}"
        stops = StopStrings(params.stop) if params.stop else None
        return Job(request_id, request, sink, prompt_ids, params, time.monotonic(),
                   IncrementalDetokenizer(self.tokenizer), stops, grammar=self._compile(params))

    def _compile(self, params: SamplingParams):
        """A new schema compiles here, on Triton's thread, while the engine thread keeps stepping
        (xgrammar releases the GIL); the engine thread only looks the grammar up."""
        if params.structured_outputs is None:
            return None
        try:
            return self.engine.structured.compile(params.structured_outputs)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def shutdown(self, timeout: float = 20.0) -> None:
        """Finish every request in flight with a final response, then stop both threads."""
        self.inbox.put(("shutdown", None))
        self._engine_thread.join(timeout)
        self._response_thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------------------------
    def _run_engine(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished()
            try:
                message = self.inbox.get(timeout=0.5) if idle else self.inbox.get_nowait()
            except queue.Empty:
                message = None
            while message is not None:
                if message[0] == "shutdown":
                    self._abort_all("the model is being unloaded", fatal=False)
                    self.outbox.put(("stop", None))
                    return
                self._handle(message)
                try:
                    message = self.inbox.get_nowait()
                except queue.Empty:
                    message = None
            if self.failure is not None or not engine.has_unfinished():
                continue
            if self._server_stopping():
                self._abort_all("the server is shutting down", fatal=False)
                continue
            try:
                if self._fault_after_steps and engine.num_steps >= self._fault_after_steps:
                    raise RuntimeError(f"injected fault after {engine.num_steps} steps (INFLIGHT_FAULT_AFTER_STEPS)")
                out = engine.step()
            except Exception as exc:    # a bug or a device fault: fail everything in flight, loudly
                log.exception("inflight engine step failed; failing all requests")
                self._abort_all(f"the engine failed: {type(exc).__name__}: {exc}")
                continue
            if len(out) or out.finished:
                self.outbox.put(("step", out))
            else:
                time.sleep(0.002)      # nothing runnable yet (static batching waiting to fill up)
            self._report_metrics()

    def _handle(self, message) -> None:
        kind, payload = message
        if kind == "add":
            job: Job = payload
            if self.failure is not None:
                self.outbox.put(("error", (job.request_id, self.failure)))
                return
            try:
                self.engine.add_request(job.request_id, job.prompt_ids, job.params, job.request.priority,
                                        job.request.cache_salt, arrival_time=job.arrival, grammar=job.grammar)
            except (ValueError, QueueFullError) as exc:
                name = "input_ids" if job.request.prompt_ids is not None else "text_input"
                self.outbox.put(("error", (job.request_id, str(exc).replace("'prompt_token_ids'", f"'{name}'"))))
        elif kind == "abort":
            self.engine.abort(payload)

    def _server_stopping(self) -> bool:
        now = time.monotonic()
        if self._shutdown_flag is None or now < self._next_flag_check:
            return False
        self._next_flag_check = now + 0.2
        return os.path.exists(self._shutdown_flag)

    def _abort_all(self, reason: str, fatal: bool = True) -> None:
        """End every request in the engine (their blocks go back) and fail them with `reason`."""
        self.failure = reason
        try:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            self.engine.step()           # reports the aborts and releases everything
        except Exception:
            log.exception("inflight engine could not release its requests")
        self.outbox.put(("fail" if fatal else "drain", reason))
        self._report_metrics(force=True)

    def _report_metrics(self, force: bool = False) -> None:
        """The numbers are read here; publishing them is Triton IPC, left to the response thread."""
        snapshot = self.metrics.snapshot(self.engine, force) if self.metrics is not None else None
        if snapshot is not None:
            self.outbox.put(("metrics", snapshot))

    # ---- response thread ------------------------------------------------------------------------------
    def _run_responses(self) -> None:
        jobs: dict[str, Job] = {}
        last_poll = time.monotonic()
        while True:
            try:
                kind, payload = self.outbox.get(timeout=self.cancel_poll_s)
            except queue.Empty:
                kind, payload = "poll", None
            if kind == "register":
                jobs[payload.request_id] = payload
            elif kind == "step":
                self._deliver(jobs, payload)
            elif kind == "error":
                request_id, message = payload
                job = jobs.pop(request_id, None)
                if job is not None:
                    self._finish(job, None, error=message)
            elif kind in ("fail", "drain"):
                for job in jobs.values():
                    self._finish(job, None, error=payload)
                jobs.clear()
                if kind == "fail" and self.on_failure is not None:
                    self.on_failure(payload)
            elif kind == "metrics":
                self.metrics.publish(payload)
            elif kind == "stop":
                for job in jobs.values():
                    self._finish(job, None, error=self.failure or "the model is being unloaded")
                return
            now = time.monotonic()
            if now - last_poll >= self.cancel_poll_s:
                last_poll = now
                self._poll_cancelled(jobs)

    def _deliver(self, jobs: dict[str, Job], out) -> None:
        logprobs = out.logprobs or [None] * len(out.token_ids)
        for request_id, token, logprob in zip(out.request_ids, out.token_ids, logprobs):
            job = jobs.get(request_id)
            if job is None or job.done:
                continue
            if job.first_token_time is None:
                job.first_token_time = time.monotonic()
            job.output_ids.append(token)
            if logprob is not None and job.params.logprobs:
                job.pending_logprobs.append(logprob)
            self._on_tokens(job, [token], out.finished.get(request_id))
        for request_id, reason in out.finished.items():
            job = jobs.pop(request_id, None)
            if job is not None and not job.done:     # ended without a token this step (abort, expiry)
                self._finish(job, reason, error=out.errors.get(request_id))

    def _on_tokens(self, job: Job, tokens: list[int], finish: str | None) -> None:
        delta = job.detokenizer.add(tokens, final=finish is not None)
        text = delta.text if delta else ""
        if job.stops is not None:
            text = job.stops.feed(text, final=finish is not None)
            if job.stops.stopped and finish is None:
                finish = "stop"
                self.inbox.put(("abort", job.request_id))     # its later "abort" finish is ignored
        if not job.request.stream:
            job.text.append(text)
            if finish is not None:
                self._finish(job, finish)
            return
        if delta is None and finish is None:
            return                                  # an incomplete character: wait for the next token
        outputs = self._outputs(job, text, delta.context_ids if delta else [], delta.new_ids if delta else [],
                                finish)
        self._send(job, outputs, final=finish is not None)
        if finish is not None:
            self._record(job, finish)

    def _outputs(self, job: Job, text: str, context_ids, new_ids, finish: str | None) -> dict:
        request = job.request
        outputs = {"text_output": np.array([text.encode("utf-8")], dtype=object)}
        if request.return_token_ids:
            outputs["token_ids"] = np.asarray(new_ids, dtype=np.int32)
            outputs["context_ids"] = np.asarray(context_ids, dtype=np.int32)
        if request.return_finish_reason and finish is not None:
            outputs["finish_reason"] = np.array([finish.encode()], dtype=object)
        if request.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([len(job.prompt_ids)], dtype=np.uint32)
        if request.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([len(job.output_ids)], dtype=np.uint32)
        if request.return_logprobs:
            outputs["logprobs"] = np.array([json.dumps(job.pending_logprobs).encode()], dtype=object)
            job.pending_logprobs = []
        return outputs

    def _finish(self, job: Job, reason: str | None, error: str | None = None) -> None:
        """The request's one final response."""
        if job.done:
            return
        if error is not None or reason == "abort" or reason == "error":
            self._send(job, None, final=True, error=error if reason != "abort" else None)
            self._record(job, reason or "error")
            return
        request = job.request
        if request.stream:          # normally the last token carried the final flag already
            self._send(job, None, final=True)
            self._record(job, reason)
            return
        text = "".join(job.text)
        ids = job.output_ids
        if not request.exclude_input_in_output:
            prompt = request.prompt_text if request.prompt_text is not None else decode(self.tokenizer, job.prompt_ids)
            text, ids = prompt + text, job.prompt_ids + ids
        self._send(job, self._outputs(job, text, [], ids, reason), final=True)
        self._record(job, reason)

    def _send(self, job: Job, outputs, final: bool, error: str | None = None) -> None:
        try:
            job.sink.send(outputs, final=final, error=error)
        except Exception:          # the client is gone: stop generating for it
            log.warning("inflight: sending a response for %s failed; aborting it", job.request_id, exc_info=True)
            final = True
        if final:
            job.done = True

    @staticmethod
    def _cancelled(job: Job) -> bool:
        try:
            return job.sink.is_cancelled()
        except Exception:
            return True

    def _cancel(self, job: Job) -> None:
        self.inbox.put(("abort", job.request_id))
        try:
            job.sink.send(None, final=True)
        except Exception:
            log.debug("inflight: final flag after cancellation failed for %s", job.request_id, exc_info=True)
        job.done = True
        self._record(job, "cancelled")

    def _poll_cancelled(self, jobs: dict[str, Job]) -> None:
        """Every cancel_poll_s, not after every send: each check is a round trip to the server
        (with 16 streams, checking after each token took half the response thread's time)."""
        for request_id, job in list(jobs.items()):
            if job.done:
                jobs.pop(request_id)
            elif self._cancelled(job):
                self._cancel(job)
                jobs.pop(request_id)

    def _record(self, job: Job, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.after_request(job, reason, time.monotonic())


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    values = {name: getattr(params, name) for name in params.__slots__}
    try:
        return SamplingParams(**{**values, **changes})
    except ValueError as exc:
        raise RequestError(str(exc)) from None

"""The serving loop behind a decoupled Triton model: one engine thread, one response thread.

The engine thread owns the LLMEngine: it drains the inbox (add / abort / shutdown), steps the
engine while anything is unfinished, and hands each StepOutput to the response thread. The
response thread owns the per-request state (detokenizer, stop strings, timings) and talks to the
response senders, so Triton IPC never stalls the step loop. Every request gets exactly one final
response: finished, aborted, cancelled, refused or failed.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..config import SamplingParams, usable_cpus
from ..detokenizer import (REPLACEMENT, DecodeOptions, IncrementalDetokenizer, StopStrings, completed_token_text,
                           decode, token_text)
from ..engine import LLMEngine, QueueFullError
from ..reasoning import ReasoningTokens
from .grammar_seats import GrammarSeats, SeatsTaken
from .job import Job, ResponseSink, Sample
from .outputs import embedding_outputs, response_outputs
from .protocol import GenerateRequest, RequestError, bytes_per_token, check_text_size

log = logging.getLogger("inflight")
HEARTBEATS_PER_S = 100     # queue heartbeats a second, at most, over all waiting streams of a model
# cancellation checks a second, at most, over the requests that have no token yet (a model's): each
# is a round trip to tritonserver (~0.1 ms), and checking 1,000 queued ones every poll took the
# response thread 70% of a core; those that run are checked every poll, as they hold a seat
QUEUED_CHECKS_PER_S = 500


class EngineLoop:
    def __init__(self, engine: LLMEngine, tokenizer, metrics=None, cancel_poll_s: float = 0.2,
                 on_failure: Callable[[str], None] | None = None, heartbeat_s: float = 1.0,
                 heartbeat_share: float = 1.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.bytes_per_token = bytes_per_token(tokenizer)
        self.metrics = metrics
        self.cancel_poll_s = cancel_poll_s
        self.heartbeat_s = heartbeat_s           # between a queued stream's heartbeats (queue_heartbeat)
        # this loop's part of HEARTBEATS_PER_S: an instance's, where Triton runs several (one
        # tritonserver writes them all, one OpenAI server reads them all)
        self.heartbeat_share = heartbeat_share
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
        # the response thread's own: the requests still owed a response, and token texts
        self._jobs: dict[str, Job] = {}             # by job id: for cancellation polls
        self._samples: dict[str, Sample] = {}       # by engine request id
        self._owner: dict[str, Job] = {}            # engine request id -> its job
        self._token_texts: dict[int, str] = {}      # token id -> its text alone
        self._queued_checked = 0                    # where the next poll's share of the queued begins
        # new grammars compile here, not on Triton's execute thread, where one request's large schema
        # held up every request that arrived after it (vLLM compiles in a pool too); half the cores
        # this engine is given (an instance's part, where Triton runs several)
        cores = engine.config.cpu_threads or usable_cpus()
        self._compiles = ThreadPoolExecutor(max(1, cores // 2), thread_name_prefix="inflight-grammar")
        self._closing = False                    # shutdown() has begun: no grammar starts compiling
        # requests waiting for their grammar count against max_queue_size too: the pool's queue is
        # the server's only other one
        self._compile_seats = GrammarSeats(engine.config.max_queue_size)
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
        try:
            if self.failure is not None:
                raise RequestError(self.failure)
            job = self._make_job(request, sink)
        except RequestError as exc:
            self.refuse(sink, str(exc))
            return
        except Exception as exc:      # a bug reading this request: its error, not a traceback, not the server's
            log.exception("inflight: a request could not be read")
            self.refuse(sink, f"the request could not be read: {type(exc).__name__}: {exc}")
            return
        spec = job.samples[0].params.structured_outputs
        try:
            job.grammar = None if spec is None else self.engine.structured.cached(spec)
        except ValueError as exc:     # a constraint refused before: refused again at once
            self.refuse(sink, str(exc))
            return
        new_grammar = spec is not None and job.grammar is None
        if new_grammar and self._closing:
            self.refuse(sink, "the server is shutting down")
            return
        if new_grammar:
            limit = self.engine.config.max_queue_size
            try:
                given_up = self._compile_seats.take(job)
            except SeatsTaken:
                self.refuse(sink, f"queue full: {limit} requests are already waiting for their grammar to compile "
                                  "(max_queue_size)")
                return
            if given_up is not None:
                self.outbox.put(("error", (given_up, "queue full: a request of a higher priority took this one's "
                                                     f"place in the queue (max_queue_size {limit})")))
        # before the engine can produce its first token; and while a grammar compiles, so that the
        # response thread sees its client leave (and sends its queue heartbeats)
        self.outbox.put(("register", job))
        if not new_grammar:
            self._enqueue(job)        # a grammar compiled before does not wait behind new ones
            return
        try:
            compiling = self._compiles.submit(self._compile_and_enqueue, job)
        except RuntimeError:          # the loop began to shut down meanwhile
            self._compile_seats.leave(job)
            self.outbox.put(("error", (job, "the server is shutting down")))
            return
        compiling.add_done_callback(lambda done: self._compiled(done, job))

    def _compiled(self, compiling, job: Job) -> None:
        """A compile's end (its request now in the engine's queue, or answered): its seat goes
        back; one cancelled at shutdown is refused; an error is logged (it has nowhere else to go)."""
        self._compile_seats.leave(job)
        if compiling.cancelled():
            self.outbox.put(("error", (job, "the server is shutting down")))
        elif compiling.exception() is not None:
            log.error("inflight: a request's compile ended in an error", exc_info=compiling.exception())

    def _enqueue(self, job: Job) -> None:
        job.enqueued = time.monotonic()            # its wait for a seat starts here, after its grammar
        self.inbox.put(("add", job))

    def _compile_and_enqueue(self, job: Job) -> None:
        """On a compile thread: the request's grammar (xgrammar releases the GIL, so the engine
        thread steps on meanwhile), then the request to the engine; a bad constraint is refused.
        Not compiled: a request that ended while it waited here (its client left), and at a stop,
        one not begun (Triton waits for every request before it unloads the model)."""
        if job.done or not self._compile_seats.start(job):      # its client left, or it gave up its seat
            return
        if self._closing or self._stop_flagged():
            self.outbox.put(("error", (job, "the server is shutting down")))
            return
        try:
            job.grammar = self.engine.structured.compile(job.samples[0].params.structured_outputs)
        except ValueError as exc:     # a bad constraint, named by its field
            self.outbox.put(("error", (job, str(exc))))
            return
        except Exception as exc:      # a bug in the compile: this request's error
            log.exception("inflight: a grammar could not be compiled")
            self.outbox.put(("error", (job, f"the grammar could not be compiled: {type(exc).__name__}: {exc}")))
            return
        self._enqueue(job)

    def refuse(self, sink: ResponseSink, message: str) -> None:
        """A request refused before it reached the engine. Counted on the response thread, which
        makes every other metric update: the Python backend's metrics are not safe to update from
        two threads at once (concurrent increments corrupted its shared memory and crashed
        tritonserver)."""
        self.outbox.put(("refused", None))
        sink.send(None, final=True, error=message)

    def _make_job(self, request: GenerateRequest, sink: ResponseSink) -> Job:
        queue_limit = self.engine.config.max_queue_size
        if queue_limit is not None and request.n > queue_limit:
            # each output waits as a request of its own: this one could never be queued ("queue full")
            raise RequestError(f"'n' ({request.n}) is more than max_queue_size ({queue_limit}): each output "
                               "waits in the queue as a request")
        if request.prompt_ids is not None:
            prompt_ids = request.prompt_ids
        else:
            field = _prompt_field(request)
            check_text_size(request.prompt_text, self.engine.max_model_len, self.bytes_per_token, field)
            prompt_ids = self.tokenizer(request.prompt_text)["input_ids"]
            if not prompt_ids:
                raise RequestError(f"input '{field}' is empty, and this tokenizer adds no BOS to start from")
        params = request.params
        if request.bad_words:
            params = _replace(params, bad_words_ids=params.bad_words_ids + self._bad_words_ids(request.bad_words))
        if request.return_cumulative_logprob and params.logprobs is None:
            params = _replace(params, logprobs=0)      # the sum needs each token's log-probability
        with self._id_lock:
            self._ids += 1
            job_id = f"req-{self._ids}"
        # each output's reasoning tokens counted where asked for (one scan of the prompt for all n)
        markers = self.engine.reasoning if request.return_num_reasoning_tokens else None
        reasoning = None if markers is None else markers.reply_opens(prompt_ids, params.reasoning_ended)
        samples = [self._make_sample(job_id if request.n == 1 else f"{job_id}.{i}", params, i, request, prompt_ids,
                                     reasoning) for i in range(request.n)]
        now = time.monotonic()
        return Job(job_id, request, sink, prompt_ids, now, samples, enqueued=now)

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as it starts the text and, where a leading space makes it another
        token of its own (" is" is not "is" for most tokenizers), as it reads mid-text: vLLM bans
        both forms."""
        stems = [word.lstrip() or word for word in words]       # whitespace alone: banned as it is
        # one call for every form (a fast tokenizer batches it: 100,000 words one at a time held
        # this Triton thread, and every request behind it, 4.4 s)
        encoded = self.tokenizer(stems + [" " + stem for stem in stems], add_special_tokens=False)["input_ids"]
        banned = []
        for word, alone, spaced in zip(words, encoded[:len(stems)], encoded[len(stems):]):
            banned.append(tuple(alone))
            if word.strip() and alone and len(spaced) == len(alone) and spaced[0] != alone[0]:
                banned.append(tuple(spaced))
        return tuple(word for word in banned if word)     # text a tokenizer drops cannot be generated

    def _make_sample(self, request_id: str, params: SamplingParams, index: int, request: GenerateRequest,
                     prompt_ids: list[int], reasoning: bool | None) -> Sample:
        """Output `index` of n runs with seed + index (vLLM's rule): n seeded outputs differ from
        each other, and the same seed gives the same n outputs again. Past the largest seed a
        request may give (2**64 - 1) the sum wraps to 0, 1, ... reasoning: whether the prompt left
        the model reasoning, where its reasoning tokens are counted; None where they are not."""
        if index and params.seed is not None:
            seed = params.seed + index
            params = _replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)
        if index and params.prompt_logprobs is not None:
            params = _replace(params, prompt_logprobs=None)     # the outputs share one prompt: scored once
        stops = StopStrings(params.stop, request.include_stop_str_in_output) if params.stop else None
        options = DecodeOptions(params.skip_special_tokens, params.spaces_between_special_tokens)
        return Sample(request_id, params, IncrementalDetokenizer(self.tokenizer, prompt_ids, options), stops,
                      request.include_stop_str_in_output, self.tokenizer.eos_token_id,
                      reasoning=None if reasoning is None else ReasoningTokens(self.engine.reasoning, reasoning))

    def shutdown(self, timeout: float = 20.0) -> None:
        """Finish every request in flight with a final response, then stop both threads (grammars
        compiling first finish and join them; those not begun are refused)."""
        self._closing = True
        self._compiles.shutdown(wait=True, cancel_futures=True)
        self.inbox.put(("shutdown", None))
        self._engine_thread.join(timeout)
        self._response_thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------------------------
    def _run_engine(self) -> None:
        while True:
            try:
                if self._engine_turn():
                    return
            except Exception as exc:    # a bug or a device fault, in a step or around it: fail everything, loudly
                log.exception("inflight engine thread failed; failing all requests")
                self._abort_all(f"the engine failed: {type(exc).__name__}: {exc}")

    def _engine_turn(self) -> bool:
        """Take the inbox's messages, then one step if anything can run; True once shut down."""
        engine = self.engine
        # after a failure the loop only answers messages: requests it could not release stay unfinished
        idle = self.failure is not None or not engine.has_unfinished()
        try:
            message = self.inbox.get(timeout=0.5) if idle else self.inbox.get_nowait()
        except queue.Empty:
            message = None
        while message is not None:
            if message[0] == "shutdown":
                self._abort_all("the model is being unloaded", fatal=False)
                self.outbox.put(("stop", None))
                return True
            self._handle(message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                message = None
        if self.failure is not None or not engine.has_unfinished():
            return False
        if self._server_stopping():
            self._abort_all("the server is shutting down", fatal=False)
            return False
        if self._fault_after_steps and engine.num_steps >= self._fault_after_steps:
            raise RuntimeError(f"injected fault after {engine.num_steps} steps (INFLIGHT_FAULT_AFTER_STEPS)")
        steps = engine.num_steps
        out = engine.step()
        if len(out) or out.finished or out.prompt_logprobs:    # a prompt chunk brings no token
            self.outbox.put(("step", out))
        if engine.num_steps == steps:
            time.sleep(0.002)      # nothing runnable yet (static batching waiting to fill up)
        self._report_metrics()
        return False

    def _handle(self, message) -> None:
        kind, payload = message
        if kind == "add":
            job: Job = payload
            if job.done:       # cancelled (or failed) before it got here: _cancel marks it before its aborts
                return
            if self.failure is not None:
                self.outbox.put(("error", (job, self.failure)))
                return
            added = []
            group = [] if len(job.samples) > 1 else None
            try:
                for sample in job.samples:
                    self.engine.add_request(sample.request_id, job.prompt_ids, sample.params, job.request.priority,
                                            job.request.cache_salt, arrival_time=job.enqueued,
                                            grammar=job.grammar, group=group, room_for=len(job.samples) - len(added),
                                            pooling=job.request.pooling)
                    added.append(sample)
            except (ValueError, QueueFullError) as exc:
                for sample in added:
                    self.engine.abort(sample.request_id)
                name = _prompt_field(job.request)
                self.outbox.put(("error", (job, str(exc).replace("'prompt_token_ids'", f"'{name}'"))))
        elif kind == "abort":
            self.engine.abort(payload)
        elif kind == "release":        # the response thread failed: every request's blocks go back
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            self.engine.step()

    def _server_stopping(self) -> bool:
        """The engine thread's look at the stop flag, once in 0.2 s."""
        now = time.monotonic()
        if now < self._next_flag_check:
            return False
        self._next_flag_check = now + 0.2
        return self._stop_flagged()

    def _stop_flagged(self) -> bool:
        """The launcher has asked the server to stop (its flag file exists)."""
        return self._shutdown_flag is not None and os.path.exists(self._shutdown_flag)

    def _abort_all(self, reason: str, fatal: bool = True) -> None:
        """End every request in the engine (their blocks go back) and fail them with `reason`."""
        self.failure = reason
        for request_id in list(self.engine.requests):
            try:                         # each on its own: one the fault left half-admitted stops no other
                self.engine.abort(request_id)
            except Exception:
                log.exception("inflight engine could not abort %s", request_id)
        try:
            self.engine.step()           # reports the aborts and releases everything
        except Exception:
            log.exception("inflight engine could not release its requests")
        self.outbox.put(("fail" if fatal else "drain", reason))
        try:
            self._report_metrics(force=True)
        except Exception:
            log.exception("inflight engine could not report its metrics")

    def _report_metrics(self, force: bool = False) -> None:
        """The numbers are read here; publishing them is Triton IPC, left to the response thread."""
        snapshot = self.metrics.snapshot(self.engine, force) if self.metrics is not None else None
        if snapshot is not None:
            self.outbox.put(("metrics", snapshot))

    # ---- response thread ------------------------------------------------------------------------------
    def _run_responses(self) -> None:
        last_poll = time.monotonic()
        while True:
            try:
                kind, payload = self.outbox.get(timeout=self.cancel_poll_s)
            except queue.Empty:
                kind, payload = "poll", None
            try:
                if self._dispatch(kind, payload):
                    return
                now = time.monotonic()
                if now - last_poll >= self.cancel_poll_s:
                    last_poll = now
                    self._poll_cancelled()
            except Exception as exc:   # a bug here would leave every stream waiting: fail them all, loudly
                log.exception("inflight response thread failed; failing all requests")
                self.failure = f"the server failed: {type(exc).__name__}: {exc}"
                self.inbox.put(("release", None))
                for job in self._jobs.values():
                    if not job.done:      # not _fail: its bookkeeping may be what failed
                        self._send(job, None, final=True, error=self.failure)
                        try:
                            self._record(job, "error")
                        except Exception:      # the metrics may be what failed
                            log.debug("inflight: %s could not be counted", job.job_id, exc_info=True)
                self._jobs.clear()
                if self.on_failure is not None:
                    self.on_failure(self.failure)

    def _dispatch(self, kind: str, payload) -> bool:
        """One message from the engine thread; True when the loop is done."""
        if kind == "register":
            if self.failure is not None:    # the loop failed after submit() checked: no step will end it
                self._fail(payload, self.failure)
                return False
            self._jobs[payload.job_id] = payload
            for sample in payload.samples:
                self._samples[sample.request_id] = sample
                self._owner[sample.request_id] = payload
        elif kind == "step":
            self._deliver(payload)
        elif kind == "error":         # refused by the engine: no step will ever report its samples
            job, message = payload
            self._fail(job, message, refused=True)
        elif kind in ("fail", "drain"):
            for job in self._jobs.values():
                self._fail(job, payload)
            self._jobs.clear()
            if kind == "fail" and self.on_failure is not None:
                self.on_failure(payload)
        elif kind == "metrics":
            self.metrics.publish(payload)
        elif kind == "refused":
            if self.metrics is not None:
                self.metrics.refused()
        elif kind == "stop":
            for job in self._jobs.values():
                self._fail(job, self.failure or "the model is being unloaded")
            return True
        return False

    def _deliver(self, out) -> None:
        samples, owner = self._samples, self._owner
        touched: dict[Job, None] = {}        # jobs with news, in order
        for request_id, entries in out.prompt_logprobs.items():
            job = owner.get(request_id)
            if job is not None:
                job.prompt_logprobs += entries
        for request_id, cached in out.cached.items():
            sample = samples.get(request_id)
            if sample is not None:
                sample.num_cached_tokens = cached
        for request_id, vector in out.embeddings.items():
            job = owner.get(request_id)
            if job is not None:
                job.embedding = vector
        logprobs = out.logprobs or itertools.repeat(None)
        now = time.monotonic()
        for request_id, token, entry in zip(out.request_ids, out.token_ids, logprobs):
            sample = samples.get(request_id)
            job = owner.get(request_id)
            if sample is None or sample.finished or job.done:
                continue
            if sample.first_token_time is None:
                if self.metrics is not None:
                    self.metrics.first_token(job, now)
                sample.first_token_time = now
            if self.metrics is not None:
                self.metrics.delivered(job, None if sample.last_token_time is None else now - sample.last_token_time)
            sample.last_token_time = now
            if sample.add(token, entry, out.finished.get(request_id)):
                self.inbox.put(("abort", request_id))      # a stop string; its later "abort" is ignored
            touched[job] = None
        for request_id, reason in out.finished.items():
            sample, job = samples.pop(request_id, None), owner.pop(request_id, None)
            if sample is None or sample.finished or job.done:
                continue
            if reason in ("abort", "error") or request_id in out.errors:   # ended without a token
                self._fail(job, out.errors.get(request_id))
                continue
            sample.finish_reason = reason
            sample.ready = True
            touched[job] = None
        if self.metrics is not None:          # before the responses, so metrics never lag a reply
            self.metrics.publish_delivered()
        for job in touched:
            self._respond(job)

    def _respond(self, job: Job) -> None:
        """A stream: one response per step that brought something (new text or an end), or with
        stream_interval N > 1 once an output has N tokens to send, an output ends, or the first
        token arrives (vLLM's rule: fewer responses, less host work per token); the last one is
        final once every output has ended. Otherwise one response at the end."""
        if job.done:
            return
        request = job.request
        if request.stream:
            ready = [sample for sample in job.samples if sample.ready]
            if not ready:
                return
            interval = max(request.stream_interval, self.engine.config.stream_interval)
            if job.num_responses and not any(s.finished or s.pending_tokens >= interval for s in ready):
                return                      # fewer than stream_interval tokens to send yet
        elif not job.finished:
            return
        if request.pooling is not None:     # an embedding: ready only at its end, one response
            assert job.finished and job.embedding is not None, "an embedding request ends with its vector"
            self._record(job, job.samples[0].finish_reason)
            self._send(job, embedding_outputs(job), final=True)
            return
        prompt = None
        if not request.exclude_input_in_output:
            prompt = request.prompt_text if request.prompt_text is not None else decode(self.tokenizer, job.prompt_ids)
        pieces = [sample.take() for sample in job.samples]
        final = job.finished
        if final:       # counted before the client can see its end, so metrics never lag a reply
            self._record(job, job.samples[0].finish_reason)
        self._send(job, response_outputs(job, pieces, self._decoded_token, prompt), final=final)

    def _decoded_token(self, token: int, context: list[int]) -> str:
        """vLLM's `decoded_token`: the token decoded alone (cached), unless that leaves a character
        unfinished: then what it completes after the sampled tokens before it (`context`)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = token_text(self.tokenizer, token)
        return completed_token_text(self.tokenizer, token, context) if text.endswith(REPLACEMENT) else text

    def _fail(self, job: Job, error: str | None, refused: bool = False) -> None:
        """End a job now with an error (or, error None, with an empty final response: an abort).
        `refused`: the engine would not take it, so it never ran."""
        if job.done:
            return
        self._forget(job)
        for sample in job.samples:
            if not sample.finished:
                self.inbox.put(("abort", sample.request_id))
        if not refused:
            self._record(job, "error" if error is not None else "abort")
        elif self.metrics is not None:
            self.metrics.refused()
        self._send(job, None, final=True, error=error)

    def _send(self, job: Job, outputs, final: bool, error: str | None = None) -> None:
        job.num_responses += 1
        job.last_response = time.monotonic()
        try:
            job.sink.send(outputs, final=final, error=error)
        except Exception as exc:   # the client is gone, or this response could not be built or sent
            log.warning("inflight: sending a response for %s failed; aborting it", job.job_id, exc_info=True)
            job.done = True
            self._forget(job)
            for sample in job.samples:
                if not sample.finished:
                    self.inbox.put(("abort", sample.request_id))
            if not final:          # a final response was counted before it was sent
                self._record(job, "error")
            try:                   # a client still there gets its end, with why
                job.sink.send(None, final=True, error=f"sending a response failed: {type(exc).__name__}: {exc}")
            except Exception:
                log.debug("inflight: the final error for %s could not be sent either", job.job_id, exc_info=True)
            return
        if final:
            job.done = True

    @staticmethod
    def _cancelled(job: Job) -> bool:
        try:
            return job.sink.is_cancelled()
        except Exception:
            return True

    def _forget(self, job: Job) -> None:
        """Drop an ended job's samples: a step reporting them later finds nothing to deliver, and
        one the engine never took (cancelled or failed before its "add") is reported by no step."""
        for sample in job.samples:
            self._samples.pop(sample.request_id, None)
            self._owner.pop(sample.request_id, None)

    def _cancel(self, job: Job) -> None:
        job.done = True            # first: an "add" the engine thread has not taken yet is then dropped
        self._forget(job)
        for sample in job.samples:
            self.inbox.put(("abort", sample.request_id))
        try:
            job.sink.send(None, final=True)
        except Exception:
            log.debug("inflight: final flag after cancellation failed for %s", job.job_id, exc_info=True)
        self._record(job, "cancelled")

    def _poll_cancelled(self) -> None:
        """Every cancel_poll_s, not after every send: each check is a round trip to the server
        (with 16 streams, checking after each token took half the response thread's time).
        Requests with tokens are all checked; those without, a share at a time (QUEUED_CHECKS_PER_S)."""
        now = time.monotonic()
        for job_id, job in list(self._jobs.items()):
            if job.done:
                self._jobs.pop(job_id)
        queued = [job for job in self._jobs.values() if job.first_token_time is None]
        share = max(1, int(QUEUED_CHECKS_PER_S * self.heartbeat_share * self.cancel_poll_s))
        start = self._queued_checked % len(queued) if queued else 0
        turn = (queued[start:] + queued[:start])[:share]
        self._queued_checked = start + len(turn)
        waiting_turn = {id(job) for job in queued} - {id(job) for job in turn}     # not checked this poll
        asking = []           # live streams that asked for queue_heartbeat
        for job_id, job in list(self._jobs.items()):
            if id(job) not in waiting_turn and self._cancelled(job):
                self._cancel(job)
                self._jobs.pop(job_id)
            elif job.request.queue_heartbeat:
                asking.append(job)
        # Spread over every stream that may need one, not only the ones silent now: those just
        # answered drop out of the silent ones, and counting only those let two streams out of
        # phase each get a heartbeat every heartbeat_s, twice the rate HEARTBEATS_PER_S allows.
        interval = max(self.heartbeat_s, len(asking) / (HEARTBEATS_PER_S * self.heartbeat_share))
        for job in asking:
            if now - max(job.arrival, job.last_response) >= interval:
                job.last_response = now
                self._heartbeat(job)

    def _heartbeat(self, job: Job) -> None:
        """A response without outputs for a stream that has had none for a while. Triton's HTTP
        frontend notices that a client closed its connection only when it writes to it (server
        issue #7077), and then cancels the request: without a write, a request whose client left
        while it waited in the queue would still be prefilled and run to its first token, and one
        whose tokens a large stream_interval holds back would run on between its responses. Each
        silent stream once a second at most, and HEARTBEATS_PER_S in all: 400 queued streams
        with a heartbeat every 0.2 s (2,000 responses a second for Triton to write and the
        OpenAI server to read) cost the 64 running ones 9% of their tokens/s on 2 vCPUs, once a
        second ~4%."""
        try:
            job.sink.send({}, final=False)
        except Exception:          # the client is gone
            log.debug("inflight: a heartbeat for %s failed; cancelling it", job.job_id, exc_info=True)
            self._cancel(job)

    def _record(self, job: Job, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.after_request(job, reason, time.monotonic())


def _prompt_field(request: GenerateRequest) -> str:
    """The input a request's prompt came in, as its errors name it."""
    if request.pooling is not None:
        return "embedding_request.input"
    return "input_ids" if request.prompt_ids is not None else "text_input"


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    values = {name: getattr(params, name) for name in params.__slots__}
    try:
        return SamplingParams(**{**values, **changes})
    except ValueError as exc:
        raise RequestError(str(exc)) from None

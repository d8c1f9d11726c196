"""LLMEngine: requests in, one token per running request per step out.

Single-threaded by design: one caller drives add_request / abort / step (the Triton adapter does
so from its engine thread). Nothing here knows about Triton.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from .config import EngineConfig, SamplingParams, parse_priority
from .kv_cache import KVCacheManager
from .logprobs import PromptPositions, TokenLogprobs, prompt_logprobs
from .lora import load_adapter
from .pooling import KINDS, ONE_TOKEN, Pooler, PoolingParams, resolve_runner
from .reasoning import Reasoning
from .request import Request, RequestOutput, Status, StepOutput
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .score_head import apply_overrides, head_rows
from .structured import StructuredOutputs
from .tokenizer import load_tokenizer

log = logging.getLogger("inflight")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size: the request is refused, not queued."""


class LLMEngine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, eos_token_ids: tuple[int, ...],
                 model_key: bytes, tokenizer=None, pooler: Pooler | None = None):
        """tokenizer: the checkpoint's transformers tokenizer, or None for one without (structured
        outputs need it). pooler: with config.runner "pooling", the checkpoint's (pooling.py)."""
        assert (pooler is not None) == (config.runner == "pooling"), "a pooling engine has its checkpoint's pooler"
        self.config = config
        self.runner = runner
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.spec.vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_key = model_key
        prefix_caching = config.enable_prefix_caching and config.policy == "continuous"
        self.kv = KVCacheManager(runner.num_blocks, config.block_size, prefix_caching)
        self.scheduler = Scheduler(config, self.max_model_len, self.kv, eos_token_ids)
        self.sampler = Sampler(runner.device, config.seed)
        self.reasoning = None if config.reasoning_parser is None else Reasoning.load(config.reasoning_parser,
                                                                                      tokenizer)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, eos_token_ids, config.max_num_seqs,
                                            runner.device, self.reasoning)
        self.num_constrained = 0                     # unfinished requests with structured outputs
        self.num_budgeted = 0                        # unfinished requests with a thinking_token_budget
        self.pooler = pooler
        self.num_pooling = 0                         # unfinished embedding requests
        self.requests: dict[str, Request] = {}       # unfinished requests by id
        self._arrivals = itertools.count()
        self._displaced: dict[str, str] = {}         # requests a higher priority took the place of -> error
        self.num_steps = 0
        self.last_step_s = 0.0
        self.num_computed_tokens = 0                 # tokens run through the model (no padding)
        self.num_padding_tokens = 0
        self.num_generated_tokens = 0

    @classmethod
    def from_pretrained(cls, model_dir: str, config: EngineConfig | None = None,
                        lora_modules: dict[str, str] | None = None, tokenizer=None) -> "LLMEngine":
        """Load a local Hugging Face checkpoint directory (config.json + *.safetensors), and with
        config.enable_lora the PEFT LoRA adapters in `lora_modules` (name -> adapter directory).
        `tokenizer`: the checkpoint's, already loaded; by default loaded here, or none if it has none."""
        from transformers import AutoConfig, GenerationConfig

        config = config or EngineConfig()
        if lora_modules and not config.enable_lora:
            raise ValueError(f"'lora_modules' {sorted(lora_modules)} given but 'enable_lora' is false")
        if config.allow_runtime_lora_updating and not config.enable_lora:
            raise ValueError("'allow_runtime_lora_updating' needs 'enable_lora'")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
        hf_config = AutoConfig.from_pretrained(model_dir)
        apply_overrides(hf_config, config.hf_overrides)
        config = dataclasses.replace(config, runner=resolve_runner(config.runner, model_dir, hf_config))
        eos = getattr(hf_config, "eos_token_id", None)
        if os.path.exists(os.path.join(model_dir, "generation_config.json")):
            # a generation config of sampling defaults alone names no EOS: config.json's stands
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id or eos
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if tokenizer is None:
            tokenizer = load_tokenizer(model_dir)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids = (tokenizer.eos_token_id, *eos_ids)        # vLLM's EOS set: the tokenizer's and the configs'
        runner = ModelRunner(model_dir, hf_config, config, lora_modules, score_rows=head_rows(hf_config, tokenizer))
        model_key = hashlib.blake2b(f"{os.path.realpath(model_dir)}|{runner.dtype}".encode(), digest_size=16).digest()
        head = runner.model.compute_logits if runner.spec.num_labels is not None else None
        pooler = Pooler(hf_config, runner.spec.hidden_size, model_dir, head) if config.runner == "pooling" else None
        return cls(runner, config, eos_ids, model_key, tokenizer=tokenizer, pooler=pooler)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    priority: str | int = "normal", cache_salt: str | None = None,
                    arrival_time: float | None = None, grammar=None, group: list[Request] | None = None,
                    room_for: int = 1, pooling: PoolingParams | None = None) -> Request:
        """Queue a request; raises ValueError (naming the field) for anything that could never run,
        QueueFullError when the waiting queue is full. Returns the request's (read-only) state.
        With structured outputs, `grammar` is its grammar compiled ahead (self.structured.compile,
        on another thread); without it the grammar is compiled here. The outputs of one n > 1
        request pass the same `group` list, which each joins: the queue timeout treats them as one
        request; the first passes `room_for` n, so that the queue makes room for all n at once or
        refuses them before any is added. An engine with runner "pooling" takes pooling requests
        only: `pooling` given, of `params` only the LoRA adapter read (pooling.py)."""
        params = self._check_runner(params, pooling)
        if not isinstance(params, SamplingParams):
            raise TypeError("'params' must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"'request_id' {request_id!r} is already in use")
        prompt = self._check_prompt(prompt_token_ids)
        self._check_token_params(params)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + at least one output token exceeds max_model_len "
                             f"({self.max_model_len})" if pooling is None else
                             f"'prompt_token_ids' ({len(prompt)} tokens) must be shorter than max_model_len "
                             f"({self.max_model_len})")
        # a longer max_tokens is capped: the output ends with "length" at max_model_len, as in vLLM
        # (the pool holds a whole max_model_len sequence: the runner refuses a smaller one at load)
        priority = parse_priority(priority)
        salt = self._salt_key(cache_salt)
        if params.thinking_token_budget is not None and (self.reasoning is None or self.reasoning.end_id is None):
            why = "which is not set" if self.reasoning is None else "and the tokenizer has none (no reply reasons)"
            raise ValueError(f"'thinking_token_budget' needs the engine's reasoning_parser (the model's reasoning "
                             f"markers), {why}")
        matcher = None
        if params.structured_outputs is not None:
            compiled = grammar if grammar is not None else self.structured.compile(params.structured_outputs)
            matcher = self.structured.new_matcher(compiled)
        # the adapter after every other check: a refused request reads none, and makes no other give its row up
        lora_id, lora_key = self._lora_adapter(params.lora_name, params.lora_path)
        self._make_room(priority, room_for)     # last: nothing below refuses it once another gave up its place
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        req = Request(request_id=request_id, token_ids=prompt, num_prompt_tokens=len(prompt), params=params,
                      priority=priority, arrival_seq=next(self._arrivals),
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                      generator=generator,
                      # fixed-length parts (the adapter's present or not): no salt can pose as an adapter
                      cache_key=hashlib.blake2b(self.model_key + salt + lora_key, digest_size=16).digest(),
                      matcher=matcher, reasoning=not params.reasoning_ended and self.structured.waits(matcher, prompt),
                      lora_id=lora_id,
                      group=group, pooling=pooling)
        if params.thinking_token_budget is not None:
            req.thinking_left = self.reasoning.budget_left(prompt, params.thinking_token_budget)
            self.num_budgeted += 1
        if group is not None:
            group.append(req)
        self.num_constrained += matcher is not None
        self.num_pooling += pooling is not None
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_runner(self, params: SamplingParams | None, pooling: PoolingParams | None) -> SamplingParams:
        """The request's kind against the engine's runner (vLLM's rule: a pooling model embeds, a
        generating one generates); a pooling request's checks, and the step it runs as."""
        if pooling is None:
            if self.pooler is not None:
                kind, serves = KINDS[self.pooler.task]
                raise ValueError(f'this model runs as {kind} (its engine\'s runner is "pooling"): it serves '
                                 f"{serves} requests, not generation")
            return params or SamplingParams()
        if self.pooler is None:
            kind = "classification needs a classifier" if pooling.task == "classify" else \
                "embeddings need a model run as an embedding model"
            raise ValueError(f'{kind} (the engine setting runner "pooling", as vLLM\'s); this one generates')
        self.pooler.check(pooling)
        if params is None:
            return ONE_TOKEN
        return dataclasses.replace(ONE_TOKEN, lora_name=params.lora_name, lora_path=params.lora_path)

    def _make_room(self, priority: int, count: int) -> None:
        """Room in the queue for `count` requests of this priority class, or QueueFullError. A full
        queue refuses them, unless requests of a lower class wait there never started: then as
        many as are needed give up their places (the newest of the lowest class first), all or
        none, and end with the error, reported by the next step."""
        limit = self.config.max_queue_size
        excess = 0 if limit is None else self.scheduler.num_waiting_for_a_seat(count) - limit
        if excess <= 0:
            return
        victims = self.scheduler.displaceable(priority, excess)
        if len(victims) < excess:
            raise QueueFullError(f"queue full: {limit} requests are already waiting (max_queue_size)")
        for victim in victims:
            self.scheduler.abort(victim, "error")
            victim.error = self._displaced[victim.request_id] = (
                f"queue full: a request of a higher priority took this one's place in the queue (max_queue_size "
                f"{limit})")

    @staticmethod
    def _salt_key(cache_salt: str | None) -> bytes:
        """The salt's part of the prefix-cache key: a digest of fixed length."""
        # "" would share the unsalted requests' blocks; vLLM refuses it too
        if cache_salt == "" or not isinstance(cache_salt, str | None):
            raise ValueError("'cache_salt' must be a non-empty string")
        try:
            salt = (cache_salt or "").encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("'cache_salt' is not valid UTF-8 text (it holds a lone surrogate)") from None
        return hashlib.blake2b(salt, digest_size=16).digest()

    def _lora_adapter(self, lora_name: str | None, lora_path: str | None) -> tuple[int, bytes]:
        """(adapter id, prefix-cache key part) of the request's adapter: blocks computed with an adapter
        are never shared with the base model or another adapter. With a path, the adapter is loaded
        first where it is not (runtime LoRA updating)."""
        if lora_name is None:
            return -1, b""
        lora = self.runner.lora
        if lora is None:
            raise ValueError(f"'lora_name' {lora_name!r}: LoRA is not enabled on this model ('enable_lora' is false)")
        if lora_path is None:
            adapter_id = lora.named(lora_name)
            if adapter_id is None:
                raise ValueError(f"unknown 'lora_name' {lora_name!r}; known: {lora.names}")
        else:       # '~' read as the user's home, as vLLM reads an adapter's path
            adapter_id = self._runtime_adapter(lora, lora_name, os.path.expanduser(lora_path))
        return adapter_id, b"|lora:" + lora.keys[adapter_id]

    def _runtime_adapter(self, lora, lora_name: str, lora_path: str) -> int:
        """The id of the adapter loaded from lora_path under lora_name, reading it now (on the engine's
        thread: the steps wait for it) where it is not loaded, or its files changed since."""
        adapter_id = lora.lookup(lora_name, lora_path)
        if adapter_id is not None:
            return adapter_id
        if not self.config.allow_runtime_lora_updating:
            raise ValueError(f"'lora_path' {lora_path!r}: loading LoRA adapters at runtime is off "
                             "('allow_runtime_lora_updating' is false)")
        adapter = load_adapter(lora_name, lora_path, self.runner.spec, self.config.max_lora_rank)
        adapter_id = lora.add(adapter, held={r.lora_id for r in self.requests.values()})
        log.info("inflight: loaded LoRA adapter %r from %s", lora_name, lora_path)
        return adapter_id

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("'prompt_token_ids' is empty")
        try:
            ids = np.asarray(prompt)
        except ValueError:          # ragged nesting: numpy's own message names no field
            ids = None
        if ids is None or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError("'prompt_token_ids' must be a list of integers")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise ValueError(f"'prompt_token_ids': token id {int(ids[bad[0]])} at position {int(bad[0])} "
                             f"is outside the vocabulary [0, {self.vocab_size})")
        return [int(t) for t in prompt]

    def _check_token_params(self, params: SamplingParams) -> None:
        """The sampler indexes the logits with these ids: one outside the vocabulary would fail the
        whole step, so it is refused here."""
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("bad_words_ids", [t for word in params.bad_words_ids for t in word]),
                          ("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise ValueError(f"'{name}': token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_id: str) -> bool:
        """End a request now (reported with finish reason 'abort' by the next step)."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return False
        self.scheduler.abort(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.scheduler.has_work()

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One iteration: schedule, forward, sample, update. Returns the new token of every request
        that advanced and the requests that ended (finished, aborted, failed)."""
        with self.runner.on_device():
            return self._step()

    def _step(self) -> StepOutput:
        started = time.perf_counter()
        errors = self._expire_waiting()
        errors.update(self._displaced)
        self._displaced.clear()
        scheduler, table = self.scheduler, self.scheduler.table
        out = scheduler.schedule()
        request_ids, token_ids, logprobs, prompt_entries, pooled = [], [], None, {}, {}
        if len(out):
            logits, prompt, hidden = self.runner.execute(out, table, keep_hidden=self.num_pooling > 0)
            scored = self._score_prompt(prompt, table) if prompt is not None else []
            sample_rows = out.sample_rows
            pooled = self._pool(hidden, table, sample_rows) if hidden is not None else {}
            mask = self.structured.step_mask(table, sample_rows) if self.num_constrained else None
            forced = self._reasoning_ends(table, sample_rows) if self.num_budgeted else None
            tokens, step_logprobs = self.sampler(logits, table, sample_rows, mask, forced)
            grammar_done = mask.advance(tokens) if mask is not None else None
            if self.num_budgeted:
                self._count_reasoning(table, sample_rows, tokens)
            request_ids = table.request_ids[sample_rows].tolist()
            if step_logprobs is not None:
                logprobs = [None] * len(tokens)
                for j, i in enumerate(step_logprobs.index.tolist()):
                    logprobs[i] = step_logprobs.entry(j, int(tokens[i]))
                    table.requests[int(sample_rows[i])].logprobs.append(logprobs[i])
            scheduler.update(out, tokens, grammar_done)
            prompt_entries = self._record_prompt_logprobs(scored)
            token_ids = tokens.tolist()
            if mask is not None and mask.rejected:
                request_ids, token_ids, logprobs = self._fail_rejected(mask.rejected, request_ids, token_ids,
                                                                       logprobs, errors)
            if pooled:      # an embedding request's token goes to nobody; it ends with its prompt, as vLLM's: "stop"
                request_ids, token_ids, logprobs = _without(pooled, request_ids, token_ids, logprobs)
                for request_id in pooled:
                    self.requests[request_id].finish_reason = scheduler.finished[request_id] = "stop"
            self.num_computed_tokens += out.num_tokens
            self.num_padding_tokens += out.num_padding_tokens
            self.num_generated_tokens += len(token_ids)
            self.num_steps += 1
        finished, scheduler.finished = scheduler.finished, {}
        for request_id in finished:
            req = self.requests.pop(request_id, None)
            if req is not None and req.matcher is not None:
                self.num_constrained -= 1
            if req is not None and req.params.thinking_token_budget is not None:
                self.num_budgeted -= 1
            if req is not None and req.pooling is not None:
                self.num_pooling -= 1
        self.last_step_s = time.perf_counter() - started
        admitted, scheduler.admitted = scheduler.admitted, {}
        return StepOutput(request_ids, token_ids, logprobs, finished, errors, prompt_entries, admitted, pooled)

    def _pool(self, hidden: torch.Tensor, table, sample_rows: np.ndarray) -> dict[str, list[float]]:
        """The embeddings of the pooling requests among the sampling rows (their prompts' last
        tokens), kept on their requests too."""
        reqs = [(i, table.requests[row]) for i, row in enumerate(sample_rows.tolist())]
        reqs = [(i, req) for i, req in reqs if req.pooling is not None]
        if not reqs:
            return {}
        index = torch.tensor([i for i, _ in reqs], device=hidden.device)
        vectors = self.pooler.pool(hidden[index], [req.pooling for _, req in reqs])
        for (_, req), vector in zip(reqs, vectors):
            req.embedding = vector
        return {req.request_id: vector for (_, req), vector in zip(reqs, vectors)}

    def _reasoning_ends(self, table, sample_rows: np.ndarray) -> dict[int, int]:
        """The sampling positions whose thinking_token_budget is spent: the end marker is forced."""
        return {i: self.reasoning.end_id for i, row in enumerate(sample_rows.tolist())
                if (left := table.requests[row].thinking_left) is not None and left <= 0}

    def _count_reasoning(self, table, sample_rows: np.ndarray, tokens: np.ndarray) -> None:
        for row, token in zip(sample_rows.tolist(), tokens.tolist()):
            req = table.requests[row]
            if req.params.thinking_token_budget is not None:
                req.thinking_left = self.reasoning.budget_after(req.thinking_left, token,
                                                                req.params.thinking_token_budget)

    def _score_prompt(self, prompt: PromptPositions, table) -> list[tuple[Request, TokenLogprobs]]:
        """The prompt tokens this step reached, scored: (request, entry) per position."""
        entries = prompt_logprobs(prompt, table.num_prompt_logprobs[prompt.rows], self.runner.compute_logits)
        return [(table.requests[row], entry) for row, entry in zip(prompt.rows.tolist(), entries)]

    @staticmethod
    def _record_prompt_logprobs(scored: list[tuple[Request, TokenLogprobs]]) -> dict[str, list]:
        """Onto their requests once the step has stood (a step that raised before update() is
        recomputed, and must not add its positions twice); request id -> entries."""
        by_request: dict[str, list] = {}
        for req, entry in scored:
            req.prompt_logprobs.append(entry)
            by_request.setdefault(req.request_id, []).append(entry)
        return by_request

    def _fail_rejected(self, rejected: list[int], request_ids: list[str], token_ids: list[int],
                       logprobs: list | None, errors: dict[str, str]):
        """Requests whose sampled token their grammar refused (it allowed none, or every one it
        allowed was banned, by bad_words): already finished by update(); report them as errors, without the token,
        which leaves the request too (it was never allowed, and never streamed)."""
        finished = self.scheduler.finished
        for i in rejected:
            req = self.requests[request_ids[i]]
            req.token_ids.pop()
            if req.row >= 0:       # static batching holds its row to the group's end, then copies it back
                self.scheduler.table.num_tokens[req.row] -= 1
            if logprobs is not None and logprobs[i] is not None:
                req.logprobs.pop()
            req.finish_reason = finished[req.request_id] = "error"
            req.error = errors[req.request_id] = (
                "'structured_outputs': no token allowed by the grammar was left to sample (the grammar "
                "admits no continuation of the output so far, or bans such as 'bad_words' removed every one)")
        return _without({request_ids[i] for i in rejected}, request_ids, token_ids, logprobs)

    def _expire_waiting(self) -> dict[str, str]:
        limit = self.config.max_queue_wait_s
        if limit is None:
            return {}
        errors = {}
        for req in self.scheduler.expire_waiting(limit):
            req.error = errors[req.request_id] = f"timed out in queue after {limit:g} s (max_queue_wait_s)"
        return errors

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Offline batch generation: run every prompt to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError("'params' must be one SamplingParams or one per prompt")
        base = next(self._arrivals)
        return self._run([self.add_request(f"generate-{base}-{i}", p, sp)
                          for i, (p, sp) in enumerate(zip(prompt_token_ids, params))])

    def embed(self, prompt_token_ids: Sequence[Sequence[int]], pooling: PoolingParams | None = None,
              lora_name: str | None = None) -> list[RequestOutput]:
        """Offline embeddings (runner "pooling"): each prompt's in RequestOutput.embedding, in
        prompt order; with a LoRA adapter's weights where named."""
        base = next(self._arrivals)
        adapter = None if lora_name is None else SamplingParams(lora_name=lora_name)
        return self._run([self.add_request(f"embed-{base}-{i}", p, adapter, pooling=pooling or PoolingParams())
                          for i, p in enumerate(prompt_token_ids)])

    def classify(self, prompt_token_ids: Sequence[Sequence[int]], use_activation: bool | None = None,
                 lora_name: str | None = None) -> list[RequestOutput]:
        """Offline classification (a *ForSequenceClassification): each prompt's class scores in
        RequestOutput.embedding (probabilities; use_activation False: the logits), in prompt order."""
        return self.embed(prompt_token_ids, PoolingParams(use_activation=use_activation, task="classify"), lora_name)

    def _run(self, reqs: list[Request]) -> list[RequestOutput]:
        while any(r.status != Status.FINISHED for r in reqs):
            self.step()
        return [to_output(r) for r in reqs]

    # ---- observability -----------------------------------------------------------------------------
    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name (SamplingParams.lora_name)."""
        return [] if self.runner.lora is None else self.runner.lora.names

    def stats(self) -> dict:
        scheduler = self.scheduler
        live, allocated = scheduler.slot_usage()
        stats = {
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_blocks_cached": self.kv.num_cached_blocks,
            "kv_slot_utilization": live / allocated if allocated else 1.0,
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "preemptions": scheduler.num_preemptions,
            "steps": self.num_steps,
            "last_step_s": self.last_step_s,
            "computed_tokens": self.num_computed_tokens,
            "prefill_tokens": scheduler.num_prefill_tokens,
            "prompt_tokens": scheduler.num_prompt_tokens,
            "padding_tokens": self.num_padding_tokens,
            "generated_tokens": self.num_generated_tokens,
            "prefix_cache_query_tokens": scheduler.prefix_query_tokens,
            "prefix_cache_hit_tokens": scheduler.prefix_hit_tokens,
            "prefix_cache_resumed_hit_tokens": scheduler.resumed_hit_tokens,
            "lora_loads": 0 if self.runner.lora is None else self.runner.lora.num_loads,
        }
        if self.runner.lora is not None:
            # by adapter id, summed by name in lora_names' order: an older adapter of a name (its files
            # changed) runs on in a row of its own until its requests end
            lora = self.runner.lora
            running, waiting = scheduler.lora_requests(len(lora.keys))
            position = {name: i for i, name in enumerate(lora.names)}
            owner = np.array([position.get(name, -1) for name in lora.row_names], dtype=np.int64)
            named = owner >= 0
            stats["lora_names"] = lora.names
            stats["lora_running"], stats["lora_waiting"] = (
                np.bincount(owner[named], counts[named], minlength=len(position)).astype(np.int64)
                for counts in (running, waiting))
        return stats

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def _without(dropped, request_ids: list[str], token_ids: list[int], logprobs: list | None):
    """The step's parallel lists less the requests in `dropped`."""
    keep = [i for i, request_id in enumerate(request_ids) if request_id not in dropped]
    return ([request_ids[i] for i in keep], [token_ids[i] for i in keep],
            None if logprobs is None else [logprobs[i] for i in keep])


def to_output(req: Request) -> RequestOutput:
    asked = req.params.prompt_logprobs is not None
    generated = req.output_token_ids if req.pooling is None else []     # a pooling request's token is nobody's
    return RequestOutput(req.request_id, req.prompt_token_ids, generated, req.finish_reason,
                         list(req.logprobs) if req.params.logprobs is not None else None, req.num_preemptions,
                         [None, *req.prompt_logprobs] if asked else None, req.embedding)

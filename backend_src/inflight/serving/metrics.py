"""Engine metrics through the Python backend's custom metrics API, served on Triton's metrics port
next to Triton's own (all prefixed `inflight_`, labelled with the model name); with
REPORT_CUSTOM_METRICS in config.pbtxt, also the Triton vLLM backend's `vllm:` metrics, as it
exports them (its src/utils/metrics.py: names, buckets, labels model and version)."""
from __future__ import annotations

import os
import time

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

GAUGES = {
    "kv_blocks_used": "KV-cache blocks held by requests",
    "kv_blocks_total": "KV-cache blocks in the pool",
    "kv_blocks_cached": "KV-cache blocks holding a reusable prefix, in use or free",
    "requests_running": "Requests in the running batch",
    "requests_waiting": "Requests waiting for admission (including preempted ones)",
}
# engine stats counters -> metric name, description
COUNTERS = {
    "preemptions": ("preemptions_total", "Requests preempted (recompute) for lack of KV blocks or for priority"),
    "computed_tokens": ("prompt_and_decode_tokens_total", "Tokens run through the model"),
    # from the engine's stats, not counted as first tokens reach the responses: a metric update is a
    # round trip to Triton, and the response thread makes those before it sends the step's responses
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens of requests admitted (each output's, cache hits "
                      "included)"),
    "prefix_cache_query_tokens": ("prefix_cache_queries_total", "Prompt tokens of new requests looked up in the prefix cache"),
    "prefix_cache_hit_tokens": ("prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
    "lora_loads": ("lora_adapter_loads_total", "LoRA adapters copied into a slot (more adapters than max_loras)"),
}
# per LoRA adapter (label lora_name), counted when a request ends -> description
LORA_COUNTERS = {
    "lora_requests_total": "Requests ended, by LoRA adapter",
    "lora_prompt_tokens_total": "Prompt tokens of ended requests, by LoRA adapter",
    "lora_generation_tokens_total": "Tokens generated, by LoRA adapter",
}
# per LoRA adapter (label lora_name), the engine's queues as each stats snapshot finds them -> description
LORA_GAUGES = {
    "lora_requests_running": "Requests running, by LoRA adapter",
    "lora_requests_waiting": "Requests waiting, by LoRA adapter",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token", LATENCY_BUCKETS),
    "time_per_output_token_seconds": ("Mean time between a request's generated tokens", STEP_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the final response", LATENCY_BUCKETS),
    "scheduler_step_seconds": ("Duration of one engine step (schedule, forward, sample, update)", STEP_BUCKETS),
}


# the vLLM backend's bucket boundaries
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
VLLM_COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens_total", "Number of generation tokens processed."),
}
VLLM_HISTOGRAMS = {      # buckets None: 1-2-5 up to max_model_len
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS),
    "itl": ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", VLLM_ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            VLLM_E2E_BUCKETS),
    "request_prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    "request_generation": ("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    "n": ("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
}

FINISHED = ("stop", "length")     # how a request ends that the latency histograms observe


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return out
            out.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, pb_utils, model_name: str, min_interval_s: float = 0.05, lora_names=(), max_loras: int = 0,
                 vllm_labels: dict | None = None, max_model_len: int = 0, labels: dict | None = None):
        """lora_names: the adapters served from the start; max_loras (0: LoRA off) of them run at
        once, and those loaded at runtime get their series as the engine's stats first name them
        (or as a request of theirs finishes, whichever comes first). vllm_labels ({model,
        version}): also export the vLLM backend's metrics. labels: where the model has several
        instances, this one's (model_instance, gpu), on inflight's metrics.
        Every series also carries this process's pid: Triton 2.51 counts a series' users per
        process, so one that two processes share (the old and new instance of a reload, or two
        instances) is freed under the other when the first lets it go, and tritonserver crashed."""
        self._pb = pb_utils
        process = {"pid": str(os.getpid())}
        self._labels = {"model": model_name, **(labels or {}), **process}
        vllm_labels = None if vllm_labels is None else {**vllm_labels, **process}
        self._families = []          # a MetricFamily must outlive its metrics
        self._gauges = {key: self._metric(f"inflight_{key}", desc, "GAUGE") for key, desc in GAUGES.items()}
        self._counters = {key: self._metric(f"inflight_{name}", desc, "COUNTER")
                          for key, (name, desc) in COUNTERS.items()}
        self._generation = self._metric("inflight_generation_tokens_total", "Tokens generated and delivered", "COUNTER")
        self._vllm = None if vllm_labels is None else self._vllm_metrics(vllm_labels, max_model_len)
        # tokens delivered since the last publish: generated, prompts of outputs begun, token gaps,
        # and the times to first token of requests (inflight's) and of outputs (vLLM's) begun
        self._new_tokens = 0
        self._new_prompt_tokens = 0
        self._gaps: list[float] = []
        self._first_tokens: list[float] = []
        self._vllm_first_tokens: list[float] = []
        self._histograms = {key: self._metric(f"inflight_{key}", desc, "HISTOGRAM", buckets=buckets)
                            for key, (desc, buckets) in HISTOGRAMS.items()}
        self._requests = self._family("inflight_requests_total", "Requests ended, by how they ended", "COUNTER")
        self._by_reason: dict[str, object] = {}
        # one series per adapter the engine serves: a refused unknown name adds none
        self._lora_families = {key: self._family(f"inflight_{key}", desc, kind) for metrics, kind in
                               ((LORA_COUNTERS, "COUNTER"), (LORA_GAUGES, "GAUGE")) for key, desc in metrics.items()}
        self._by_lora: dict[str, dict] = {}
        self._lora_queues: dict[str, dict] = {}        # name -> its gauges as last published
        for name in lora_names:
            self._lora_series(name)
        if max_loras:       # held, as every metric here is, for as long as the model runs; set once
            self._max_loras = self._metric("inflight_max_loras", "LoRA adapters that may run at once (max_loras)",
                                           "GAUGE")
            self._max_loras.set(max_loras)
        self._last_counts = dict.fromkeys(COUNTERS, 0)
        self._last_update = 0.0
        self._steps_seen = 0
        self.min_interval_s = min_interval_s

    def _family(self, name: str, description: str, kind: str):
        family = self._pb.MetricFamily(name=name, description=description, kind=getattr(self._pb.MetricFamily, kind))
        self._families.append(family)
        return family

    def _metric(self, name: str, description: str, kind: str, labels: dict | None = None, **extra):
        return self._family(name, description, kind).Metric(labels=labels or self._labels, **extra)

    def _vllm_metrics(self, labels: dict, max_model_len: int) -> dict:
        lengths = buckets_1_2_5(max_model_len)
        metrics = {key: self._metric(name, desc, "COUNTER", labels) for key, (name, desc) in VLLM_COUNTERS.items()}
        for key, (name, desc, buckets) in VLLM_HISTOGRAMS.items():
            metrics[key] = self._metric(name, desc, "HISTOGRAM", labels, buckets=buckets or lengths)
        return metrics

    def delivered(self, job, gap: float | None) -> None:
        """Response thread: one token reached an output; gap: the time since that output's
        previous token (None for its first)."""
        self._new_tokens += 1
        if self._vllm is not None:
            if gap is None:
                self._new_prompt_tokens += len(job.prompt_ids)
            else:
                self._gaps.append(gap)

    def first_token(self, job, now: float) -> None:
        """Response thread: an output's first token, observed as it comes (as vLLM observes it),
        not when the request ends: a dashboard's TTFT would otherwise lag by whole generations
        and miss the requests still running. Call before the output records its time."""
        if job.first_token_time is None:
            self._first_tokens.append(now - job.arrival)
        if self._vllm is not None:
            self._vllm_first_tokens.append(now - job.arrival)

    def refused(self) -> None:
        """A request refused before it ran (malformed, or one the engine would not take): counted
        by how it ended but in no latency or token histogram, as vLLM's loggers never see it."""
        self._by_reason_metric("error").increment(1)

    def snapshot(self, engine, force: bool = False) -> tuple[float | None, dict | None] | None:
        """Engine thread, no IPC: the duration of a step that ran since the last call (not of an
        empty poll), and the engine's stats at most every min_interval_s (always when the engine
        has gone idle, so an idle server reads exact zeros); None when there is nothing new."""
        step_s = engine.last_step_s if engine.num_steps > self._steps_seen else None
        self._steps_seen = engine.num_steps
        now = time.monotonic()
        if not force and engine.has_unfinished() and now - self._last_update < self.min_interval_s:
            return None if step_s is None else (step_s, None)
        self._last_update = now
        return step_s, engine.stats()

    def publish(self, snapshot: tuple[float | None, dict | None]) -> None:
        """Response thread: hand a snapshot to Triton's metrics (each call is a round trip)."""
        step_s, stats = snapshot
        if step_s is not None:
            self._histograms["scheduler_step_seconds"].observe(step_s)
        if stats is None:
            return
        self._gauges["kv_blocks_used"].set(stats["kv_blocks_used"])
        self._gauges["kv_blocks_total"].set(stats["kv_blocks_total"])
        self._gauges["kv_blocks_cached"].set(stats["kv_blocks_cached"])
        self._gauges["requests_running"].set(stats["running"])
        self._gauges["requests_waiting"].set(stats["waiting"])
        for key, metric in self._counters.items():
            delta = stats[key] - self._last_counts[key]
            if delta:
                metric.increment(delta)
                self._last_counts[key] = stats[key]
        if "lora_names" in stats:
            self._publish_lora_queues(stats["lora_names"], stats["lora_running"], stats["lora_waiting"])

    def _lora_series(self, name: str) -> dict:
        series = self._by_lora.get(name)
        if series is None:
            series = self._by_lora[name] = {key: family.Metric(labels={**self._labels, "lora_name": name})
                                             for key, family in self._lora_families.items()}
            self._lora_queues[name] = dict.fromkeys(LORA_GAUGES, 0)
        return series

    def _publish_lora_queues(self, names: list[str], running, waiting) -> None:
        """Each adapter's running and waiting requests (arrays in the order of the engine's
        lora_names), only those that changed: each set is a round trip to Triton. An adapter loaded
        at runtime that gave its row up reads 0."""
        now = {name: dict(zip(LORA_GAUGES, values)) for name, *values in zip(names, running, waiting)}
        for name in names:
            self._lora_series(name)
        for name, published in self._lora_queues.items():
            for key in LORA_GAUGES:
                value = now.get(name, {}).get(key, 0)
                if published[key] != value:
                    self._by_lora[name][key].set(int(value))
                    published[key] = value

    def publish_delivered(self) -> None:
        """Response thread, after each step's responses: tokens counted as delivered, as vLLM
        counts its outputs (the token a step makes after a stop string ended its output is not
        generated text)."""
        if self._new_tokens:
            self._generation.increment(self._new_tokens)
            if self._vllm is not None:
                self._vllm["generation_tokens"].increment(self._new_tokens)
            self._new_tokens = 0
        for ttft in self._first_tokens:
            self._histograms["time_to_first_token_seconds"].observe(ttft)
        self._first_tokens.clear()
        for ttft in self._vllm_first_tokens:
            self._vllm["ttft"].observe(ttft)
        self._vllm_first_tokens.clear()
        if self._vllm is not None:
            if self._new_prompt_tokens:
                self._vllm["prompt_tokens"].increment(self._new_prompt_tokens)
                self._new_prompt_tokens = 0
            for gap in self._gaps:
                self._vllm["itl"].observe(gap)
            self._gaps.clear()

    def _by_reason_metric(self, reason: str):
        metric = self._by_reason.get(reason)
        if metric is None:
            metric = self._by_reason[reason] = self._requests.Metric(labels={**self._labels, "finish_reason": reason})
        return metric

    def after_request(self, job, reason: str, now: float) -> None:
        """Response thread: how a request ended, and for one that finished (a stop or its length)
        its latencies: as vLLM, whose loggers never see an aborted request, a request cancelled,
        timed out or failed is counted by how it ended but in no histogram (its end-to-end time is
        the client's or the fault's, and one that never ran would read as a 0-token generation)."""
        self._by_reason_metric(reason).increment(1)
        params = job.samples[0].params
        lora = self._by_lora.get(params.lora_name)
        if lora is None and params.lora_path is not None and reason in FINISHED:
            lora = self._lora_series(params.lora_name)      # it ran: an adapter loaded at runtime
        if lora is not None:
            lora["lora_requests_total"].increment(1)
            lora["lora_prompt_tokens_total"].increment(len(job.prompt_ids))
            generated = sum(len(sample.output_ids) for sample in job.samples)
            if generated:
                lora["lora_generation_tokens_total"].increment(generated)
        if reason not in FINISHED:
            return
        self._histograms["e2e_request_latency_seconds"].observe(now - job.arrival)
        if job.first_token_time is not None and len(job.output_ids) > 1:
            self._histograms["time_per_output_token_seconds"].observe(
                (now - job.first_token_time) / (len(job.output_ids) - 1))
        if self._vllm is not None:
            self._after_request_vllm(job, now)

    def _after_request_vllm(self, job, now: float) -> None:
        """Per output, as vLLM records each (child) request of the vLLM backend's: its end; n per
        request (first tokens are observed as they come)."""
        vllm = self._vllm
        vllm["n"].observe(len(job.samples))
        for sample in job.samples:
            vllm["e2e"].observe(now - job.arrival)
            vllm["request_prompt"].observe(len(job.prompt_ids))
            vllm["request_generation"].observe(len(sample.output_ids))

"""GET /metrics: Triton's metrics page as it is (what Triton's own OpenAI frontend serves there),
then vLLM's server metrics for the model this server fronts, under vLLM 0.32's names and labels
(`model_name`, `engine`), made from the engine's metrics that inflight's `llm` publishes on that
page (`inflight_*`, one series per process: summed here). Dashboards, autoscalers and gateways
written for a vLLM server scrape its /metrics — Gateway API inference extension and llm-d pick an
endpoint by vllm:num_requests_waiting, vllm:kv_cache_usage_perc and vllm:lora_requests_info — and
so read this server as one. A `vllm:` family already on Triton's page (`llm`'s, or the vLLM
backend's, with REPORT_CUSTOM_METRICS) is left as it is there. Each scrape reads Triton's page
once; nothing is kept between scrapes."""
from __future__ import annotations

import time
from collections import defaultdict

import aiohttp
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .errors import APIError

# vLLM name -> inflight's (the sample's name: a counter's with its _total)
GAUGES = {
    "vllm:num_requests_running": ("inflight_requests_running", "Requests in the running batch."),
    "vllm:num_requests_waiting": ("inflight_requests_waiting",
                                  "Requests waiting for admission, preempted ones included."),
}
COUNTERS = {
    "vllm:num_preemptions": ("inflight_preemptions_total", "Requests preempted by the engine."),
    "vllm:prompt_tokens": ("inflight_prompt_tokens_total", "Prompt tokens of the outputs begun."),
    "vllm:generation_tokens": ("inflight_generation_tokens_total", "Tokens generated and delivered."),
    "vllm:prefix_cache_queries": ("inflight_prefix_cache_queries_total",
                                  "Prompt tokens of new requests looked up in the prefix cache."),
    "vllm:prefix_cache_hits": ("inflight_prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
}
HISTOGRAMS = {      # with inflight's buckets
    "vllm:time_to_first_token_seconds": ("inflight_time_to_first_token_seconds",
                                         "Seconds from a request's arrival to its first token."),
    "vllm:request_time_per_output_token_seconds": ("inflight_time_per_output_token_seconds",
                                                   "A finished request's mean seconds between its tokens."),
    "vllm:e2e_request_latency_seconds": ("inflight_e2e_request_latency_seconds",
                                         "Seconds from a finished request's arrival to its last response."),
}
# vLLM's finished_reason values (every one is exported, as there) <- inflight's finish_reason labels
FINISHED = {"stop": ("stop",), "length": ("length",), "abort": ("abort", "cancelled"), "error": ("error",),
            "repetition": ()}
LABELS = ["model_name", "engine"]


class VllmMetrics:
    def __init__(self, url: str, triton_model: str, served_model_name: str):
        self.url = url                      # Triton's metrics endpoint
        self.triton_model = triton_model
        self.labels = [served_model_name, "0"]
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def page(self) -> bytes:
        """The Prometheus text page; a 503 naming the endpoint where Triton's cannot be read."""
        try:
            async with self.session.get(self.url) as response:
                if response.status != 200:
                    raise APIError(503, f"Triton's metrics at {self.url} answered {response.status}")
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise APIError(503, f"Triton's metrics at {self.url} cannot be read "
                                f"({type(exc).__name__}: {exc})") from None
        return combined(text, self.triton_model, self.labels)


class _Page:
    """The registry generate_latest reads: these families, once."""
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def combined(text: str, triton_model: str, labels: list[str]) -> bytes:
    """Triton's page, then the vLLM families it lacks (a name twice would make the page invalid)."""
    families = list(text_string_to_metric_families(text))
    taken = {family.name for family in families}
    added = [family for family in translate(families, triton_model, labels) if family.name not in taken]
    return text.encode() + (b"\n" if text and not text.endswith("\n") else b"") + generate_latest(_Page(added))


def translate(triton: list[Metric], triton_model: str, labels: list[str]) -> list[Metric]:
    """vLLM's families from Triton's: the series of `triton_model`, summed over its processes and
    instances; none where it publishes no `inflight_*` metrics."""
    samples = _samples(triton, triton_model)
    if not any(name.startswith("inflight_") for name in samples):
        return []
    families = []
    for name, (source, doc) in GAUGES.items():
        families.append(GaugeMetricFamily(name, doc, labels=LABELS))
        families[-1].add_metric(labels, _sum(samples, source))
    used, total = _sum(samples, "inflight_kv_blocks_used"), _sum(samples, "inflight_kv_blocks_total")
    families.append(GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache blocks held by requests, a fraction of "
                                      "the pool (1: full).", labels=LABELS))
    families[-1].add_metric(labels, used / total if total else 0.0)
    for name, (source, doc) in COUNTERS.items():
        families.append(CounterMetricFamily(name, doc, labels=LABELS))
        families[-1].add_metric(labels, _sum(samples, source))
    success = CounterMetricFamily("vllm:request_success", "Requests ended, by how (inflight's cancelled: abort; "
                                  "refused: error).", labels=[*LABELS, "finished_reason"])
    for reason, sources in FINISHED.items():
        success.add_metric([*labels, reason], sum(_sum(samples, "inflight_requests_total", finish_reason=source)
                                                  for source in sources))
    families.append(success)
    for name, (source, doc) in HISTOGRAMS.items():
        families.append(HistogramMetricFamily(name, doc, labels=LABELS))
        families[-1].add_metric(labels, _buckets(samples, f"{source}_bucket"), _sum(samples, f"{source}_sum"))
    if "inflight_max_loras" in samples:
        families.append(_lora_info(samples))
    return families


def _lora_info(samples: dict) -> GaugeMetricFamily:
    """vLLM's vllm:lora_requests_info: the adapters with requests running and waiting in its
    labels, its value the time (a reader takes the latest series)."""
    def adapters(source: str) -> str:
        counts = defaultdict(float)
        for sample in samples.get(source, ()):
            counts[sample.labels["lora_name"]] += sample.value
        return ",".join(name for name, count in sorted(counts.items()) if count > 0)

    info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters with requests running and waiting.",
                             labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    max_loras = max(sample.value for sample in samples["inflight_max_loras"])
    info.add_metric([str(int(max_loras)), adapters("inflight_lora_requests_waiting"),
                     adapters("inflight_lora_requests_running")], time.time())
    return info


def _samples(triton: list[Metric], triton_model: str) -> dict[str, list]:
    """The model's samples by sample name (a counter's with _total; a histogram's _bucket, _sum, _count)."""
    samples = defaultdict(list)
    for family in triton:
        for sample in family.samples:
            if sample.labels.get("model") == triton_model:
                samples[sample.name].append(sample)
    return samples


def _sum(samples: dict, name: str, **match: str) -> float:
    return sum(s.value for s in samples.get(name, ()) if all(s.labels.get(k) == v for k, v in match.items()))


def _buckets(samples: dict, name: str) -> list[tuple[str, float]]:
    """A histogram's cumulative buckets summed over its series, in order of their bounds."""
    counts = defaultdict(float)
    for sample in samples.get(name, ()):
        counts[sample.labels["le"]] += sample.value
    if not counts:
        return [("+Inf", 0.0)]
    return sorted(counts.items(), key=lambda bucket: float(bucket[0]))

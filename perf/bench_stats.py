"""Serving-benchmark statistics, with the definitions spelled out (unit-tested in tests/).

Per request, from the client's clock: sent (request written), response times (one per streamed
response), num_output_tokens (the server's count).
  TTFT  = first response - sent
  TPOT  = (last response - first response) / (num_output_tokens - 1)      (requests with >= 2 tokens)
  ITL   = every gap between consecutive responses of a request
  E2E   = last response - sent
Run-level: makespan = last response of any request - first send; throughput = requests / makespan;
generated tokens/s = sum(num_output_tokens) / makespan; goodput = requests meeting every given SLO
(TTFT and/or TPOT bound) / makespan. For requests sent one at a time, interleaved with another
system's (`interleaved=True`), the time they took is the sum of their E2Es instead of the makespan.
A run where no request succeeded has every figure NaN (its first error is in the summary too).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    sent: float
    response_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.response_times[0] - self.sent if self.response_times else None

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2 or len(self.response_times) < 2:
            return None
        return (self.response_times[-1] - self.response_times[0]) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.response_times).tolist()

    @property
    def e2e(self) -> float | None:
        return self.response_times[-1] - self.sent if self.response_times else None


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    """Linear-interpolation percentiles (numpy's default); NaN for no values."""
    values = np.asarray([v for v in values if v is not None], dtype=float)
    if not values.size:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def median_of_rounds(values) -> float:
    """The median over the rounds that have a figure: a round whose requests all failed has NaN,
    which statistics.median would sort anywhere (the result then hung on the rounds' order); NaN
    when no round has one. Each round's line says why it has none (error_note)."""
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else float("nan")


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a / b: each round's two runs share that round's host speed."""
    return median_of_rounds(x / y for x, y in zip(a, b))


def rotated(order: list, round_index: int) -> list:
    """The order of round `round_index` of interleaved runs: each alternative one place later than in
    the round before, so that each takes every place once every len(order) rounds."""
    shift = round_index % max(len(order), 1)
    return order[shift:] + order[:shift]


def summarize(records: list[RequestRecord], slo_ttft: float | None = None, slo_tpot: float | None = None,
              interleaved: bool = False) -> dict:
    done = [r for r in records if r.error is None and r.response_times]
    if not done:            # NaN figures: the callers print the run's row instead of failing on a key
        makespan = float("nan")
    elif interleaved:
        makespan = sum(r.e2e for r in done)
    else:
        makespan = max(r.response_times[-1] for r in done) - min(r.sent for r in records)

    def meets_slo(r: RequestRecord) -> bool:
        ok_ttft = slo_ttft is None or r.ttft <= slo_ttft
        ok_tpot = slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot
        return ok_ttft and ok_tpot

    tokens = sum(r.num_output_tokens for r in done)
    return {
        "requests": len(records),
        "errors": len(records) - len(done),
        "first_error": next((r.error or "no response" for r in records
                             if r.error is not None or not r.response_times), None),
        "makespan_s": makespan,
        "request_throughput": len(done) / makespan,
        "generated_tokens_per_s": tokens / makespan,
        "generated_tokens": tokens,
        "goodput": sum(meets_slo(r) for r in done) / makespan,
        "ttft": percentiles(r.ttft for r in done),
        "tpot": percentiles(r.tpot for r in done),
        "itl": percentiles(gap for r in done for gap in r.itls),
        "e2e": percentiles(r.e2e for r in done),
    }


def error_note(summary: dict) -> str:
    """'' for a run without errors, else how many of its requests failed and the first error."""
    if not summary["errors"]:
        return ""
    errors, requests = summary["errors"], summary["requests"]
    failed = f"all {requests}" if errors == requests else f"{errors} of {requests}"
    return f"  ({failed} requests failed; the first error: {summary['first_error']})"

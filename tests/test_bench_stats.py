"""The serving benchmarks' statistics and process control do what their definitions say."""
import math

import pytest

from perf.bench_stats import RequestRecord, error_note, percentiles, rotated, summarize


def test_percentiles_interpolate_linearly_and_ignore_missing_values():
    p = percentiles([1, 2, 3, 4, None, 5], qs=(0, 50, 90, 100))
    assert p == {"p0": 1.0, "p50": 3.0, "p90": pytest.approx(4.6), "p100": 5.0}
    assert all(math.isnan(v) for v in percentiles([None]).values())


def test_ttft_tpot_itl_and_e2e_of_one_request():
    r = RequestRecord(sent=10.0, response_times=[10.5, 10.6, 10.8, 11.1], num_output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.6 / 3)             # first to last response over tokens after the first
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)


def test_tpot_counts_tokens_not_responses():
    # a response may carry two tokens (a character split across them): TPOT uses the server's count
    r = RequestRecord(sent=0.0, response_times=[1.0, 2.0], num_output_tokens=5)
    assert r.tpot == pytest.approx(0.25)
    assert RequestRecord(sent=0.0, response_times=[1.0], num_output_tokens=1).tpot is None


def test_summary_throughput_and_goodput():
    fast = RequestRecord(0.0, [0.1, 0.2, 0.3], 3)        # ttft 0.1, tpot 0.1
    slow = RequestRecord(0.0, [1.0, 2.0, 4.0], 3)        # ttft 1.0, tpot 1.5
    failed = RequestRecord(0.0, [], 0, error="queue full")
    s = summarize([fast, slow, failed], slo_ttft=0.5, slo_tpot=0.5)
    assert s["makespan_s"] == pytest.approx(4.0)
    assert s["errors"] == 1 and s["generated_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(2 / 4.0)
    assert s["generated_tokens_per_s"] == pytest.approx(6 / 4.0)
    assert s["goodput"] == pytest.approx(1 / 4.0)        # only `fast` meets both SLOs
    assert summarize([fast, slow])["goodput"] == pytest.approx(2 / 4.0)   # no SLO: every request counts
    assert s["ttft"]["p50"] == pytest.approx(0.55)


def test_interleaved_requests_count_their_own_time_not_the_span():
    # sent one at a time with another system's requests between them: 10 s apart, 1 s and 3 s long
    first, second = RequestRecord(0.0, [0.5, 1.0], 4), RequestRecord(10.0, [11.0, 13.0], 4)
    s = summarize([first, second], interleaved=True)
    assert s["makespan_s"] == pytest.approx(4.0)
    assert s["generated_tokens_per_s"] == pytest.approx(8 / 4.0)
    assert s["request_throughput"] == pytest.approx(2 / 4.0)
    assert summarize([first, second])["generated_tokens_per_s"] == pytest.approx(8 / 13.0)


def test_a_run_where_every_request_failed_has_every_figure_nan_and_its_first_error():
    # a server down or refusing the load: the benchmarks print the run's row, not a KeyError
    s = summarize([RequestRecord(1.0, error="HTTP 503"), RequestRecord(1.0, error="HTTP 503")])
    assert s.keys() == summarize([RequestRecord(0.0, [0.5, 1.0], 2)]).keys()
    assert s["errors"] == 2 and s["first_error"] == "HTTP 503"
    assert math.isnan(s["generated_tokens_per_s"]) and math.isnan(s["ttft"]["p99"]) and math.isnan(s["tpot"]["p50"])
    assert error_note(s) == "  (all 2 requests failed; the first error: HTTP 503)"
    assert error_note(summarize([RequestRecord(0.0, [0.5, 1.0], 2)])) == ""


def test_rotated_puts_each_alternative_in_every_place_once_every_n_rounds():
    orders = [rotated(["a", "b", "c"], r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("events, counted, error", [
    # inflight's generate_stream: num_output_tokens per event (two tokens in the last)
    ([{"text_output": "a", "num_output_tokens": 1}, {"text_output": "bc", "num_output_tokens": 2}], 3, None),
    # vLLM's OpenAI server: the count in the usage chunk after the text
    ([{"choices": [{"text": "a"}], "usage": None}, {"choices": [{"text": "bc"}], "usage": None},
      {"choices": [], "usage": {"completion_tokens": 3}}], 3, None),
    # a clean end short of max_tokens (an abort): an error, not a full-length success
    ([{"text_output": "a", "num_output_tokens": 1}, {"text_output": "b", "finish_reason": "abort",
                                                     "num_output_tokens": 1}], 2, "ended with 2 of 3 tokens"),
])
def test_a_served_stream_counts_the_servers_tokens(events, counted, error):
    import asyncio
    import json

    import httpx

    from perf.serve_vs_vllm import one_request
    from perf.workloads import WorkItem
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    record = RequestRecord(sent=0.0)

    async def stream():
        async with httpx.AsyncClient(transport=transport) as client:
            await one_request(client, "http://server/stream", {}, WorkItem([1, 2], 3), record)
    asyncio.run(stream())
    assert record.num_output_tokens == counted and len(record.response_times) == 2
    assert (record.error is None) if error is None else error in record.error


def test_paused_stops_a_process_tree_for_the_block_and_continues_it_after():
    # side-by-side serving runs stop the server not being measured (perf/serve_vs_vllm.py)
    import subprocess
    import sys
    import time

    from perf.quiet import paused, tree_cpu_seconds
    busy = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); exec('while True: pass')"
    parent = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.5)
        with paused(parent.pid):
            time.sleep(0.1)                 # signals delivered, the tree's CPU clock settles
            before = tree_cpu_seconds(parent.pid)
            time.sleep(0.4)
            assert tree_cpu_seconds(parent.pid) - before < 0.02
        before = tree_cpu_seconds(parent.pid)
        time.sleep(0.4)
        assert tree_cpu_seconds(parent.pid) - before > 0.1      # both processes run again
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()


def test_machine_busy_seconds_counts_a_busy_process_and_no_more_than_the_cores():
    # bench-openai splits a token's CPU with it (perf/openai_bench.py)
    import os
    import subprocess
    import sys
    import time

    from perf.quiet import machine_busy_seconds, tree_cpu_seconds
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        start, own, machine = time.monotonic(), tree_cpu_seconds(busy.pid), machine_busy_seconds()
        time.sleep(0.6)
        spun, counted = tree_cpu_seconds(busy.pid) - own, machine_busy_seconds() - machine
        wall = time.monotonic() - start
        assert spun > 0.3 and spun - 0.05 <= counted <= wall * os.cpu_count() + 0.05
    finally:
        busy.kill()
        busy.wait()


def test_the_kernel_benchmark_takes_the_peak_of_the_gpu_it_runs_on():
    """% of peak against the H200's 4.8 TB/s on an H100 read ~30% low, like a regression."""
    from perf.kernel_bench import device_peak_tbps
    assert device_peak_tbps("NVIDIA H200") == 4.8
    assert device_peak_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert device_peak_tbps("NVIDIA H100 PCIe") == 2.0
    assert device_peak_tbps("NVIDIA A100-SXM4-80GB") == 2.039
    assert device_peak_tbps("NVIDIA L4") is None


def test_a_gpu_of_unknown_peak_gets_no_percentage_and_the_report_says_why():
    """It was NaN: the GPU check's report printed 'nan% of peak' and a 'nan' column."""
    from perf.kernel_bench import percent_of_peak
    from scripts.gpu_check import Stage, summarize
    assert percent_of_peak(2.4, 4.8) == 50.0 and percent_of_peak(2.4, None) is None
    rows = [{"case": "decode b1", "pct_of_peak": percent_of_peak(2.4, None)}]
    stage = Stage("bench-kernels", "Kernels", 60, details={"results": rows, "device": "NVIDIA L4"})
    assert summarize(stage) == "1 cases on NVIDIA L4; median decode bandwidth (the GPU's peak is unknown)"


def test_a_ratio_is_the_median_of_the_rounds_ratios():
    """Each round's runs share that round's host speed: 2 and 1.5 and 4, not 15 / 5."""
    from perf.bench_stats import median_ratio
    assert median_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 2.5]) == 2.0


def test_a_round_whose_requests_all_failed_is_left_out_of_the_medians():
    """Its figures are NaN, which statistics.median sorts anywhere: the result hung on the order."""
    from perf.bench_stats import median_of_rounds, median_ratio
    nan = float("nan")
    assert median_of_rounds([40.0, nan, 20.0]) == median_of_rounds([nan, 40.0, 20.0]) == 30.0
    assert median_ratio([40.0, nan, 20.0], [20.0, 10.0, 10.0]) == 2.0
    assert math.isnan(median_of_rounds([nan, nan]))

"""The load generator: drive a workload through an OpenAI-compatible endpoint and measure what users feel.

    result = await run_bench("http://127.0.0.1:8000", make_workload("mixed"), BenchSettings(concurrency=16))
    print_results([result])
"""

from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.report import print_results, render_table
from warmroute.bench.stats import BenchResult, RequestRecord

__all__ = ["BenchResult", "BenchSettings", "RequestRecord", "print_results", "render_table", "run_bench"]

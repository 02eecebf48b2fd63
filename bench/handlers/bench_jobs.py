"""Tangguh's handler for the benchmark: the shared job body (bench/work.py)."""
import supervisor
from bench import work


@supervisor.job("bench")
def bench(ctx, payload):
    work.run(**payload)

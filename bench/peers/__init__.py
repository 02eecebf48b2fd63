"""The peer frameworks' apps for the benchmark, each running bench/work.py.

Brokers: Redis ``BENCH_PEER_REDIS`` (default db 13) and PostgreSQL
``BENCH_PG_URL`` in schema ``BENCH_PG_SCHEMA``.
"""
import os

PEER_REDIS = os.environ.get("BENCH_PEER_REDIS", "redis://127.0.0.1:6379/13")
PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_SCHEMA = os.environ.get("BENCH_PG_SCHEMA", "bench_procrastinate")

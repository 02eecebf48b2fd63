"""Where a PostgreSQL claim and ack spend the server's CPU: the row versions and each index.

    python -m bench.pg_update [--jobs 8000] [--rounds 3]

A claim and an ack each write a new version of the job's row (its state changes,
and ``state`` is in indexes, so neither update is HOT), and every index of the
table takes an entry for each version, whether or not its columns changed. Each
round, in a fresh schema made by the broker's own ``migrate``: ``--jobs`` no-op
jobs enqueued, then claimed 16 at a time and acked 16 at a time through the
broker, with every index, then without the named ones. Prints the median over
the rounds of the server backend's CPU (``/proc`` of the connection's
``pg_backend_pid``) per job for the claims and for the acks, and the client's
wall time per job. A search index dropped here is a filter of ``tangguh jobs``
and the console that would scan instead: the table says what each one costs.
"""
import argparse
import os
import statistics
import time
import uuid

import psutil
import psycopg

from supervisor.backends import open_broker
from supervisor.model import NewJob

URL = os.environ.get("TANGGUH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
SEARCH = ("jobs_search_queued", "jobs_search_state", "jobs_search_queue", "jobs_search_type",
          "jobs_search_resource", "jobs_search_idempotency", "jobs_search_finished")
CASES = (("every index", ()), ("without the payload's GIN index", ("jobs_search_payload",)),
         ("without the 7 search B-trees", SEARCH), ("without every search index", SEARCH + ("jobs_search_payload",)),
         ("without search and jobs_stats", SEARCH + ("jobs_search_payload", "jobs_stats")))
INFO = {"host": "bench", "pid": 1, "slot": 0, "duration": 0.001}


def _cpu(process):
    t = process.cpu_times()
    return t.user + t.system


def one(dropped, jobs):
    """(claim server CPU, ack server CPU, wall) µs per job with the ``dropped`` indexes gone."""
    schema = "bench_" + uuid.uuid4().hex[:8]
    broker = open_broker(f"{URL}{'&' if '?' in URL else '?'}schema={schema}")
    try:
        broker.migrate()
        with psycopg.connect(URL, autocommit=True) as db:
            for name in dropped:
                db.execute(f"DROP INDEX {schema}.{name}")
        for start in range(0, jobs, 500):
            broker.enqueue_many([NewJob("bench", {"kind": "noop", "key": f"k{i}"}) for i in range(start, start + 500)])
        backend = psutil.Process(broker._execute("SELECT pg_backend_pid()").fetchone()[0])
        claim = ack = 0.0
        done, began = 0, time.perf_counter()
        while done < jobs:
            before = _cpu(backend)
            leased = broker.claim(["default"], 16, 60, "bench")
            middle = _cpu(backend)
            if not leased:
                break
            broker.ack_many([(job.lease, None, INFO) for job in leased])
            claim, ack = claim + middle - before, ack + _cpu(backend) - middle
            done += len(leased)
        wall = time.perf_counter() - began
        return claim / done * 1e6, ack / done * 1e6, wall / done * 1e6
    finally:
        broker.close()
        with psycopg.connect(URL, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    results = {label: [] for label, _ in CASES}
    for _ in range(args.rounds):
        for label, dropped in CASES:  # interleaved: a shared machine's load falls on every case alike
            results[label].append(one(dropped, args.jobs))
    print(f"PostgreSQL claim of 16 + ack_many of 16, {args.jobs:,} jobs, median of {args.rounds} rounds;"
          f" load {os.getloadavg()[0]:.1f}\n")
    print("| indexes | claim, server CPU µs a job | ack, server CPU µs a job | both | client wall µs a job |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, rows in results.items():
        claim, ack, wall = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"| {label} | {claim:.1f} | {ack:.1f} | {claim + ack:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()

"""Where a SQLite batch enqueue's time goes: the producer's checks, the broker's loop, the INSERT, each index.

    python -m bench.sqlite_insert [--batches 40] [--rounds 5]

Each round enqueues ``--batches`` batches of 500 no-op jobs in every case below,
each case into a fresh database file made by the broker's own ``migrate`` and
opened with its connection settings (WAL, ``synchronous=normal``), and prints the
median µs per job over the rounds:

- ``Client.enqueue_many``: the whole producer's path (a ``NewJob`` built and checked
  per job, ids, then the broker);
- ``broker.enqueue_many``: the broker's part alone, on jobs checked beforehand;
- ``INSERT``: the broker's one ``executemany`` statement alone, on rows built
  beforehand, with every index, then without the named ones.

The cases of a round run one after another, so a shared machine's load falls on
all of them alike; compare the rows of one run, not runs of different days.
"""
import argparse
import os
import statistics
import tempfile
import time

from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.model import NewJob, first_token_at

BATCH = 500
PAYLOAD = {"kind": "noop", "key": "bench"}
INSERT = ("INSERT INTO jobs (id, queue, type, payload, state, resource_id, idempotency_key, max_attempts, timeout,"
          " priority, run_at, queued_at, trace_id, expires_at, token)"
          " VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
SEARCH = ("jobs_search_queued", "jobs_search_state", "jobs_search_queue", "jobs_search_type")
# (label, indexes dropped before the INSERTs): each a read path the console, search or stats needs.
WITHOUT = (("every index", ()), ("without jobs_stats", ("jobs_stats",)),
           ("without the 4 search indexes", SEARCH), ("without search and stats", SEARCH + ("jobs_stats",)),
           ("primary key only", SEARCH + ("jobs_stats", "jobs_ready")))


def fresh(folder, name):
    url = f"sqlite:///{os.path.join(folder, name)}.db"
    broker = open_broker(url)
    broker.migrate()
    return url, broker


def rows_of(jobs, now):
    return [(j.id, j.queue, j.type, j.payload_json, j.resource_id, j.idempotency_key, j.max_attempts, j.timeout,
             j.priority, now + j.delay, now, j.trace_id, None, first_token_at(j, now)) for j in jobs]


def round_(folder, k, batches):
    """{case: µs per job} for one round."""
    out = {}
    url, broker = fresh(folder, f"client-{k}")
    client = Client(url)
    t = time.perf_counter()
    for _ in range(batches):
        client.enqueue_many([("bench", PAYLOAD)] * BATCH)
    out["Client.enqueue_many"] = (time.perf_counter() - t) / (batches * BATCH) * 1e6
    client.close()
    broker.close()

    _, broker = fresh(folder, f"broker-{k}")
    jobs = [[NewJob("bench", PAYLOAD).validate() for _ in range(BATCH)] for _ in range(batches)]
    t = time.perf_counter()
    for batch in jobs:
        broker.enqueue_many(batch)
    out["broker.enqueue_many"] = (time.perf_counter() - t) / (batches * BATCH) * 1e6
    broker.close()

    for label, dropped in WITHOUT:
        _, broker = fresh(folder, f"insert-{k}-{len(dropped)}")
        db = broker.db
        for name in dropped:
            db.execute(f"DROP INDEX {name}")
        now = time.time()
        rows = [rows_of([NewJob("bench", PAYLOAD).validate() for _ in range(BATCH)], now) for _ in range(batches)]
        t = time.perf_counter()
        for batch in rows:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(INSERT, batch)
            db.execute("COMMIT")
        out[f"INSERT, {label}"] = (time.perf_counter() - t) / (batches * BATCH) * 1e6
        broker.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40, help="batches of 500 per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="sqlite-insert-")
    rounds = [round_(folder, k, args.batches) for k in range(args.rounds)]
    print(f"SQLite batch enqueue, batches of {BATCH}, {args.batches} batches a case, median of {args.rounds} rounds;"
          f" load {os.getloadavg()[0]:.1f}")
    print()
    print("| case | µs per job | jobs/s |")
    print("| --- | ---: | ---: |")
    for case in rounds[0]:
        us = statistics.median(r[case] for r in rounds)
        print(f"| {case} | {us:.1f} | {1e6 / us:,.0f} |")


if __name__ == "__main__":
    main()

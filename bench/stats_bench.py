"""``stats(queues)`` on a large broker, and what the index behind it costs claim+ack (issue 16).

    python -m bench.stats_bench                                 # SQLite and PostgreSQL, 200,000 and 1,000,000
    python -m bench.stats_bench --backends sqlite --sizes 200000 --runs 10

For each backend and size, on a fresh store: N ready jobs in the ``default``
queue, plus 1,000 scheduled (due in an hour), 1,000 done and 1,000 dead in it,
and 1,000 dead in ``failing``. One job is enqueued through the broker and the
rest are copies of its row made by one ``INSERT ... SELECT`` (a million
``enqueue_many`` calls take minutes; the rows and indexes are the same).
PostgreSQL is then vacuumed and analyzed, as autovacuum would after a bulk
load; SQLite is not analyzed (the broker never runs ANALYZE).

Measured: ``stats(["default", "failing"])`` ``--runs`` times after one warm-up
call (p50 and max), the plan of each statement it runs, and claim+ack: claim
batches of 10 from ``default`` and ack each job, 2,000 jobs, with the store
full (the cost of keeping the stats index on the writes that move a job).
Prints a Markdown table; writes ``bench/results/stats-<label>.json``. Not a
test: nothing here asserts.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.broker_bench import STORES  # noqa: E402
from supervisor.backends import open_broker  # noqa: E402
from supervisor.model import NewJob  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUEUES = ["default", "failing"]
EXTRA = 1_000  # scheduled, done and dead jobs beside the ready ones
CLAIM_ACK_JOBS = 2_000


def groups(n):
    """(count, queue, state, run_at offset from now in s, finished) for each kind of row the store holds."""
    return [
        (n, "default", "queued", -2 * n * 1e-3 - 10, False),  # spread over the past: all due
        (EXTRA, "default", "queued", 3600, False),
        (EXTRA, "default", "done", -10, True),
        (EXTRA, "default", "dead", -10, True),
        (EXTRA, "failing", "dead", -10, True),
    ]


def fill(kind, broker, n):
    template = broker.enqueue(NewJob("export", {"customer_id": 1, "order": {"id": 1}, "to": "a@example.com"},
                                     resource_id="customer:1"))
    if kind == "sqlite":
        db, cols = broker.db, [r["name"] for r in broker.db.execute("PRAGMA table_info(jobs)")]
        table, mark, pad = "jobs", "?", "printf('%09d', x)"
    else:
        db, table, mark, pad = broker._conn(), broker._jobs, "%s", "lpad(x::text, 9, '0')"
        cols = [r[0] for r in db.execute("SELECT column_name FROM information_schema.columns"
                                         " WHERE table_schema = %s AND table_name = 'jobs' ORDER BY ordinal_position",
                                         (broker.schema,))]
    offset = 0
    for count, queue, state, run_in, finished in groups(n):
        values = {"id": f"'c' || {pad}", "queue": mark, "state": mark,
                  "run_at": f"t.run_at + {mark} + x * 1e-3", "queued_at": "t.queued_at + x * 1e-3",
                  "finished_at": "t.queued_at + x * 1e-3" if finished else "NULL"}
        select = ", ".join(values.get(c, f"t.{c}") for c in cols)
        if kind == "sqlite":
            rows = (f"WITH RECURSIVE s(x) AS (SELECT {offset + 1} UNION ALL SELECT x + 1 FROM s"
                    f" WHERE x < {offset + count}) SELECT {select} FROM jobs t, s WHERE t.id = {mark}")
        else:
            rows = f"SELECT {select} FROM {table} t, generate_series({offset + 1}, {offset + count}) x WHERE t.id = {mark}"
        params = (queue, state, run_in, template)
        if kind == "sqlite":
            with broker._write():
                db.execute(f"INSERT INTO jobs ({', '.join(cols)}) {rows}", params)
        else:
            db.execute(f"INSERT INTO {table} ({', '.join(cols)}) {rows}", params)
        offset += count
    if kind == "sqlite":
        with broker._write():
            db.execute("DELETE FROM jobs WHERE id = ?", (template,))
    else:
        db.execute(f"DELETE FROM {table} WHERE id = %s", (template,))
        db.execute(f"VACUUM ANALYZE {table}")


def plans(kind, broker):
    """The plan of each statement ``stats`` runs, one line per plan node that reads the jobs table."""
    seen = []
    if kind == "sqlite":
        db = broker.db
        real = db.execute

        class Spy:
            def __getattr__(self, name):
                return getattr(db, name)

            def execute(self, sql, params=()):
                if "FROM jobs" in sql:
                    seen.extend(r[3] for r in real("EXPLAIN QUERY PLAN " + sql, params))
                return real(sql, params)

        broker.db = Spy()
        try:
            broker.stats(QUEUES)
        finally:
            broker.db = db
        return seen
    real = broker._execute

    def spy(sql, params=None, **kw):
        if broker._jobs in sql:
            seen.extend(r[0].strip() for r in real("EXPLAIN " + sql, params).fetchall()
                        if broker._jobs in r[0] or "jobs" in r[0] and "Scan" in r[0])
        return real(sql, params, **kw)

    broker._execute = spy
    try:
        broker.stats(QUEUES)
    finally:
        del broker._execute
    return [line for line in seen if "Scan" in line]


def claim_ack(broker):
    started, done = time.perf_counter(), 0
    while done < CLAIM_ACK_JOBS:
        jobs = broker.claim(["default"], 10, 60, "bench")
        if not jobs:
            break
        for job in jobs:
            broker.ack(job.lease, None)
        done += len(jobs)
    return done / (time.perf_counter() - started)


def measure(kind, n, runs):
    with STORES[kind]() as url:
        broker = open_broker(url)
        try:
            broker.migrate()
            started = time.perf_counter()
            fill(kind, broker, n)
            loaded = time.perf_counter() - started
            first = broker.stats(QUEUES)["default"]
            assert first.ready == n and first.scheduled == EXTRA and first.done == EXTRA, first
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                broker.stats(QUEUES)
                times.append((time.perf_counter() - t) * 1000)
            return {"backend": kind, "jobs": n, "load_s": round(loaded, 1),
                    "stats_p50_ms": round(statistics.median(times), 1), "stats_max_ms": round(max(times), 1),
                    "claim_ack_per_s": round(claim_ack(broker)), "plans": plans(kind, broker)}
        finally:
            broker.close()


def markdown(rows):
    out = ["| backend | ready jobs | stats() p50 / max (ms) | claim+ack (jobs/s) |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['backend']} | {r['jobs']:,} | {r['stats_p50_ms']} / {r['stats_max_ms']}"
                   f" | {r['claim_ack_per_s']:,} |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--sizes", default="200000,1000000")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--label", default="current", help="names the results file: stats-<label>.json")
    args = parser.parse_args(argv)
    rows = []
    for kind in args.backends.split(","):
        why_not = STORES[kind]().available()
        if why_not:
            print(f"skipping {kind}: {why_not}", file=sys.stderr)
            continue
        for n in (int(s) for s in args.sizes.split(",")):
            row = measure(kind, n, args.runs)
            print(f"{kind} {n:,}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
    print(markdown(rows))
    result = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
              "label": args.label, "results": rows}
    with open(os.path.join(RESULTS, f"stats-{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

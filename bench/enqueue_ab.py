"""The producer's enqueue cost of two revisions, side by side, rounds interleaved (issue 17).

    python -m bench.enqueue_ab REV [--against REV2] [--cases redis-single,sqlite-batch] [--rounds 10]
                                   [--huey] [--json FILE]

``REV`` is checked out into a temporary git worktree; ``--against`` defaults
to the working tree. Each side runs in its own process importing its own
``supervisor`` package (like ``bench.claim_ab``), and the two alternate round
by round (ABBA), so the load of a shared machine falls on both alike. A round
of a case is what scenario 2 of ``python -m bench`` does: ``Client.enqueue``
of the bench's no-op payload 2,000 times (``single``), or ``enqueue_many`` of
500 jobs 20 times (``batch``). Each round reports the CPU time of the producer
process per job (``time.process_time``: what other load on the machine
disturbs least) and the wall-clock jobs/s.

Cases: ``{sqlite,redis,postgres}-{single,batch}``. ``--json`` writes every round's figures.
``--huey``: each round of ``redis-single`` also runs Huey's single enqueue (the bench's peer,
its own key in the same Redis database), A, B and Huey in an order turned each round, and the
table gains each side's rate over Huey's of the same round (the target: issue "Performance II").
``BENCH_REDIS`` names another Redis (a query in it is kept: ``rediss://…?ssl_cert_reqs=none``).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A query in BENCH_REDIS is kept (``rediss://host:port?ssl_cert_reqs=none`` for a TLS server).
_REDIS, _, _REDIS_QUERY = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379").partition("?")
REDIS = _REDIS + "/13" + (f"?{_REDIS_QUERY}" if _REDIS_QUERY else "")
POSTGRES = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
SINGLE, BATCHES, BATCH = 2000, 20, 500


def worker():
    """One side: answer each case name on stdin with ``cpu_us_per_job wall_jobs_per_s``."""
    from supervisor.backends import open_broker
    from supervisor.client import Client

    tag = uuid.uuid4().hex[:8]
    folder = tempfile.mkdtemp(prefix="enqueue-ab-")
    urls = {"sqlite": f"sqlite:///{folder}/ab.db", "redis": f"{REDIS}{'&' if _REDIS_QUERY else '?'}prefix=enqueue-ab-{tag}",
            "postgres": f"{POSTGRES}?schema=enqueue_ab_{tag}"}
    clients = {}
    payload = {"kind": "noop", "key": f"bench:{tag}"}  # what bench/run.py's scenario 2 enqueues
    try:
        for line in sys.stdin:
            backend, mode = line.split()
            if backend not in clients:
                with open_broker(urls[backend]) as broker:
                    broker.migrate()
                clients[backend] = Client.from_url(urls[backend])
                clients[backend].enqueue("bench", payload)  # connect, import
            client = clients[backend]
            cpu, wall = time.process_time(), time.perf_counter()
            if mode == "single":
                for _ in range(SINGLE):
                    client.enqueue("bench", payload)
                n = SINGLE
            else:
                for _ in range(BATCHES):
                    client.enqueue_many([("bench", payload)] * BATCH)
                n = BATCHES * BATCH
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"{cpu / n * 1e6:.3f} {n / wall:.1f}", flush=True)
    finally:
        for client in clients.values():
            client.close()
        if "redis" in clients:
            import redis

            r = redis.Redis.from_url(REDIS)
            for key in r.scan_iter(match=f"enqueue-ab-{tag}*", count=1000):
                r.delete(key)
        if "postgres" in clients:
            import psycopg

            with psycopg.connect(POSTGRES, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "enqueue_ab_{tag}" CASCADE')


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.enqueue_ab", description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the revision to compare (e.g. the commit before a change)")
    p.add_argument("--against", default=None, help="the other revision (default: the working tree)")
    p.add_argument("--cases", default="redis-single,sqlite-batch")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None, help="write every round's figures here")
    p.add_argument("--huey", action="store_true", help="run Huey's single enqueue in the redis-single rounds too")
    args = p.parse_args(argv)
    cases = [tuple(c.split("-")) for c in args.cases.split(",")]
    from bench.trees import checked_out  # not at the top: the worker imports the other side's bench

    results = {(label, case): [] for label in ("A", "B") for case in cases}
    huey_rounds = huey_enqueue() if args.huey else None
    sides = ("A", "B", "H") if args.huey else ("A", "B")
    with checked_out({"A": args.rev, "B": args.against}, "enqueue-ab") as trees:
        # The worker is this file; PYTHONPATH makes it import each side's own supervisor package.
        procs = {label: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=path,
                                         env=dict(os.environ, PYTHONPATH=path), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
                 for label, (path, _) in trees.items()}
        for r in range(args.rounds):
            for case in cases:
                turned = sides[r % len(sides):] + sides[:r % len(sides)]
                order = turned if r % 2 == 0 else turned[::-1]
                for label in order if case == ("redis", "single") else [s for s in order if s != "H"]:
                    if label == "H":
                        results.setdefault(("H", case), []).append(huey_rounds())
                        continue
                    procs[label].stdin.write(" ".join(case) + "\n")
                    procs[label].stdin.flush()
                    cpu, rate = procs[label].stdout.readline().split()
                    results[label, case].append((float(cpu), float(rate)))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    print("| case | A CPU µs/job | B CPU µs/job | B / A CPU (range) | A jobs/s | B jobs/s | B / A jobs/s (range) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in cases:
        a, b = results["A", case], results["B", case]
        cpu_a, cpu_b = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
        rate_a, rate_b = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
        cpu_r = [y[0] / x[0] for x, y in zip(a, b)]  # each round ran A and B back to back
        rate_r = [y[1] / x[1] for x, y in zip(a, b)]
        print(f"| {'-'.join(case)} | {cpu_a:.1f} | {cpu_b:.1f} | {cpu_b / cpu_a:.2f} ({min(cpu_r):.2f}–{max(cpu_r):.2f})"
              f" | {rate_a:,.0f} | {rate_b:,.0f} | {rate_b / rate_a:.2f} ({min(rate_r):.2f}–{max(rate_r):.2f}) |")
    if ("H", ("redis", "single")) in results:
        a, b, h = (results[label, ("redis", "single")] for label in ("A", "B", "H"))
        print("\n| redis-single | Huey jobs/s | A ÷ Huey (per round) | B ÷ Huey (per round) |\n| --- | ---: | --- | --- |")
        print(f"| medians | {statistics.median(h):,.0f} | {statistics.median(x[1] / y for x, y in zip(a, h)):.2f}"
              f" ({' '.join(f'{x[1] / y:.2f}' for x, y in zip(a, h))}) | {statistics.median(x[1] / y for x, y in zip(b, h)):.2f}"
              f" ({' '.join(f'{x[1] / y:.2f}' for x, y in zip(b, h))}) |")
    print(f"\nA = {trees['A'][1]}, B = {trees['B'][1]}; {args.rounds} rounds, medians")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"A": trees["A"][1], "B": trees["B"][1], "rounds": args.rounds, "loadavg": os.getloadavg(),
                       "single_calls": SINGLE, "batches": f"{BATCHES} x {BATCH}",
                       "cases": {"-".join(case): {label: [{"cpu_us_per_job": c, "jobs_per_s": r}
                                                          for c, r in results[label, case]] for label in ("A", "B")}
                                 for case in cases},
                       "huey_redis_single_jobs_per_s": results.get(("H", ("redis", "single")))}, f, indent=1)


def huey_enqueue():
    """A round of Huey's single enqueue as scenario 2 runs it (its defaults, results off): jobs/s."""
    import redis
    from huey import RedisHuey

    name = f"enqueue-ab-{uuid.uuid4().hex[:8]}"
    huey = RedisHuey(name, url=REDIS, results=False)
    task = huey.task()(_noop)
    payload = {"kind": "noop", "key": f"bench:{name}"}
    task(payload)  # connect

    def one_round():
        wall = time.perf_counter()
        for _ in range(SINGLE):
            task(payload)
        rate = SINGLE / (time.perf_counter() - wall)
        redis.Redis.from_url(REDIS).delete(huey.storage.queue_key)  # its queue, a list
        return rate
    return one_round


def _noop(kwargs):
    pass


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--worker":
        worker()
    else:
        main()

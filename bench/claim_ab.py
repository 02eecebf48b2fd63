"""Claim+ack throughput of two revisions, side by side, rounds interleaved.

    python -m bench.claim_ab REV [--against REV2] [--backend sqlite|redis|postgres] [--rounds 20] [--batch N]

``REV`` is checked out into a temporary git worktree; ``--against`` defaults
to the working tree. Each side runs in its own process importing its own
``supervisor`` package, and the two alternate round by round (ABBA), so the
load of a shared machine falls on both alike. A round enqueues 1,000 jobs with
no scheduling controls, then claims them 10 at a time and acks each one; with
``--batch N``, claims N at a time and acks them with one ``ack_many``, each with
the outcome info the daemon stores (host, pid, slot, duration: the master's way). Each side reports its
jobs/s and its own CPU per job (``time.process_time``: the client's share, which
the server's and other processes' load disturb least). On Redis each side also reports the
server's time a job in the scripts (``INFO commandstats``' ``EVALSHA`` time over the round: the
claims' and acks' Lua, which the client's CPU does not see); nothing else may use that server
meanwhile.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0")
POSTGRES = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def worker(backend, batch=0):
    """One side: answer each line on stdin with one round's jobs/s and CPU µs per job."""
    from supervisor.backends import open_broker
    from supervisor.model import NewJob

    tag = uuid.uuid4().hex[:8]
    folder = tempfile.mkdtemp(prefix="claim-ab-")
    url = {"sqlite": f"sqlite:///{folder}/ab.db", "redis": f"{REDIS}?prefix=claim-ab-{tag}",
           "postgres": f"{POSTGRES}?schema=claim_ab_{tag}"}[backend]
    broker = open_broker(url)
    broker.migrate()
    server = None
    if backend == "redis":
        import redis

        server = redis.Redis.from_url(REDIS)

    def script_usec():
        return server.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0) if server else 0

    try:
        for _ in sys.stdin:
            broker.enqueue_many([NewJob("bench", {"n": i}, queue="bench") for i in range(1000)])
            scripts = script_usec()
            started, cpu, n = time.perf_counter(), time.process_time(), 0
            while jobs := broker.claim(["bench"], batch or 10, 30, "ab"):
                if batch:
                    broker.ack_many([(job.lease, None, {"host": "ab", "pid": 1, "slot": 0, "duration": 0.0012})
                                     for job in jobs])
                    n += len(jobs)
                    continue
                for job in jobs:
                    broker.ack(job.lease)
                    n += 1
            rate, cpu = n / (time.perf_counter() - started), (time.process_time() - cpu) / n * 1e6
            print(rate, cpu, (script_usec() - scripts) / n, flush=True)
    finally:
        broker.close()
        if backend == "redis":
            import redis

            client = redis.Redis.from_url(REDIS)
            for key in client.scan_iter(match=f"claim-ab-{tag}*", count=1000):
                client.delete(key)
        elif backend == "postgres":
            import psycopg

            with psycopg.connect(POSTGRES, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "claim_ab_{tag}" CASCADE')


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.claim_ab", description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the revision to compare (e.g. the commit before a change)")
    p.add_argument("--against", default=None, help="the other revision (default: the working tree)")
    p.add_argument("--backend", choices=("sqlite", "redis", "postgres"), default="sqlite")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=0, help="claim this many at a time, acked by one ack_many")
    args = p.parse_args(argv)
    from bench.trees import checked_out  # not at the top: the worker imports the other side's bench

    with checked_out({"A": args.rev, "B": args.against}, "claim-ab") as trees:
        # The worker is this file; PYTHONPATH makes it import each side's own supervisor package.
        procs = {label: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", args.backend,
                                          str(args.batch)],
                                         cwd=path, env=dict(os.environ, PYTHONPATH=path), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
                 for label, (path, _) in trees.items()}
        results, cpus, servers = {"A": [], "B": []}, {"A": [], "B": []}, {"A": [], "B": []}
        for r in range(args.rounds):
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                procs[label].stdin.write("go\n")
                procs[label].stdin.flush()
                rate, cpu, server = procs[label].stdout.readline().split()
                results[label].append(float(rate))
                cpus[label].append(float(cpu))
                servers[label].append(float(server))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    redis_side = args.backend == "redis"
    print(f"| {args.backend} | revision | median claim+ack/s | best | client CPU µs/job |"
          + (" server scripts µs/job |" if redis_side else "") + " rounds |")
    print("| --- | --- | ---: | ---: | ---: |" + (" ---: |" if redis_side else "") + " ---: |")
    for label, (_, rev) in trees.items():
        xs = results[label]
        print(f"| {label} | {rev} | {statistics.median(xs):,.0f} | {max(xs):,.0f} | "
              f"{statistics.median(cpus[label]):.1f} |"
              + (f" {statistics.median(servers[label]):.1f} |" if redis_side else "") + f" {len(xs)} |")
    for what, figures in (("jobs/s", results), ("client CPU", cpus)) + ((("server scripts", servers),)
                                                                         if redis_side else ()):
        a, b = statistics.median(figures["A"]), statistics.median(figures["B"])
        ratios = [y / x for x, y in zip(figures["A"], figures["B"])]  # each round ran A and B back to back
        print(f"\n{what} B / A (medians): {b / a:.2f}; per round: {min(ratios):.2f} – {max(ratios):.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()

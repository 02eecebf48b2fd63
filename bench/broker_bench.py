"""Broker throughput: enqueue, enqueue_many and claim+ack, per backend.

    python -m bench.broker_bench                # every available backend
    python -m bench.broker_bench --backends sqlite --sizes 1000
    python -m bench.broker_bench --backends redis-replica,redis-wait1 --sizes 1000 --out bench/results/broker-wait.json

For each backend (SQLite always; Redis and PostgreSQL when their broker module
imports and the server at ``TANGGUH_TEST_REDIS_URL`` / ``TANGGUH_TEST_POSTGRES_URL``
answers) and each queue depth (1,000 and 100,000 jobs), on a fresh store:

1. ``enqueue_many``: fill the ``bench`` queue with that many jobs, batches of 500;
2. ``enqueue``: 1,000 single calls onto a second queue, with the store full;
3. ``claim+ack``: claim batches of 10 from ``bench`` and ack each job, for the
   first 2,000 jobs (all of them at 1,000) — so a deep queue stays quick to run.

Redis runs under a throwaway key prefix and PostgreSQL in a throwaway schema,
both removed afterwards. ``redis-replica`` and ``redis-wait1`` start a private
Redis primary with one replica; ``redis-wait1`` sets ``wait_replicas=1`` (the
cost of ``broker.redis_wait_replicas``, see docs/brokers.md). Prints a
Markdown table; writes ``bench/results/broker.json``.
Each measured loop also stops at a time budget, so the whole run stays bounded.
"""
import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid

if __package__ in (None, ""):  # run as a script: python bench/broker_bench.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from supervisor.backends import open_broker  # noqa: E402
from supervisor.model import NewJob  # noqa: E402

REDIS_URL = os.environ.get("TANGGUH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TANGGUH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "broker.json")

BATCH = 500  # enqueue_many batch size
CLAIM_BATCH = 10
SINGLE_ENQUEUES = 1_000
CLAIM_ACK_JOBS = 2_000  # claim+ack measured on at most this many jobs
BUDGET = 20.0  # seconds any one measured loop may take before it stops and reports what it did


def job(i, queue="bench"):
    return NewJob("bench", {"n": i, "to": "user@example.com"}, queue=queue)


def rate(count, seconds):
    return count / seconds if seconds > 0 else float("inf")


# -- backends: each yields a fresh broker URL and cleans up after it ------------

def _with_query(url, **params):
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in params.items())


class SQLiteStore:
    name = "sqlite"

    def available(self):
        return None

    def __enter__(self):
        self.folder = tempfile.mkdtemp(prefix="tangguh-bench-")
        return f"sqlite:///{self.folder}/bench.db"

    def __exit__(self, *exc):
        shutil.rmtree(self.folder, ignore_errors=True)


class RedisStore:
    name = "redis"

    def available(self):
        try:
            importlib.import_module("supervisor.backends.redis")
            import redis

            redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
        except Exception as exc:  # noqa: BLE001 - any failure means "skip this backend"
            return f"{type(exc).__name__}: {exc}"
        return None

    def __enter__(self):
        self.prefix = f"tangguh-bench-{uuid.uuid4().hex[:10]}"
        return _with_query(REDIS_URL, prefix=self.prefix)

    def __exit__(self, *exc):
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{self.prefix}*", count=1000):
            client.delete(key)
        client.close()


class PostgresStore:
    name = "postgres"

    def available(self):
        try:
            importlib.import_module("supervisor.backends.postgres")
            import psycopg

            psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    def __enter__(self):
        self.schema = f"tangguh_bench_{uuid.uuid4().hex[:10]}"
        return _with_query(POSTGRES_URL, schema=self.schema)

    def __exit__(self, *exc):
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


class ReplicatedRedisStore:
    """A private Redis primary with one replica on this machine (free loopback ports).

    ``redis-replica`` measures the broker on it as is; ``redis-wait1`` with
    ``wait_replicas=1``: every enqueue and outcome write waits for the replica's
    confirmation (WAIT), which is the cost of not losing them in a failover.
    """

    def __init__(self, wait):
        self.wait = wait
        self.name = "redis-wait1" if wait else "redis-replica"

    def available(self):
        return None if shutil.which("redis-server") else "redis-server is not installed"

    def _server(self, *extra):
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", self.folder, "--dbfilename", f"{port}.rdb",
                                 "--repl-diskless-sync-delay", "0", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return port

    def __enter__(self):
        import redis

        self.folder, self.procs = tempfile.mkdtemp(prefix="tangguh-bench-"), []
        primary = self._server()
        replica = self._server("--replicaof", "127.0.0.1", str(primary))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the replica is in sync
            try:
                if redis.Redis(port=replica).info("replication").get("master_link_status") == "up":
                    break
            except redis.RedisError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("the bench's replica never synced")
        url = f"redis://127.0.0.1:{primary}/0?prefix=bench"
        return _with_query(url, wait_replicas=1) if self.wait else url

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


STORES = {"sqlite": SQLiteStore, "redis": RedisStore, "postgres": PostgresStore,
          "redis-replica": lambda: ReplicatedRedisStore(False), "redis-wait1": lambda: ReplicatedRedisStore(True)}


# -- measurements ---------------------------------------------------------------

def measure(store, queued):
    with store as url:
        broker = open_broker(url)
        try:
            broker.migrate()
            return _measure(broker, queued)
        finally:
            broker.close()


def _measure(broker, queued):
    # 1. enqueue_many: fill the queue.
    started, done = time.perf_counter(), 0
    while done < queued and time.perf_counter() - started < BUDGET * 3:
        n = min(BATCH, queued - done)
        broker.enqueue_many([job(done + i) for i in range(n)])
        done += n
    many_rate = rate(done, time.perf_counter() - started)
    depth = done

    # 2. single enqueues, onto another queue so "bench" keeps exactly `depth` jobs.
    started, singles = time.perf_counter(), 0
    while singles < SINGLE_ENQUEUES and time.perf_counter() - started < BUDGET:
        broker.enqueue(job(singles, queue="bench-single"))
        singles += 1
    single_rate = rate(singles, time.perf_counter() - started)

    # 3. claim in batches of 10, ack each.
    target = min(depth, CLAIM_ACK_JOBS)
    started, acked = time.perf_counter(), 0
    while acked < target and time.perf_counter() - started < BUDGET:
        jobs = broker.claim(["bench"], min(CLAIM_BATCH, target - acked), 30.0, "bench")
        if not jobs:
            break
        for j in jobs:
            broker.ack(j.lease, info={"duration": 0.0})
        acked += len(jobs)
    claim_rate = rate(acked, time.perf_counter() - started)
    return {"queued": depth, "enqueue_per_s": round(single_rate, 1), "enqueue_jobs": singles,
            "enqueue_many_per_s": round(many_rate, 1), "enqueue_many_jobs": depth,
            "claim_ack_per_s": round(claim_rate, 1), "claim_ack_jobs": acked}


def markdown(rows):
    lines = ["| backend | queued | enqueue/s | enqueue_many/s | claim+ack/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['queued']:,} | {r['enqueue_per_s']:,.0f} | {r['enqueue_many_per_s']:,.0f}"
                     f" | {r['claim_ack_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="broker_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sqlite,redis,postgres", help="comma-separated (default: all)")
    parser.add_argument("--sizes", default="1000,100000", help="queue depths (default 1000,100000)")
    parser.add_argument("--out", default=RESULTS, help=f"JSON results (default {RESULTS})")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows, skipped = [], {}
    began = time.perf_counter()
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if name not in STORES:
            parser.error(f"unknown backend {name!r} (expected {', '.join(STORES)})")
        why_not = STORES[name]().available()
        if why_not:
            skipped[name] = why_not
            print(f"skipping {name}: {why_not}", file=sys.stderr)
            continue
        for queued in sizes:
            row = dict(backend=name, **measure(STORES[name](), queued))
            print(f"{name} {queued:,}: {row}", file=sys.stderr)
            rows.append(row)
    table = markdown(rows)
    print(table)
    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "method": {"enqueue_many_batch": BATCH, "claim_batch": CLAIM_BATCH, "single_enqueues": SINGLE_ENQUEUES,
                   "claim_ack_jobs": CLAIM_ACK_JOBS, "budget_seconds_per_loop": BUDGET},
        "seconds": round(time.perf_counter() - began, 1),
        "results": rows,
        "skipped": skipped,
        "table": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

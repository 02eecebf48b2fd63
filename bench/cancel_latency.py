"""How long a running CPU-bound job takes to stop once it is cancelled.

    python -m bench.cancel_latency [--broker sqlite,redis,postgres] [--rounds 5] [--heartbeat 1.0]
                                   [--grace 3.0] [--json FILE]

A real ``tangguh run`` (one worker; tests/daemon.py) runs each handler of
tests/handlers/control.py, a pure-Python loop: ``cancel_cooperative`` (asks
``ctx.cancelled()`` inside ``critical()``), ``cancel_ignored`` (never asks:
``Cancelled`` is raised into it) and ``cancel_stuck`` (inside ``critical()``
for longer than ``cancel_grace``: killed). Each round cancels the job once it
has started and reads the latency from the broker's own record: the cancel
request's ``at`` to the ``ended_at`` of the attempt the supervisor closed
``cancelled`` (both the broker's clock; the poll that waits for the end does
not enter the figure). The targets (issue 15): ``heartbeat_seconds + 1 s`` for
the first two, ``cancel_grace + 1 s`` for the stuck one.

Redis and PostgreSQL are the local servers of the test suite
(``TANGGUH_TEST_REDIS_URL``, ``TANGGUH_TEST_POSTGRES_URL``), under a fresh key
prefix or schema, removed afterwards.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import uuid

from tests.daemon import Daemon
from tests.util import wait_for

HANDLERS = ("cancel_cooperative", "cancel_ignored", "cancel_stuck")
REDIS_URL = os.environ.get("TANGGUH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TANGGUH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def broker_url(broker, folder):
    tag = uuid.uuid4().hex[:10]
    if broker == "sqlite":
        return f"sqlite:///{folder}/broker.db", lambda: None
    if broker == "redis":
        import redis

        prefix = f"tangguh-bench-{tag}"

        def drop():
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)
            client.close()
        return f"{REDIS_URL}?prefix={prefix}", drop
    import psycopg

    schema = f"tangguh_bench_{tag}"

    def drop():
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return f"{POSTGRES_URL}?schema={schema}", drop


def measure(broker, rounds, heartbeat, grace):
    folder = tempfile.mkdtemp(prefix=f"tangguh-cancel-{broker}-")
    url, drop = broker_url(broker, folder)
    d = Daemon(folder, broker_url=url, handler_files=("control.py",), supervisor={"workers": 1, "cancel_grace": grace},
               broker={"lease_seconds": max(10.0, heartbeat * 3), "heartbeat_seconds": heartbeat},
               log={"level": "warning"})
    out = {}
    try:
        d.start()
        for handler in HANDLERS:
            figures = []
            for i in range(rounds):
                marker = os.path.join(folder, f"{handler}-{i}")
                job_id = d.enqueue(handler, {"marker": marker})
                wait_for(lambda: os.path.exists(marker), timeout=30, message=f"{handler} to start")
                d.broker.cancel([job_id], by="bench", reason="latency")
                job = d.wait_job(job_id, states=("cancelled", "done", "dead"), timeout=grace + 30)
                if job.state != "cancelled":
                    raise RuntimeError(f"{handler}: ended {job.state}, not cancelled")
                figures.append(job.history[-1]["ended_at"] - job.cancel_request["at"])
                wait_for(lambda: d.status()["workers"][0]["state"] == "idle", timeout=30, message="worker idle")
            out[handler] = {"median": statistics.median(figures), "max": max(figures), "rounds": figures}
    finally:
        d.stop()
        drop()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.cancel_latency", description=__doc__.splitlines()[0])
    p.add_argument("--broker", default="sqlite,redis,postgres")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--heartbeat", type=float, default=1.0, help="broker.heartbeat_seconds")
    p.add_argument("--grace", type=float, default=3.0, help="supervisor.cancel_grace")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    results = {}
    print(f"cancel latency, heartbeat_seconds {a.heartbeat:g}, cancel_grace {a.grace:g}, {a.rounds} rounds\n")
    print("| broker | handler | median s | max s | target s |")
    print("| --- | --- | --- | --- | --- |")
    for broker in a.broker.split(","):
        results[broker] = measure(broker, a.rounds, a.heartbeat, a.grace)
        for handler, r in results[broker].items():
            target = (a.grace if handler == "cancel_stuck" else a.heartbeat) + 1
            print(f"| {broker} | {handler} | {r['median']:.2f} | {r['max']:.2f} | {target:g} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

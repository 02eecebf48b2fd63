"""The cost of cancelling a fan-in on PostgreSQL: a batch of N members feeding one callback.

    python -m bench.fanin_cancel [--members 1000,2000,5000] [--how batch,members]

The batch has both callbacks (``on_success``, ``on_complete``). ``batch``: ``cancel_batch``
(the callbacks first, then the members); ``members``: one ``cancel`` of the members alone
(the ``on_complete`` waiting: each member's end settles it, the last releases it).
Prints the seconds of the cancel and how many times the callbacks' rows were updated
(``pg_stat_user_tables.n_tup_upd`` of the jobs table, minus the cancels' own updates).
Needs PostgreSQL at ``postgresql://postgres@127.0.0.1:5432/test`` (``BENCH_PG_URL``);
each run uses a throwaway schema, dropped afterwards.
"""
import argparse
import os
import time
import uuid

import psycopg

from supervisor.client import Client
from supervisor.workflows import cancel_batch

URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def updates(conn, schema):
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT n_tup_upd FROM pg_stat_user_tables WHERE schemaname = %s AND relname = 'jobs'",
                        (schema,)).fetchone()[0]


def one(n, how):
    schema = f"tangguh_bench_{uuid.uuid4().hex[:10]}"
    admin = psycopg.connect(URL, autocommit=True)
    try:
        with Client.from_url(f"{URL}?schema={schema}") as client:
            client.broker.migrate()
            batch = client.batch([("export", {"i": i}) for i in range(n)], on_success=("report", {}),
                                 on_complete=("cleanup", {}))
            members = [m for m in client.get(batch.id).parents]
            time.sleep(1)  # the statistics collector's flush
            before = updates(admin, schema)
            t0 = time.perf_counter()
            if how == "batch":
                cancel_batch(client, batch, by="bench")
            else:
                client.cancel(members, by="bench")
            took = time.perf_counter() - t0
            assert client.get(batch.on_success).state == "cancelled"
            cb = 2 if how == "batch" else 0  # the callbacks' own cancels
        deadline = time.monotonic() + 5
        while True:  # the stats of the committed transaction arrive within a second or so
            got = updates(admin, schema) - before
            if got >= n + cb or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return took, got - n - cb
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="1000,2000,5000")
    ap.add_argument("--how", default="batch,members")
    args = ap.parse_args()
    print("| how | members | seconds | callback row updates |")
    print("|---|---:|---:|---:|")
    for how in args.how.split(","):
        for n in map(int, args.members.split(",")):
            took, extra = one(n, how)
            print(f"| {how} | {n:,} | {took:.2f} | {extra} |", flush=True)


if __name__ == "__main__":
    main()

"""A Redis prune's time against the number of queue names ever used.

    python -m bench.prune_queues [--names 1000,5000,20000] [--rounds 3] [--url redis://127.0.0.1:6379/13]

``P:queues`` keeps the name of every queue producers use, and the master prunes
every 5 minutes inside its loop, so a prune's time is time the loop serves no
child and answers no socket. For each count of names, in a database emptied
first, each queue holding one queued job (a queue with nothing left leaves
``P:queues`` at its first prune), times:

- ``prune``: the broker's prune as it is (``CHUNK`` queues a round trip);
- ``a round trip a queue``: the same script called queue by queue, as prune did
  before the chunks.

Prints the median of the rounds (the two cases alternate within a round) and
the server's own microseconds a script call (``INFO commandstats``, both cases).
Then, once per count, the same names with nothing in their queues: the first
prune's time and how many names it leaves.
"""
import argparse
import statistics
import time

import redis

from supervisor.backends import open_broker
from supervisor.backends.redis import prune as redis_prune
from supervisor.model import NewJob


def one_by_one(broker, retention):
    age_us = int(retention * 1e6)
    for queue in sorted(broker.r.smembers(broker.keys.queues)):
        broker._run("prune", queue, [age_us, redis_prune.BATCH, min(age_us, broker.done_ttl * 1_000_000)])


CASES = {"prune": lambda broker, retention: broker.prune(retention, 5000), "a round trip a queue": one_by_one}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", default="1000,5000,20000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--url", default="redis://127.0.0.1:6379/13")
    args = ap.parse_args()
    raw = redis.Redis.from_url(args.url)
    rows, empty = [], []
    for count in [int(n) for n in args.names.split(",")]:
        raw.flushdb()
        broker = open_broker(args.url + "?prefix=bench-prune")
        broker.migrate()
        broker.enqueue_many([NewJob("bench", {}, queue=f"q{i}") for i in range(count)])
        times = {name: [] for name in CASES}
        raw.config_resetstat()
        for _ in range(args.rounds):
            for name, case in CASES.items():
                t = time.perf_counter()
                case(broker, 7 * 86400)
                times[name].append(time.perf_counter() - t)
        server = raw.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        for name in CASES:
            rows.append((count, name, statistics.median(times[name]), server))
        raw.flushdb()
        broker.migrate()
        pipe = raw.pipeline(transaction=False)
        for i in range(count):
            pipe.sadd("bench-prune:queues", f"q{i}")
        pipe.execute()
        t = time.perf_counter()
        broker.prune(7 * 86400, 5000)
        empty.append((count, time.perf_counter() - t, raw.scard("bench-prune:queues")))
        broker.close()
    raw.flushdb()
    print(f"Redis prune over queue names, one queued job in each queue, median of {args.rounds} rounds\n")
    print("| queue names | case | s a prune | µs a name | server µs a script call |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for count, name, seconds, server in rows:
        print(f"| {count:,} | {name} | {seconds:.3f} | {seconds / count * 1e6:.0f} | {server:.1f} |")
    print("\nThe same names, their queues empty: the first prune\n")
    print("| queue names | s a prune | names left |")
    print("| ---: | ---: | ---: |")
    for count, seconds, left in empty:
        print(f"| {count:,} | {seconds:.3f} | {left:,} |")


if __name__ == "__main__":
    main()

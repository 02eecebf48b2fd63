"""A process of cache readers for the stampede test: ``cache_readers.py REDIS_URL GO_FILE THREADS TOTAL``.

Each thread counts itself ready, waits for GO_FILE, then reads the cold key
``cold`` through ``Cache.get_or_build``. The builder counts its runs in Redis
and holds until all TOTAL readers (of every process) have entered, so every
one of them is concurrent with the build. Prints the values and counters as
JSON.
"""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from supervisor import toolkit  # noqa: E402
from supervisor.toolkit.cache import Cache  # noqa: E402


def main(url, go, threads, total):
    client, prefix = toolkit.open_redis(url)
    values, counters = [], []

    def build():
        client.incr(prefix + "test:builds")
        deadline = time.monotonic() + 20
        while int(client.get(prefix + "test:entered") or 0) < total and time.monotonic() < deadline:
            time.sleep(0.005)
        return "built once"

    def reader():
        metrics = {}
        cache = Cache(client, prefix, metrics, wait=30)
        client.incr(prefix + "test:ready")
        while not os.path.exists(go):
            time.sleep(0.005)
        client.incr(prefix + "test:entered")
        values.append(cache.get_or_build("cold", build, ttl=300))
        counters.append(metrics)

    pool = [threading.Thread(target=reader) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    merged = {}
    for m in counters:
        for k, v in m.items():
            merged[k] = merged.get(k, 0) + v
    print(json.dumps({"values": values, "metrics": merged}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

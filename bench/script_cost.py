"""The Redis server's time a job in the claim and ack scripts, and in variants of them.

    python -m bench.script_cost [--jobs 4000] [--batch 40] [--rounds 3]

Starts a private redis-server (``redis-server`` on the PATH, a free port, nothing
saved), so no other client's commands are counted. Each round, for the scripts as
they are and for each variant below: enqueues ``--jobs`` of the bench's jobs, claims
them ``--batch`` at a time, acks them ``--batch`` at a time, and reads ``INFO
commandstats`` (``EVALSHA``'s microseconds, the server's own clock) after each
phase. Prints the median of the rounds, a job. A variant leaves a part out (the
row's encoding, the lease's write, the history's text, the done index), so the
difference from "as is" is what that part costs; a variant's claim reply is not
decoded (its rows may be incomplete), so its claims count jobs by the leased set.
Each variant's text change must apply: a script edited past it fails here, loudly.
"""
import argparse
import socket
import statistics
import subprocess
import time

import redis

from supervisor.backends import open_broker
from supervisor.backends.redis import scripts
from supervisor.client import Client

LEASE = '"bench:1:script_cost"'
ROW = "out[#out + 1] = lease_row(key, v, until_text, owner, owner_json)"
VARIANTS = {
    "as is": {},
    "claim: the row not encoded": {"claim": [(ROW, "lease_row(key, v, until_text, owner, owner_json); out[#out + 1] = '0'")]},
    "claim: no lease written": {"claim": [(ROW, "out[#out + 1] = '0'")]},
    "claim: no row read": {"claim": [("local v = redis.call('HMGET', key, unpack(ROW_FIELDS))",
                                      "local v = {}; v[STATE_AT] = 'queued'"), (ROW, "out[#out + 1] = '0'")]},
    "ack: no history text": {"ack_many": [("'history', history)", "'history', '[]')")]},
    "ack: no done index": {"ack_many": [("redis.call('ZADD', DONE, NOW, id)", "")]},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answering(port, within=10):
    """A client of the private redis-server on ``port`` once it answers a PING."""
    r = redis.Redis(port=port)
    deadline = time.monotonic() + within
    while True:
        try:
            r.ping()
            return r
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def measure(r, url, jobs, batch, decoded):
    """(claim µs, ack µs) of the server's script time a job; ack None when the claims were not decoded."""
    r.flushall()
    with open_broker(url) as b:
        b.migrate()
    client, broker = Client.from_url(url), open_broker(url)
    try:
        for start in range(0, jobs, 1000):
            client.enqueue_many([("bench", {"kind": "noop", "key": "k"})] * min(1000, jobs - start))
        leased_set = broker.keys.for_scripts("default")[0][2]
        r.config_resetstat()
        leased = []
        while decoded:
            got = broker.claim(["default"], batch, 30, "bench:1:script_cost")
            if not got:
                break
            leased += got
        while not decoded and r.zcard(leased_set) < jobs:
            broker._run("claim", "default", [batch, 30_000_000, "bench:1:script_cost", LEASE])
        claim = r.info("commandstats")["cmdstat_evalsha"]["usec"]
        if r.zcard(leased_set) != jobs:
            raise RuntimeError(f"{r.zcard(leased_set)} of {jobs} jobs leased")
        if not decoded:
            return claim / jobs, None
        r.config_resetstat()
        info = {"host": "h", "pid": 1, "slot": 0, "duration": 0.001}
        for start in range(0, len(leased), batch):
            lost = broker.ack_many([(j.lease, None, info) for j in leased[start:start + batch]])
            if lost:
                raise RuntimeError(f"{len(lost)} acks refused")
        return claim / jobs, r.info("commandstats")["cmdstat_evalsha"]["usec"] / jobs
    finally:
        broker.close()
        client.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        r = answering(port)
        url = f"redis://127.0.0.1:{port}/0?prefix=script-cost"
        source = scripts.sources()  # the cached dict every broker registers from: changed in place per variant
        base = dict(source)
        results = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, changes in VARIANTS.items():
                source.clear()
                source.update(base)
                for script, edits in changes.items():
                    text = base[script]
                    for old, new in edits:
                        if old not in text:
                            raise SystemExit(f"variant {name!r}: {script}.lua no longer holds {old!r}")
                        text = text.replace(old, new)
                    source[script] = text
                results[name].append(measure(r, url, args.jobs, args.batch, decoded=not name.startswith("claim")))
        source.clear()
        source.update(base)
    finally:
        server.terminate()
        server.wait(10)
    print(f"server time a job in EVALSHA, median of {args.rounds} rounds of {args.jobs} jobs, "
          f"claims and acks of {args.batch}")
    print("| scripts | claim µs | ack µs |\n| --- | ---: | ---: |")
    for name, rounds in results.items():
        acks = [a for _, a in rounds if a is not None]
        ack = f"{statistics.median(acks):.1f}" if acks else ""
        print(f"| {name} | {statistics.median(c for c, _ in rounds):.1f} | {ack} |")


if __name__ == "__main__":
    main()

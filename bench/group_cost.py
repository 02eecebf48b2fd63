"""The longest single script call (Redis blocks every other client meanwhile) of each operation on one big group.

    python -m bench.group_cost [--members 100000]

Starts a private redis-server (``redis-server`` on the PATH, a free port, nothing
saved, ``slowlog-log-slower-than 0``) and runs, on one group of ``--members`` jobs
with one callback: the enqueue, claiming and acking every member (the last ack
releases the callback), reading the callback (``batch_status``), claiming it, pruning
the group; cancelling a second one (``cancel_batch``) and discarding it; replaying a
third one's dead members, purging them, requeueing its callback. For each, prints the
number of script calls and the longest command (the server's own clock, SLOWLOG): the
time Redis answered nobody else.
"""
import argparse
import time

from bench.script_cost import answering, free_port
from supervisor import workflows
from supervisor.backends import open_broker
from supervisor.client import Client


def longest(r):
    """(calls, longest µs, its command) of the scripts since the last call; resets the log."""
    log = r.slowlog_get(1_000_000)
    r.slowlog_reset()
    scripts = [e for e in log if e["command"].split(b" ", 1)[0].upper() in (b"EVALSHA", b"EVAL")]
    if not log:
        return 0, 0, ""
    top = max(log, key=lambda e: e["duration"])
    return len(scripts), top["duration"], top["command"].split(b" ", 1)[0].decode(errors="replace")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=100_000)
    args = ap.parse_args(argv)
    n = args.members
    port = free_port()
    import subprocess
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--slowlog-log-slower-than", "0",
                               "--slowlog-max-len", "1000000"], stdout=subprocess.DEVNULL)
    rows = []

    def phase(name, fn):
        longest(r)
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        calls, us, cmd = longest(r)
        rows.append((name, calls, us, cmd, wall))
        print(f"{name}: {calls} script calls, longest {us / 1000:.1f} ms ({cmd}), wall {wall:.1f} s", flush=True)

    try:
        r = answering(port)
        url = f"redis://127.0.0.1:{port}/0?prefix=group-cost&socket_timeout=120"
        with open_broker(url) as b:
            b.migrate()
        client, broker = Client.from_url(url), open_broker(url)
        members = [("bench", {"i": i}) for i in range(n)]
        flow = {}
        phase("enqueue group", lambda: flow.update(a=client.group(members, then=("bench", {}))))
        info = {"host": "h", "pid": 1, "slot": 0, "duration": 0.001}

        def run(ids, dead=False):
            left = len(ids)
            while left:
                got = broker.claim(["default"], min(1000, left), 600, "bench:1:g")
                left -= len(got)
                for j in got:
                    assert j.id in ids
                if dead:
                    for j in got:
                        broker.dead(j.lease, "failed", {"type": "E", "message": "x"}, info)
                else:
                    broker.ack_many([(j.lease, None, info) for j in got])

        a = flow["a"]
        phase("claim + ack every member (the last releases the callback)", lambda: run(set(a.ids)))
        phase("batch_status (get the callback)", lambda: workflows.batch_status(broker, a.then))
        phase("claim + ack the callback (its claim carries every parent's end)", lambda: run({a.then}))
        phase("prune the done group", lambda: [broker.prune(0) for _ in range(300)])
        batch = {}
        phase("enqueue batch", lambda: batch.update(b=client.batch(members, on_success=("bench", {}))))
        phase("cancel_batch", lambda: workflows.cancel_batch(client, batch["b"].id, by="bench"))
        phase("discard the cancelled callback", lambda: broker.discard([batch["b"].id]))
        phase("discard the cancelled members, 10,000 a call",
              lambda: [broker.discard(batch["b"].members[i:i + 10_000]) for i in range(0, n, 10_000)])
        phase("enqueue batch 3", lambda: batch.update(c=client.batch(members, on_success=("bench", {}))))
        c = batch["c"]
        phase("every member dead (the first cancels the callback)", lambda: run(set(c.members), dead=True))
        phase("dlq_replay every member, one call", lambda: broker.dlq_replay(c.members))
        phase("every member dead again", lambda: run(set(c.members), dead=True))
        phase("dlq_purge every member, one call", lambda: broker.dlq_purge(c.members))
        phase("requeue the cancelled callback", lambda: broker.requeue([c.on_success]))
        client.close()
        broker.close()
    finally:
        server.terminate()
        server.wait(10)
    print(f"\n{n} members")
    print("| operation | script calls logged | longest command ms | it was | wall s |\n| --- | ---: | ---: | --- | ---: |")
    for name, calls, us, cmd, wall in rows:
        print(f"| {name} | {calls} | {us / 1000:.1f} | {cmd} | {wall:.1f} |")


if __name__ == "__main__":
    main()

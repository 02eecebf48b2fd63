"""The cost of a fan-in: a 10,000-job group with one callback against 10,000 plain jobs, per broker.

    python -m bench.workflows_bench [--broker sqlite,redis,postgres] [--rounds 3] [--jobs 10000] [--json FILE]

Each run is scenario 1 of ``python -m bench`` (bench/run.py's harness, its
Tangguh daemon of 2 workers and its no-op job body) with one difference on the
group side: the jobs are enqueued as ``client.group(members, then=callback)``,
so every member's ack also settles the callback's dependency and the last one
releases it. Measured: the seconds from the first execution's start to the
last one's end (the callback's included on the group side), the master's CPU
per job (user + system, start-up included: on SQLite the release runs in the
acking master's process; less sensitive to other load than wall time), and
the enqueue time of the whole batch. Sides alternate round by round (ABBA) so the load of
a shared machine falls on both; compare the ratios, not the absolute figures.
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from bench import run
from bench.throughput_ab import Tangguh  # bench/run.py's, noting its master's CPU seconds at the stop

BROKERS = ("sqlite", "redis", "postgres")


def one_run(fw, ev, settings, group):
    """(seconds first start -> last end, enqueue seconds, master CPU µs per job) of one run."""
    fw.reset()
    key = ev.fresh()
    payload = {"kind": "noop", "key": key}
    n = settings.noop_jobs
    t0 = time.perf_counter()
    if group:
        fw.client.group([("bench", payload)] * n, then=("bench", payload))
    else:
        fw.client.enqueue_many([("bench", payload)] * n)
    enqueue_s = time.perf_counter() - t0
    expected = n + 1 if group else n
    fw.start()
    try:
        ev.wait_count(expected, settings.throughput_budget + 5.0)
    finally:
        fw.stop()
        fw.cleanup()
    recs = ev.records()
    if len(recs) < expected:
        raise SystemExit(f"{fw.name}: {len(recs)} of {expected} executions within the bound")
    return max(r[1] for r in recs) - min(r[0] for r in recs), enqueue_s, round(fw.master_cpu * 1e6 / len(recs))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.workflows_bench", description=__doc__.splitlines()[0])
    p.add_argument("--broker", default=",".join(BROKERS), help="comma-separated, of sqlite, redis, postgres")
    p.add_argument("--rounds", type=int, default=3, help="rounds per broker (each runs both sides)")
    p.add_argument("--jobs", type=int, default=10_000, help="members / plain jobs per run (default 10,000)")
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    brokers = [b.strip() for b in args.broker.split(",")]
    if any(b not in BROKERS for b in brokers) or args.rounds < 1 or args.jobs < 2:
        p.error("--broker: of sqlite, redis, postgres; --rounds >= 1; --jobs >= 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    settings = run.Settings(quick=False)
    settings.noop_jobs = args.jobs
    settings.throughput_budget = 600.0  # a bound for a stuck run only: a loaded machine is slow, not wrong
    ev = run.Evidence()
    ev.r.ping()
    tmp = tempfile.mkdtemp(prefix="workflows-bench-")
    rounds = []
    try:
        for broker in brokers:
            for r in range(args.rounds):
                figures = {"broker": broker, "round": r + 1, "loadavg": round(os.getloadavg()[0], 2)}
                for side in ("plain", "group") if r % 2 == 0 else ("group", "plain"):
                    seconds, enqueue_s, cpu = one_run(Tangguh(tmp, broker), ev, settings, side == "group")
                    figures[side], figures[f"{side}_enqueue"] = round(seconds, 3), round(enqueue_s, 3)
                    figures[f"{side}_cpu_us"] = cpu
                rounds.append(figures)
                print(f"  {broker} round {r + 1}: plain {figures['plain']:.2f} s, group {figures['group']:.2f} s,"
                      f" master {figures['plain_cpu_us']} / {figures['group_cpu_us']} µs/job"
                      f" (enqueue {figures['plain_enqueue']:.2f} / {figures['group_enqueue']:.2f} s; load {figures['loadavg']})",
                      file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"jobs": args.jobs, "machine": run.machine(), "rounds": rounds}, f, indent=2)
    finally:
        ev.clear()
    print(f"{args.rounds} rounds of {args.jobs:,} no-ops per broker (group: + 1 callback)\n")
    print("| broker | plain s (median) | group s (median) | group / plain | per round: min – max"
          " | master CPU µs/job plain / group | enqueue plain / group s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for broker in brokers:
        mine = [f for f in rounds if f["broker"] == broker]
        plain, group = statistics.median(f["plain"] for f in mine), statistics.median(f["group"] for f in mine)
        ratios = [f["group"] / f["plain"] for f in mine]
        enq = (statistics.median(f["plain_enqueue"] for f in mine), statistics.median(f["group_enqueue"] for f in mine))
        cpu = (statistics.median(f["plain_cpu_us"] for f in mine), statistics.median(f["group_cpu_us"] for f in mine))
        print(f"| {broker} | {plain:.2f} | {group:.2f} | {group / plain:.2f} | {min(ratios):.2f} – {max(ratios):.2f}"
              f" | {cpu[0]:.0f} / {cpu[1]:.0f} | {enq[0]:.2f} / {enq[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

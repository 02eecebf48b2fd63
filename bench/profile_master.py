"""Where the master's time goes per job: cProfile of a real daemon on a no-op run.

    python -m bench.profile_master [--broker sqlite|redis|postgres] [--jobs 5000] [--prefetch N] [--top 40]
                                   [--body noop|empty] [--save PATH]

Enqueues N no-op jobs (bench/work.py's body; with ``--body empty`` a job that
returns at once and leaves no evidence, so the rate is one supervisor's
ceiling: what its master and broker can do with nothing else to wait for),
starts a daemon of 2 workers with the config defaults (``lease_seconds = 5``,
``heartbeat_seconds = 1`` as in ``python -m bench``; ``--prefetch`` pins
``broker.prefetch``) whose master runs under cProfile, waits until every job
has run, stops it with SIGTERM and prints the master's CPU per job (over the
whole run, start-up included, and in the steady state between 10 % and 90 % of
the jobs done: what the 25 µs target of issue 17 is about) with the jobs a
second in that state and, over the same span, the CPU a job of the children and
of the broker's server processes (``redis-server``; every ``postgres`` process
of the machine, so another client's work shows there too), the Python calls a job (cProfile's count: steadier than
any time on a shared machine) and the functions with the most own time. The
children are forked from the profiled master but end with ``os._exit``, so
only the master's time is in the profile.
"""
import argparse
import collections
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import redis
import tomli_w

from bench import run

PROFILED = """
import cProfile, sys, time
from supervisor.cli import main
prof = cProfile.Profile(time.process_time)  # CPU, not wall: a wait on the broker costs the master nothing
prof.enable()
try:
    main(["run", "-c", sys.argv[1]])
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(sys.argv[2])
"""


def cpu_of(processes):
    """User + system CPU seconds of ``processes`` (one that ended meanwhile counts nothing)."""
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--broker", default="redis", choices=("sqlite", "redis", "postgres"))
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--prefetch", default=None, help="broker.prefetch (default: the config default)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--body", default="noop", choices=("noop", "empty"),
                    help="the job: bench/work.py's no-op (two Redis commands of evidence) or nothing at all")
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime, cumulative, ncalls")
    ap.add_argument("--no-profile", action="store_true", help="only the master's CPU per job, no cProfile")
    ap.add_argument("--events", action="store_true", help="log at debug and count the master's events per kind")
    ap.add_argument("--keep-log", metavar="PATH", help="copy the master's log there")
    ap.add_argument("--save", metavar="PATH", help="keep the profile there (for pstats' callers and callees)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fw = run.Tangguh(tmp, args.broker)
        fw.reset()
        key = f"prof-{uuid.uuid4().hex[:8]}"
        ev = redis.Redis.from_url(run.EVIDENCE_URL)
        fw.enqueue_many([{"kind": args.body, "key": key}] * args.jobs)
        cfg_path = os.path.join(tmp, "t.toml")
        broker = {"url": fw.url, "lease_seconds": 5, "heartbeat_seconds": 1.0}
        if args.prefetch is not None:
            broker["prefetch"] = args.prefetch if args.prefetch == "auto" else int(args.prefetch)
        with open(cfg_path, "wb") as f:
            tomli_w.dump({"supervisor": {"workers": 2, "handlers": os.path.join(run.ROOT, "bench", "handlers"),
                                         "socket": os.path.join(tmp, "t.sock")}, "broker": broker,
                          "log": {"level": "debug" if args.events else "info", "format": "json"}}, f)
        out = os.path.join(tmp, "master.prof")
        cmd = [sys.executable, "-c", PROFILED, cfg_path, out] if not args.no_profile else \
            [sys.executable, "-m", "supervisor.cli", "run", "-c", cfg_path]
        env = dict(os.environ, PYTHONPATH=run.ROOT)
        started = time.monotonic()
        log = open(os.path.join(tmp, "master.log"), "wb")  # a file, as a journal would take it
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
        deadline = started + 300
        master = psutil.Process(proc.pid)
        if args.body == "empty":  # no evidence: the broker's own count of jobs done, read less often
            poll = 0.2  # stats() is a count over the jobs: a PostgreSQL server feels it at 20 a second

            def count():
                return sum(q.done for q in fw.client.stats().values())
        else:
            poll = 0.01

            def count():
                return int(ev.get(f"{key}:n") or 0)
        # (jobs done, master CPU s, monotonic s, children's CPU s, server's CPU s) once past 10 %
        # and once past 90 % of the jobs
        marks = []
        server = {"redis": "redis-server", "postgres": "postgres"}.get(args.broker)
        while (done := count()) < args.jobs and time.monotonic() < deadline:
            if len(marks) < 2 and done >= args.jobs * (0.1, 0.9)[len(marks)]:
                t = master.cpu_times()
                marks.append((done, t.user + t.system, time.monotonic(), cpu_of(master.children()),
                              cpu_of(p for p in psutil.process_iter(["name"]) if p.info["name"] == server)))
            time.sleep(poll)
        wall = time.monotonic() - started
        cpu = master.cpu_times()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        done = count()
        ev.delete(f"{key}:n", f"{key}:t")
        fw.cleanup()
        print(f"{args.broker}: {done} jobs in {wall:.1f}s (start-up included); master CPU "
              f"{(cpu.user + cpu.system) / max(done, 1) * 1e6:.0f} µs/job "
              f"(user {cpu.user:.2f}s, system {cpu.system:.2f}s); load {os.getloadavg()[0]:.1f}")
        if len(marks) == 2 and marks[1][0] > marks[0][0]:
            # What the 25 µs target is about: the job path, without start-up and the last idle polls.
            print(f"  steady state (from {marks[0][0]} to {marks[1][0]} jobs done): master CPU "
                  f"{(marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0]) * 1e6:.0f} µs/job, "
                  f"{(marks[1][0] - marks[0][0]) / (marks[1][2] - marks[0][2]):,.0f} jobs/s")
            jobs = marks[1][0] - marks[0][0]
            # A child recycled or a server process ended in between would make its share read low.
            print(f"  the same span, CPU a job: children {(marks[1][3] - marks[0][3]) / jobs * 1e6:.0f} µs"
                  + (f", {server} {(marks[1][4] - marks[0][4]) / jobs * 1e6:.0f} µs" if server else "")
                  + f"; two CPUs give {2 / ((marks[1][0] - marks[0][0]) / (marks[1][2] - marks[0][2])) * 1e6:.0f}"
                    " µs a job at this rate")
        if args.keep_log:
            shutil.copyfile(os.path.join(tmp, "master.log"), args.keep_log)
        if args.events:
            counts = collections.Counter()
            with open(os.path.join(tmp, "master.log")) as f:
                for line in f:
                    if line.startswith("{"):
                        counts[json.loads(line).get("event")] += 1
            print("events:", dict(counts.most_common()))
        if not args.no_profile:
            stats = pstats.Stats(out)
            # Calls a job: what cProfile counts moves little with the machine's speed or load, unlike
            # its times (start-up's calls included; compare runs of the same number of jobs).
            print(f"  Python calls a job: {stats.total_calls / max(done, 1):.0f} ({stats.total_calls:,} in all)")
            stats.sort_stats(args.sort).print_stats(args.top)
            if args.save:
                stats.dump_stats(args.save)


if __name__ == "__main__":
    main()

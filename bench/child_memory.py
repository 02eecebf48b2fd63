"""What a forked child's first Redis call adds to its private memory, and what a parent can do first.

    python -m bench.child_memory [--url redis://127.0.0.1:6379/12] [--rounds 3]

The bench's job body (bench/work.py) opens a Redis connection in each child at
its first job. On the Redis broker the master has made a connection before it
forks; on SQLite it has not, and each child pays the first call alone. This
forks a child from a parent that has imported redis-py (as the master has,
through the handler module) after one of these preparations, and reads the
child's ``Private_Dirty`` (``/proc/self/smaps_rollup``) before and after its
first pipeline (the job body's ``INCR`` + ``RPUSH``):

* ``nothing``: the parent imported redis and did nothing else (the SQLite master);
* ``modules``: it also imported the standard modules the first call imports
  (``email.parser``: ``importlib.metadata`` reads redis-py's version for
  ``CLIENT SETINFO``; ``encodings.idna``, ``stringprep``, ``unicodedata``: the
  host name's encoding for ``getaddrinfo``);
* ``metadata``: and looked redis-py's version up (``importlib.metadata``'s scan);
* ``connected``: the parent made a connection and a call, then closed it (the Redis
  broker's master);
* ``daemon``: the parent imported what a SQLite master has (``supervisor.master``, the
  SQLite broker), nothing else;
* ``daemon, connected``: that, then a connection and a call.

Prints the median of the rounds in KiB; the difference between two rows is
what that preparation saves each child.
"""
import argparse
import importlib
import os
import subprocess
import statistics
import sys

from importlib import metadata

import redis

# name -> (import the master's modules, the lazy modules, the version lookup, a connection and a call)
STEPS = {"nothing": (False, False, False, False), "modules": (False, True, False, False),
         "metadata": (False, True, True, False), "connected": (False, False, False, True),
         "daemon": (True, False, False, False), "daemon, connected": (True, False, False, True)}
LAZY_MODULES = ("email.parser", "encodings.idna", "stringprep", "unicodedata")


def private_dirty():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise RuntimeError("no Private_Dirty in smaps_rollup")


def first_call(url):
    r = redis.Redis.from_url(url)
    p = r.pipeline(transaction=False)
    p.incr("bench:child_memory:n")
    p.rpush("bench:child_memory:t", "start end t0 pid")
    p.execute()
    r.delete("bench:child_memory:n", "bench:child_memory:t")
    r.close()


def child(url, preparation):
    """In a fresh interpreter: prepare as told, fork, and return the child's KiB for its first call."""
    daemon, modules, version, connect = STEPS[preparation]
    if daemon:
        importlib.import_module("supervisor.master")
        importlib.import_module("supervisor.backends.sqlite")
    if modules:
        for name in LAZY_MODULES:
            importlib.import_module(name)
    if version:
        metadata.version("redis")
    if connect:
        first_call(url)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        before = private_dirty()
        first_call(url)
        os.write(w, str(private_dirty() - before).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return int(f.read())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("BENCH_EVIDENCE_URL", "redis://127.0.0.1:6379/12"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", choices=list(STEPS), help=argparse.SUPPRESS)  # a round's own interpreter
    args = ap.parse_args(argv)
    if args.one:
        print(child(args.url, args.one))
        return
    results = {step: [] for step in STEPS}
    for _ in range(args.rounds):
        for step in STEPS:  # each in a new interpreter: what one preparation leaves behind stays there
            out = subprocess.run([sys.executable, "-m", "bench.child_memory", "--url", args.url, "--one", step],
                                 check=True, capture_output=True, text=True).stdout
            results[step].append(int(out))
    print(f"a child's first Redis pipeline: its Private_Dirty growth, KiB (median of {args.rounds})")
    print("| the parent before the fork | KiB | rounds |\n| --- | ---: | --- |")
    for step in STEPS:
        print(f"| {step} | {statistics.median(results[step]):.0f} | {', '.join(map(str, results[step]))} |")


if __name__ == "__main__":
    main()

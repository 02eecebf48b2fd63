"""Where the CPU of a no-op job goes, per process, beside Huey in the same run; and the floors.

    python -m bench.cpu_budget [--jobs 10000] [--rounds 3] [--json FILE]

Each round runs scenario 1 of ``python -m bench`` (N no-op jobs enqueued, then
the workers started, 2 worker processes, the same job body) for Huey, Tangguh on
Redis and Tangguh on SQLite, in turn, and reads the CPU (user + system) each
process used until the last job ran: the master (Huey: the consumer's main
process), the worker processes together, and redis-server. Divided by the jobs:
CPU µs per job, start-up included (the master's import and fork, ~0.7 s on a
slow machine, is ~70 µs per job of 10,000). On a 2-core machine the total is
what bounds the throughput: every process shares the same two cores.

Then the floors on this machine, measured the same way: a socketpair round trip
between two processes (one pipe message each way), a Redis PING through
redis-py and through a bare socket (redis-py's own CPU per call), and
redis-py's packing of a 46-argument script call.
"""
import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import psutil
import redis

from bench import run

NAMES = ("huey", "tangguh-redis", "tangguh-sqlite")


def _cpu(p):
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _redis_server():
    return next(p for p in psutil.process_iter(["name"]) if p.info["name"] == "redis-server")


def one_run(fw, ev, n):
    """{role: CPU µs per job} of one throughput run of ``fw``."""
    fw.reset()
    key = ev.fresh()
    if fw.batch is None:
        for i in range(0, n, 500):
            fw.enqueue_many([{"kind": "noop", "key": key}] * 500)
    else:
        for _ in range(n):
            fw.enqueue({"kind": "noop", "key": key})
    server = _redis_server()
    server_before = _cpu(server)
    fw.start()
    top = fw.procs[0].pid
    seen = {}
    deadline = time.monotonic() + 120
    try:
        while ev.count() < n and time.monotonic() < deadline:
            for p in fw.processes():  # children come and go: keep each one's last reading
                seen[p.pid] = p
            time.sleep(0.05)
        for p in fw.processes():
            seen[p.pid] = p
        cpu = {pid: _cpu(p) for pid, p in seen.items()}
        server_cpu = _cpu(server) - server_before
        done = ev.count()
    finally:
        fw.stop()
        fw.cleanup()
    master = cpu.pop(top, 0.0)
    out = {"master": master, "workers": sum(cpu.values()), "redis-server": server_cpu}
    out = {k: round(v / max(done, 1) * 1e6) for k, v in out.items()}
    out["total"] = sum(out.values())
    out["jobs"] = done
    return out


def floors():
    """The machine's floors, in µs: wall and CPU of the round trips a job's path is made of."""
    out = {}
    a, b = socket.socketpair()
    n = 10000
    pid = os.fork()
    if pid == 0:
        a.close()
        for _ in range(n):
            b.sendall(b.recv(64))
        os._exit(0)
    b.close()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        a.sendall(b"x" * 40)
        a.recv(64)
    out["socketpair round trip, wall"] = (time.perf_counter() - t) / n * 1e6
    out["socketpair round trip, one side's CPU"] = (time.process_time() - c) / n * 1e6
    os.waitpid(pid, 0)
    a.close()
    r = redis.Redis.from_url(run.EVIDENCE_URL)
    r.ping()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(3000):
        r.ping()
    out["redis-py PING, wall"] = (time.perf_counter() - t) / 3000 * 1e6
    out["redis-py PING, client CPU"] = (time.process_time() - c) / 3000 * 1e6
    host, port = r.connection_pool.connection_kwargs["host"], r.connection_pool.connection_kwargs["port"]
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(3000):
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        s.recv(64)
    out["bare-socket PING, wall"] = (time.perf_counter() - t) / 3000 * 1e6
    out["bare-socket PING, client CPU"] = (time.process_time() - c) / 3000 * 1e6
    s.close()
    args = ["EVALSHA", "a" * 40, 3, "k1", "k2", "k3"] + ["job_01M8RVF10ZSBAW7GSAGE3A1J1B", 17, '{"pid":1}', "null"] * 10
    conn = r.connection_pool.get_connection()
    c = time.process_time()
    for _ in range(3000):
        conn.pack_command(*args)
    out["redis-py packing a 46-argument call, CPU"] = (time.process_time() - c) / 3000 * 1e6
    r.connection_pool.release(conn)
    r.close()
    return {k: round(v, 1) for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    runs = {name: [] for name in NAMES}
    ev = run.Evidence()
    with tempfile.TemporaryDirectory() as tmp:
        make = {"huey": lambda: run.Huey(tmp), "tangguh-redis": lambda: run.Tangguh(tmp, "redis"),
                "tangguh-sqlite": lambda: run.Tangguh(tmp, "sqlite")}
        for i in range(args.rounds):
            for name in NAMES:
                result = one_run(make[name](), ev, args.jobs)
                runs[name].append(result)
                print(f"  round {i + 1} {name}: {result}  (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nCPU µs per no-op job, median of {args.rounds} rounds of {args.jobs:,} jobs, 2 workers each\n")
    print("| framework | master / main process | worker processes | redis-server | total |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in NAMES:
        med = {k: statistics.median(r[k] for r in runs[name]) for k in ("master", "workers", "redis-server", "total")}
        print(f"| {name} | {med['master']:,.0f} | {med['workers']:,.0f} | {med['redis-server']:,.0f} | "
              f"{med['total']:,.0f} |")
    floor = floors()
    print("\n| floor on this machine | µs |\n| --- | ---: |")
    for k, v in floor.items():
        print(f"| {k} | {v} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "floors": floor, "jobs": args.jobs, "machine": os.uname().release}, f, indent=1)


if __name__ == "__main__":
    main()

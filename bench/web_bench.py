"""The web console under load: page latency with many jobs, and its memory after live updates.

    python -m bench.web_bench                                   # every available backend, 1,000,000 jobs
    python -m bench.web_bench --backends sqlite --jobs 100000 --live-seconds 60

For each backend, on a fresh store: load ``--jobs`` queued jobs (batches of 500;
payloads ``{"customer_id": i % 10000, ...}``, four types) plus 1,000 dead
letters, start a real ``tangguh web`` process (open, on loopback), then ask for
each page ``--requests`` times in a row and report p50/p95 (after 3 warm-up
requests). Then ``--browsers`` clients hold the overview's live stream open
for ``--live-seconds`` while the sampler reads the broker every second, and
the console's RSS is taken at the end. Prints a Markdown table and writes
``bench/results/web-<backend>.json``. Not a test: nothing here asserts.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from bench.broker_bench import STORES  # noqa: E402
from supervisor.backends import open_broker  # noqa: E402
from supervisor.model import NewJob, error_info  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TYPES = ("export", "invoice", "email", "resize")
DEAD = 1_000


def load(url, n):
    started = time.perf_counter()
    broker = open_broker(url)
    broker.migrate()
    batch = []
    for i in range(n):
        batch.append(NewJob(TYPES[i % 4], {"customer_id": i % 10_000, "order": {"id": i}, "to": "a@example.com"},
                            resource_id=f"customer:{i % 10_000}").validate())
        if len(batch) == 500:
            broker.enqueue_many(batch)
            batch = []
            if i % 100_000 == 99_999:
                print(f"  {i + 1} jobs loaded, {time.perf_counter() - started:.0f} s", flush=True)
    if batch:
        broker.enqueue_many(batch)
    ids = broker.enqueue_many([NewJob("export", {"customer_id": 42, "n": i}, queue="failing").validate()
                               for i in range(DEAD)])
    while True:
        claimed = broker.claim(["failing"], 100, 60, "bench")
        if not claimed:
            break
        for job in claimed:
            broker.dead(job.lease, "exception", error_info("exception", "ValueError", "export failed",
                                                           "Traceback (most recent call last):\nValueError"))
    broker.close()
    return time.perf_counter() - started, ids[0]


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_console(url, folder):
    config = os.path.join(folder, "web.toml")
    with open(config, "w") as f:
        f.write(f'[broker]\nurl = "{url}"\nqueues = ["default", "failing"]\n[log]\nlevel = "warning"\n'
                '[schedules.nightly]\ncron = "0 3 * * *"\ntype = "export"\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "web", "-c", config, "--listen",
                             f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/login", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the console did not start")


def timed(url):
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as answer:
        answer.read()
        status = answer.status
    return (time.perf_counter() - started) * 1000, status


def pages(job_id):
    return [("overview", "/"), ("jobs (newest, with count)", "/jobs"), ("jobs by state", "/jobs?state=dead"),
            ("jobs by type", "/jobs?type=invoice"), ("jobs by payload field", "/jobs?where=customer_id%3D4242"),
            ("job", f"/jobs/{job_id}"), ("dead letters", "/dead"), ("queues", "/queues"),
            ("schedules", "/schedules"), ("supervisors", "/supervisors"), ("api jobs by type", "/api/jobs?type=email")]


def measure_pages(base, job_id, requests):
    rows = []
    for name, path in pages(job_id):
        for _ in range(3):
            timed(base + path)
        times = []
        for _ in range(requests):
            ms, status = timed(base + path)
            assert status == 200, (path, status)
            times.append(ms)
        times.sort()
        rows.append({"page": name, "path": path, "p50_ms": round(statistics.median(times), 1),
                     "p95_ms": round(times[max(0, int(len(times) * 0.95) - 1)], 1)})
        print(f"  {name:<28} p50 {rows[-1]['p50_ms']:>8} ms   p95 {rows[-1]['p95_ms']:>8} ms", flush=True)
    return rows


def live(base, pid, browsers, seconds):
    """``browsers`` clients on the overview's stream for ``seconds``; the console's RSS before and after."""
    before = psutil.Process(pid).memory_info().rss
    stop = time.monotonic() + seconds
    events = [0] * browsers

    def follow(i):
        with urllib.request.urlopen(base + "/events/overview", timeout=30) as stream:
            for line in stream:
                if line.startswith(b"event: overview"):
                    events[i] += 1
                if time.monotonic() > stop:
                    return

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(browsers)]
    for t in threads:
        t.start()
    peak = before
    while time.monotonic() < stop:
        time.sleep(5)
        peak = max(peak, psutil.Process(pid).memory_info().rss)
    for t in threads:
        t.join(40)
    after = psutil.Process(pid).memory_info().rss
    return {"browsers": browsers, "seconds": seconds, "events_per_browser": min(events),
            "rss_before_mib": round(before / 2**20, 1), "rss_after_mib": round(after / 2**20, 1),
            "rss_peak_mib": round(peak / 2**20, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,redis,postgres")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--browsers", type=int, default=5)
    parser.add_argument("--live-seconds", type=float, default=600)
    args = parser.parse_args(argv)
    for name in args.backends.split(","):
        store = STORES[name]()
        problem = store.available()
        if problem:
            print(f"{name}: skipped ({problem})")
            continue
        with store as url, tempfile.TemporaryDirectory() as folder:
            print(f"{name}: loading {args.jobs} jobs", flush=True)
            load_seconds, job_id = load(url, args.jobs)
            proc, base = start_console(url, folder)
            try:
                rows = measure_pages(base, job_id, args.requests)
                memory = live(base, proc.pid, args.browsers, args.live_seconds)
                print(f"  live: {memory}", flush=True)
            finally:
                proc.terminate()
                proc.wait(20)
        result = {"backend": name, "jobs": args.jobs, "dead": DEAD, "load_seconds": round(load_seconds, 1),
                  "pages": rows, "live": memory, "python": platform.python_version(),
                  "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(os.path.join(RESULTS, f"web-{name}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(f"\n| {name}, {args.jobs:,} jobs | p50 ms | p95 ms |\n| --- | ---: | ---: |")
        for r in rows:
            print(f"| {r['page']} | {r['p50_ms']} | {r['p95_ms']} |")


if __name__ == "__main__":
    main()
